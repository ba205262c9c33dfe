"""Fast mode's rule book: primitive -> rule(walker, eqn, operands' layouts, multiplicity) ->
results' layouts, and the primitives it declares it does not model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardplan.runtime.fast.calls import (
    _MANUAL_COLLECTIVES,
    cond,
    fused_attention,
    inline,
    kernel,
    manual_collective,
    scan,
    shard_map,
    while_loop,
)
from shardplan.runtime.fast.elementwise import (
    along,
    broadcast,
    constraint,
    elementwise,
    layout_preserving,
    quick,
    reduce,
    reshape,
    reshard_op,
    stack,
    top_k,
    unstack,
)
from shardplan.runtime.fast.lookups import gather, scatter
from shardplan.runtime.fast.matmul import dot, grouped
from shardplan.runtime.fast.opsets import _FREE, _LAYOUT_PRESERVING
from shardplan.runtime.fast.slicing import concatenated, sliced
from shardplan.runtime.fast.values import Val, _replicated
from shardplan.runtime.fast.walker import RuleBook
from shardplan.runtime.kernels import FUSED_ATTENTION
from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS, named


def _one(method: Callable[..., Any]) -> Callable[..., list[Val]]:
    """A rule of one result from a rule function of one result (wrapped in a list)."""
    return lambda walk, eqn, ins, mult: [method(walk, eqn, ins, mult)]


# fast mode's rule book: primitive -> rule(walker, eqn, operands' Vals, multiplicity) -> result
# Vals (None: not modelled for these operands). Elementwise primitives go to ``elementwise``
# before the table is read; a call of a primitive not catalogued is inlined.
_RULES: dict[str, Callable[..., list[Val] | None]] = {
    **dict.fromkeys(ELEMENTWISE, _one(elementwise)),
    **dict.fromkeys(named(traits=("call",)), inline),
    "scan": scan,
    "cond": cond,
    "while": while_loop,
    "ragged_dot_general": grouped,
    "pallas_call": kernel,
    **dict.fromkeys(FUSED_ATTENTION, fused_attention),
    "shard_map": shard_map,
    **dict.fromkeys(_MANUAL_COLLECTIVES, manual_collective),
    "name": lambda walk, eqn, ins, mult: [ins[0]],  # checkpoint_name: the value itself
    "pvary": lambda walk, eqn, ins, mult: list(ins),  # marks values as varying over axes: nothing moves
    **dict.fromkeys(
        {"axis_index"} | named(kinds=("creation",)) | _FREE | named(kinds=("random",)),
        lambda walk, eqn, ins, mult: [_replicated(o.aval) for o in eqn.outvars],
    ),
    "dot_general": _one(dot),
    **dict.fromkeys(REDUCTIONS, lambda walk, eqn, ins, mult: [reduce(walk, eqn, ins[0], mult)]),
    "broadcast_in_dim": broadcast,
    "transpose": lambda walk, eqn, ins, mult: [
        Val(
            tuple(ins[0].shape[p] for p in eqn.params["permutation"]),
            ins[0].itemsize,
            tuple(ins[0].dims[p] for p in eqn.params["permutation"]),
            ins[0].partial,
        )
    ],
    **dict.fromkeys(
        ("reshape", "squeeze", "expand_dims"),
        lambda walk, eqn, ins, mult: [reshape(walk, eqn.invars[0], ins[0], tuple(eqn.outvars[0].aval.shape), mult)],
    ),
    "sharding_constraint": lambda walk, eqn, ins, mult: [constraint(walk, eqn, ins[0], mult)],
    "reshard": reshard_op,
    "gather": _one(gather),
    **dict.fromkeys(("scatter-add", "scatter_add", "scatter"), _one(scatter)),
    "unstack": unstack,
    "stack": _one(stack),  # jnp.stack (a primitive in this jax): operands laid out alike, a new whole dim
    **dict.fromkeys(
        named(kinds=("slicing", "along")) - {"stack", "unstack"}
        | _LAYOUT_PRESERVING - named(kinds=("elementwise", "identity")),
        layout_preserving,
    ),
    # along a dim
    **dict.fromkeys(named(kinds=("along",)) - {"top_k"}, along),
    "top_k": top_k,
    # static slices and concatenations along a split dim (the others keep their layout as above)
    "slice": sliced,
    "split": sliced,
    "concatenate": concatenated,
}


# What fast mode declares it does not model: replicated results, reported in the step's notes
# (XLA's program for them is not predicted). The coverage test (tests/test_primitives.py) holds
# every catalogued primitive to a rule here or an entry in this set.
_FALLBACKS = frozenset(
    {"optimization_barrier", "bitcast_convert_type", "scatter-mul", "scatter_mul"}
    | {"sharding_cast", "mesh_cast"}  # other jax releases' names of reshard
    | set(_MANUAL_COLLECTIVES) - set(_RULES)
)


def rule_book() -> tuple[frozenset[str], frozenset[str]]:
    """fast mode's primitives with a rule, and its declared fallbacks (for the coverage test)."""
    return frozenset(_RULES) | ELEMENTWISE, _FALLBACKS


RULE_BOOK = RuleBook(elementwise, _RULES, inline, quick)  # a call of a primitive the catalogue does not name: inlined
