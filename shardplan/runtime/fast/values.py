"""Fast mode's vocabulary: a value's layout (``Val``), the walk's context (``_Ctx``: the mesh,
the compiler's book, the ledger, the counters), a call's boundary, a run's frame, and layout
helpers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardplan.core.notes import Note
from shardplan.core.stepcost import Communication
from shardplan.runtime.fast.books import COMPILERS, Compiler
from shardplan.runtime.primitives import itemsize

_T = TypeVar("_T")


Dims = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Val:
    """An abstract value and how it is split: per dim the mesh axes, and pending partial sums."""

    shape: tuple[int, ...]
    itemsize: int
    dims: Dims
    partial: frozenset[str] = frozenset()

    @property
    def axes(self) -> set[str]:
        return {a for d in self.dims for a in d}


@dataclass
class _Ctx:
    mesh: dict[str, int]
    batch_axes: tuple[str, ...] = ()  # the axes inputs are split over (activations carry them)
    book: Compiler = COMPILERS["cpu"]  # the compiler whose program is predicted
    comm: list[Communication] = field(default_factory=list)
    labelled: set[int] = field(default_factory=set)  # rows of ``comm`` whose ``moves`` is a label only
    backward: bool = False  # the equation being costed is in the backward pass (a transpose's)
    backward_rows: set[int] = field(default_factory=set)  # rows of ``comm`` added in the backward pass
    flops: float = 0.0
    matmul_flops: dict[str, float] = field(default_factory=dict)  # source line -> its matmuls' flops
    grouped_flops: dict[str, float] = field(default_factory=dict)  # of those, the grouped matmuls'
    grouped_total: float = 0.0  # every flop of the grouped matmuls (jax's dense decomposition's masks too)
    dense_grouped: dict[str, tuple[int, float]] = field(default_factory=dict)  # line -> (groups, FLOPs) run densely
    # the buffers the compiler's own grouped matmuls hold (False: the shard_map backend's cost,
    # whose grouped matmuls are its partitioner's, run on each device's groups)
    grouped_memory: bool = True
    transcendentals: float = 0.0
    hbm: float = 0.0  # bytes read and written in memory (XLA's fusion assumed: see Walker.traffic)
    launches: float = 0.0  # kernels launched (equations whose results are stored, collectives)
    unmodeled: dict[str, int] = field(default_factory=dict)
    cache: dict[tuple, Val] = field(default_factory=dict)
    gathered_now: int = 0
    gathered_peak: int = 0
    held_gathers: dict[Any, int] = field(default_factory=dict)  # gathers merged across matmuls, held
    # XLA combines the step's gradient reductions into one (tuple) collective before the
    # optimizer (see core.timing.combined): its results are new buffers, alive with the unreduced
    # gradients. ``reduced``: their bytes per device (results); ``reduced_from``: what the step
    # held at the first of them (program order), None before it.
    reduced: int = 0
    reduced_from: int | None = None
    reducing: bool = False
    lookups: list[str] = field(default_factory=list)  # sources of lookups whose table and indices share an axis
    kernels: list[Note] = field(default_factory=list)  # what the Pallas kernels' costs estimate
    loops: list[str] = field(default_factory=list)  # sources of while loops whose trip count is not fixed
    source: str = ""  # 'file:line' in the user's code of the equation being propagated

    memo: dict[Any, int] = field(default_factory=dict)  # split and local sizes asked again and again

    def split_dims(self, dims: Dims) -> int:
        """Devices a layout splits a value over (the product of its dims' splits)."""
        return math.prod(self.split(tuple(d)) for d in dims)

    def split(self, axes: tuple[str, ...]) -> int:
        key = axes if type(axes) is tuple else tuple(axes)
        n = self.memo.get(key)
        if n is None:
            n = self.memo[key] = math.prod(self.mesh[a] for a in key)
        return n

    def local(self, v: Val) -> int:
        key = (v.shape, v.dims, v.itemsize)
        n = self.memo.get(key)
        if n is None:
            n = v.itemsize
            for size, axes in zip(v.shape, v.dims, strict=True):
                n *= size // self.split(axes) if axes else size
            self.memo[key] = n
        return n

    def held(self, v: Val) -> int:
        """Bytes ``v``'s local part takes in memory: :meth:`local`, padded to the compiler's tiles."""
        tile = self.book.tile
        if tile is None or not v.shape:
            return self.local(v)
        key = ("held", v.shape, v.dims, v.itemsize)
        n = self.memo.get(key)
        if n is None:
            local = [size // self.split(axes) if axes else size for size, axes in zip(v.shape, v.dims, strict=True)]
            n = self.memo[key] = tiled_bytes(local, v.itemsize, tile)
        return n

    def gather_reduces(self, axes: tuple[str, ...]) -> bool:
        """Whether a gather over ``axes`` is an all-reduce of the zero-padded shard: over the whole
        slice, where the compiler does so (``Compiler.gathers_reduce``)."""
        n = self.split(axes)
        return bool(self.book.gathers_reduce and n >= self.book.gathers_reduce and n == self.split(tuple(self.mesh)))

    def copy(self, nbytes: int, mult: int, kernels: int = 1) -> None:
        """``kernels`` kernels that each copy ``nbytes`` into another layout (read and written)."""
        self.hbm += 2 * nbytes * mult * kernels
        self.launches += mult * kernels

    def add(
        self,
        kind: str,
        axes: tuple[str, ...],
        nbytes: int,
        mult: int,
        why: str,
        moves: str = "",
        label: bool = False,
        itemsize: int = 4,
    ) -> None:
        """One collective; ``label``: ``moves`` names the param only for the ledger (a scanned
        layer's slice of it, see ``calls.scan``): its launches are counted as they are.
        An all-reduce adds one flop per element of its result, as XLA's cost analysis counts it (a
        reduce-scatter none; XLA:CPU's is an all-reduce of the whole: ``Compiler.scatters_whole``)."""
        if axes and nbytes and self.split(tuple(axes)) > 1:  # over axes of size 1 nothing moves
            # A collective reads its buffer and writes its result (``nbytes``: an all-gather's
            # result, a reduce-scatter's input; the other side is 1/n of it).
            n = self.split(tuple(axes))
            if kind == "all-gather" and self.gather_reduces(tuple(axes)):
                kind = "all-reduce"
            self.hbm += (nbytes + nbytes // n if kind in ("all-gather", "reduce-scatter") else 2 * nbytes) * mult
            if kind == "all-reduce" or (kind == "reduce-scatter" and self.book.scatters_whole):
                self.flops += nbytes / itemsize * mult
            self.launches += mult
            self.comm.append(Communication(kind, tuple(axes), nbytes * mult, mult, why, self.source, moves))
            if label and moves:
                self.labelled.add(len(self.comm) - 1)
            if self.backward:
                self.backward_rows.add(len(self.comm) - 1)


@dataclass(frozen=True)
class _Boundary:
    """What a call's caller holds of the call's inputs and outputs (memory traffic; XLA inlines
    calls): the inputs in memory, the outputs the caller's readers fuse, and for the other inputs
    the values in memory their fused producers read."""

    stored: frozenset
    fusable_outs: dict[Any, int]  # -> how many of the caller's equations read it
    reads: dict[Any, frozenset]


@dataclass
class _Frame:
    """Memory-traffic state of one jaxpr being run (mutable working state of ``Walker.run``)."""

    jaxpr: Any
    env: dict[Any, Val]
    stored: set  # values in memory
    fused: dict[Any, int]  # results computed inside their readers -> their producer's index
    shared: set  # fused results several equations read
    soft: dict[Any, int]  # call results the readers fuse -> how many read it
    closures: dict[Any, frozenset]  # value -> the (value in memory, layout) pairs reading it reads
    written: set = field(default_factory=set)  # values from literals alone, written where first read


_NONE: frozenset = frozenset()  # an empty set nothing adds to


_NORMAL: dict[tuple, Dims] = {}  # (dims, rank) -> normal dims: asked ~100,000 times per costing


def _norm(dims: Dims, rank: int) -> Dims:
    if type(dims) is tuple:
        try:
            hit = _NORMAL.get((dims, rank))
        except TypeError:  # a list inside: not hashable, normalised below
            hit = None
        if hit is not None:
            return hit
    out = tuple(tuple(d) for d in dims) + ((),) * (rank - len(dims))
    if type(dims) is tuple and len(_NORMAL) < 100_000:
        try:
            _NORMAL[(dims, rank)] = out
        except TypeError:
            pass
    return out


def scatter_onto(
    v: Val, target: Dims, split: Callable[[tuple[str, ...]], int], batch: int = 0, keep: frozenset[str] = frozenset()
) -> tuple[list[list[str]], list[str]]:
    """Where a pending sum in ``v`` is reduce-scattered to reach ``target``: per dim, ``v``'s axes
    with the summed axes ``target`` splits it over added where they divide it (not on a batched
    matmul's first ``batch`` dims that ``v`` splits already, nor the axes in ``keep``), and those
    axes in order. The rest of the sum is all-reduced (``relayout.resolve``)."""
    dims = [list(d) for d in v.dims]
    scatter: list[str] = []
    for i, t in enumerate(_norm(target, len(v.shape))):
        for a in t:
            if (
                a in v.partial
                and a not in dims[i]
                and not (i < batch and v.dims[i])
                and a not in keep
                and v.shape[i] % split((*dims[i], a)) == 0
            ):
                scatter.append(a)
                dims[i].append(a)
    return dims, scatter


def _per_dim(axes: tuple[str, ...], dims: tuple[frozenset[str], ...]) -> list[tuple[str, ...]]:
    """The all-reduces of a pending sum over ``axes``: one over all of them, or where the matmul
    that made it summed over several contracted dims split apart (``dims``, the axes of each:
    ``Compiler.sums_per_dim``), one per dim's axes, then one over any left."""
    if not axes:
        return []
    parts = [tuple(a for a in axes if a in d) for d in dims]
    parts = [p for p in parts if p]
    left = tuple(a for a in axes if not any(a in p for p in parts))
    return [*parts, left] if left else parts or [axes]


def _contracted(eqn: Any) -> int:
    """Elements a matmul contracts (0: not a matmul)."""
    if eqn.primitive.name != "dot_general":
        return 0
    (lc, _), _ = eqn.params["dimension_numbers"]
    return math.prod(eqn.invars[0].aval.shape[i] for i in lc)


def _reads_narrow(eqn: Any) -> bool:
    """A matmul at the default precision (its float32 operands read in ``Compiler.matmul_itemsize``)."""
    return eqn.primitive.name == "dot_general" and eqn.params.get("precision") in (None, (None, None))


GRANULE = 512  # bytes: XLA:TPU's smallest buffer (a float32[3] takes 512 B; measured per array)


def tiled_bytes(shape: Sequence[int], itemsize: int, tile: tuple[int, int]) -> int:
    """Bytes an array takes laid out in (second-minor, minor) ``tile``s: dims of 1 take no place;
    the compiler lays the two tiled dims out where they pad least (measured: a (64, 16) float32
    parameter takes 8 KiB, laid out as (16, 64)); whole granules of 512 B."""
    dims = [d for d in shape if d != 1] or [1]
    whole = math.prod(dims)
    if len(dims) == 1:
        n = _round_up(whole, tile[1])
    else:
        n = min(
            whole // (a * b) * _round_up(a, tile[0]) * _round_up(b, tile[1])
            for i, a in enumerate(dims)
            for j, b in enumerate(dims)
            if i != j
        )
    return _round_up(n * itemsize, GRANULE)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _batch_scatter(v: Val, ctx: _Ctx, rows: int | None = 0) -> Dims:
    """Where an activation's pending sum over a batch axis goes when no reader says: onto its rows
    (a matmul's: the dim its operands' leading dims went to; else its leading dim), where they are
    whole (measured: under a 2-D plan whose embedding width is split over the batch axis, XLA
    reduce-scatters a projection's sum over `data` onto the batch rows; a GShard dispatch
    "gsec,gsd->egcd" summed over the sequence's `data`, its groups split over `model`, is
    all-reduced, not scattered onto the experts' dim)."""
    dims = [tuple(d) for d in v.dims]
    if rows is not None and len(v.shape) >= 2 and rows < len(dims) and not dims[rows]:
        axes = tuple(a for a in ctx.batch_axes if a in v.partial and a not in v.axes)
        if axes and v.shape[rows] % ctx.split(axes) == 0:
            dims[rows] = axes
    return tuple(dims)


def _broadcast(v: Val, shape: tuple[int, ...]) -> Val:
    """``v`` seen at the output's shape: its size-1 dims (broadcast) are whole."""
    dims = tuple(d if v.shape[i] == shape[i] else () for i, d in enumerate(v.dims))
    return Val(shape, v.itemsize, dims, v.partial)


def _spec_dims(spec: Any, rank: int) -> Dims:
    """A PartitionSpec's entries as per-dim axis tuples."""
    dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in tuple(spec)]
    return _norm(tuple(dims), rank)


def _size(v: Val) -> int:
    """A value's bytes over the whole mesh (what XLA's gather partitioner compares)."""
    return math.prod(v.shape) * v.itemsize


def _without(dims: Dims, axes: set[str]) -> Dims:
    """``dims`` with ``axes`` taken off every dim (those dims gathered over them)."""
    return tuple(tuple(a for a in d if a not in axes) for d in dims)


def _tuple(dims: list) -> Dims:
    return tuple(tuple(d) for d in dims)


def _is_float(var: Any) -> bool:
    import numpy as np

    return bool(np.issubdtype(var.aval.dtype, np.floating))


def _replicated(aval: Any) -> Val:
    shape = tuple(getattr(aval, "shape", ()))
    return Val(shape, itemsize(aval), ((),) * len(shape))


def _local_shape(v: Val, ctx: _Ctx) -> tuple[int, ...]:
    return tuple(size // ctx.split(axes) if axes else size for size, axes in zip(v.shape, v.dims, strict=True))


def _fits(shape: tuple[int, ...], dims: Dims, ctx: _Ctx) -> bool:
    return len(dims) <= len(shape) and all(shape[i] % ctx.split(d) == 0 for i, d in enumerate(dims) if d)
