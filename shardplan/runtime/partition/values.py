"""The shard_map partitioner's vocabulary: a value in the per-device program (``V``: its local
array and layout), a grouped matmul's exact rows (``Rows``), the record of what was issued
(``Record``, ``Fallback``), and the partitioner's sets of primitives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardplan.ledger import Communication
from shardplan.runtime.primitives import ELEMENTWISE, named
from shardplan.runtime.sharding import (
    Dims,
)

# The partitioner's sets, as policy over the primitive catalogue (shardplan/runtime/primitives.py).
# Run on local shards laid out alike (operands of the result's rank, or scalars): elementwise
# arithmetic, identities, and a bitcast to a dtype of the same size (its rule checks the ranks).
_ELEMENTWISE = ELEMENTWISE | named(kinds=("identity",)) | {"bitcast_convert_type"}


# Equation params that carry an output sharding when traced under explicit mesh axes.
_SHARDING_PARAMS = ("sharding", "out_sharding")


# Layout changes of values typed by mesh axes (``jax.sharding.reshard``; ``sharding_cast`` and
# ``mesh_cast`` in other jax releases): a reshard to the layout they name, as a constraint is.
_RESHARDS = named(kinds=("reshard",)) - {"sharding_constraint"}


# Linear in all operands together: a sum of partial sums is a partial sum.
# ``name`` is ``checkpoint_name``: an identity tagging a value for a remat policy.
_LINEAR_ALL = named(traits=("linear",)) & _ELEMENTWISE


_REMAT = named(traits=("remat",))


_INLINE = named(traits=("call",)) - _REMAT


# What the partitioner runs on whole operands by design (gathered first, then the op as traced,
# reported as a fallback when anything moved; see ``Partitioner.fallback``): collectives (they are
# only met inside a shard_map region the user wrote, which runs as written), kernels XLA cannot
# split, loops and branches it does not partition, and the rest below. The coverage test
# (tests/test_primitives.py) holds every catalogued primitive to a rule or an entry here.
_FALLBACKS = named(kinds=("collective", "kernel")) - {"ppermute"} | {
    "expand_dims",
    "scatter-mul",
    "scatter_mul",
    "rng_bit_generator",
    "threefry2x32",
}


@dataclass(frozen=True)
class Fallback:
    """An op that had no local rule for its operands' layout and ran on whole (gathered) operands."""

    op: str
    source: str
    why: str
    bytes: int = 0  # per device per step: the operands' bytes made whole (gathered or summed) for it


@dataclass
class Record:
    issued: list[Communication] = field(default_factory=list)  # the collective ledger's rows
    fallbacks: list[Fallback] = field(default_factory=list)
    # Every grouped matmul (``ragged_dot_general``) as this device runs it: (source, groups, the
    # axes the groups are split over (this device runs its own), forward (the weights' group dim
    # kept: each row through its group's weights) or not (the ragged rows contracted: a weight
    # gradient), the ragged rows it runs (its share of the rows: ``Rows``), the product of the
    # other dims' local sizes times the runs per step, and the elements jax's dense decomposition
    # masks per row and local group times the runs per step: the lhs's other dims forward, the
    # lhs's and rhs's for a weight gradient).
    # FLOPs follow from them as each compiler runs grouped matmuls
    # (``backends.shard_map.grouped_flops``).
    grouped: list[tuple[str, int, tuple[str, ...], bool, int, float, float]] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"count", "bytes"}} per device per step, as ``shardplan.core.hlo.summarize``."""
        out = {k: {"count": 0, "bytes": 0} for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}
        for c in self.issued:
            out[c.kind]["count"] += c.count
            out[c.kind]["bytes"] += c.bytes
        return out


@dataclass(frozen=True, eq=False)
class Rows:
    """Along ``dim``, the rows of this device's groups (``[start, start + count)`` of the tokens
    sorted by group, the groups split over ``axes`` by the group sizes ``sizes``) are exact, the
    others are not (zero out of a grouped matmul, anything after an elementwise op): a pending sum
    over ``axes`` once those rows are zeroed. Ops that read only this device's rows (elementwise
    ops, grouped matmuls over the same groups) run on it as it is; any other op gets it zeroed
    outside its rows and summed, as a pending sum is."""

    # The group sizes' ``V``: rows of one grouping are the same rows. (``Any``: the emitted module's
    # copy of this file has no postponed annotations, and V comes after.)
    sizes: Any
    axes: tuple[str, ...]
    dim: int
    start: Any  # traced scalars (None in a dry run)
    count: Any

    def fits(self, v: Any, sizes: Any, axes: tuple[str, ...], dim: int) -> bool:
        return self.sizes is sizes and self.axes == axes and self.dim == dim and not v.dims[dim]


@dataclass
class V:
    """A value in the per-device program: the local array (None in a dry run) and its layout."""

    x: Any
    shape: tuple[int, ...]
    dtype: Any
    dims: Dims
    partial: frozenset[str] = frozenset()
    act: bool = False  # derived from the batch (an activation), not only from params and constants
    shared: bool = False  # read by several ops: its pending sum is reduced once, by the first reader
    # A value made inside the step from nothing split (``jnp.zeros``, ``full``, ``iota``, ``arange``
    # and elementwise ops of those): ``make(dims)`` builds its local block in any layout, so it takes
    # the layout its reader wants at no cost, as XLA does (a dry run's returns None).
    make: Callable[[Dims], Any] | None = None
    # A grouped matmul's result with its groups split (see ``Rows``): exact on this device's rows.
    rows: Rows | None = None


def _t(dims) -> Dims:
    return tuple(tuple(d) for d in dims)


def _source(eqn: Any) -> str:
    from shardplan.runtime.sources import eqn_source  # the emitted copy replaces this function

    return eqn_source(eqn)


def _a2a_move(dims: list[list[str]], target: Dims, shape, n: Callable) -> tuple[int, int, str] | None:
    """A mesh axis the relayout from ``dims`` to ``target`` moves by one all-to-all: the minor
    axis of dim ``i``, which ``target`` does not keep there, and the next axis ``target`` adds to
    dim ``j`` (whose local size it divides). None when no axis moves that way."""
    for i, cur in enumerate(dims):
        if not cur or list(target[i][: len(cur)]) == cur:
            continue
        a = cur[-1]
        for j, (dj, tj) in enumerate(zip(dims, target, strict=True)):
            if (
                j != i
                and len(tj) > len(dj)
                and list(tj[: len(dj)]) == dj
                and tj[len(dj)] == a
                and (shape[j] // n(dj)) % n((a,)) == 0
            ):
                return i, j, a
    return None


def _common(a: Dims, b: Dims) -> Dims:
    """The layout both ``a`` and ``b`` refine: per dim, their common leading axes."""
    out = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < len(x) and k < len(y) and x[k] == y[k]:
            k += 1
        out.append(tuple(x[:k]))
    return tuple(out)
