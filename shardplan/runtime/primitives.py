"""The primitive catalogue: what each jaxpr primitive is, once, for every walker over a step's
jaxpr (fast mode, the shard_map backend's partitioner, the roles ``suggest`` reads, the kernel
model, the pipeline pass). Part of the sharding floor: it imports nothing of shardplan, and
``shardplan lower``'s module carries it.

A row is a fact about the primitive (its kind, and traits such as "linear in its operands"),
never a policy: how an engine lays a value out through it stays in that engine, stated as set
algebra over this table (``named``), so that a primitive added here reaches every engine at once.
``tests/test_primitives.py`` checks that every catalogued primitive has, in each engine, a rule
or a declared fallback, and that each engine's names are all catalogued.

To add a primitive: one row here (kind and traits); then a rule, or an entry in the declared
fallbacks, in each engine's table (the coverage test names the engines that lack one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

KINDS = (
    "elementwise",  # result shape = operand shape (scalars broadcast before), element by element
    "identity",  # the value itself, tagged or fenced (checkpoint_name, optimization_barrier)
    "view",  # the same elements in another shape or order (XLA: a bitcast, or a transposing copy)
    "broadcast",  # new dims of repeated elements
    "creation",  # a value made from no operand data (iota)
    "reduction",  # dims folded away
    "contraction",  # matmuls
    "slicing",  # parts of an operand, or operands put side by side (dims keep their meaning)
    "along",  # an op along one dim whose result depends on the whole dim (sort, cumsum, top_k)
    "lookup",  # indexed reads and writes (gather, scatter)
    "reshard",  # a layout set by the program (sharding constraints, reshards)
    "control",  # runs sub-jaxprs (calls, remat, custom derivatives, scan, while, cond, shard_map)
    "collective",  # manual-axes communication inside shard_map
    "random",  # PRNG keys and bits
    "kernel",  # a hand-written kernel (Pallas, cuDNN's fused attention)
)

TRAITS = (
    "transcendental",  # counted apart, as XLA's cost analysis does
    "expensive",  # XLA's fusion will not duplicate it into several consumers (IsExpensive)
    "linear",  # linear in its operands jointly: a sum of partial sums in, a partial sum out
    "bitcast",  # XLA does it as a bitcast of the buffer (or folds it into the consumer's layout)
    "keeps-layout",  # result dims of unchanged size keep their operand's layout (a wanted layout flows back)
    "into-operand",  # the result is operand 0 updated (scatter): the other operands' dims are others
    "call",  # runs one sub-jaxpr once on its own operands (inlined by the walkers)
    "remat",  # a call whose body the backward pass recomputes
)


@dataclass(frozen=True)
class Prim:
    """One primitive: its kind (one of ``KINDS``) and its traits (of ``TRAITS``)."""

    kind: str
    traits: frozenset[str] = frozenset()


def _rows(kind: str, names: str, *traits: str) -> dict[str, Prim]:
    return {n: Prim(kind, frozenset(traits)) for n in names.split()}


_TRANSCENDENTAL = (
    "acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma erf erf_inv erfc exp exp2 expm1 lgamma "
    "log log1p logistic pow rsqrt sin sinh sqrt tan tanh"
)

CATALOGUE: Mapping[str, Prim] = MappingProxyType(
    {
        **_rows("elementwise", _TRANSCENDENTAL, "transcendental", "expensive"),
        **_rows("elementwise", "div rem", "expensive"),
        **_rows("elementwise", "add add_any sub neg reduce_precision", "linear"),
        **_rows("elementwise", "convert_element_type copy copy_p", "linear", "keeps-layout"),
        **_rows(
            "elementwise",
            "abs and ceil clamp conj eq floor ge gt imag integer_pow is_finite le lt max min mul ne nextafter not "
            "or population_count real round select_n shift_left shift_right_arithmetic shift_right_logical sign "
            "square stop_gradient xor",
        ),
        # The same bits as another dtype: element by element where the item sizes agree (a dim
        # added or dropped otherwise).
        **_rows("view", "bitcast_convert_type", "bitcast"),
        **_rows("identity", "name", "linear", "bitcast", "keeps-layout"),
        **_rows("identity", "optimization_barrier"),
        **_rows("view", "reshape squeeze expand_dims transpose", "linear", "bitcast"),
        **_rows("broadcast", "broadcast_in_dim", "linear"),
        **_rows("creation", "iota"),
        # an uninitialised buffer (a cond's placeholder for the residuals of the branch not taken)
        **_rows("creation", "empty2"),
        **_rows("reduction", "reduce_sum", "linear"),
        **_rows("reduction", "reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin"),
        **_rows("contraction", "dot_general"),
        # a grouped matmul; XLA:CPU runs jax's dense decomposition of it (``ragged_dense``)
        **_rows("contraction", "ragged_dot_general"),
        **_rows("slicing", "slice dynamic_slice dynamic_update_slice pad concatenate split", "keeps-layout"),
        **_rows("slicing", "stack unstack"),
        **_rows("along", "cumsum cumprod cummax cummin cumlogsumexp sort rev top_k"),
        **_rows("lookup", "gather"),
        **_rows("lookup", "scatter scatter-add scatter_add scatter-mul scatter_mul", "into-operand"),
        **_rows("reshard", "sharding_constraint reshard sharding_cast mesh_cast"),
        **_rows(
            "control", "pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr", "call"
        ),
        **_rows("control", "remat2 checkpoint", "call", "remat"),
        **_rows("control", "scan while cond shard_map"),
        **_rows(
            "collective",
            "psum psum2 psum_invariant pmax pmin all_gather all_gather_invariant all_to_all ppermute reduce_scatter "
            "axis_index pvary",
        ),
        **_rows(
            "random",
            "rng_bit_generator random_bits random_seed random_wrap random_unwrap random_fold_in random_split "
            "random_clone threefry2x32",
        ),
        **_rows("kernel", "pallas_call dot_product_attention_fwd_wrapper dot_product_attention_bwd_wrapper"),
    }
)


def named(*, kinds: tuple[str, ...] = (), traits: tuple[str, ...] = (), every: tuple[str, ...] = ()) -> frozenset[str]:
    """The catalogued primitives of any of ``kinds`` or with any of ``traits`` (all of them when
    both are empty), restricted to those with every trait of ``every``."""
    assert set(kinds) <= set(KINDS) and set(traits) | set(every) <= set(TRAITS), (kinds, traits, every)
    return frozenset(
        n
        for n, p in CATALOGUE.items()
        if (not kinds and not traits or p.kind in kinds or p.traits & set(traits)) and set(every) <= p.traits
    )


def kind_of(name: str) -> str | None:
    """A primitive's kind, None when it is not catalogued."""
    row = CATALOGUE.get(name)
    return row.kind if row is not None else None


# The sets every walker shares.
TRANSCENDENTAL = named(traits=("transcendental",))
ELEMENTWISE = named(kinds=("elementwise",))
REDUCTIONS = named(kinds=("reduction",))
CALLS = named(traits=("call",))


_ITEMSIZE: dict[Any, int] = {}  # dtype -> bytes per element: asked for every equation walked


def itemsize(aval: Any) -> int:
    """Bytes per element of an abstract value (a PRNG key: 8)."""
    dtype = aval.dtype
    hit = _ITEMSIZE.get(dtype)
    if hit is not None:
        return hit
    import numpy as np

    try:
        n = int(np.dtype(dtype).itemsize)
    except TypeError:  # PRNG key types
        n = 8
    _ITEMSIZE[dtype] = n
    return n


def ragged_dense(eqn: Any) -> Any:
    """A ``ragged_dot_general``'s dense decomposition, as jax lowers it where the compiler has no
    grouped matmul (XLA:CPU): each group's rows masked out of a copy of the ragged operand, one
    matmul that also contracts the groups (the groups' count times the useful FLOPs). None where
    jax cannot decompose it (a group offset)."""
    import jax
    from jax._src.lax import lax as lax_internal

    if eqn.params.get("group_offset") is not None:
        return None
    params = {k: v for k, v in eqn.params.items() if k != "group_offset"}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    try:
        closed = jax.make_jaxpr(lambda *xs: lax_internal._ragged_dot_general_impl(*xs, **params))(*avals)
    except (NotImplementedError, TypeError, ValueError):  # a mode jax does not decompose: not modelled
        return None
    return closed.jaxpr if not closed.consts else None


def subjaxpr(eqn: Any) -> Any:
    """The body of a call XLA inlines (not a kernel's body, nor a shard_map's per-device one)."""
    if eqn.primitive.name in ("pallas_call", "shard_map"):
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is not None:
            return j.jaxpr if hasattr(j, "jaxpr") else j
    return None
