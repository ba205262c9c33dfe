"""The partitioner's local rules for contractions: reductions, argmax, matmuls (``dot_general``) and
grouped matmuls (``ragged_dot_general``, its groups split by ``Rows``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplan.runtime.partition.partitioner import RULES, Partitioner
from shardplan.runtime.partition.values import Rows, V, _t


# -- reductions ------------------------------------------------------------------------
def op_reduce_sum(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = ins[0]
    axes = tuple(eqn.params["axes"])
    kept = [i for i in range(len(v.shape)) if i not in axes]
    reduced = frozenset(a for i in axes for a in v.dims[i])
    xs = part.bind(eqn, [v.x], out_sharding=None) if "out_sharding" in eqn.params else part.bind(eqn, [v.x])
    return part.out(eqn, [tuple(v.dims[i] for i in kept)], [v.partial | reduced], v.act, xs)


def op_reduce_max(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = part.resolve(ins[0])
    axes = tuple(eqn.params["axes"])
    kept = [i for i in range(len(v.shape)) if i not in axes]
    reduced = tuple(a for a in part.mesh if any(a in v.dims[i] for i in axes))
    changes = {"out_sharding": None} if "out_sharding" in eqn.params else {}
    xs = part.bind(eqn, [v.x], **changes)
    dims = tuple(v.dims[i] for i in kept)
    if reduced:
        o = eqn.outvars[0].aval
        part.issue("all-reduce", reduced, part.nbytes(tuple(o.shape), dims, o.dtype))
        if xs is not None:
            red = jax.lax.pmax if eqn.primitive.name == "reduce_max" else jax.lax.pmin
            xs = [red(xs[0], reduced)]
    return part.out(eqn, [dims], act=v.act, xs=xs)


def op_argmax(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = ins[0]
    axes = set(eqn.params["axes"])
    v = part.to(part.resolve(v), tuple(() if i in axes else d for i, d in enumerate(v.dims)))
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [tuple(d for i, d in enumerate(v.dims) if i not in axes)], act=v.act, xs=xs)


# -- matmul ----------------------------------------------------------------------------
def op_dot_general(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    if lhs.partial and rhs.partial:
        rhs = part.resolve(rhs)
    ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
    lfree = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
    rfree = [j for j in range(len(rhs.shape)) if j not in rc and j not in rb]
    # Which side keeps its layout in a conflict: the activation (the batch's split), else the
    # side whose gather would move more bytes.
    lbytes = part.nbytes(lhs.shape, lhs.dims, lhs.dtype)
    rbytes = part.nbytes(rhs.shape, rhs.dims, rhs.dtype)
    keep_left = (lhs.act, lbytes) >= (rhs.act, rbytes)

    def used(dims, skip):
        return {a for k, d in enumerate(dims) if k != skip for a in d}

    # Batch dims: both sides the same layout.
    for i, j in zip(lb, rb, strict=True):
        if ldims[i] != rdims[j]:
            src = ldims[i] if keep_left else rdims[j]
            ldims[i], rdims[j] = list(src), list(src)
    # An axis a batch dim takes is given up by the other dims of that side.
    for dims, bs in ((ldims, lb), (rdims, rb)):
        taken = {a for i in bs for a in dims[i]}
        for k in range(len(dims)):
            if k not in bs:
                dims[k] = [a for a in dims[k] if a not in taken]
    # Contracting dims: split alike on both sides -> local, and a pending sum.
    for i, j in zip(lc, rc, strict=True):
        if ldims[i] == rdims[j]:
            continue
        for _ in range(3):
            a, b = ldims[i], rdims[j]
            if a == b:
                break
            if not a and not set(b) & (used(ldims, i) | lhs.partial):
                ldims[i] = list(b)
            elif not b and not set(a) & (used(rdims, j) | rhs.partial):
                rdims[j] = list(a)
            elif keep_left and b:
                rdims[j] = []
            elif a:
                ldims[i] = []
            else:
                rdims[j] = []
        if ldims[i] != rdims[j]:
            ldims[i], rdims[j] = [], []
    contract = {a for i in lc for a in ldims[i]}
    # Free dims: an axis splits one free dim of one side, and not the contraction or batch.
    inner = {a for i in (*lc, *lb) for a in ldims[i]}
    for i in lfree:
        ldims[i] = [a for a in ldims[i] if a not in inner]
    for j in rfree:
        rdims[j] = [a for a in rdims[j] if a not in inner]
    lf = {a for i in lfree for a in ldims[i]}
    rf = {a for j in rfree for a in rdims[j]}
    clash = lf & rf
    if clash:
        # A batch axis stays on the activation; another axis (a sequence split meeting a
        # column-parallel weight) stays where gathering the other side moves fewer bytes.
        if not clash & part.batch_axes and lhs.act != rhs.act:
            lgain = part.nbytes(lhs.shape, [[a for a in d if a not in clash] for d in ldims], lhs.dtype)
            rgain = part.nbytes(rhs.shape, [[a for a in d if a not in clash] for d in rdims], rhs.dtype)
            keep_left = lgain > rgain
        if keep_left:
            for j in rfree:
                rdims[j] = [a for a in rdims[j] if a not in clash]
        else:
            for i in lfree:
                ldims[i] = [a for a in ldims[i] if a not in clash]
    # An axis pending on one operand must not split the other (its blocks would not line up).
    lt, rt = _t(ldims), _t(rdims)
    # A pending sum over an axis that splits the other side would pair the wrong blocks.
    if lhs.partial & {a for d in rt for a in d}:
        lhs = part.resolve(lhs)
    if rhs.partial & {a for d in lt for a in d}:
        rhs = part.resolve(rhs)
    l2 = part.to(lhs, lt, keep_partial=True)
    r2 = part.to(rhs, rt, keep_partial=True)
    partial = set(l2.partial | r2.partial | contract)
    out_dims = [lt[i] for i in lb] + [lt[i] for i in lfree] + [rt[j] for j in rfree]
    xs = (
        part.bind(eqn, [l2.x, r2.x], out_sharding=None)
        if "out_sharding" in eqn.params
        else part.bind(eqn, [l2.x, r2.x])
    )
    return part.out(eqn, [out_dims], [frozenset(partial)], act=lhs.act or rhs.act, xs=xs)


# -- grouped matmul (jax.lax.ragged_dot: experts stacked by group, tokens sorted by group) --
def op_ragged_dot_general(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    """A grouped matmul with its groups split over axes ``G`` (an expert axis): each device
    runs its own groups on the rows they own (rows ``[start, start + its sizes)`` of the
    sorted tokens, rolled to the front: jax's grouped matmul has no group offset), locally.

    Forward (the weights' group dim split, the ragged rows a free dim): rows outside the
    device's groups come out zero, so the result is a pending sum over ``G``. Weight
    gradient (the ragged rows contracted, the result's group dim split as its param wants):
    each device's groups, nothing pending. The ragged rows and the group sizes are whole
    (the sort that made them is global); contracting dims follow the matmul's rule. The
    devices that hold the same groups (the mesh axes nothing else in the matmul splits: a
    ``data`` axis beside ``expert``) each run an even share of those groups' rows, in a buffer of
    the rows over their count (``_chunk``): a pending sum over those axes too, forward and in a
    weight gradient, where each had run all of them."""
    lhs, rhs, sizes = ins
    nums = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = nums.dot_dimension_numbers
    if lb or rb or len(nums.lhs_ragged_dimensions) != 1 or len(nums.rhs_group_dimensions) > 1:
        return None
    (r,) = nums.lhs_ragged_dimensions
    grouping = sizes
    sizes = part.whole(part.resolve(sizes))
    g = sizes.shape[0]
    lfree = [i for i in range(len(lhs.shape)) if i not in lc]
    forward = bool(nums.rhs_group_dimensions)
    if forward:  # lhs (..., m, ..., k), rhs (g, k, n): out (lhs free dims, rhs free dims)
        (gd,) = nums.rhs_group_dimensions
        rfree = [j for j in range(len(rhs.shape)) if j not in rc and j != gd]
        group = tuple(rhs.dims[gd])
        ragged_pairs: list[tuple[int, int]] = []
        want = None
    else:  # ragged rows contracted: out (g, lhs free dims, rhs free dims)
        rfree = [j for j in range(len(rhs.shape)) if j not in rc]
        hint = part.hints.get(eqn.outvars[0])
        group = tuple(hint[0]) if hint is not None and hint[0] and g % part.n(hint[0]) == 0 else ()
        ragged_pairs = [(r, rc[lc.index(r)])]
        want = list(hint[1:]) if hint is not None else None
    # Operands exact on this device's rows of this grouping (an earlier grouped matmul's result
    # and what elementwise ops made of it) are read as they are: only those rows are read.
    # (zeroed elsewhere: a row no group takes must add nothing, whatever it held)
    rrow = ragged_pairs[0][1] if ragged_pairs else -1
    hinted = {a for w in want for a in w} if want is not None else set()
    chunk = _chunk(part, ((lhs, r), (rhs, rrow)), grouping, group, hinted)
    lhs, rhs = (
        part.bare(part.unown(v), v.rows.axes)
        if v.rows and v.rows.fits(v, grouping, group + chunk, dim)
        else part.unown(v)
        for v, dim in ((lhs, r), (rhs, rrow))
    )
    if lhs.partial and rhs.partial:
        rhs = part.resolve(rhs)
    ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
    if not forward and want is not None:
        # The gradient's layout where an operand's dim is whole and its axes idle (a free
        # slice); where they split something already, the result moves afterwards instead.
        free = [ldims[i] for i in lfree] + [rdims[j] for j in rfree]  # the result's dims after the group's
        for dim, wanted in zip(free, want, strict=True):
            if wanted and not dim and not set(wanted) & ({x for d in (*ldims, *rdims) for x in d} | set(group)):
                dim[:] = list(wanted)
    # The ragged rows whole; the group axes nowhere else.
    for i, j in ragged_pairs:
        ldims[i], rdims[j] = [], []
    ldims[r] = []
    for dims in (ldims, rdims):
        for k in range(len(dims)):
            if not (forward and dims is rdims and k == gd):
                dims[k] = [a for a in dims[k] if a not in group]
    # Contracting dims split alike: local, and a pending sum. Split unlike: the cheapest of
    # both whole (the split sides gathered) and one side taking the other's split (its own
    # split of the dim, and of other dims over those axes, gathered; the result's sum
    # pending): an FSDP expert weight is gathered where the tokens are larger.
    out_elems = math.prod(lhs.shape[i] for i in lfree) * math.prod(rhs.shape[j] for j in rfree)
    out_bytes = out_elems * np.dtype(eqn.outvars[0].aval.dtype).itemsize // part.n(group)

    def taking(dims: list, k: int, split: list, nbytes: int, closed: set) -> int | None:
        """What laying ``dims``' dim ``k`` out as ``split`` moves (None: it cannot)."""
        if set(split) & closed:
            return None
        moved = set(dims[k]) | {x for m, d in enumerate(dims) if m != k for x in d if x in split}
        return nbytes * part.n(tuple(moved)) if moved else 0

    for i, j in zip(lc, rc, strict=True):
        a, b = ldims[i], rdims[j]
        if a == b:
            continue
        lb_, rb_ = part.nbytes(lhs.shape, _t(ldims), lhs.dtype), part.nbytes(rhs.shape, _t(rdims), rhs.dtype)
        options = [((lb_ * part.n(tuple(a)) if a else 0) + (rb_ * part.n(tuple(b)) if b else 0), 0)]
        take_l = taking(ldims, i, b, lb_, set(lhs.partial))
        if take_l is not None:
            options.append((take_l + out_bytes, 1))
        take_r = taking(rdims, j, a, rb_, set(rhs.partial) | set(group))
        if take_r is not None:
            options.append((take_r + out_bytes, 2))
        choice = min(options)[1]
        if choice == 0:
            ldims[i], rdims[j] = [], []
        else:
            dims, k, split = (ldims, i, b) if choice == 1 else (rdims, j, a)
            for m in range(len(dims)):
                dims[m] = list(split) if m == k else [x for x in dims[m] if x not in split]
    contract = {a for i in lc for a in ldims[i]}
    # A free axis on both sides: the weight's side gives it up.
    lf = {a for i in lfree for a in ldims[i]}
    for j in rfree:
        rdims[j] = [a for a in rdims[j] if a not in lf and a not in contract]
    for i in lfree:
        ldims[i] = [a for a in ldims[i] if a not in contract]
    lt, rt = _t(ldims), _t(rdims)
    lsplit = {a for d in lt for a in d} | set(group)
    rsplit = {a for d in rt for a in d} | set(group)
    if lhs.partial & rsplit:
        lhs = part.resolve(lhs)
    if rhs.partial & lsplit:
        rhs = part.resolve(rhs)
    l2 = part.to(lhs, lt, keep_partial=True)
    r2 = part.to(rhs, rt, keep_partial=True)
    # What it runs: the ragged rows (whole) against the other dims' local sizes on both sides.
    # The rows a device runs: its groups' rows, split evenly over ``chunk`` (a buffer of the
    # rows over the chunks' count holds a chunk whatever the routing).
    rows = -(-lhs.shape[r] // part.n(chunk))
    lk = math.prod(s // part.n(d) for i, (s, d) in enumerate(zip(lhs.shape, lt, strict=True)) if i != r)
    rn = math.prod(rhs.shape[j] // part.n(rt[j]) for j in rfree)
    masked = (lk if forward else lk + rn) * part.mult  # what jax's dense decomposition masks, per row and group
    part.record.grouped.append((part.source, g, group, forward, rows, float(lk * rn * part.mult), float(masked)))
    xs: list | None = None
    start: Any = None
    count: Any = None
    if not part.dry:
        lx, rx, local_sizes = l2.x, r2.x, sizes.x
        if group or chunk:
            n = g // part.n(group)
            first = part.index(group) * n
            local_sizes = jax.lax.dynamic_slice_in_dim(sizes.x, first, n)
            start = jnp.sum(jnp.where(jnp.arange(g) < first, sizes.x, 0))
            count = jnp.sum(local_sizes)
            if chunk:  # this replica's share of the groups' rows, and each group's rows in it
                per = (count + part.n(chunk) - 1) // part.n(chunk)
                lo = jnp.minimum(part.index(chunk) * per, count)
                hi = jnp.minimum(lo + per, count)
                begin = jnp.cumsum(local_sizes) - local_sizes
                local_sizes = jnp.clip(jnp.minimum(hi, begin + local_sizes) - jnp.maximum(lo, begin), 0).astype(
                    local_sizes.dtype
                )
                # Read through a dynamic slice (at an offset that is 0 at run time): XLA:TPU
                # (libtpu 0.0.42) fails to compile a weight gradient's grouped matmul whose group
                # sizes are an elementwise op's result (RET_CHECK in mask_aggregator.cc), but not
                # sizes sliced out of an array, as the whole groups' are.
                local_sizes = jax.lax.dynamic_slice_in_dim(
                    jnp.concatenate([local_sizes, jnp.zeros_like(local_sizes)]), jnp.minimum(count, 0), n
                )
                start, count = start + lo, hi - lo
            lx = jax.lax.slice_in_dim(jnp.roll(lx, -start, axis=r), 0, rows, axis=r)
            if not forward:
                rx = jax.lax.slice_in_dim(jnp.roll(rx, -start, axis=rrow), 0, rows, axis=rrow)
        xs = part.bind(eqn, [lx, rx, local_sizes])
        if forward and (group or chunk) and xs is not None:
            at = lfree.index(r)
            pad = [(0, lhs.shape[r] - rows if k == at else 0) for k in range(xs[0].ndim)]
            xs = [jnp.roll(jnp.pad(xs[0], pad), start, axis=at)]
    out_free = [lt[i] for i in lfree] + [rt[j] for j in rfree]
    out_dims = out_free if forward else [group, *out_free]
    partial = l2.partial | r2.partial | contract | ({*chunk} if not forward else set())
    (out,) = part.out(eqn, [out_dims], [frozenset(partial)], act=lhs.act or rhs.act, xs=xs)
    if forward and (group or chunk):  # this device's rows: its share of its groups' tokens (zero elsewhere)
        out = part.owned(out, Rows(grouping, group + chunk, lfree.index(r), start, count))
    return [out]


def _chunk(part: Partitioner, ops: Any, grouping: V, group: tuple[str, ...], wanted: set) -> tuple[str, ...]:
    """The mesh axes a grouped matmul splits its rows over: those that split nothing else in it
    (neither operand, nor a pending sum, nor the layout its result is wanted in), so that each
    replica of a device's groups runs its share of their rows rather than all of them. An operand
    exact on its own share of the rows (an earlier grouped matmul's result) keeps its split."""
    used = set(group) | wanted
    for v, _ in ops:
        own = set(v.rows.axes) if v.rows is not None else set()
        used |= {a for d in v.dims for a in d} | (set(v.partial) - own)
    idle = tuple(a for a in part.mesh if a not in used and part.mesh[a] > 1)
    for v, dim in ops:
        rows = v.rows
        if rows is not None and rows.sizes is grouping and rows.dim == dim and rows.axes[: len(group)] == group:
            held = rows.axes[len(group) :]
            if set(held) <= set(idle):
                return held
    return idle


RULES.ops.update(
    {
        "reduce_sum": op_reduce_sum,
        "reduce_max": op_reduce_max,
        "reduce_min": op_reduce_max,
        "argmax": op_argmax,
        "argmin": op_argmax,
        "reduce_and": op_argmax,
        "reduce_or": op_argmax,
        "reduce_prod": op_argmax,
        "reduce_xor": op_argmax,
        "dot_general": op_dot_general,
        "ragged_dot_general": op_ragged_dot_general,
    }
)
