"""What moving state from one plan's layout to another's costs: per leaf, the collectives a
compiled reshard (``jax.jit(lambda x: x, in_shardings=A, out_shardings=B)``) runs, per device.

Pure and jax-free. Both layouts must cover the same devices in the same order (what
``shardplan.make_mesh`` builds for two meshes of one device count): when the meshes differ
(``data=8`` and ``data=4,model=2``), both are rewritten over their common refinement (``data``
of the first becomes the sub-axes ``data`` x ``model`` of the second), so an axis of one mesh
is a group of sub-axes of the other. The rules per leaf are in :func:`leaf_moves`; bytes are
per device, as the HLO reader counts them (``shardplan.core.hlo``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardplan.core.leaves import Decision
from shardplan.errors import as_error, error

Dims = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Move:
    """One predicted collective of one leaf's reshard."""

    path: str
    kind: str  # all-to-all | all-gather | collective-permute
    axes: tuple[str, ...]  # the target mesh's axes (or the source's, for an axis only it has)
    bytes: int  # per device


@dataclass(frozen=True)
class Refinement:
    """Two meshes over the same devices, as sub-axes of one finer mesh."""

    sizes: dict[str, int]  # sub-axis -> size, major to minor
    a: dict[str, tuple[str, ...]]  # axis of mesh A -> its sub-axes
    b: dict[str, tuple[str, ...]]


def refine(a: dict[str, int], b: dict[str, int]) -> Refinement | None:
    """The common refinement of two row-major meshes of one device count, or None when their
    axes cut the device order at boundaries that do not nest (``2x3`` against ``3x2``)."""
    if math.prod(a.values()) != math.prod(b.values()):
        return None

    def cuts(sizes: dict[str, int]) -> list[int]:
        out, stride = [], math.prod(sizes.values())
        for s in sizes.values():  # cut points as strides from the major end
            stride //= s
            out.append(stride)
        return out

    points = sorted(set(cuts(a)) | set(cuts(b)) | {math.prod(a.values())}, reverse=True)
    for hi, lo in zip(points, points[1:]):
        if hi % lo:
            return None
    segs = [(hi // lo, lo) for hi, lo in zip(points, points[1:])]  # (size, stride) major to minor
    sizes: dict[str, int] = {}
    names = [f"#{i}" for i in range(len(segs))]
    for n, (s, _) in zip(names, segs):
        sizes[n] = s

    def groups(mesh: dict[str, int]) -> dict[str, tuple[str, ...]]:
        out, stride = {}, math.prod(mesh.values())
        for axis, s in mesh.items():
            hi, stride = stride, stride // s
            out[axis] = tuple(n for n, (_, st) in zip(names, segs) if stride <= st < hi)
        return out

    return Refinement(sizes, groups(a), groups(b))


def _refined(dims: Dims, groups: dict[str, tuple[str, ...]]) -> list[list[str]]:
    return [[sub for axis in d for sub in groups[axis]] for d in dims]


def _local(shape: tuple[int, ...], itemsize: int, dims: list[list[str]], sizes: dict[str, int]) -> int:
    return math.prod(n // math.prod(sizes[a] for a in d) for n, d in zip(shape, dims)) * itemsize


def _layout(d: Decision, groups: dict[str, tuple[str, ...]]) -> list[list[str]]:
    return _refined(d.spec.dims, groups) + [[] for _ in range(len(d.shape) - len(d.spec.dims))]


def same_layout(a: Decision, b: Decision, ref: Refinement) -> bool:
    """Whether every device holds the same block of the leaf under both layouts."""
    return a.shape == b.shape and _layout(a, ref.a) == _layout(b, ref.b)


def refinement_or_error(mesh_a: dict[str, int], mesh_b: dict[str, int]) -> Refinement:
    """:func:`refine`, or the error that says why two meshes cannot be compared."""
    ref = refine(mesh_a, mesh_b)
    if ref is None:
        raise as_error(
            [
                error(
                    "mesh-mismatch",
                    f"cannot reshard between mesh {mesh_a} and mesh {mesh_b}: "
                    + (
                        "different device counts"
                        if math.prod(mesh_a.values()) != math.prod(mesh_b.values())
                        else "their axes cut the device order at boundaries that do not nest"
                    ),
                    "compare the plans on meshes of one device count (--mesh), e.g. data=4,model=2 and data=8",
                    path="--mesh",
                )
            ]
        )
    return ref


def leaf_moves(a: Decision, b: Decision, ref: Refinement) -> list[Move]:
    """The collectives that take one leaf from layout ``a`` to layout ``b``, the way XLA's SPMD
    partitioner does it (checked against compiled reshards: tests/test_review.py and
    benchmarks/reshard.py):

    0. every dim keeps its block count (only which device holds which block changes): one
       collective-permute of the local block;
    1. a source dim whose split partly moves to another dim and partly goes away is gathered
       whole (the moving part is sliced again afterwards);
    2. sub-axes that move to another dim: one all-to-all (a dim that receives them gathers what
       it drops first), of the local buffer after the free slices (sub-axes only the target has)
       are taken; a permute follows when a moved sub-axis must sit before one the dim keeps or
       slices, when one that stays was minor to one that left (strided blocks), or when two
       dims trade sub-axes;
    3. a dim that drops sub-axes and gains others: a permute of the target's block when every
       target block lies inside one source block, else a permute and an all-gather up to the
       target's block;
    4. a dim that only drops sub-axes (last dim first): an all-gather per dim (its result),
       after a permute when a dropped sub-axis is more major than a kept one (strided blocks);
    5. what is left is free when each dim's sub-axes lead the target's, in its order (a local
       slice), else a permute of the target's block.
    """
    rank = len(a.shape)
    src, dst = _layout(a, ref.a), _layout(b, ref.b)
    if src == dst:
        return []
    sizes = ref.sizes
    back = {sub: axis for axis, subs in ref.b.items() for sub in subs}
    back_a = {sub: axis for axis, subs in ref.a.items() for sub in subs}

    def named(subs) -> tuple[str, ...]:
        out: list[str] = []
        for sub in subs:
            name = back.get(sub) or back_a[sub]
            if name not in out:
                out.append(name)
        return tuple(out)

    def local(dims) -> int:
        return _local(a.shape, a.itemsize, dims, sizes)

    target = local(dst)
    if all(math.prod(sizes[x] for x in sd) == math.prod(sizes[x] for x in dd) for sd, dd in zip(src, dst)):
        # rule 0: every dim keeps its block count, only which device holds which block changes
        return [Move(a.path, "collective-permute", named(x for d in dst for x in d), local(src))]
    where = {sub: j for j, d in enumerate(dst) for sub in d}
    held = {sub for d in src for sub in d}
    added = [[sub for sub in d if sub not in held] for d in dst]
    moving: dict[str, int] = {}
    dropping: list[list[str]] = [[] for _ in range(rank)]
    for i, d in enumerate(src):
        out = [sub for sub in d if where.get(sub, -1) != i]
        gone = [sub for sub in out if sub not in where]
        if gone and len(gone) < len(out):  # rule 1
            gone = out
        dropping[i] = gone
        moving.update({sub: where[sub] for sub in out if sub not in gone})
    moves: list[Move] = []
    cur = [list(d) for d in src]
    done: set[int] = set()
    if moving:  # rule 2
        for j in sorted(set(moving.values()), reverse=True):  # a dim that receives drops its own first
            if dropping[j] and not added[j]:
                cur[j] = [sub for sub in cur[j] if sub not in dropping[j]]
                moves.append(Move(a.path, "all-gather", named(dropping[j]), local(cur)))
                dropping[j] = []
        sliced = [d + [sub for sub in added[k] if sub not in d] for k, d in enumerate(cur)]
        moves.append(Move(a.path, "all-to-all", named(moving), local(sliced)))
        origin = {sub: next(i for i, d in enumerate(src) if sub in d) for sub in moving}
        trade = any(origin[x] == moving[y] and origin[y] == moving[x] for x in moving for y in moving)
        late = any(  # a moved sub-axis must land after the dim's own and sliced ones
            dst[j].index(sub) < max((k for k, x in enumerate(dst[j]) if x not in moving), default=-1)
            for sub, j in moving.items()
        )
        for sub, j in moving.items():
            cur[origin[sub]].remove(sub)
            done.add(j)
        for j in done:
            cur[j] = list(dst[j])
        strided = any(  # a sub-axis left behind after a more major one moved out: strided blocks
            any(x in moving for x in d[:k]) and sub not in moving and sub not in dropping[i]
            for i, d in enumerate(src)
            for k, sub in enumerate(d)
        )
        if trade or late or strided:
            moves.append(Move(a.path, "collective-permute", named(moving), target))
    for i in reversed(range(rank)):
        if not dropping[i] or i in done:
            continue
        kept = [sub for sub in cur[i] if sub not in dropping[i]]
        if added[i]:  # rule 3
            have = math.prod(sizes[x] for x in cur[i])
            if math.prod(sizes[x] for x in dst[i]) % have:
                moves.append(Move(a.path, "collective-permute", named(cur[i]), local(cur)))
                moves.append(Move(a.path, "all-gather", named(dropping[i]), target))
            else:
                moves.append(Move(a.path, "collective-permute", named(dst[i]), target))
            cur[i] = list(dst[i])
            done.add(i)
            continue
        if kept and cur[i].index(dropping[i][0]) < cur[i].index(kept[-1]):  # rule 4
            moves.append(Move(a.path, "collective-permute", named(cur[i]), local(cur)))
        cur[i] = kept
        moves.append(Move(a.path, "all-gather", named(dropping[i]), local(cur)))
    for i in range(rank):  # rule 5
        if i not in done and dst[i][: len(cur[i])] != cur[i]:
            moves.append(Move(a.path, "collective-permute", named(dst[i]), target))
            break
    return moves


def reshard_moves(
    before: tuple[Decision, ...], after: tuple[Decision, ...], mesh_a: dict[str, int], mesh_b: dict[str, int]
) -> list[Move]:
    """Every leaf's collectives from ``before`` to ``after`` (matched by path; leaves present
    in one layout only are not moved).

    Raises:
        ShardPlanError: the meshes have different device counts, or cut the device order in
            ways that do not nest (no common refinement).
    """
    ref = refinement_or_error(mesh_a, mesh_b)
    by_path = {d.path: d for d in after}
    out: list[Move] = []
    for d in before:
        other = by_path.get(d.path)
        if other is not None and other.shape == d.shape:
            out += leaf_moves(d, other, ref)
    return out


def totals(moves: list[Move]) -> dict[tuple[str, tuple[str, ...]], int]:
    """Bytes per device by (collective kind, mesh axes)."""
    out: dict[tuple[str, tuple[str, ...]], int] = {}
    for m in moves:
        out[(m.kind, m.axes)] = out.get((m.kind, m.axes), 0) + m.bytes
    return out
