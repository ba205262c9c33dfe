"""Collectives that move values between layouts: a pending sum resolved (reduce-scatter,
all-reduce, a windowed einsum's ring) and a value resharded (all-gather, all-to-all,
collective-permute, free slices), each recorded in the walk's ledger.
"""

from __future__ import annotations

import math
from typing import Any

from shardplan.runtime.fast.books import WINDOWED_MAX_DEVICES
from shardplan.runtime.fast.values import Dims, Val, _batch_scatter, _norm, _per_dim, _tuple, scatter_onto
from shardplan.runtime.fast.walker import Walker


# -- resharding ------------------------------------------------------------------------
def resolve(walk, var: Any, v: Val, target: Dims | None, mult: int, why: str, contracted: int = 0) -> Val:
    """``v`` with its pending sums done: reduce-scatter over partial axes the target
    splits a dim on (when ``v`` leaves that dim whole), all-reduce over the rest.
    ``contracted``: the elements the matmul that made ``v`` contracts (``Compiler.windowed``)."""
    if not v.partial:
        return v
    if target is None and var not in walk.hints:
        if var in walk.wants:
            target = walk.wants[var]
        else:
            target = _batch_scatter(v, walk.ctx, walk.rows.get(walk.root(var), 0))
        target = _with_sum_wants(walk, var, v, target)
    target = target if target is not None else walk.hints.get(var, walk.wants.get(var, v.dims))
    key = ("resolve", walk.key(var), target)
    hit = walk.ctx.cache.get(key)
    if hit is not None:
        return hit
    origin = walk.sum_origin.get(var)
    # A matmul's sum is scattered onto a dim (whole, or split further); onto a batch dim its
    # operands split, XLA's dot partitioner all-reduces, gathers that dim and slices (measured:
    # "gsec,egcd->gsd" with g over data, e over expert, the result wanted over (data, expert)).
    batch = walk.dot_batch.get(walk.root(var), 0) if origin is not None and origin[0] == "dot_general" else 0
    # summed axes an idle axis stands in for (``matmul._idle_split``): all-reduced, then permuted
    stands_for = frozenset(walk.stand_ins.get(walk.root(var), {}).values())
    dims, scatter = scatter_onto(v, target, walk.ctx.split, batch, stands_for)
    rest = tuple(a for a in sorted(v.partial) if a not in scatter)
    if batch and rest:
        walk.dot_reduced[var] = (frozenset(rest), batch)
    reader_source = walk.ctx.source
    if origin is not None:  # the sum is the op's that made it, at its line
        why, walk.ctx.source = origin[0], origin[1] or reader_source
        contracted = contracted or origin[2]
    moves = walk.updates.get(var) or walk.updates.get(walk.root(var), "")  # a gradient: its param
    label = moves or walk.labels.get(var) or walk.labels.get(walk.root(var), "")
    only = bool(label) and not moves  # named for the ledger alone
    # (a plain matmul's: a batched one's, a scatter-add's sum is reduce-scattered onto both dims)
    plain = origin is not None and origin[0] == "dot_general" and not batch
    whole = _summed_whole(walk, v, target, dims, scatter) if plain else []
    if whole:  # all-reduced whole, then each device's block sliced (``Compiler.scatters_one_dim``)
        for part in whole:
            walk.ctx.add("all-reduce", part, walk.ctx.local(v), mult, why, label, only, v.itemsize)
        scatter = []
    if scatter:
        n = walk.ctx.split(tuple(scatter))
        windowed = walk.ctx.book.windowed
        if windowed and contracted > windowed and n <= WINDOWED_MAX_DEVICES:  # a ring inside the matmul
            ring = walk.ctx.local(v) * (n + 1) // n
            walk.ctx.add("collective-permute", tuple(scatter), ring, mult, why, label, only)
        else:
            walk.ctx.add("reduce-scatter", tuple(scatter), walk.ctx.local(v), mult, why, label, only, v.itemsize)
            if moves and walk.ctx.book.minor_scatter:
                scattered = Val(v.shape, v.itemsize, _tuple(dims))
                if any(_minor(walk, scattered, i) for i, d in enumerate(dims) if set(d) & set(scatter)):
                    # the update writes the param and its state in the scattered layout, then copies
                    walk.ctx.copy(walk.ctx.local(scattered), mult, walk.updated.get(moves, 1))
    out = Val(v.shape, v.itemsize, tuple(tuple(d) for d in dims))
    for part in _per_dim(rest, origin[3] if origin is not None else ()):
        walk.ctx.add("all-reduce", part, walk.ctx.local(out), mult, why, label, only, out.itemsize)
    if moves and mult == 1 and (scatter or rest or whole) and walk.depth == 1:
        walk.ctx.reduced += walk.ctx.local(out)
        walk.ctx.reducing = True
    walk.ctx.source = reader_source
    walk.ctx.cache[key] = out
    return out


def _summed_whole(walk: Walker, v: Val, target: Dims, dims: list[list[str]], scatter: list[str]) -> list[tuple]:
    """The all-reduces of the whole where ``scatter`` puts a matmul's summed axes on two dims or
    more of ``target`` that hold nothing else and the matmul leaves whole
    (``Compiler.scatters_one_dim``: one per dim's axes where the compiler sums per dim, else one
    over them all); [] where the sum is reduce-scattered (a scatter-add's, an embedding's
    gradient: XLA reduce-scatters it onto both dims)."""
    if not scatter or not walk.ctx.book.scatters_one_dim:
        return []
    onto = [i for i, d in enumerate(dims) if set(d) & set(scatter)]
    wanted = _norm(target, len(v.shape))
    if len(onto) < 2 or any(v.dims[i] or not set(wanted[i]) <= v.partial for i in onto):
        return []
    groups = [tuple(a for a in dims[i] if a in scatter) for i in onto]
    return groups if walk.ctx.book.sums_per_dim else [tuple(a for g in groups for a in g)]


def _with_sum_wants(walk: Walker, var: Any, v: Val, target: Dims | None) -> Dims | None:
    """``target`` with the summed axes a weight's contraction split wants on dims ``v`` and
    ``target`` leave whole (``Walker.seed_sum_wants``): the sum is reduce-scattered onto them."""
    want = walk.sum_wants.get(var)
    if want is None:
        return target
    base = _norm(target if target is not None else v.dims, len(v.shape))
    used = {a for d in base for a in d} | {a for d in v.dims for a in d}
    dims = [list(d) for d in base]
    for i, w in enumerate(_norm(want, len(v.shape))):
        if w and not dims[i] and not v.dims[i] and set(w) <= v.partial and not set(w) & used:
            dims[i] = list(w)
            used |= set(w)
    return target if dims == [list(d) for d in base] else _tuple(dims)


def reshard_key(walk: Walker, var: Any, target: Dims, tag: Any = None) -> tuple:
    """What a move of ``var`` to ``target`` is remembered under in ``_Ctx.cache`` (its root and the
    run that defined it, the layout, ``tag``): a later move of it there costs nothing."""
    return ("reshard", walk.key(var), target, tag)


def reshard(walk: Walker, var: Any, v: Val, target: Dims, mult: int, why: str, tag: Any = None) -> Val:
    """``v`` (no pending sums) laid out as ``target``: gathers, slices, all-to-alls. ``tag``:
    what else tells this reshard from another of the same value to the same layout (a matmul
    operand's cast and pass, where the compiler gathers again: :class:`Compiler`)."""
    target = _norm(target, len(v.shape))
    if v.dims == target:
        return v
    key = reshard_key(walk, var, target, tag)
    hit = walk.ctx.cache.get(key)
    if hit is not None:
        return hit
    if _sliced(v.dims, target) and var not in walk.dot_reduced:
        # the target only splits further, each dim after the axes it has: a free local slice
        # (remembered: a loop's carried state takes the layout its body reads it in, ``while_loop``)
        out = walk.ctx.cache[key] = Val(v.shape, v.itemsize, target)
        return out
    want = {a: i for i, d in enumerate(target) for a in d}
    dims = [list(d) for d in v.dims]
    moves = walk.names.get(walk.root(var), "")
    label = moves or walk.labels.get(walk.root(var), "")
    only = bool(label) and not moves  # named for the ledger alone
    mult = walk.invariant.get(walk.root(var), mult)

    def add(kind: str, axes: tuple[str, ...], nbytes: int) -> None:
        walk.ctx.add(kind, axes, nbytes, mult, why, label, only)

    def reached() -> Val:
        """The value in the target layout, remembered for the next reshard of it there."""
        out = Val(v.shape, v.itemsize, target)
        walk.ctx.cache[key] = out
        return out

    moving = [(i, want[a]) for i, d in enumerate(v.dims) for a in d if want.get(a, i) != i]
    before = [walk.ctx.split(tuple(d)) for d in dims]
    after = [walk.ctx.split(tuple(t)) for t in target]
    shrink = [i for i, (b, c) in enumerate(zip(before, after, strict=True)) if b > c]
    grow = [i for i, (b, c) in enumerate(zip(before, after, strict=True)) if b < c]
    if (
        len(shrink) == 1
        and len(grow) == 1
        and math.prod(before) == math.prod(after)
        and all(before[i] % after[i] == 0 for i in shrink)
        and all(after[i] % before[i] == 0 for i in grow)
    ):
        # As many blocks as before, one dim's blocks fewer by the factor another's are more: XLA
        # reasons in block counts, not axis names, and moves the factor with one all-to-all of the
        # local block; where the devices then hold other blocks than the target's (the factor
        # was not the dim's last axes, or other axes stand in), a permute of the local block
        # follows (measured on single reshards: over data=2, model=2, expert=2, (model, expert)
        # on dim 0 to data there and model on dim 1; over data=4, model=2, model and data to
        # (data, model) on dim 0).
        (s_dim,), (g_dim,) = shrink, grow
        local = walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims)))
        moved = tuple(a for a in walk.ctx.mesh if a in target[g_dim] and a not in dims[g_dim])
        add("all-to-all", moved or tuple(target[g_dim]), local)
        n = len(dims[s_dim]) - len(target[s_dim])
        direct = (
            n > 0
            and dims[s_dim][:-n] == list(target[s_dim])
            and list(target[g_dim]) == dims[g_dim] + dims[s_dim][-n:]
            and all(list(target[k]) == dims[k] for k in range(len(dims)) if k not in (s_dim, g_dim))
        )
        if not direct:
            add(
                "collective-permute",
                tuple(a for a in walk.ctx.mesh if a in v.axes or any(a in t for t in target)),
                local,
            )
        return reached()
    if (
        not grow
        and shrink
        and all(b % c == 0 for b, c in zip(before, after, strict=True))
        and not all(list(t) == d[: len(t)] for d, t in zip(dims, target, strict=True))
    ):
        # Fewer blocks on some dims, none more, but not by gathering each dim's last axes: the
        # blocks are permuted first (the local block), then gathered in groups to the target's
        # (measured on single reshards: over data=2, model=2, expert=2, (expert, data) on two dims
        # to data on the first; over data=4, model=2, data to model on a dim).
        add(
            "collective-permute",
            tuple(a for a in walk.ctx.mesh if a in v.axes),
            walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
        )
        for i in reversed(range(len(dims))):
            if before[i] != after[i]:
                dims[i] = list(target[i])
                add(
                    "all-gather",
                    tuple(a for a in walk.ctx.mesh if a in v.dims[i] and a not in target[i]) or tuple(v.dims[i]),
                    walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
                )
        return reached()
    if any(any(want.get(a, i) != i for a in d) and any(a not in want for a in d) for i, d in enumerate(v.dims)) or any(
        (i == k) != (j == m) for n, (i, j) in enumerate(moving) for k, m in moving[n + 1 :]
    ):
        # One dim's axes both moving to another dim and gathered (``(data, expert)`` on the
        # tokens to ``expert`` on the experts), or two axes moving from one dim to two, or from
        # two dims to one: GSPMD has no reshard for that and replicates the value (an all-gather
        # over every axis it is split on, "involuntary full rematerialization"), then slices it
        # (measured; on single reshards over data=4, model=2: (data, model) on dim 0 to data on
        # dim 1 and model on dim 2; model on dim 0 and data on dim 2 to (data, model) on dim 1).
        # Each dim gathered whole in turn, the last first.
        for i in reversed(range(len(dims))):
            if dims[i]:
                whole_dim, dims[i] = dims[i], []
                add(
                    "all-gather",
                    tuple(a for a in walk.ctx.mesh if a in whole_dim),
                    walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
                )
    elif not all(list(t[: len(d)]) == d for d, t in zip(dims, target, strict=True)) and all(
        walk.ctx.split(tuple(t)) % walk.ctx.split(tuple(d)) == 0 for d, t in zip(dims, target, strict=True)
    ):
        # Every dim as split as before or further, but not by a free slice (the target's axes on a
        # dim do not start with the value's): each device's block lies inside one block the value
        # has, on some device; XLA sends it there, a collective-permute of the target's block
        # (measured on single reshards over data=4, model=2: `model` to `data` on a dim, `model`
        # to (data, model), (data, model) to (model, data), `model` on one dim to `data` there and
        # `model` on the next).
        whole = Val(v.shape, v.itemsize, target)
        add("collective-permute", tuple(a for a in walk.ctx.mesh if a in whole.axes), walk.ctx.local(whole))
        return reached()
    # A dim an all-to-all moves an axis onto: the axes the target adds there that no dim holds are
    # sliced first, so the all-to-all moves the smaller block (measured on single reshards over
    # data=4, model=2: `model` on dim 1 to (data, model) on dim 0 is a slice over data and an
    # all-to-all of a quarter of the buffer; where the order comes out wrong, a permute follows).
    onto = {want[a] for i, d in enumerate(dims) for a in d if want.get(a, i) != i}
    for i in onto:
        dims[i] += [a for a in target[i] if all(a not in d for d in dims)]
    # ... and the axes the target leaves out there gathered first (measured: data on dim 0 and
    # model on dim 1 to data on dim 1 gathers model, then moves data on the gathered block).
    for i in sorted(onto):
        drop = [a for a in dims[i] if a not in want]
        if drop:
            dims[i] = [a for a in dims[i] if a in want]
            add("all-gather", tuple(drop), walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))))
    # An axis that moves to another dim: all-to-all of the local buffer. Moving one that is not the
    # last of its dim's axes leaves the blocks on other devices than the target's: a permute after.
    scrambled = False
    for i, d in enumerate(v.dims):
        for a in d:
            j = want.get(a)
            if j is not None and j != i and a in dims[i] and a not in dims[j]:
                scrambled = scrambled or dims[i][-1] != a
                add("all-to-all", (a,), walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))))
                dims[i].remove(a)
                dims[j].append(a)
    # A matmul's all-reduced result whose split dim the target splits further over an axis it
    # was summed over: XLA gathers the dim whole, then slices it (``resolve``). Where a mesh
    # axis is idle (neither splitting the value nor summed), XLA splits the matmul's batch over
    # it instead and permutes the summed result into place (``matmul._idle_split``'s stand-ins).
    summed, batch = walk.dot_reduced.get(var, (frozenset(), 0))
    origin = walk.sum_origin.get(var)
    idle = bool(walk.stand_ins.get(walk.root(var))) or any(
        n > 1 and a not in v.axes and a not in summed for a, n in walk.ctx.mesh.items()
    )
    for i, t in enumerate(target[:batch]):
        if origin is not None and not idle and dims[i] and any(a in summed and a not in dims[i] for a in t):
            undivided = [list(d) for d in dims]
            undivided[i] = []
            reader, walk.ctx.source = walk.ctx.source, origin[1] or walk.ctx.source  # the matmul's
            nbytes = walk.ctx.local(Val(v.shape, v.itemsize, _tuple(undivided)))
            walk.ctx.add("all-gather", tuple(dims[i]), nbytes, mult, origin[0], label, only)
            walk.ctx.source = reader
            dims[i] = []
    # Axes replaced on a dim by others of the same size that split nothing else: the local part
    # sent to the device that holds it in the target, a collective-permute (measured: a value
    # over (data, model) to (data, expert), and over model to expert, on either dim).
    held = {a for d in dims for a in d}
    wanted_axes = {a for t in target for a in t}
    for i, t in enumerate(target):
        cur = dims[i]
        k = next((n for n, (x, y) in enumerate(zip(cur, t, strict=False)) if x != y), min(len(cur), len(t)))
        old, new = cur[k:], list(t[k:])
        if (
            old
            and new
            and walk.ctx.split(tuple(old)) == walk.ctx.split(tuple(new))
            and not set(old) & wanted_axes
            and not set(new) & held
        ):
            add("collective-permute", (*old, *new), walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))))
            dims[i] = cur[:k] + new
            held = {a for d in dims for a in d}
    # Axes the target adds: a free local slice, taken before any gather (so a gather moves
    # only the part the target keeps: measured, a broadcast split over `model` met by a value
    # split over `data` is gathered over `model` in its `data` slice); not on a dim that loses
    # axes (below).
    for i, t in enumerate(target):
        for a in t:
            if a not in dims[i] and all(a not in d for d in dims) and all(x in t for x in dims[i]):
                dims[i].append(a)
    # Axes the target leaves out: all-gather (the gathered result's bytes), the last dim first
    # (measured: (data, model) made whole gathers `model` on the small buffer, then `data`).
    carried: list[str] = []  # axes gathered with a dim further left, in one collective (``gathers_at_once``)
    for i, cur in reversed(list(enumerate(list(dims)))):
        drop = [a for a in cur if a not in target[i]]
        if drop:
            kept = [a for a in cur if a in target[i]]
            fresh = [a for a in target[i] if all(a not in d for d in dims)]
            coarser = bool(not kept and fresh and walk.ctx.split(tuple(cur)) % walk.ctx.split(tuple(fresh)) == 0)
            simple = kept == cur[: len(kept)] and not coarser
            if simple and walk.ctx.book.gathers_at_once and any(a not in target[j] for j in range(i) for a in dims[j]):
                dims[i] = kept
                carried += drop
                continue
            drop = [a for a in walk.ctx.mesh if a in drop or a in carried] if carried else drop
            carried = []
            if not simple:
                # A kept axis after a dropped one, or the dim coarser over other axes: the blocks
                # are permuted first, then gathered in groups (measured on single reshards over
                # data=4, model=2: (model, data) to data, and data to model on a dim).
                add(
                    "collective-permute",
                    tuple(a for a in walk.ctx.mesh if a in cur),
                    walk.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
                )
            dims[i] = fresh if coarser else kept
            gathered = Val(v.shape, v.itemsize, _tuple(dims))
            nbytes = walk.ctx.local(gathered)
            add("all-gather", tuple(drop), nbytes)
            if moves and walk.ctx.book.minor_gather and walk.fixed(var) and _minor(walk, gathered, i):
                # a step input gathered along an inner dim: gathered as a copy with that dim outermost
                if "shard" in walk.ctx.book.minor_gather:
                    walk.ctx.copy(nbytes // walk.ctx.split(tuple(drop)), mult)
                if "whole" in walk.ctx.book.minor_gather:
                    walk.ctx.copy(nbytes, mult)
            if moves and walk.ctx.book.gather_cse is None:  # held to its last use (else: ``matmul._cast_gather``)
                walk.ctx.gathered_now += nbytes
                walk.ctx.gathered_peak = max(walk.ctx.gathered_peak, walk.ctx.gathered_now)
            elif not moves and why == "dot_general":
                # an activation gathered for a matmul: a buffer of the gathered size while the
                # matmul runs (XLA's temporaries; the whole batch's activations gathered in a
                # scanned layer's backward pass are most of a pod-scale step's peak)
                alive = walk.ctx.held(gathered)
                if walk.ctx.gather_reduces(tuple(drop)):
                    # gathered as an all-reduce of the zero-padded shard: the padded buffer, whole
                    # and in the value's own type (a narrowing cast is folded into the all-reduce),
                    # is alive beside the result (XLA:TPU v5p, read from its buffer assignment:
                    # f32[256,1024,28672] padded beside the bf16 result, 42 GiB of a 70B step's 50)
                    padded = Val(v.shape, getattr(var.aval.dtype, "itemsize", v.itemsize), _tuple(dims))
                    alive += walk.ctx.held(padded)
                walk.peak = max(walk.peak, alive)
    # What a gather freed for the target: a free local slice.
    for i, t in enumerate(target):
        for a in t:
            if a not in dims[i] and all(a not in d for d in dims):
                dims[i].append(a)
    if (scrambled or _tuple(dims) != target) and all(sorted(d) == sorted(t) for d, t in zip(dims, target, strict=True)):
        # The target's axes on every dim, in another order: the blocks sit on other devices, a
        # collective-permute of the local block (measured: (data, model) to (model, data); an
        # all-to-all that leaves (model, data) where (data, model) is wanted, then a permute).
        done = Val(v.shape, v.itemsize, target)
        add("collective-permute", tuple(a for a in walk.ctx.mesh if a in done.axes), walk.ctx.local(done))
        dims = [list(t) for t in target]
    out = Val(v.shape, v.itemsize, _tuple(dims))
    walk.ctx.cache[key] = out
    return out


def _minor(walk: Walker, v: Val, dim: int) -> bool:
    """Whether ``dim`` of ``v``'s local part is not its outermost dim of more than one element
    (``Compiler.minor_gather``)."""
    return any(size // walk.ctx.split(tuple(axes)) > 1 for size, axes in zip(v.shape[:dim], v.dims[:dim], strict=True))


def _sliced(dims: Dims, target: Dims) -> bool:
    """Whether ``target`` only adds axes after each dim's own, none of them splitting ``dims``
    elsewhere: every device keeps a part of its block, nothing moves."""
    held = {a for d in dims for a in d}
    return all(t[: len(d)] == d and not held.intersection(t[len(d) :]) for d, t in zip(dims, target, strict=True))


def to_layout(walk: Walker, var: Any, v: Val, target: Dims, mult: int, why: str) -> Val:
    """``v`` set to a layout (a constraint, a reshard): its pending sums done onto it, then moved."""
    return reshard(walk, var, resolve(walk, var, v, target, mult, why), target, mult, why)
