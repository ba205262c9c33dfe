"""Fast mode's sets of primitives, as policy over the primitive catalogue
(``shardplan/runtime/primitives.py``).
"""

from __future__ import annotations

from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS, named

# fast mode's sets, as policy over the primitive catalogue (shardplan/runtime/primitives.py).
# Ops through which a pending partial sum stays pending: linear ops that move or fold elements
# (views, broadcasts, sums) and conversions. Not elementwise arithmetic: GSPMD all-reduces each
# operand of an add of partial sums (measured: a column-parallel layer's q, k and v input
# gradients are three all-reduces, not one).
_LINEAR = named(traits=("linear",)) - named(kinds=("elementwise",)) | {"convert_element_type", "copy", "copy_p"}


# Ops XLA does as a bitcast of the same buffer (no memory traffic) or folds into the consumer's
# operand layout (``name`` is ``checkpoint_name``: an identity that tags a value for a remat
# policy). A bitcast to another dtype is not modelled (a declared fallback, below).
_VIEWS = named(traits=("bitcast",)) - {"bitcast_convert_type"}


_LAYOUT = _VIEWS | {"convert_element_type"}


# Consumers XLA fuses a single-use elementwise producer into (loop and input fusion).
_FUSES_PRODUCER = ELEMENTWISE | _LAYOUT | REDUCTIONS | {"broadcast_in_dim"}


_FREE = {"iota", "stop_gradient"}


_IN_PLACE = {"scatter-add", "scatter_add", "scatter", "dynamic_update_slice"}  # write into operand 0


# Elementwise ops XLA's fusion will not duplicate into several consumers (instruction_fusion's
# IsExpensive): transcendental functions and divisions.
_EXPENSIVE = named(traits=("expensive",))


# Ops whose output dims of unchanged size keep their operands' layout (a wanted layout flows back;
# not scans along a dim, cumsum or rev, where a split would change what each device computes).
_LAYOUT_PRESERVING = named(traits=("keeps-layout",))
