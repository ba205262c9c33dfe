"""The step's computation lowered to per-device code: the shard_map backend's partitioner.

The training step's forward and backward pass is traced once over global abstract values
(a jaxpr: ``value_and_grad`` of the loss). Inside ``jax.shard_map`` the jaxpr is then run
equation by equation on *local* shards: every value carries its layout (per dimension the
mesh axes that split it, and the axes over which it is a pending partial sum), each op is
given operands in a layout it can run on locally, and an explicit collective is issued
only where the layout requires one:

- a matmul contracting a dimension split on both sides (a row-parallel layer, a data
  parallel weight gradient) runs locally and leaves a pending sum, reduced once where a
  consumer needs the value whole: ``psum``, or ``psum_scatter`` where the consumer splits
  a dimension over the same axis (an FSDP gradient, a sequence-parallel activation);
- a column-parallel matmul (weight split on its output dim) stays split, and so does
  attention with heads split over an axis;
- an operand split where the op needs it whole is ``all_gather``-ed right before that op
  (an FSDP weight before its matmul, and again in the backward pass: nothing keeps it);
- a lookup in a table split over its rows is a masked local lookup and a pending sum;
- a value made in the step (``jnp.zeros``, ``iota``, masks from them) is built in the layout
  its reader wants, so a KV cache made with ``jnp.zeros`` and written with
  ``dynamic_update_slice`` is split like the K/V written into it;
- an op with no local rule gets its operands whole (gathered) and runs replicated:
  correct, and listed in :attr:`Record.fallbacks` with its source line and the bytes made
  whole (the backend warns of each, or refuses them with ``strict``).

Reductions over the batch become local reductions and a sum over the batch axes, so the
loss is the global loss whatever it divides by (a padding-masked token count included).
Every collective issued is recorded (kind, axes, per-device bytes in the convention of
``shardplan.core.hlo``, why, source line): the prediction of the compiled step's.

The package: ``partitioner`` (the interpreter: ``Partitioner``, its layouts, collectives and
structure: calls, remat, scans, shard_map regions; the rule book ``RULES``), the local rules by
concern, each registering itself in ``RULES`` (``ops_layout``: elementwise, shape and layout ops;
``ops_contract``: reductions and matmuls; ``ops_lookup``: gathers and scatters; ``ops_control``:
cond and while loops), ``values`` (``V``,
``Rows``, the record and the partitioner's sets) and ``program`` (the per-device step:
``local_step``, ``predict``). ``shardplan lower`` copies these files into its module, in that order
(``tools/emit.py``).
"""

from shardplan.runtime.partition import ops_contract, ops_control, ops_layout, ops_lookup  # noqa: F401  (their rules)
from shardplan.runtime.partition.partitioner import RULES, Partitioner, rule_book
from shardplan.runtime.partition.program import local_step, predict
from shardplan.runtime.partition.values import Fallback, Record, Rows, V
from shardplan.runtime.sharding import Dims

__all__ = [
    "RULES",
    "Dims",
    "Fallback",
    "Partitioner",
    "Record",
    "Rows",
    "V",
    "local_step",
    "predict",
    "rule_book",
]
