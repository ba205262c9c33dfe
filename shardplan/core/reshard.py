"""What moving state from one plan's layout to another's costs: per leaf, the collectives a
compiled reshard (``jax.jit(lambda x: x, in_shardings=A, out_shardings=B)``) runs, per device.

Pure and jax-free. Both layouts must cover the same devices in the same order (what
``shardplan.make_mesh`` builds for two meshes of one device count): when the meshes differ
(``data=8`` and ``data=4,model=2``), both are rewritten over their common refinement (``data``
of the first becomes the sub-axes ``data`` x ``model`` of the second), so an axis of one mesh
is a group of sub-axes of the other. Per leaf, with the bytes the HLO reader counts
(``shardplan.core.hlo``):

- a sub-axis that splits another dim after the reshard: an all-to-all of the local buffer;
- a sub-axis no dim keeps: an all-gather (the gathered local result);
- a sub-axis only the target splits on: a local slice, free;
- the same sub-axes in another order: a collective-permute of the local buffer.
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
    if list(a.items()) == list(b.items()):
        return Refinement(dict(a), {k: (k,) for k in a}, {k: (k,) for k in b})

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


def leaf_moves(a: Decision, b: Decision, ref: Refinement) -> list[Move]:
    """The collectives that take one leaf from layout ``a`` to layout ``b``."""
    rank = len(a.shape)
    src = _refined(a.spec.dims, ref.a) + [[] for _ in range(rank - len(a.spec.dims))]
    dst = _refined(b.spec.dims, ref.b) + [[] for _ in range(rank - len(b.spec.dims))]
    if src == dst:
        return []
    sizes = ref.sizes
    back = {sub: axis for axis, subs in ref.b.items() for sub in subs}
    back_a = {sub: axis for axis, subs in ref.a.items() for sub in subs}

    def named(subs) -> tuple[str, ...]:
        out: list[str] = []
        for s in subs:
            name = back.get(s) or back_a[s]
            if name not in out:
                out.append(name)
        return tuple(out)

    moves: list[Move] = []
    cur = [list(d) for d in src]
    where = {s: j for j, d in enumerate(dst) for s in d}
    moved = [s for i, d in enumerate(src) for s in d if where.get(s, i) != i]
    if moved:
        moves.append(Move(a.path, "all-to-all", named(moved), _local(a.shape, a.itemsize, cur, sizes)))
        for s in moved:
            i = next(k for k, d in enumerate(cur) if s in d)
            cur[i].remove(s)
            cur[where[s]].append(s)
    dropped = [s for d in cur for s in d if s not in where]
    if dropped:
        cur = [[s for s in d if s in where] for d in cur]
        moves.append(Move(a.path, "all-gather", named(dropped), _local(a.shape, a.itemsize, cur, sizes)))
    # What is left is free only if each dim's kept sub-axes lead the target's, in its order
    # (then the added ones are a local slice); otherwise blocks change devices: a permute.
    if any(dst[i][: len(cur[i])] != cur[i] for i in range(rank)):
        moves.append(
            Move(
                a.path, "collective-permute", named(s for d in dst for s in d), _local(a.shape, a.itemsize, cur, sizes)
            )
        )
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
