"""Fast mode's rules for matmuls (``dot_general``) and grouped matmuls (``ragged_dot_general``):
the operands' layouts XLA's dot partitioner picks, the pending sums it leaves, and the FLOPs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from shardplan.runtime import splitk
from shardplan.runtime.fast.calls import inline
from shardplan.runtime.fast.relayout import reshard, reshard_key, resolve, to_layout
from shardplan.runtime.fast.values import Dims, Val, _is_float, _local_shape, _norm, _reads_narrow, _tuple
from shardplan.runtime.fast.walker import Walker
from shardplan.runtime.primitives import itemsize


def _rhs_yields(lhs: Val, rhs: Val, first: str | None = None) -> bool:
    """Where one axis splits a free dim of each matmul operand: whether the right-hand one gives
    it up. ``first``: the operand Shardy lays out first, which keeps its split (``Walker.laid_first``:
    a scanned layer's weight slice against activations a matmul made before the loop); else XLA's
    propagation keeps the larger operand's split (ties: the left's)."""
    if first is not None:
        return first == "lhs"
    return math.prod(rhs.shape) * rhs.itemsize <= math.prod(lhs.shape) * lhs.itemsize


def dot(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lx, rx = eqn.invars
    lhs, rhs = ins
    out_aval = eqn.outvars[0].aval
    # A pending sum over the axes the other operand splits a contraction over: done first, as a
    # reduce-scatter onto that dim, and the matmul contracts split.
    lhs = _scattered_onto_contraction(walk, lx, lhs, rhs, lc, rc, mult)
    rhs = _scattered_onto_contraction(walk, rx, rhs, lhs, rc, lc, mult)
    # One pending sum at a time: a partial operand times a whole one stays partial.
    if lhs.partial and rhs.partial:
        rhs = resolve(walk, rx, rhs, None, mult, "dot_general")
    partial = set(lhs.partial | rhs.partial)
    pending = set(partial)
    lhs, rhs = replace(lhs, partial=frozenset()), replace(rhs, partial=frozenset())
    lfree = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
    rfree = [i for i in range(len(rhs.shape)) if i not in rc and i not in rb]
    ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
    # Batch dims: both sides must agree; keep the more split one. Where they disagree, XLA
    # partitions the matmul over the batch dims alone: both operands' contracting dims are
    # gathered (measured: an expert weight's gradient, experts split on one side and tokens
    # on the other, gathers both rather than summing a split over `data`).
    # An axis splits one batch dim only: where each side splits a different batch dim over it
    # (heads over an axis on one side, the same axis on the other's sequence), the first keeps it.
    conflict = False
    batch_axes: set[str] = set()
    for i, j in zip(lb, rb, strict=True):
        # One side's split extends the other's ((data, expert) against data) by axes the other
        # operand splits a free dim over: where the extending side is the smaller operand, XLA
        # keeps the other's free split and the extending side's longest prefix free of it on the
        # batch dim, the rest gathered off (measured on single matmuls "gsd,egcd->gsec": tokens
        # over (data, expert) against experts' buffers over expert on e and data on g, 4x the
        # tokens' bytes: the tokens gathered over expert; the buffers smaller than the tokens:
        # the buffers moved. A weight too: "egcd,edf->egcf", dispatched tokens over (data,
        # expert) on g against experts' weights over expert on e, XLA:CPU gathers the weights
        # where they are the smaller operand (73,728 B against 196,608 B of tokens; 131,072
        # against 262,144) and moves the tokens by all-to-all where they are (49,152 against
        # 73,728; 65,536 against 524,288), 2026-12-06).
        prefix = None
        for longer, shorter, other, free, mine, theirs in (
            (ldims[i], rdims[j], rdims, rfree, lhs, rhs),
            (rdims[j], ldims[i], ldims, lfree, rhs, lhs),
        ):
            taken = {a for k in free for a in other[k]}
            if (
                len(longer) > len(shorter)
                and longer[: len(shorter)] == shorter
                and taken & set(longer)
                and math.prod(mine.shape) * mine.itemsize < math.prod(theirs.shape) * theirs.itemsize
            ):
                prefix = list(itertools.takewhile(lambda a, t=taken: a not in t, longer))  # type: ignore[misc]
                break
        if prefix is not None and not batch_axes & set(prefix):
            ldims[i], rdims[j] = list(prefix), list(prefix)
        elif ldims[i] != rdims[j]:
            options = sorted((ldims[i], rdims[j]), key=lambda d: -walk.ctx.split(tuple(d)))
            keep = next((d for d in options if not batch_axes & set(d)), [])
            ldims[i], rdims[j] = list(keep), list(keep)
            conflict = True
        batch_axes |= set(ldims[i])
    if conflict:
        for i, j in zip(lc, rc, strict=True):
            ldims[i], rdims[j] = [], []
        # an axis the batch dims now take leaves the operands' other dims (gathered there)
        taken_b = {a for i in lb for a in ldims[i]}
        for k in range(len(ldims)):
            if k not in lb:
                ldims[k] = [a for a in ldims[k] if a not in taken_b]
        for k in range(len(rdims)):
            if k not in rb:
                rdims[k] = [a for a in rdims[k] if a not in taken_b]
    if not conflict and not pending:
        lhs, rhs = _crossed(walk, (lx, rx), (lhs, rhs), (ldims, rdims), (lc, rc), mult)
    # Contracting dims: split the same way on both sides -> local, then a pending sum.
    wanted = walk.wants.get(eqn.outvars[0], walk.hints.get(eqn.outvars[0]))  # (its readers' layout)
    tile: Dims | None = None  # the result computed as wanted: the operands' free dims sliced to it
    alike = any(ldims[i] and ldims[i] == rdims[j] for i, j in zip(lc, rc, strict=True))  # a sum either way
    for i, j in zip(lc, rc, strict=True):
        a, b = ldims[i], rdims[j]
        if a == b:
            partial |= set(a)
            continue
        if wanted is not None and not pending and (not a or not b):
            # One side split on the contraction, the other whole, the result wanted with those
            # axes on a batch or free dim of the split side: XLA moves them there (an all-to-all)
            # and contracts whole, whatever the sizes (measured on XLA:CPU and XLA:GPU: x @ w, x
            # over `model` on the batch and `expert` on its width, w whole, wanted over (model,
            # expert) on the batch: 2 KiB of all-to-all, not an 8 KiB reduce-scatter; 16 KiB where
            # the reduce-scatter would be 2 KiB).
            dims, base = (ldims, 0) if a else (rdims, len(lb) + len(lfree))
            split = a or b
            batch, side_free = (lb, lfree) if a else (rb, rfree)
            spots = [(k, n) for n, k in enumerate(batch)] + [(k, base + n) for n, k in enumerate(side_free)]
            spot = _wanted_spot(_norm(wanted, len(out_aval.shape)), dims, spots, split)
            if spot is not None:
                k, goal = spot
                dims[k] = list(goal)
                (ldims if a else rdims)[i if a else j] = []
                continue
            if not alike and set(split) & {x for d in _norm(wanted, len(out_aval.shape)) for x in d}:
                # Wanted split over a contraction axis elsewhere (another dim, or with axes the
                # split side's dim lacks): XLA gathers the split side whole on the dim (keeping
                # its other splits) and computes only the wanted tile of the result, no partial
                # sum (measured on XLA:CPU, h @ w, w whole, 8 devices as model = 4, data = 2: h
                # over (model, data) on its contraction, wanted over (model, data) on (rows,
                # columns), on its columns, or over model on its rows: h gathered whole, 98,304 B,
                # where slicing w and reduce-scattering would move 24,576 B; h over data on its
                # rows and model on the contraction, wanted (data, model): h gathered over model
                # alone, 49,152 B. Wanted with no contraction axis, or none: sliced and summed;
                # another contraction dim split alike on both sides: ``_whole_where_split_further``.)
                if a:
                    lhs = _gathered_on(walk, lx, lhs, i, eqn, mult, ldims)
                    ldims[i] = []
                else:
                    rhs = _gathered_on(walk, rx, rhs, j, eqn, mult, rdims)
                    rdims[j] = []
                tile = _norm(wanted, len(out_aval.shape))
                continue
        # One side split on the contraction: gather it there, or slice the other side and sum
        # the partial results (GSPMD weighs the bytes; so do we).
        if (
            moved := _contraction_moves(
                walk, lhs, rhs, i, j, ldims, rdims, lb, lfree, rfree, (lx, rx, eqn.outvars[0]), wanted, pending
            )
        ) is not None:
            # One side whole on the dim, or split over different axes free on it, and the
            # result's pending sum cheaper than gathering the other side: that side is gathered
            # whole on the dim (XLA's dot partitioner replicates it there; a whole side or a
            # split the other extends is only sliced) and sliced as the other is; the matmul
            # stays split (measured: a row-parallel weight split over `data` meets hidden states
            # split over `model` on the contraction: XLA gathers the weight and all-reduces the
            # result; a replicated weight meets them: XLA gathers the states, whose bytes are
            # fewer than the result's).
            # (a side split over other axes of as many devices, or a divisor as many, is moved onto
            # the other's split by a collective-permute of the blocks it lacks, not gathered:
            # measured, a weight over `data` on its rows, 2 devices, against hidden states over
            # `expert` or `model` on their width, 4 devices, and over `data` on their batch: 512 B
            # permuted where fast mode gathered 2 KiB, XLA:CPU, 2026-12-06)
            across = _across(walk, a, b)
            if moved == "rhs":
                if b != a[: len(b)] and not across and not _finer(walk, a, b):
                    rhs = _gathered_on(walk, rx, rhs, j, eqn, mult)
                rdims[j] = list(a)
            else:
                if a != b[: len(a)] and not across and not _finer(walk, b, a):
                    lhs = _gathered_on(walk, lx, lhs, i, eqn, mult)
                ldims[i] = list(b)
            partial |= set(ldims[i])
        elif (idle := _onto_idle_axes(walk, (lhs, rhs), a, b, (ldims, rdims), (i, j), (lb, lfree, rfree))) is not None:
            ldims[i], rdims[j] = list(idle), list(idle)
            partial |= set(idle)
        elif (side := _onto_the_others_split(walk, a, b, ldims, rdims, i, j)) is not None:
            if side == "lhs":
                ldims[i] = list(b)
            else:
                rdims[j] = list(a)
            partial |= set(ldims[i])
        else:
            # Conflict (the axis also splits the other operand elsewhere): gather the cheaper side.
            ltotal = walk.ctx.local(Val(lhs.shape, lhs.itemsize, _tuple(ldims)))
            rtotal = walk.ctx.local(Val(rhs.shape, rhs.itemsize, _tuple(rdims)))
            if ltotal * walk.ctx.split(tuple(a)) <= rtotal * walk.ctx.split(tuple(b)):
                ldims[i] = [x for x in a if x in b]
            else:
                rdims[j] = [x for x in b if x in a]
            common = [x for x in ldims[i] if x in rdims[j]]
            ldims[i], rdims[j] = list(common), list(common)
            partial |= set(common)
    # Free dims: an axis may split only one operand's free dims and not the contraction.
    contract_axes = {x for i in lc for x in ldims[i]} | {x for i in lb for x in ldims[i]}
    for i in lfree:
        ldims[i] = [x for x in ldims[i] if x not in contract_axes]
    used = {x for i in lfree for x in ldims[i]} | contract_axes
    for j in rfree:
        clash = [x for x in rdims[j] if x in used]
        if clash:
            # The same axis splits a free dim of each side: XLA's propagation keeps the split of
            # the larger operand (its whole size) and gathers the other (measured: under sequence
            # parallelism a layer's weights are gathered, the sequence stays split).
            # (inside a loop body, where one axis clashes, the operand laid out first: ``priority``)
            if _rhs_yields(lhs, rhs, walk.laid_first(lx, rx) if len(clash) == 1 else None):
                rdims[j] = [x for x in rdims[j] if x not in used]
            else:
                for i in lfree:
                    ldims[i] = [x for x in ldims[i] if x not in clash]
    if tile is not None:
        _slice_to(tile, ldims, rdims, lb, rb, lfree, rfree)
    elif wanted is None and (readers := walk.free.get(eqn.outvars[0])) is not None:
        # The result met split values in its readers (an elementwise op computed split: the
        # second pass's ``free``): XLA computes only that split of it, its operands sliced where
        # they hold those dims whole (measured on ``x @ w + b``, x gathered whole off its width, w
        # whole, b split on the columns over data, model or both: 1/2, 1/4, 1/8 of the FLOPs on
        # XLA:CPU, XLA:TPU v5e and XLA:GPU H100 alike, 2026-12-07; fast mode had computed it whole).
        _slice_to(_norm(readers, len(out_aval.shape)), ldims, rdims, lb, rb, lfree, rfree)
    claimed = walk.claimed.get(eqn.outvars[0])
    passed = walk.passed.get(eqn.outvars[0])
    if (
        claimed is None
        and wanted is None
        and passed is not None
        and not pending
        and len(passed) == len(lb) + len(lfree) + len(rfree)
    ):
        # Laid out by Shardy's first phase (an elementwise chain from a split input)
        partial = _computed_as_passed(passed, ldims, rdims, (lb, rb, lc, rc, lfree, rfree))
    if claimed is None and lb and eqn.outvars[0] in walk.back:  # a plain matmul keeps its pending sum
        claimed = walk.back_claim(
            eqn.outvars[0],
            tuple([tuple(ldims[i]) for i in lb] + [tuple(ldims[i]) for i in lfree] + [tuple(rdims[j]) for j in rfree]),
        )
    if claimed is not None and (not lb or walk.xla_claims) and partial & {a for d in claimed for a in d}:
        # A matmul whose contraction both sides split over an axis the constraint wants on the
        # result: the sum stays (reduce-scattered, or all-reduced beside an idle axis that stands
        # in: ``_idle_split``), the operands are not gathered (measured on single matmuls; and, on
        # XLA's layouts, on experts' weight gradients "egcd,egcf->edf", tokens over (data, expert)
        # on g, the result over expert on e: a reduce-scatter over expert and an all-reduce over
        # data, where moving the operands' batch dims onto expert gathered the tokens over (data,
        # expert)). A batched matmul under a plan's own constraint keeps the constraint's layout
        # (applied there too, one random MoE pair of 200 moved: its collectives closer, its peak
        # 30.1 -> 34.0% and FLOPs 22.7 -> 28.7% off).
        claimed = None
    if claimed is not None and not pending and len(claimed) == len(lb) + len(lfree) + len(rfree):
        # A constraint's layout given to the matmul's result (Shardy's apply-sharding-constraints):
        # XLA's partitioner then lays the operands out to produce it, each batch and free dim
        # split as the result is (measured: tokens split over data x expert, dispatched to
        # experts split over expert, are gathered over expert first, not moved after).
        taken = {a for d in claimed for a in d}
        _lay_out(claimed, ldims, rdims, lb, rb, lfree, rfree)
        partial = set()
        for i, j in zip(lc, rc, strict=True):
            if ldims[i] != rdims[j] or any(a in taken for a in ldims[i]):
                ldims[i], rdims[j] = [], []
            partial |= set(ldims[i])
    if wanted is not None:
        stand_ins = _idle_split(
            walk, _norm(wanted, len(out_aval.shape)), tuple(out_aval.shape), ldims, rdims, lb, rb, lfree, rfree, partial
        )
        if stand_ins:
            walk.stand_ins[walk.root(eqn.outvars[0])] = stand_ins
    whole = False
    if partial and not lb:
        further = _wanted_of(walk, eqn.outvars[0], wanted)
        if further is not None:
            # the axes each side's contraction was split over before it was laid out for the matmul
            lsplit = {a for i in lc for a in lhs.dims[i]}
            rsplit = {a for j in rc for a in rhs.dims[j]}
            whole = _whole_where_split_further(further, ldims, rdims, lfree, rfree, partial, rsplit, lsplit)
    lt, rt = _tuple(ldims), _tuple(rdims)
    narrow = walk.ctx.book.matmul_itemsize
    # The operands as they came (a contraction gathered above is gathered by the partitioner here).
    l0, r0 = (o if not o.partial else v for o, v in zip(ins, (lhs, rhs), strict=True))
    used = pending | partial | lhs.axes | rhs.axes | l0.axes | r0.axes | {a for d in (*lt, *rt) for a in d}
    reordered, result_moved = _reordered(walk, (l0, r0), (lt, rt), (lb, rb), (lfree, rfree), used)
    for v, times in reordered:
        walk.ctx.add(
            "collective-permute", _permuted_over(walk, v, used), _moved_bytes(walk, eqn, v) * times, mult, "dot_general"
        )
    sides = []
    for x, v, t, o, bs, obs in ((lx, lhs, lt, rhs, lb, rb), (rx, rhs, rt, lhs, rb, lb)):
        through = _through_idle(walk, v, t, o, bs, obs, used)
        if through is not None:
            # onto the other side's batch split by a slice over the idle axis, a permute and a
            # gather over it (``_through_idle``), not an all-to-all
            shifted, over = through
            local = _moved_bytes(walk, eqn, v)
            walk.ctx.add(
                "collective-permute",
                _permuted_over(walk, v, used),
                local // walk.ctx.split(shifted),
                mult,
                "dot_general",
            )
            walk.ctx.add("all-gather", over, local, mult, "dot_general")
            v = replace(v, dims=t)
            walk.ctx.cache[reshard_key(walk, x, t)] = v
        sides.append(v)
    lhs, rhs = sides
    if narrow and _reads_narrow(eqn):
        # Cast before it moves (the default precision computes in a narrower type); gathered
        # again for a later matmul where the compiler does (``Compiler.gather_cse``).
        for x, v, t in ((lx, lhs, lt), (rx, rhs, rt)):
            if v.itemsize == 4 and _is_float(x):
                _cast_gather(walk, eqn, x, v, t, mult, narrow)
            else:
                reshard(walk, x, v, t, mult, "dot_general")
    else:
        reshard(walk, lx, lhs, lt, mult, "dot_general")
        reshard(walk, rx, rhs, rt, mult, "dot_general")
    out_dims = [lt[i] for i in lb] + [lt[i] for i in lfree] + [rt[j] for j in rfree]
    shape = tuple(out_aval.shape)
    out = Val(shape, itemsize(out_aval), tuple(out_dims), frozenset(partial))
    summed = tuple(frozenset(lt[i]) for i in lc if lt[i])
    if walk.ctx.book.sums_per_dim and len(summed) > 1:
        walk.sum_dims[eqn.outvars[0]] = summed
    k = math.prod(lhs.shape[i] for i in lc)
    kshards = walk.ctx.split(tuple(x for i in lc for x in lt[i]))
    walk.count_flops(2 * (walk.ctx.local(out) / out.itemsize) * (k / kshards), mult, "dot_general")
    if result_moved:  # computed in the operands' device order: the result moved to its own
        walk.ctx.add("collective-permute", _permuted_over(walk, out, used), walk.ctx.local(out), mult, "dot_general")
    if walk.ctx.book.split_k is not None:
        _split_k(walk, eqn, Val(lhs.shape, lhs.itemsize, lt), Val(rhs.shape, rhs.itemsize, rt), out, mult)
    if out.partial and lb:  # its leading dims are the batch dims (see ``resolve``)
        walk.dot_batch[walk.root(eqn.outvars[0])] = len(lb)
    if out.partial:  # where its operands' rows went: an operand's leading dim, else none
        first = lb[:1] or lfree[:1]
        rows_kept = first == [0] if first else rfree[:1] == [0]
        walk.rows[walk.root(eqn.outvars[0])] = 0 if rows_kept else None
    if whole:  # all-reduced where it is computed, whole on the dims it slices after
        walk.kept_whole.add(eqn.outvars[0])
        seen = walk.transposed_as(eqn.outvars[0])
        if seen is not None:
            walk.kept_whole.add(seen[0])
        if out.partial:
            return resolve(walk, eqn.outvars[0], out, out.dims, mult, "dot_general", contracted=k)
    want = walk.wants.get(eqn.outvars[0])
    if out.partial and want is not None and any(a in out.partial for d in want for a in d):
        # Its readers keep a split over a pending axis: reduce-scattered onto it here.
        return resolve(walk, eqn.outvars[0], out, want, mult, "dot_general", contracted=k)
    return out


def _reordered(
    walk: Walker,
    ops: tuple[Val, Val],
    targets: tuple[Dims, Dims],
    batch: tuple[Sequence[int], Sequence[int]],
    free: tuple[Sequence[int], Sequence[int]],
    used: set[str],
) -> tuple[tuple[tuple[Val, int], ...], bool]:
    """What XLA's dot partitioner permutes besides the moves to ``targets``, in a matmul whose
    batch dims are split alike on both sides beside an idle mesh axis (``used``: the axes an
    operand, the result or a pending sum uses), where an operand is gathered over an axis the
    other operand keeps on a free dim: the gathered operand's local block, before its gather.
    Where that axis leaves its batch dim, both operands and the result (the matmul computed in the
    gathered operand's device order), unless the gathered operand, gathered, is no larger than the
    other: then it alone, before and after its gather. Returns the operands to permute (each with
    how many of its local blocks) and whether the result is permuted.

    Measured on XLA:CPU over data=2, expert=2, model=2 (2026-12-08), ``bij,bjk->bik`` with b over
    data, the result and the lhs over (data, expert) on (b, i): the rhs over (data, expert) on b
    permutes 106,496 B (lhs 32,768 + rhs 24,576 + result 49,152) beside its gather; a rhs of 4,096 B
    permutes 4,096 + 8,192 B; the rhs over expert on k or j, 24,576 B (the rhs alone). 14 shapes of
    ``bij,bjk->bik`` and the MoE dispatch ``gsec,gsd->egcd`` alike; XLA:TPU v5e the same in its bf16
    copies. Not applied (measured otherwise on random pairs): whole batch dims, a batch split one
    side takes by a slice, matmuls with no batch dims, a kept split the other side only acquires."""
    if not any(targets[0][b] for b in batch[0]) or not any(n > 1 and a not in used for a, n in walk.ctx.mesh.items()):
        return (), False  # (no batch split, or no idle axis)
    gathered: list[tuple[Val, int]] = []
    for k in (0, 1):
        v, t, other, ot = ops[k], targets[k], ops[1 - k], targets[1 - k]
        if any(other.dims[b] != ot[b] for b in batch[1 - k]) or any(
            tuple(v.dims[b][: len(t[b])]) != t[b] for b in batch[k]
        ):
            continue  # the other side's batch split moves, or this side's is not kept as its leading axes
        left = set(v.axes) - {a for d in t for a in d}
        kept = {a for f in free[1 - k] for a in other.dims[f] if a in ot[f]}
        if left & kept:
            off_batch = tuple(a for b in batch[k] for a in v.dims[b] if a in left & kept)
            if not off_batch:
                gathered.append((v, 1))
                continue
            n = walk.ctx.split(off_batch)
            if walk.ctx.local(v) * n <= walk.ctx.local(other):
                return ((v, 1), (v, n)), False  # into the other side's order: before and after its gather
            return ((ops[0], 1), (ops[1], 1)), True
    return tuple(gathered), False


def _through_idle(
    walk: Walker,
    v: Val,
    target: Dims,
    other: Val,
    batch: Sequence[int],
    other_batch: Sequence[int],
    used: set[str],
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """Where a batched matmul's operand moves one axis from another dim onto the end of its batch
    split, which the other operand already holds, and a mesh axis of that size is idle (``used``:
    the axes the matmul uses): XLA slices the operand's batch over the idle axis, permutes the
    blocks so the idle axis stands where the moved one was, and gathers over it (measured on
    XLA:CPU over data=2, expert=2, model=2, ``bij,bjk->bik``, the result over (data, expert) on b:
    the lhs over data on b and expert on i or j, the rhs over (data, expert) on b: 16,384 B
    permuted and 32,768 B gathered where an all-to-all would move 32,768 B; the same on five
    shapes and for the rhs; XLA:TPU v5e the same in bf16, 2026-12-08). Returns (the moved axis,
    the idle one), or None."""
    if not batch or not any(target[b] for b in batch):
        return None
    grow = [b for b in batch if len(target[b]) == len(v.dims[b]) + 1 and tuple(v.dims[b]) == target[b][:-1]]
    if len(grow) != 1:
        return None
    (b,) = grow
    moved = target[b][-1]
    shrink = [
        f
        for f in range(len(v.dims))
        if f not in batch and v.dims[f] and v.dims[f][-1] == moved and tuple(v.dims[f][:-1]) == target[f]
    ]
    if len(shrink) != 1 or any(tuple(v.dims[k]) != target[k] for k in range(len(v.dims)) if k not in (b, shrink[0])):
        return None
    if tuple(other.dims[other_batch[list(batch).index(b)]]) != target[b]:
        return None  # the other side takes the split too (then XLA moves this one by all-to-all)
    idle = [a for a, n in walk.ctx.mesh.items() if n == walk.ctx.mesh[moved] and a not in used]
    return ((moved,), (idle[0],)) if idle else None


def _moved_bytes(walk: Walker, eqn: Any, v: Val) -> int:
    """The local bytes of a matmul operand as the compiler moves it: in the narrow type where it
    casts float32 operands first (``Compiler.matmul_itemsize``)."""
    narrow = walk.ctx.book.matmul_itemsize
    cast = narrow if narrow and _reads_narrow(eqn) and v.itemsize == 4 else v.itemsize
    return walk.ctx.local(replace(v, itemsize=cast))


def _permuted_over(walk: Walker, v: Val, used: set[str]) -> tuple[str, ...]:
    """The axes a permute of ``v``'s blocks into another device order crosses: its own and the
    mesh's idle ones (``used``: the axes the matmul uses), in mesh order."""
    return tuple(a for a, n in walk.ctx.mesh.items() if a in v.axes or (n > 1 and a not in used))


def _wanted_of(walk: Walker, var: Any, wanted: Dims | None) -> Dims | None:
    """The layout a matmul's result is wanted in: its readers' (``wanted``), a constraint's, or,
    where a transpose alone reads it (a weight's gradient, computed transposed), the transposed
    value's, permuted back."""
    rank = len(var.aval.shape)
    got = wanted if wanted is not None else walk.claimed.get(var)
    if got is not None:
        return _norm(got, rank)
    seen = walk.transposed_as(var)
    if seen is None:
        return None
    out, perm = seen
    after = walk.wants.get(out, walk.hints.get(out, walk.claimed.get(out)))
    if after is None:
        return None
    back: list[tuple[str, ...]] = [()] * rank
    for k, d in enumerate(_norm(after, rank)):
        back[perm[k]] = tuple(d)
    return tuple(back)


def _whole_where_split_further(
    wanted: Dims,
    ldims: list[list[str]],
    rdims: list[list[str]],
    lfree: list[int],
    rfree: list[int],
    partial: set,
    lclash: set[str],
    rclash: set[str],
) -> bool:
    """A plain matmul's free dim that an operand splits over axes the other operand's contraction
    was split over too (``lclash`` for the lhs's free dims, ``rclash`` for the rhs's), wanted split
    further over an axis the result is summed over: XLA's dot partitioner does not scatter the sum
    onto it. It gathers the operand's dim, computes the result whole there (that many times the
    FLOPs), all-reduces it and slices (measured on XLA:CPU, XLA:TPU and XLA:GPU, a weight's
    gradient ``bsf,bsd->fd``: cotangents over ``data`` x ``expert`` on the tokens, inputs over
    ``data`` and ``expert`` on ``d``, the gradient wanted over ``(expert, data)`` on ``d``: the
    inputs' ``d`` gathered, 4x the FLOPs, an 8,192 B all-reduce of the whole gradient). Where no
    such clash is (the cotangents' tokens over ``data`` alone) or the wanted split adds no summed
    axis, the sum is reduce-scattered onto the split dim or all-reduced there (2,048 B, the
    FLOPs split). Sets those dims whole in ``ldims`` / ``rdims`` in place; whether any was."""
    out = [(ldims[i], lclash) for i in lfree] + [(rdims[j], rclash) for j in rfree]
    cleared = False
    for (dims, clash), want in zip(out, wanted, strict=True):
        if dims and set(dims) & clash and list(want[: len(dims)]) == dims and set(want[len(dims) :]) & partial:
            dims.clear()
            cleared = True
    return cleared


def _idle_split(
    walk,
    want: Dims,
    shape: tuple[int, ...],
    ldims: list[list[str]],
    rdims: list[list[str]],
    lb: Sequence[int],
    rb: Sequence[int],
    lfree: list[int],
    rfree: list[int],
    partial: set[str],
) -> dict[str, str]:
    """A matmul's result dim that its readers want split further, over axes neither operand
    nor the pending sum uses, is computed split so: the operand that holds the dim is sliced
    there (no collective), the matmul does that share of the work and a pending sum is reduced
    on that share (XLA's dot partitioner lays the result out as wanted; measured on single
    matmuls ``a @ b`` with ``a`` over ``data`` and the result wanted over ``(data, model)`` or
    ``model`` on its columns, ``model`` idle: a quarter or half of the FLOPs, the all-reduce of
    the half). Where the readers want it split over an axis the sum is over, an idle axis of
    the same size stands in for it: the result computed split over the idle axis, all-reduced
    over the summed one and permuted into place (measured: the result wanted over ``(data,
    expert)``, summed over ``expert``, ``model`` idle: an all-reduce and a collective-permute of
    the quarter, where a reduce-scatter of the half was predicted). Updates ``ldims`` /
    ``rdims`` in place; returns the stand-ins (idle axis -> summed axis). Where the readers want
    summed axes on two dims or more, no axis stands in: the sum is reduced onto them (all-reduced
    whole on XLA:CPU and XLA:GPU, reduce-scattered on XLA:TPU: ``Compiler.scatters_one_dim``;
    measured on ``x.T @ g`` over ``(a, b)`` wanted ``(a, b)``, ``c`` idle)."""
    used = {a for d in (*ldims, *rdims) for a in d} | partial
    if sum(1 for w in want if set(w) & partial) > 1:
        # (the axes no side uses and nothing sums still split the result where it is computed:
        # ``x.T @ g`` over (a, b) wanted ((a, c), b) is computed over c, reduce-scattered over
        # (a, b) and permuted into place, as XLA does on every compiler)
        for p, d in enumerate(_sides(ldims, rdims, lb, rb, lfree, rfree)):
            spare = [a for a in want[p] if a not in used and walk.ctx.mesh.get(a, 1) > 1][:1]
            if spare and not d[0] and shape[p] % walk.ctx.split(tuple(spare)) == 0:
                for side in d:
                    side.extend(spare)
                used.update(spare)
        return {}
    named = {a for d in want for a in d}
    dims = _sides(ldims, rdims, lb, rb, lfree, rfree)
    stand_ins: dict[str, str] = {}
    for p, sides in enumerate(dims):
        cur, w = sides[0], list(want[p])
        if w[: len(cur)] != cur:
            continue
        extra: list[str] = []
        for a in w[len(cur) :]:
            if a in partial:
                idle = next(
                    (m for m, n in walk.ctx.mesh.items() if n == walk.ctx.mesh[a] and m not in used | named),
                    None,
                )
                if idle is None:
                    break
                stand_ins[idle] = a
                used.add(idle)
                a = idle
            elif a in used or walk.ctx.mesh.get(a, 1) == 1:
                break
            extra.append(a)
        while extra and shape[p] % walk.ctx.split((*cur, *extra)):
            stand_ins.pop(extra.pop(), None)
        for side in sides:
            side.extend(extra)
        used.update(extra)
    return stand_ins


def _sides(
    ldims: list[list[str]],
    rdims: list[list[str]],
    lb: Sequence[int],
    rb: Sequence[int],
    lfree: list[int],
    rfree: list[int],
) -> list[tuple[list[str], ...]]:
    """Per result dim of a matmul, the operand dims that make it (a batch dim's two, a free dim's one)."""
    dims: list[tuple[list[str], ...]] = [(ldims[i], rdims[j]) for i, j in zip(lb, rb, strict=True)]
    return dims + [(ldims[i],) for i in lfree] + [(rdims[j],) for j in rfree]


def _split_k(walk: Walker, eqn: Any, lhs: Val, rhs: Val, out: Val, mult: int) -> None:
    """XLA:GPU's split of the local matmul's contraction (``Compiler.split_k``): the float32
    partial results' workspace alive while they are added up (on top of the result), the
    additions and the padded contraction's products counted as FLOPs."""
    gpu = walk.ctx.book.split_k
    assert gpu is not None
    lc = eqn.params["dimension_numbers"][0][0]
    lb = eqn.params["dimension_numbers"][1][0]
    if not lc or 0 in lhs.shape or not all(_is_float(x) for x in eqn.invars):  # XLA:GPU splits no integer matmul
        return
    # Its dims merged as XLA:GPU canonicalises a matmul: batch, free and contracting dims each one
    # (measured: "mhd,hdn->mn" splits as a contraction of h x d).
    ls, rs = _local_shape(lhs, walk.ctx), _local_shape(rhs, walk.ctx)
    b = math.prod(ls[i] for i in lb)
    k = math.prod(ls[i] for i in lc)
    m = math.prod(ls) // (b * k)
    n = math.prod(rs) // (b * k)
    bits = (lhs.itemsize * 8, rhs.itemsize * 8, out.itemsize * 8)
    side, wider = walk.dot_merged(eqn)
    if wider > 1 and (
        math.prod(ls) * lhs.itemsize + math.prod(rs) * rhs.itemsize + b * m * n * out.itemsize <= splitk.MERGE_BYTES
    ):
        # merged with the matmuls that share an operand with it: split as the wider matmul
        m, n = (m, round(n * wider)) if side == 0 else (round(m * wider), n)
        split = splitk.choose(gpu, b, m, n, k, bits)
        m, n = (m, round(n / wider)) if side == 0 else (round(m / wider), n)
    else:
        split = splitk.choose(gpu, b, m, n, k, bits)
    if split == 1:
        return
    partials = b * split * m * n
    if out.partial and eqn.outvars[0] not in walk.summed_by_adds():
        # summed over devices first: the partials added up before the collective
        walk.peak = max(walk.peak, partials * 4)
        adds = partials * wider
    elif out.partial:  # added to another partial sum first: held until that addition adds them up
        walk.widened[eqn.outvars[0]] = partials * 4
        adds = partials * wider
    else:  # the addition fused into every reader: the partials held as long as the result
        walk.widened[eqn.outvars[0]] = partials * 4
        adds = partials * wider * walk.kernel_reads(eqn.outvars[0])
    walk.count_flops(adds + 2 * b * m * n * (splitk.padded(k, split, bits) - k), mult, "dot_general")


def _scattered_onto_contraction(
    walk: Walker, x: Any, v: Val, other: Val, mine: Sequence[int], theirs: Sequence[int], mult: int
) -> Val:
    """``v``'s pending sums done as reduce-scatters onto its contracting dims where the other
    operand splits the same dims over exactly those axes and ``v`` leaves them whole; ``v`` as it
    was unless every pending axis goes so. XLA lays the sum out as the matmul reads it (measured
    on a weight's gradient under batch x sequence splits: keys' cotangents, a sum over the
    queries split over ``seq``, times the layer's inputs split over ``seq`` on the same tokens:
    the cotangents reduce-scattered onto the tokens and the gradient contracted split, a quarter
    of the FLOPs of gathering the inputs and contracting whole, 2026-12-06)."""
    if not v.partial:
        return v
    target = [list(d) for d in v.dims]
    left = set(v.partial)
    for i, j in zip(mine, theirs, strict=True):
        axes = list(other.dims[j])
        if axes and not v.dims[i] and set(axes) <= left and v.shape[i] % walk.ctx.split(tuple(axes)) == 0:
            target[i] = axes
            left -= set(axes)
    if left:
        return v
    return resolve(walk, x, v, _tuple(target), mult, "dot_general")


def _wanted_spot(
    wanted: Dims, dims: list, spots: list[tuple[int, int]], split: list
) -> tuple[int, tuple[str, ...]] | None:
    """Where a side's contraction split (``split``) goes when the result is ``wanted``: the dim of
    that side (``spots``: its dim and the result's) whose wanted axes are its own plus ``split``,
    with the wanted axes; None where there is none."""
    for k, r in spots:
        want = tuple(wanted[r])
        if set(split) <= set(want) and set(want) == set(dims[k]) | set(split) and not set(dims[k]) & set(split):
            return k, want
    return None


def _elsewhere(dims: list, k: int) -> set[str]:
    """The axes an operand's layout ``dims`` splits its dims other than ``k`` over."""
    return {x for n, d in enumerate(dims) if n != k for x in d}


def _crossed(
    walk: Walker,
    xs: tuple[Any, Any],
    vals: tuple[Val, Val],
    dims: tuple[list, list],
    contracting: tuple[Sequence[int], Sequence[int]],
    mult: int,
) -> tuple[Val, Val]:
    """Both sides split their contracting dims over the same axes, laid out otherwise (the
    batch over `data` and the sequence over `model` on one side, the other way round on the
    other; or (data, model) against (model, data) on one dim), and over no other dim: XLA lays
    the smaller side out as the other (an all-to-all, a collective-permute), contracts split and
    sums the result (measured 2026-12-06, XLA:CPU: a weight gradient ``btd,btf->df``, x over
    (data, model) on (b, t), the cotangents over (model, data): 4 KiB of all-to-all and 4 KiB of
    permute, x's local bytes, then the all-reduce; gathering both dims took 160 KiB and 8x the
    FLOPs). ``dims`` are updated in place; the operands are returned, the moved one resharded."""
    (lx, rx), (lhs, rhs), (ldims, rdims), (lc, rc) = xs, vals, dims, contracting
    a = [x for i in lc for x in ldims[i]]
    b = [x for j in rc for x in rdims[j]]
    if not a or sorted(a) != sorted(b) or all(ldims[i] == rdims[j] for i, j in zip(lc, rc, strict=True)):
        return lhs, rhs
    if _tuple(ldims) != lhs.dims or _tuple(rdims) != rhs.dims:  # the batch dims were laid out anew
        return lhs, rhs
    others = {x for k, d in enumerate(ldims) if k not in lc for x in d}
    others |= {x for k, d in enumerate(rdims) if k not in rc for x in d}
    if others & set(a):
        return lhs, rhs
    if walk.ctx.local(rhs) <= walk.ctx.local(lhs):
        for i, j in zip(lc, rc, strict=True):
            rdims[j] = list(ldims[i])
        return lhs, reshard(walk, rx, rhs, _tuple(rdims), mult, "dot_general")
    for i, j in zip(lc, rc, strict=True):
        ldims[i] = list(rdims[j])
    return reshard(walk, lx, lhs, _tuple(ldims), mult, "dot_general"), rhs


def _onto_the_others_split(walk: Walker, a: list, b: list, ldims: list, rdims: list, i: int, j: int) -> str | None:
    """Which side (``"lhs"``/``"rhs"``) XLA moves onto the other's contraction split where the two
    split contracting dims ``i``/``j`` over other axes and one side's axes split the other
    operand elsewhere (hidden states over `data` on their width meet a weight over `expert` on
    its rows and `data` on its columns): the side whose axes the other takes, where the other's
    axes are free on it and split its dim over as many devices or more; it is contracted split
    and the result summed. None: both are gathered there, as XLA does where the move would
    split the dim over fewer devices, where the other's axes are taken, and on a mesh with an
    axis neither side splits (measured 2026-12-06 on single matmuls, XLA:CPU: x (8, 16, 32) over
    `data` on its width times w (32, 16) over (expert, data), mesh expert = 4, data = 2: 4 KiB of
    collective-permute and a 4 KiB all-reduce where fast mode gathered 17 KiB; a weight over
    `data` on its rows against x over `data` on its batch and `expert` on its width, the weight
    permuted onto `expert`, 512 B, not gathered, 2 KiB)."""
    if not a or not b or set(a) & set(b):
        return None
    used_l, used_r = _elsewhere(ldims, i), _elsewhere(rdims, j)
    if {x for x, n in walk.ctx.mesh.items() if n > 1} - (used_l | used_r | set(a) | set(b)):
        return None
    split = walk.ctx.split
    if set(a) & used_r and not set(b) & used_l and split(tuple(b)) >= split(tuple(a)):
        return "lhs"
    if set(b) & used_l and not set(a) & used_r and split(tuple(a)) >= split(tuple(b)):
        return "rhs"
    return None


def _onto_idle_axes(
    walk: Walker,
    vals: tuple[Val, Val],
    a: list,
    b: list,
    dims: tuple[list, list],
    at: tuple[int, int],
    layout: tuple[Sequence[int], Sequence[int], Sequence[int]],
) -> list[str] | None:
    """The axes neither operand splits (idle) that XLA moves a contraction split onto where one
    side splits contracting dims ``at`` over axes the other side splits elsewhere and the other
    side is whole there: the split side permuted onto the idle axes (as many devices or a
    multiple), the other sliced, the result summed over them, where that moves fewer bytes than
    gathering the split side (measured 2026-12-06, XLA:CPU: x (8, 16, 32) over `data` on its width
    times w (32, 16) over `data` on its columns, mesh data = 2, model = 4: 4 KiB permuted onto
    `model` and a 4 KiB all-reduce where fast mode gathered 16 KiB; a weight over `data` on its
    rows against x over `data` on its batch, `expert` idle: the 2 KiB weight gathered, moving it
    and summing the result would be 4.5 KiB). None: not that case, or the gather is cheaper."""
    (lhs, rhs), (ldims, rdims), (i, j), (lb, lfree, rfree) = vals, dims, at, layout
    if bool(a) == bool(b):
        return None
    mine, theirs, k, kk, axes, v = (ldims, rdims, i, j, a, lhs) if a else (rdims, ldims, j, i, b, rhs)
    used_mine, used_theirs = _elsewhere(mine, k), _elsewhere(theirs, kk)
    if not set(axes) & used_theirs:
        return None
    idle = [x for x, n in walk.ctx.mesh.items() if n > 1 and x not in used_mine | used_theirs | set(axes)]
    split = walk.ctx.split
    n_idle, n_axes = split(tuple(idle)), split(tuple(axes))
    if not idle or n_idle < n_axes or n_idle % n_axes:
        return None
    gathered = walk.ctx.local(Val(v.shape, v.itemsize, _tuple(mine))) * n_axes
    taken = {x for n in (*lb, *lfree) for x in ldims[n]}
    shape = tuple(lhs.shape[n] for n in (*lb, *lfree)) + tuple(rhs.shape[n] for n in rfree)
    out_dims = tuple(tuple(ldims[n]) for n in (*lb, *lfree)) + tuple(
        tuple(x for x in rdims[n] if x not in taken) for n in rfree
    )
    out = walk.ctx.local(Val(shape, max(lhs.itemsize, rhs.itemsize), out_dims))
    return idle if gathered // n_idle + out < gathered else None


def _finer(walk: Walker, target: list, have: list) -> bool:
    """Whether a dim split over ``have`` is split over ``target``, other axes of a multiple as many
    devices, by a collective-permute: each device's new block lies within an old one."""
    if not target or not have or set(target) & set(have):
        return False
    n, m = walk.ctx.split(tuple(target)), walk.ctx.split(tuple(have))
    return n > m and n % m == 0


def _across(walk: Walker, a: list, b: list) -> bool:
    """Whether one contracting dim is split over other axes of as many devices on each side (a
    side is then moved across by a collective-permute, not gathered: ``_contraction_moves``)."""
    return bool(a and b) and not set(a) & set(b) and walk.ctx.split(tuple(a)) == walk.ctx.split(tuple(b))


def _contraction_moves(
    walk,
    lhs: Val,
    rhs: Val,
    i: int,
    j: int,
    ldims: list,
    rdims: list,
    lb: Any,
    lfree: list,
    rfree: list,
    xs: tuple[Any, Any, Any] = (None, None, None),
    wanted: Dims | None = None,
    pending: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    """Which operand (``"lhs"``/``"rhs"``) takes the other's split on contracting dims ``i``/``j``
    split over different axes, or None (both gathered there). An operand may take the other's
    axes where they split none of its other dims; it does where the result's pending sum costs
    less than gathering the other operand on the contraction (GSPMD weighs the two)."""
    a, b = ldims[i], rdims[j]
    used_l, used_r = _elsewhere(ldims, i), _elsewhere(rdims, j)
    ltotal = walk.ctx.local(Val(lhs.shape, lhs.itemsize, _tuple(ldims))) * walk.ctx.split(tuple(a))
    rtotal = walk.ctx.local(Val(rhs.shape, rhs.itemsize, _tuple(rdims))) * walk.ctx.split(tuple(b))
    shape = tuple(lhs.shape[k] for k in (*lb, *lfree)) + tuple(rhs.shape[k] for k in rfree)
    mine = [tuple(ldims[k]) for k in (*lb, *lfree)]
    theirs = [tuple(rdims[k]) for k in rfree]
    taken = {x for d in mine for x in d}
    if any(x in taken for d in theirs for x in d):  # a free dim of each side over one axis: see ``dot``
        if _rhs_yields(lhs, rhs):
            theirs = [tuple(x for x in d if x not in taken) for d in theirs]
        else:
            clash = {x for d in theirs for x in d}
            mine = [tuple(x for x in d if x not in clash) for d in mine]
    dims = tuple(mine) + tuple(theirs)
    out = walk.ctx.local(Val(shape, max(lhs.itemsize, rhs.itemsize), dims))
    if _across(walk, a, b) and not set(a) & used_r and not set(b) & used_l:
        # Split over other axes of as many devices: XLA moves the smaller side onto the other's
        # split (a collective-permute of its bytes) and contracts split, the result's sum pending
        # (measured 2026-12-06, XLA:CPU: a weight gradient ``btd,btf->df`` with x over `seq` and
        # the cotangents over `data`, 2 devices each of 8: the smaller permuted, 16 KiB or 4 KiB,
        # the result all-reduced; over axes of 2 and 4 devices both are gathered, as below).
        lsize = walk.ctx.local(Val(lhs.shape, lhs.itemsize, _tuple(ldims)))
        rsize = walk.ctx.local(Val(rhs.shape, rhs.itemsize, _tuple(rdims)))
        return "rhs" if rsize <= lsize else "lhs"
    # A whole side that propagation may lay out (a value the step computes, not one of its inputs
    # with the jit's sharding, and no layouts fixed as XLA's propagation made them,
    # ``Walker.xla_claims``) takes the split side's axes, whatever the bytes: Shardy propagates the
    # contraction's split onto it, a free slice, and the result's sum is completed after
    # (measured 2026-12-06, XLA:CPU: x (8, 16, 32) split over (seq, model) on its width times
    # ``w * 2`` or ``ws[0]``, all-reduces the (8, 16, 32) or (8, 16, 256) result, where ``w``
    # itself is gathered; the same over `model` alone, and with the rows split over `seq`). A
    # whole side whose layout is fixed is XLA's partitioner's to weigh (below).
    # Not where the result is wanted with those axes (a loop's carry laid out so): the two
    # splits meet in the matmul and the split side is gathered (measured: the same matmul in a
    # scan whose carry enters split on its width).
    fixed = walk.xla_claims
    lx, rx, result = xs
    # Nor where a pending sum rides on the matmul (a partial side is summed first, not sliced).
    taken_out = {x for d in (*(wanted or ()), *walk.carried.get(result, ())) for x in (d or ())}
    free = not fixed and not pending
    open_l = free and lx is not None and not walk.fixed(lx) and not set(b) & taken_out
    open_r = free and rx is not None and not walk.fixed(rx) and not set(a) & taken_out
    if not any(dims):
        # A result split nowhere: where the split side leaves devices holding copies, XLA gathers
        # the contraction whatever the sizes (measured: 64x1024 @ 1024x16 split over `model` = 4
        # of 8 devices gathers 256 KiB, not a 4 KiB sum); where it splits every device, XLA slices
        # the whole side and all-reduces the result when that is fewer bytes than the gather
        # (measured 2026-12-06: the same over (seq, model) = 8, or over one axis of 8, a 4 KiB
        # all-reduce; (8, 16, 256) @ (256, 32) over all 8 a 16 KiB all-reduce, over 4 of 8 the
        # 128 KiB gather; (8, 16, 32) @ (32, 32) over all 8, the bytes equal: gathered).
        devices = math.prod(walk.ctx.mesh.values())
        if a and not b and not set(a) & used_r and (open_r or (walk.ctx.split(tuple(a)) == devices and out < ltotal)):
            return "rhs"
        if b and not a and not set(b) & used_l and (open_l or (walk.ctx.split(tuple(b)) == devices and out < rtotal)):
            return "lhs"
        return None
    options = []
    # A whole side is sliced for free and the result's sum completed after. Given the operands'
    # layouts as XLA's propagation made them (``Walker.xla_claims``), only where that sum costs less
    # than gathering the split side (measured on single matmuls with fixed layouts: x (b, s, d) over
    # data times a weight split over seq on d all-reduces while the result's bytes are under the
    # weight's, and gathers the weight from equal on; x split on d meeting a whole weight, the
    # same). The walker's own propagation slices a whole side the step computes (a scanned
    # layer's weight slice, a cast: Shardy propagates the split onto it); a whole side that is one
    # of the step's inputs, its layout fixed, is weighed as above: sliced only where the sum costs
    # less than the gather (measured on XLA:CPU, 2026-12-07: x (8, 16, 48) over `model` on its
    # batch and `seq` on its width times a whole (48, 144) weight: x gathered over `seq`, 12 KiB,
    # not a 36 KiB sum; the same in whole steps, a GPT-2-style fused q/k/v projection and a GShard
    # MoE's expert matmuls. Slicing every whole side, as until then, had all-reduce's p90 over 80
    # random pairs at 16.7% of the step's bytes; weighing the inputs, 13.8%.)
    if a and not set(a) & used_r and (out <= ltotal if b else (open_r or out < ltotal)):
        options.append((rtotal if b else 0, "rhs"))
    if b and not set(b) & used_l and (out <= rtotal if a else (open_l or out < rtotal)):
        options.append((ltotal if a else 0, "lhs"))
    return min(options)[1] if options else None


def _gathered_on(walk: Walker, x: Any, v: Val, dim: int, eqn: Any, mult: int, dims: Sequence | None = None) -> Val:
    """``v`` gathered whole on ``dim`` for a matmul (cast first where the compiler narrows), its
    other dims as they are (or as ``dims`` lays them out)."""
    target = tuple(() if k == dim else tuple(d) for k, d in enumerate(v.dims if dims is None else dims))
    narrow = walk.ctx.book.matmul_itemsize
    if narrow and eqn.params.get("precision") in (None, (None, None)) and v.itemsize == 4 and _is_float(x):
        return replace(_cast_gather(walk, eqn, x, v, target, mult, narrow), itemsize=v.itemsize)
    return reshard(walk, x, v, target, mult, "dot_general")


def _lay_out(
    result: Dims, ldims: list[list[str]], rdims: list[list[str]], lb: Any, rb: Any, lfree: Any, rfree: Any
) -> None:
    """The operands' batch and free dims split as the result's (``result``: batch, lhs free, rhs
    free dims in order)."""
    for k, (i, j) in enumerate(zip(lb, rb, strict=True)):
        ldims[i], rdims[j] = list(result[k]), list(result[k])
    for p, i in enumerate(lfree):
        ldims[i] = list(result[len(lb) + p])
    for q, j in enumerate(rfree):
        rdims[j] = list(result[len(lb) + len(lfree) + q])


def _computed_as_passed(passed: Dims, ldims: list[list[str]], rdims: list[list[str]], dims: tuple) -> set[str]:
    """A matmul whose result Shardy's first phase lays out (an elementwise chain links it to a split
    input: ``claims.passed_layouts``): that layout reaches the result before the operands' do, so XLA
    moves the operands to compute it there, not the result after (measured on ``(g @ w.T) * sin(h)``,
    h split: 46 of 60 random layouts had differed from XLA:CPU, 5 after; XLA:TPU v5e and XLA:GPU
    H100 alike). A dim it leaves whole keeps the longest prefix of its own split whose axes are
    free (Shardy's later phases add it); a contraction keeps the axes the result does not take.
    Lays the operands out (``ldims``, ``rdims``) and returns the axes left summed."""
    lb, rb, lc, rc, lfree, rfree = dims
    natural = [ldims[i] for i in lb] + [ldims[i] for i in lfree] + [rdims[j] for j in rfree]
    used = {a for d in passed for a in d}
    result = []
    for d, n in zip(passed, natural, strict=True):
        keep = list(d)
        if tuple(n[: len(d)]) == tuple(d):
            for a in n[len(d) :]:
                if a in used:
                    break
                keep.append(a)
        used |= set(keep)
        result.append(tuple(keep))
    partial: set[str] = set()
    for i, j in zip(lc, rc, strict=True):
        common = [a for a in ldims[i] if a in rdims[j] and a not in used]
        ldims[i], rdims[j] = list(common), list(common)
        partial |= set(common)
    _lay_out(tuple(result), ldims, rdims, lb, rb, lfree, rfree)
    return partial


def _slice_to(
    tile: Dims,
    ldims: list[list[str]],
    rdims: list[list[str]],
    lb: Sequence[int],
    rb: Sequence[int],
    lfree: Sequence[int],
    rfree: Sequence[int],
) -> None:
    """Lay a matmul's operands out so that it computes only ``tile`` of its result: each batch and
    free dim whole on its side(s), or split over a prefix of the tile's axes there, takes the
    tile's axes where neither operand splits any dim over the rest: a slice of what the device
    holds. In place."""
    taken = {x for d in (*ldims, *rdims) for x in d}
    for want, sides in zip(tile, _sides(ldims, rdims, lb, rb, list(lfree), list(rfree)), strict=True):
        have = list(sides[0])
        more = set(want[len(have) :])
        # whole there, or split over a prefix of the tile's axes and the rest free: sliced further
        if (
            want
            and len(want) > len(have)
            and tuple(have) == tuple(want[: len(have)])
            and not more & taken
            and all(side == have for side in sides)
        ):
            for side in sides:
                side[:] = want
            taken |= more


def _cast_gather(walk: Walker, eqn: Any, x: Any, v: Val, target: Dims, mult: int, narrow: int) -> Val:
    """``v`` cast to ``narrow`` bytes per element and moved to ``target`` for the matmul ``eqn``:
    one gather per matmul, or the gather an earlier matmul made where the compiler merges them
    (``Compiler.gather_cse``, ``walk.shares``), held from its first reader to its last."""
    share = walk.shares.get((id(eqn), walk.root(x)))
    tag = (narrow, walk.backward) if share is None else (narrow, "shared", share.group)
    moved = reshard(walk, x, replace(v, itemsize=narrow), target, mult, "dot_general", tag)
    if share is not None and share.first != share.last:
        key = ("held gather", walk.root(x), share.group)
        if share.first and moved.dims != v.dims:
            n = walk.ctx.held_gathers[key] = walk.ctx.held(moved)
            walk.ctx.gathered_now += n
            walk.ctx.gathered_peak = max(walk.ctx.gathered_peak, walk.ctx.gathered_now)
        elif share.last:
            walk.ctx.gathered_now -= walk.ctx.held_gathers.pop(key, 0)
    return moved


def grouped(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
    """:func:`grouped_rule`, its FLOPs also tallied by line apart (``_Ctx.grouped_flops``)."""
    before, total = dict(walk.ctx.matmul_flops), walk.ctx.flops
    out = grouped_rule(walk, eqn, ins, mult)
    walk.ctx.grouped_total += walk.ctx.flops - total
    for line, n in walk.ctx.matmul_flops.items():
        if n != before.get(line, 0.0):
            walk.ctx.grouped_flops[line] = walk.ctx.grouped_flops.get(line, 0.0) + n - before.get(line, 0.0)
    return out


def grouped_rule(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
    """A grouped matmul (``ragged_dot_general``): jax's dense decomposition walked in place where
    the compiler runs that (``Compiler.dense_ragged``), else the compiler's own with the group
    dim and the ragged rows whole (the experts' weights gathered over their group split, the
    tokens' pending sums reduced) and the other dims as a matmul's: a contraction the weights
    split is taken by the tokens (a pending sum), the weights' free dims keep their split (so
    does the result); FLOPs as that compiler counts them (``whole_ragged``)."""
    book = walk.ctx.book
    if book.dense_ragged:
        return inline(walk, eqn, ins, mult)
    if book.whole_ragged is None:
        return None
    nums = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = nums.dot_dimension_numbers
    if lb or rb or len(nums.lhs_ragged_dimensions) != 1:
        return None
    (r,) = nums.lhs_ragged_dimensions
    lhs, rhs = ins[0], ins[1]
    gd = set(nums.rhs_group_dimensions)
    rhs_dims = [() if j in gd else d for j, d in enumerate(rhs.dims)]
    pairs = dict(zip(lc, rc, strict=True))
    if r in pairs:  # the ragged rows contracted (a weight gradient): whole on both sides
        rhs_dims[pairs[r]] = ()
    taken = {a for d in rhs_dims for a in d}
    lhs_dims = [
        () if i == r else tuple(rhs_dims[pairs[i]]) if i in pairs else tuple(a for a in d if a not in taken)
        for i, d in enumerate(lhs.dims)
    ]
    for x, v, want in ((eqn.invars[0], lhs, lhs_dims), (eqn.invars[1], rhs, rhs_dims)):
        if v.dims != tuple(want) or v.partial:
            to_layout(walk, x, v, tuple(want), mult, "ragged_dot_general")
    if ins[2].axes or ins[2].partial:
        to_layout(walk, eqn.invars[2], ins[2], ((),) * len(ins[2].shape), mult, "ragged_dot_general")
    lfree = [i for i in range(len(lhs.shape)) if i not in pairs]
    rfree = [j for j in range(len(rhs.shape)) if j not in rc and j not in gd]
    out = eqn.outvars[0].aval
    out_dims = [lhs_dims[i] for i in lfree] + [rhs_dims[j] for j in rfree]
    if not gd:
        out_dims = [(), *out_dims]
    summed = {a for i in pairs for a in lhs_dims[i]}
    groups = math.prod(eqn.invars[2].aval.shape[-1:])
    # 2 x result x contraction: for grouped rows the useful FLOPs (times the groups where each
    # runs over every row), for a contraction over the ragged rows every group over every row.
    result = Val(tuple(out.shape), itemsize(out), _norm(tuple(out_dims), len(out.shape)), frozenset(summed))
    local = walk.ctx.local(result) / result.itemsize
    k = math.prod(lhs.shape[i] for i in lc) / walk.ctx.split(tuple(summed))
    dense = gd and book.whole_ragged == "dense"
    walk.count_flops(2 * local * k * (groups if dense else 1), mult, "ragged_dot_general")
    if book.whole_ragged == "dense" and groups > 1 and walk.ctx.grouped_memory:
        # XLA:GPU's dense rewrite masks the rows once per group, (groups x rows x width), and holds
        # that copy as long as the rows are held (the weight gradient's rewrite reads the same
        # copy); while it runs, each group's product over every row besides
        rows = walk.ctx.local(Val(lhs.shape, lhs.itemsize, _norm(tuple(lhs_dims), len(lhs.shape))))
        if not hasattr(eqn.invars[0], "val"):
            walk.copied[eqn.invars[0]] = max(walk.copied.get(eqn.invars[0], 0), groups * rows)
        walk.peak = max(walk.peak, groups * walk.ctx.local(result) if gd else groups * walk.ctx.local(ins[1]))
    if (dense or not gd) and groups > 1:  # every row through every group (a weight gradient's, XLA:GPU's)
        where = walk.ctx.source or walk.call_source
        g, n = walk.ctx.dense_grouped.get(where, (groups, 0.0))
        walk.ctx.dense_grouped[where] = (g, n + 2 * local * k * (groups if dense else 1) * mult)
    return [result]
