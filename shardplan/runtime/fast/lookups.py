"""Fast mode's rules for lookups (``gather``: a table read at indices) and their gradients
(``scatter``): masked local lookups, regrouped tables and the collectives they need.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from shardplan.runtime.fast.relayout import reshard, reshard_key, resolve, to_layout
from shardplan.runtime.fast.values import Dims, Val, _fits, _norm, _size, _tuple, _without
from shardplan.runtime.fast.walker import Walker
from shardplan.runtime.primitives import itemsize


def gather(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    """A lookup (:func:`_lookup`), its result then laid out as Shardy's propagation lays it out:
    where an axis splits both the table's width and the indices' batch, a batch dim keeps only the
    axes before the first that clashes (a dim's axes are major to minor; propagation keeps the
    longest prefix that does not conflict), and XLA all-gathers what the lookup computed over the
    rest (measured on XLA:CPU, tokens over (data, expert), a table split over `data` on its width:
    the result laid out whole on the batch, the lookup computed over `expert` and its output
    all-gathered over it, 6,144 B; over (expert, data), laid out over `expert`, nothing more)."""
    out = _lookup(walk, eqn, ins, mult)
    outvar = eqn.outvars[0]
    if out.partial or outvar in walk.claimed or outvar in walk.wants or outvar in walk.back:
        return out
    batch_out, indexed, kept, whole = _indexed(eqn, ins[0], ins[1], out.shape)
    offset = tuple(eqn.params["dimension_numbers"].offset_dims)
    width = {a for k, i in zip(offset, kept, strict=False) if k in whole for a in ins[0].dims[i]}
    laid = list(out.dims)
    for k in batch_out:
        if width & set(indexed[k]):
            prefix = tuple(itertools.takewhile(lambda a: a not in width, indexed[k]))
            laid[k] = tuple(a for a in laid[k] if a in prefix)
    if tuple(laid) == out.dims:
        return out
    return reshard(walk, outvar, out, tuple(laid), mult, "gather")


def _indexed(
    eqn: Any, table: Val, idx: Val, shape: tuple[int, ...]
) -> tuple[list[int], list[tuple[str, ...]], list[int], list[int]]:
    """A lookup's output dims: those that follow the indices (the batch), each split as its index
    dim; the table's kept dims; and the output dims that hold a kept dim whole (an embedding's width)."""
    dn = eqn.params["dimension_numbers"]
    offset = tuple(dn.offset_dims)
    batch_out = [k for k in range(len(shape)) if k not in offset]
    dims: list[tuple[str, ...]] = [()] * len(shape)
    for k, b in zip(batch_out, range(len(idx.shape)), strict=False):
        dims[k] = idx.dims[b] if b < len(idx.dims) else ()
    kept = [i for i in range(len(table.shape)) if i not in tuple(dn.collapsed_slice_dims)]
    whole = [k for k, i in zip(offset, kept, strict=False) if table.shape[i] == shape[k]]
    return batch_out, dims, kept, whole


def _lookup(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    table, idx = ins[0], ins[1]
    out_aval = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    offset = tuple(dn.offset_dims)
    collapsed = tuple(dn.collapsed_slice_dims)
    shape = tuple(out_aval.shape)
    # Batch dims of the output follow the indices; offset dims follow the table's kept dims.
    batch_out, dims, kept, whole = _indexed(eqn, table, idx, shape)
    indexed = Val(shape, itemsize(out_aval), tuple(dims))  # split as the indices, the width whole
    # An axis that splits both a kept dim of the table (an embedding's width) and the
    # indices (the batch): GSPMD keeps the table in place, gathers the indices over that
    # axis and looks up the table's slice for every index (measured, with the lookup's
    # output then resharded to where it is used: an all-to-all when the batch split is
    # wanted back).
    clash = {a for k, i in zip(offset, kept, strict=False) if k in whole for a in table.dims[i]} & {
        a for k in batch_out for a in dims[k]
    }
    if clash:
        walk.ctx.lookups.append(walk.ctx.source)
        for k in batch_out:
            dims[k] = tuple(a for a in dims[k] if a not in clash)
    valid = Val(shape, 1, tuple(dims))  # the fill mode's mask of valid indices: split like them
    for k, i in zip(offset, kept, strict=False):
        if k in whole:
            dims[k] = tuple(a for a in table.dims[i] if all(a not in d for d in dims))
    rows = tuple(a for i in collapsed for a in table.dims[i])
    out = Val(shape, itemsize(out_aval), tuple(dims))
    walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, "gather")
    # A table split over its rows: a masked local lookup summed over those axes (an
    # all-reduce of the output), as GSPMD does even where gathering the table would move
    # fewer bytes (measured); an axis that also splits the activations (the output, or
    # the indices) makes it gather the table instead. Indices made whole (a global sort's
    # order, the dropless MoE's) are looked up where the rows lie (measured).
    wanted = {a for d in walk.wants.get(eqn.outvars[0], ()) for a in d}
    # (indices that are literals, positions: XLA slices the table and moves it as the batch wants)
    activations = idx.axes if eqn.invars[1] not in walk.constant else set(walk.ctx.batch_axes)
    masked = bool(rows) and not any(a in out.axes or a in activations or a in wanted for a in rows)
    if clash and masked:
        regathered = regather_table(walk, eqn, table, indexed, clash, rows, mult)
        if regathered is not None:
            return filled(walk, eqn, regathered, valid, mult)
    if clash:
        lookup_indices(walk, eqn.invars[1], idx, clash, rows if masked else (), mult)
    if masked:
        looked = filled(walk, eqn, replace(out, partial=frozenset(rows)), valid, mult)
        if set(rows) <= set(walk.ctx.batch_axes) and not idx.axes:
            # Activations looked up by indices whole on the batch axes that split them (a dropless
            # MoE's tokens and routing weights in its global sort's order, and in the backward
            # pass the combine's cotangent): the lookup's sum is all-reduced where it is made, not
            # scattered onto the batch rows nor carried into what is made of it (measured on
            # XLA:CPU, XLA:TPU and XLA:GPU: each lookup all-reduced over (data, expert))
            return resolve(walk, eqn.outvars[0], looked, looked.dims, mult, "gather")
        return looked
    if rows:
        regrouped = regroup_table(walk, eqn, table, out, rows, batch_out, mult)
        if regrouped is not None:
            return filled(walk, eqn, regrouped, valid, mult)
        if not clash and not any(table.dims[i] for i in kept) and _size(out) < _size(table):
            return masked_all_indices(walk, eqn, idx, out, rows, mult)
        reshard(walk, eqn.invars[0], table, _without(table.dims, set(rows)), mult, "gather")
    return filled(walk, eqn, out, valid, mult)


def regather_table(
    walk: Walker, eqn: Any, table: Val, out: Val, clash: set[str], rows: tuple[str, ...], mult: int
) -> Val | None:
    """A table split over its rows and, on its width, over axes that split the indices too (an
    embedding ``(model, data)`` under a batch over ``data``), looked up for more bytes per device
    than the whole table holds: XLA's gather partitioner, which orders its ways by a dry-run
    cost, then regathers the table (a collective-permute of each device's shard, an all-gather of
    its width over the clashing axes), looks up each device's share of the batch split further
    over the row axes, and all-gathers the output over them to the batch's split: no all-to-all,
    and a masked sum (an all-reduce of the output) only where the rows have more shards than the
    clashing axes (measured on XLA:CPU, XLA:TPU v5e and XLA:GPU: a 256 x 128 table on data=4 x
    model=2 switches between 32 and 40 sequences of 32 tokens, 131,072 and 163,840 bytes of
    output per device; 1,024 x 128 on data=4 x model=2 and 256 x 128 on data=2 x model=4 at the
    same bytes). Only where the result is wanted so (a constraint: plans/gpt_2d.splan's `act
    "embed"`): left to propagation (a GPT-2-style decoder whose head is the same table, no
    constraint) XLA lays the result out over the table's width and sums where it lies at every
    size measured (8-128 sequences). ``out``: the lookup's result split as its indices, its width
    whole. None at or under the table's bytes (the masked lookup, ``lookup_indices``)."""
    wanted = walk.claimed.get(eqn.outvars[0]) or walk.wants.get(eqn.outvars[0])
    if wanted is None or _norm(wanted, len(out.shape)) != out.dims:
        return None  # a result laid out by propagation (the table's width split): summed where it lies
    whole = math.prod(table.shape) * table.itemsize
    if walk.ctx.local(out) <= whole:
        return None
    moves = walk.names.get(walk.root(eqn.invars[0]), "")
    local = walk.ctx.local(table)
    pair = tuple(a for a in walk.ctx.mesh if a in table.axes)
    walk.ctx.add("collective-permute", pair, local, mult, "gather", moves)
    held = tuple(a for a in walk.ctx.mesh if a in clash)
    walk.ctx.add("all-gather", held, local * walk.ctx.split(held), mult, "gather", moves)
    finer = tuple(a for a in rows if a not in out.axes)
    if finer:
        walk.ctx.add("all-gather", finer, walk.ctx.local(out), mult, "gather")
    if walk.ctx.split(rows) > walk.ctx.split(held):
        # more row shards than the clashing axes regather: the rest looked up masked and summed
        # (data=2 x model=4: an all-reduce of the output over `model`, measured)
        walk.ctx.add("all-reduce", rows, walk.ctx.local(out), mult, "gather")
    return out


def masked_all_indices(walk: Walker, eqn: Any, idx: Val, out: Val, rows: tuple[str, ...], mult: int) -> Val:
    """A table split over its rows alone, looked up by indices split over those axes too (an
    FSDP embedding under a batch split over the same axis), where the whole lookup's output is
    smaller than the table: XLA's gather partitioner gathers the indices instead of the table,
    looks every index up in the rows each device holds (masked), and reduce-scatters the output
    over the rows' axes onto the indices' split; its
    transpose gathers the updates instead of reducing the table's gradient (``scatter``).
    Measured on XLA:CPU, one lookup on data=8 (a 128-wide table of 256-8192 rows, 32 x 32
    indices: the table gathered up to 1,024 rows, whose 512 KiB equal the output's, the indices
    above) and on a model's FSDP step (4,096 x 512 table, 16 x 128 tokens; XLA:TPU alike)."""
    reshard(walk, eqn.invars[1], idx, _without(idx.dims, set(rows)), mult, "gather")
    whole = Val(out.shape, out.itemsize, _without(out.dims, set(rows)), frozenset(rows))
    walk.count_flops((walk.ctx.local(whole) - walk.ctx.local(out)) / out.itemsize, mult, "gather")
    # the sum reduce-scattered onto the indices' split, the layout GSPMD gives the lookup
    return resolve(walk, eqn.outvars[0], whole, out.dims, mult, "gather")


def filled(walk: Walker, eqn: Any, out: Val, mask: Val, mult: int) -> Val:
    """A lookup that fills out-of-range indices (``jnp.take``'s default) is lowered as the gather,
    a mask of the valid indices and a ``select`` of the looked-up values or the fill constant.
    A closed constraint on the lookup's result lays out that select, whose operands differ in
    layout (the fill is a constant): XLA moves the values and the mask to the constraint's
    layout apart (measured: a residual constrained whole gathers both)."""
    claim = walk.claimed.get(eqn.outvars[0])
    if claim is None or getattr(eqn.params.get("mode"), "name", "") != "FILL_OR_DROP":
        return out
    if out.dims == claim and not out.partial:
        return out
    out = to_layout(walk, eqn.outvars[0], out, claim, mult, "gather")
    reshard(walk, ("fill mask", eqn.outvars[0]), mask, claim, mult, "gather")
    return out


def regroup_table(
    walk, eqn: Any, table: Val, out: Val, rows: tuple[str, ...], batch_out: list[int], mult: int
) -> Val | None:
    """A table split over its rows on axes that split the lookup's output too (a position table
    split over the batch axis, looked up for a batch split over it). XLA's gather partitioner
    splits the output's batch over those axes and, within each group of devices, needs the
    table whole over them: where the table is replicated over other axes whose size divides, or
    is divided by, the rows' split, it moves the rows' split onto them (a collective-permute of
    the local rows, an all-gather of the rest where the rows' split is the larger) and looks up
    masked over them (an all-reduce of the output), rather than gathering the table (measured:
    data=2,4,8 x model=2,4, three batch sizes). None where that does not apply."""
    wanted = _norm(walk.wants.get(eqn.outvars[0], ()), len(out.shape))
    groups = walk.ctx.split(rows)
    free = tuple(a for a in walk.ctx.mesh if a not in table.axes and a not in out.axes and a not in rows)
    spare = walk.ctx.split(free)
    dims = list(out.dims)
    for k in batch_out:  # (an output laid out already, by XLA's propagation, may hold them)
        dims[k] = (*dims[k], *(a for a in wanted[k] if a in rows and all(a not in d for d in dims)))
    split = {a for k in batch_out for a in dims[k]}
    fits = _fits(out.shape, _tuple(dims), walk.ctx)
    if spare < 2 or (groups % spare and spare % groups) or split != set(rows) or not fits:
        return None
    move_split(walk, eqn.invars[0], walk.ctx.local(table), rows, free, mult)
    return Val(out.shape, out.itemsize, _tuple(dims), frozenset(free))


def move_split(walk: Walker, var: Any, local: int, held: tuple[str, ...], spare: tuple[str, ...], mult: int) -> int:
    """A value split over ``held`` moved onto ``spare`` axes (which it is not split over) as XLA's
    gather partitioner regroups devices: a collective-permute of each device's ``local`` bytes,
    then an all-gather over ``held`` of what the spare axes cannot take (where ``held`` splits
    more). Returns the bytes each device then holds."""
    moves = walk.names.get(walk.root(var), "")
    n, m = walk.ctx.split(held), walk.ctx.split(spare)
    pair = tuple(a for a in walk.ctx.mesh if a in held or a in spare)  # in mesh order, as XLA's groups
    walk.ctx.add("collective-permute", pair, local, mult, "gather", moves)
    if n > m:
        walk.ctx.add("all-gather", held, local * n // m, mult, "gather", moves)
    return local * max(1, n // m)


def regroup_gradient(walk: Walker, eqn: Any, target: Dims, idx: Val, updates: Val, mult: int) -> Val | None:
    """The transpose of ``regroup_table``'s lookup: the gradient of a table wanted split over its
    rows on the axes that split the updates' batch. XLA scatters each device's updates into the
    rows regrouped onto the spare axes, sums that over the batch axes (an all-reduce) and moves
    each device's rows back (a collective-permute) (measured). None where that does not apply."""
    dn = eqn.params["dimension_numbers"]
    inserted = tuple(dn.inserted_window_dims)
    rows = tuple(a for i in inserted for a in target[i])
    if not rows or any(target[i] for i in range(len(target)) if i not in inserted) or updates.partial:
        return None
    window = tuple(dn.update_window_dims)
    split = {a for k, d in enumerate(updates.dims) if k not in window for a in d}
    free = tuple(a for a in walk.ctx.mesh if a not in rows and a not in updates.axes and a not in idx.axes)
    groups, spare = walk.ctx.split(rows), walk.ctx.split(free)
    if split != set(rows) or spare < 2 or (groups % spare and spare % groups):
        return None
    shape = tuple(eqn.outvars[0].aval.shape)
    out = Val(shape, itemsize(eqn.outvars[0].aval), target)
    local = walk.ctx.local(out)
    pair = tuple(a for a in walk.ctx.mesh if a in rows or a in free)
    walk.ctx.add("all-reduce", rows, local * max(1, groups // spare), mult, "scatter-add")
    walk.ctx.add("collective-permute", pair, local, mult, "scatter-add")
    return out


def lookup_indices(walk: Walker, var: Any, idx: Val, clash: set[str], rows: tuple[str, ...], mult: int) -> Val:
    """A lookup's indices gathered whole over ``clash`` (the axes that split both the table's
    width and the batch). Where a masked lookup follows over the table's row axes ``rows``,
    XLA's gather partitioner groups the devices by the width split and keeps the indices split
    over the row axes within each group: a collective-permute moves the batch's split onto the
    row axes, an all-gather collects the rest of it, and an all-gather over the row axes makes
    the indices whole (measured on data=4,8,16 x model=2 and data=4,8 x model=4). XLA picks
    another way where the batch's split is smaller than the rows', and at other sizes (its
    gather partitioner orders its ways by a dry-run cost): fast mode's notes say so."""
    target = _without(idx.dims, clash)
    held = walk.ctx.split(tuple(a for a in idx.axes if a in clash))
    groups = walk.ctx.split(tuple(a for a in rows if a not in idx.axes))
    key = reshard_key(walk, var, target)
    if groups == 1 or held < groups or held % groups or key in walk.ctx.cache:
        return reshard(walk, var, idx, target, mult, "gather")
    axes = tuple(a for a in walk.ctx.mesh if a in clash and a in idx.axes)
    row_axes = tuple(a for a in rows if a not in idx.axes)
    regrouped = move_split(walk, var, walk.ctx.local(idx), axes, row_axes, mult)
    walk.ctx.add("all-gather", row_axes, regrouped * groups, mult, "gather", walk.names.get(walk.root(var), ""))
    out = Val(idx.shape, idx.itemsize, target)
    walk.ctx.cache[key] = out
    return out


def scatter(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    operand, updates = ins[0], ins[2] if len(ins) > 2 else ins[-1]
    out_aval = eqn.outvars[0].aval
    shape = tuple(out_aval.shape)
    walk.count_flops(walk.ctx.local(updates) / updates.itemsize, mult, "scatter-add")
    hint = walk.hints.get(eqn.outvars[0])
    dn = eqn.params["dimension_numbers"]
    window = tuple(dn.update_window_dims)
    kept = [i for i in range(len(shape)) if i not in tuple(dn.inserted_window_dims)]
    if hint is not None and len(ins) > 2 and len(window) == len(kept):
        # The transpose of a lookup whose result is wanted split like the table (an embedding's
        # gradient under a 2-D plan): where an axis splits both the table's kept dim and the
        # updates' batch, GSPMD moves the updates onto the table's split (all-to-all), scatters
        # every index into the rows it holds whole and reduce-scatters over the axes that split
        # the rows (measured).
        target = _norm(hint, len(shape))
        rows = {a for i in range(len(shape)) if i not in kept for a in target[i]}
        scatter_dims = [k for k in range(len(updates.shape)) if k not in window]
        clash = {a for w, i in zip(window, kept, strict=True) for a in target[i]} & {
            a for k in scatter_dims for a in updates.dims[k]
        }
        whole = math.prod(shape) * itemsize(out_aval)
        if clash and rows and _fits(shape, target, walk.ctx) and walk.ctx.local(updates) > whole:
            # The transpose of ``regather_table``'s lookup: each device scatters its own updates
            # into the rows it holds, the width whole, a sum over the updates' split (reduced
            # onto the table's width split by its reader); its shard moved back (a
            # collective-permute). Measured with the forward.
            dims = [target[i] if i not in kept else () for i in range(len(shape))]
            out = Val(shape, itemsize(out_aval), tuple(dims))
            pair = tuple(a for a in walk.ctx.mesh if any(a in d for d in target))
            shard = walk.ctx.local(Val(shape, out.itemsize, target))
            walk.ctx.add("collective-permute", pair, shard, mult, "scatter-add")
            pending = frozenset(a for d in updates.dims for a in d if a not in out.axes) | updates.partial
            return replace(out, partial=pending)
        if clash and _fits(shape, target, walk.ctx):
            moved = [[a for a in d if a not in clash] for d in updates.dims]
            for w, i in zip(window, kept, strict=True):
                if updates.shape[w] == shape[i]:
                    moved[w] = [a for a in target[i] if a in clash or a in moved[w]]
            reshard(walk, eqn.invars[2], replace(updates, partial=frozenset()), _tuple(moved), mult, "scatter-add")
            reshard(walk, eqn.invars[1], ins[1], _without(ins[1].dims, clash), mult, "scatter-add")
            dims = [tuple(a for a in target[i] if a in clash) if i in kept else () for i in range(len(shape))]
            return Val(shape, itemsize(out_aval), tuple(dims), frozenset(rows) | updates.partial)
    if hint is not None and len(ins) > 2 and not operand.axes:
        regrouped = regroup_gradient(walk, eqn, _norm(hint, len(shape)), ins[1], updates, mult)
        if regrouped is not None:
            return regrouped
    # The result (e.g. an embedding's gradient) takes the operand's layout; updates split
    # over axes the result is not split on are summed across them.
    dims = list(operand.dims)
    if not operand.axes and len(ins) > 2:
        # Batched indices (``take_along_axis``'s gradient) split a whole operand (zeros) on its
        # batch dims as they are split: each device scatters into its own rows.
        batching = zip(
            tuple(getattr(dn, "operand_batching_dims", ())),
            tuple(getattr(dn, "scatter_indices_batching_dims", ())),
            strict=False,
        )
        for od, idd in batching:
            if ins[1].shape[idd] == shape[od]:
                dims[od] = ins[1].dims[idd]
        if hint is not None and not any(dims):
            # A gradient wanted split over its rows (a table split over its vocabulary): each
            # device scatters only the updates that fall in its own rows (XLA drops the others),
            # so the sum over the updates' split is over that device's rows (measured).
            moving = updates.axes | ins[1].axes | updates.partial
            target = _norm(hint, len(shape))
            rows = {a for i in tuple(dn.inserted_window_dims) for a in target[i]}
            if (
                rows & (updates.axes | ins[1].axes)
                and not any(target[i] for i in kept)
                and _size(updates) < math.prod(shape) * itemsize(out_aval)
            ):
                # Updates split over the rows' axes and smaller than the table (the transpose
                # of ``masked_all_indices``): XLA gathers the updates and the indices and each
                # device scatters into the rows it holds; no sum over the rows (measured).
                reshard(
                    walk,
                    eqn.invars[2],
                    replace(updates, partial=frozenset()),
                    _without(updates.dims, rows),
                    mult,
                    "scatter-add",
                )
                reshard(walk, eqn.invars[1], ins[1], _without(ins[1].dims, rows), mult, "scatter-add")
                for i in tuple(dn.inserted_window_dims):
                    dims[i] = target[i]
                return Val(shape, itemsize(out_aval), tuple(dims), updates.partial)
            for i in tuple(dn.inserted_window_dims):
                dims[i] = tuple(a for a in target[i] if a not in moving)
        elif hint is None and eqn.outvars[0] in walk.siblings:
            # ``take_along_axis``'s gradient into zeros, added to a value already split over
            # the scattered dim (logits over the vocabulary): made split so (GSPMD's
            # propagation), each device scattering the updates that fall in its share
            beside = _norm(walk.siblings[eqn.outvars[0]], len(shape))
            used = {a for d in dims for a in d} | updates.axes | updates.partial | ins[1].axes
            for i in tuple(dn.inserted_window_dims):
                dims[i] = tuple(a for a in beside[i] if a not in used)
    out = Val(shape, itemsize(out_aval), tuple(dims))
    pending = frozenset(a for d in updates.dims for a in d if a not in out.axes) | updates.partial
    if len(ins) > 2 and not tuple(getattr(dn, "scatter_indices_batching_dims", ())):
        # Indices split over an axis (a lookup's tokens) split the updates with them (a free
        # slice where they are whole): each device adds its share, summed across the axis.
        pending |= frozenset(a for d in ins[1].dims[:-1] for a in d if a not in out.axes)
    return replace(out, partial=pending)
