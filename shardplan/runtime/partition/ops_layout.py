"""The partitioner's local rules for elementwise ops and ops that move or reshape data: broadcasts,
transposes, reshapes, slices, pads, concatenation, stacking, ops along a dim (sort, cumsum,
top_k), random bits, iota and sharding constraints.
"""

from __future__ import annotations

from typing import Any

import jax

from shardplan.runtime.partition.partitioner import RULES, Partitioner
from shardplan.runtime.partition.values import _LINEAR_ALL, V, _t
from shardplan.runtime.sharding import (
    Dims,
    constraint_target,
    permuted,
)


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dims of ``src`` and ``dst`` grouped where their running products meet (a reshape's blocks)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        ii, jj = [], []
        a = b = 1
        if i < len(src):
            a *= src[i]
            ii.append(i)
            i += 1
        if j < len(dst):
            b *= dst[j]
            jj.append(j)
            j += 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]
                ii.append(i)
                i += 1
            elif b < a and j < len(dst):
                b *= dst[j]
                jj.append(j)
                j += 1
            else:
                return None
        # Trailing size-1 dims join this group.
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            ii.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            jj.append(j)
            j += 1
        groups.append((ii, jj))
    return groups


# -- elementwise -----------------------------------------------------------------------
def elementwise(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """Elementwise ops; on a grouped matmul's own rows (``Rows``) where every other operand is
    exact on them (no pending sum over the groups' axes, those rows not split): the rows kept."""
    held = [v.rows for v in ins if v.rows is not None]
    if not held:
        return _elementwise(part, eqn, ins)
    r = held[0]
    rank = len(eqn.outvars[0].aval.shape)
    # Another operand pending over the groups' axes (a lookup of the routing weights) is
    # summed first where it is no larger than the rows' value.
    size = max(part.nbytes(v.shape, v.dims, v.dtype) for v in ins if v.rows is not None)
    ins = [
        part.resolve(v)
        if v.rows is None and v.partial & set(r.axes) and part.nbytes(v.shape, v.dims, v.dtype) <= size
        else v
        for v in ins
    ]
    if all(
        (v.rows is not None and v.rows.fits(v, r.sizes, r.axes, r.dim))
        or (v.rows is None and not v.partial & set(r.axes) and (len(v.shape) < rank or not v.dims[r.dim]))
        for v in ins
    ):
        return [part.owned(o, r) for o in _elementwise(part, eqn, [part.bare(v) for v in ins])]
    return _elementwise(part, eqn, [part.unown(v) for v in ins])


def _elementwise(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    name = eqn.primitive.name
    shape = tuple(eqn.outvars[0].aval.shape)
    act = any(v.act for v in ins)
    full = [i for i, v in enumerate(ins) if len(v.shape) == len(shape) and shape]
    scal = [i for i in range(len(ins)) if i not in full]
    partials = {ins[i].partial for i in full}
    keep: frozenset[str] = frozenset()
    if any(v.shared and v.partial for v in ins):
        partials = {frozenset(), frozenset({"?"})}  # a shared operand is reduced, not carried
    if len(partials) == 1 and not any(ins[i].partial for i in scal):
        only = next(iter(partials))
        # Linear in all operands together: every operand, scalars too, must carry the same
        # pending sum (a constant added to each device's partial would be summed n times:
        # an RMSNorm's ``mean + eps`` on a row-parallel output).
        if only and name in _LINEAR_ALL and all(v.partial == only for v in ins):
            keep = only
    if name == "mul" and len(ins) == 2 and not keep and not any(v.shared for v in ins):
        ps = [v.partial for v in ins]
        if bool(ps[0]) != bool(ps[1]):
            keep = ps[0] or ps[1]
    if name == "div" and ins[0].partial and not ins[1].partial and not ins[0].shared:
        keep = ins[0].partial
    # The layout: the most split operand's, extended by other operands' splits where free.
    if full:
        base = max(full, key=lambda i: (part.n(tuple(a for d in ins[i].dims for a in d)), ins[i].act))
        target = [list(d) for d in ins[base].dims]
        used = {a for d in target for a in d}
        for i in full:
            for j, d in enumerate(ins[i].dims):
                if (
                    d
                    and not target[j]
                    and not (set(d) & used)
                    and shape[j] % part.n(d) == 0
                    and (ins[i].shape[j] == shape[j])
                ):
                    target[j] = list(d)
                    used |= set(d)
        tgt = _t(target)
        if used & keep:
            keep = frozenset()
    vals = []
    for i, v in enumerate(ins):
        if i in full:
            own = tuple(t if v.shape[j] == shape[j] else () for j, t in enumerate(tgt))
            vals.append(part.to(v, own, keep_partial=bool(keep) and v.partial == keep))
        else:
            vals.append(part.resolve(v, keep=keep if v.partial == keep else frozenset()))
    xs = part.bind(eqn, [v.x for v in vals])
    out_dims = tgt if full else ((),) * len(shape)
    outs = part.out(eqn, [out_dims], [keep], act=act, xs=xs)
    if any(v.make is not None for v in ins) and all(v.make is not None or not (v.shape or v.partial) for v in ins):
        # Of values made in the step only (a mask from iotas): made too, in any layout.
        def build(want: Dims) -> Any:
            args = []
            for v in ins:
                own = tuple(d if v.shape[j] == shape[j] else () for j, d in enumerate(want)) if v.shape else ()
                args.append(v.x if v.make is None else v.make(own))
            return part.bind(eqn, args)[0]  # type: ignore[index]

        outs[0].make = part.made(eqn, build)
    return outs


# -- shapes ----------------------------------------------------------------------------
def op_broadcast_in_dim(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    v, rest = ins[0], ins[1:]
    if rest:  # dynamic shapes
        return None
    shape = tuple(eqn.params["shape"])
    dims: list[tuple[str, ...]] = [()] * len(shape)
    for i, j in enumerate(eqn.params["broadcast_dimensions"]):
        if v.shape[i] == shape[j]:
            dims[j] = v.dims[i]
    xs = part.bind(eqn, [v.x], shape=part.local_shape(shape, dims), sharding=None)
    outs = part.out(eqn, [dims], [v.partial], act=v.act, xs=xs)
    if not v.partial and (not v.shape or v.make is not None):
        # ``jnp.zeros``/``full`` (a broadcast scalar), or a broadcast of a value made in the step.
        bdims = tuple(eqn.params["broadcast_dimensions"])

        def build(want: Dims) -> Any:
            src = tuple(want[j] if v.shape[i] == shape[j] else () for i, j in enumerate(bdims))
            x = part.to(v, src).x if v.shape else v.x
            return jax.lax.broadcast_in_dim(x, part.local_shape(shape, want), bdims)

        outs[0].make = part.made(eqn, build)
    return outs


def op_transpose(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    # A pending sum is reduced before a transpose: XLA would otherwise fold the transpose into
    # the producing matmul (a weight gradient), in a form XLA:CPU runs without its fast dot path.
    hint = part.hints.get(eqn.outvars[0])
    v = part.resolve(ins[0], None if hint is None else permuted(hint, eqn.params["permutation"]))
    perm = eqn.params["permutation"]
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [tuple(v.dims[p] for p in perm)], [v.partial], act=v.act, xs=xs)


def op_squeeze(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = ins[0]
    gone = {d % len(v.shape) for d in eqn.params["dimensions"]}
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [tuple(d for i, d in enumerate(v.dims) if i not in gone)], [v.partial], v.act, xs)


def op_reshape(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    v = ins[0]
    if eqn.params.get("dimensions") is not None or len(ins) > 1:
        return None
    shape = tuple(eqn.params["new_sizes"])
    groups = _groups(v.shape, shape)
    if groups is None:
        return None
    need = [list(d) for d in v.dims]
    out: list[tuple[str, ...]] = [()] * len(shape)
    for ii, jj in groups:
        split = [i for i in ii if v.dims[i]]
        if not split:
            continue
        if len(ii) == 1 and jj:  # one dim split into several: the major output dim keeps the split
            i = ii[0]
            j = next((j for j in jj if shape[j] != 1), jj[0])  # past inserted size-1 dims ([L] -> [1, P, K])
            if shape[j] % part.n(v.dims[i]) == 0:
                out[j] = v.dims[i]
            else:
                need[i] = []
        elif len(jj) == 1:  # several dims merged into one: only the major one may be split
            first = next(i for i in ii if v.shape[i] != 1)
            for i in split:
                if i != first:
                    need[i] = []
            out[jj[0]] = tuple(need[first])
        else:
            for i in split:
                need[i] = []
    v = part.to(v, _t(need), keep_partial=True)
    xs = part.bind(eqn, [v.x], new_sizes=part.local_shape(shape, out), sharding=None)
    return part.out(eqn, [out], [v.partial], v.act, xs)


def op_iota(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    p = eqn.params
    shape, dim, dtype = tuple(p["shape"]), p["dimension"], p["dtype"]

    def build(want: Dims) -> Any:
        loc = part.local_shape(shape, want)
        x = jax.lax.broadcasted_iota(dtype, loc, dim)
        if want[dim]:  # this device's block of the iota: offset by its first index
            x = x + (part.index(want[dim]) * loc[dim]).astype(dtype)
        return x

    xs = part.bind(eqn, [])
    outs = part.out(eqn, [((),) * len(shape)], xs=xs)
    outs[0].make = part.made(eqn, build)
    return outs


def _unsplit(part: Partitioner, eqn: Any, ins: list[V], which: set[int], first: int = 1) -> tuple[V, list[V]]:
    v = ins[0]
    v = part.to(v, tuple(() if i in which else d for i, d in enumerate(v.dims)), keep_partial=True)
    rest = [part.resolve(x) for x in ins[first:]]
    rest = [part.whole(x) for x in rest]
    return v, rest


def op_slice(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = ins[0]
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(v.shape)
    cut = {i for i in range(len(v.shape)) if (start[i], limit[i], strides[i]) != (0, v.shape[i], 1)}
    v, _ = _unsplit(part, eqn, ins, cut)
    loc = part.local_shape(v.shape, v.dims)
    lim = tuple(loc[i] if i not in cut else limit[i] for i in range(len(loc)))
    xs = part.bind(eqn, [v.x], limit_indices=lim)
    return part.out(eqn, [v.dims], [v.partial], v.act, xs)


def op_dynamic_slice(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """A window at a position (a rolling buffer's read, a KV cache's): dims it takes whole keep
    their split (the position there is clamped to 0 on every device), the others are read whole."""
    sizes = tuple(eqn.params["slice_sizes"])
    cut = {i for i, n in enumerate(sizes) if n != ins[0].shape[i]}
    v, idx = _unsplit(part, eqn, ins, cut)
    xs = part.bind(eqn, [v.x, *[i.x for i in idx]], slice_sizes=part.local_shape(sizes, v.dims))
    return part.out(eqn, [v.dims], [v.partial], v.act or any(i.act for i in idx), xs)


def op_dynamic_update_slice(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """A window written at a position (a KV-cache write): dims the update covers whole take one
    split on both operands (a buffer made in the step takes the update's), the others whole."""
    op, upd, idx = ins[0], ins[1], ins[2:]
    if op.partial != upd.partial:  # linear in both together: one pending sum carried, else none
        op, upd = part.resolve(op), part.resolve(upd)
    first, second = (upd, op) if op.make is not None else (op, upd)
    dims: list[tuple[str, ...]] = []
    used: set[str] = set()
    for i, n in enumerate(op.shape):
        pick: tuple[str, ...] = ()
        if upd.shape[i] == n:
            for cand in (first.dims[i], second.dims[i]):
                if cand and not set(cand) & used and n % part.n(cand) == 0:
                    pick = cand
                    break
        dims.append(pick)
        used |= set(pick)
    tgt = _t(dims)
    op2, upd2 = part.to(op, tgt, keep_partial=True), part.to(upd, tgt, keep_partial=True)
    if op2.partial != upd2.partial:
        op2, upd2 = part.resolve(op2), part.resolve(upd2)
    idx = [part.whole(part.resolve(i)) for i in idx]
    xs = part.bind(eqn, [op2.x, upd2.x, *[i.x for i in idx]])
    act = op.act or upd.act or any(i.act for i in idx)
    return part.out(eqn, [tgt], [op2.partial], act, xs)


def op_pad(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    cfg = eqn.params["padding_config"]
    cut = {i for i, c in enumerate(cfg) if tuple(c) != (0, 0, 0)}
    v, rest = _unsplit(part, eqn, ins, cut)
    if v.partial:
        v = part.resolve(v)
    xs = part.bind(eqn, [v.x, *[r.x for r in rest]])
    return part.out(eqn, [v.dims], act=v.act or any(r.act for r in rest), xs=xs)


def op_split(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    axis = eqn.params["axis"]
    v, _ = _unsplit(part, eqn, ins, {axis})
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [v.dims] * len(eqn.outvars), [v.partial] * len(eqn.outvars), v.act, xs)


def op_concatenate(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    dim = eqn.params["dimension"]
    base = max(ins, key=lambda v: (part.n(tuple(a for d in v.dims for a in d)), v.act))
    tgt = tuple(() if i == dim else d for i, d in enumerate(base.dims))
    vals = [part.to(v, tgt) for v in ins]
    xs = part.bind(eqn, [v.x for v in vals])
    return part.out(eqn, [tgt], act=any(v.act for v in ins), xs=xs)


def op_stack(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """``jnp.stack`` (a primitive in this jax): the operands laid out alike, a new whole dim."""
    axis = eqn.params["axis"]
    base = max(ins, key=lambda v: (part.n(tuple(a for d in v.dims for a in d)), v.act))
    vals = [part.to(part.resolve(v), base.dims) for v in ins]
    xs = part.bind(eqn, [v.x for v in vals])
    dims = base.dims[:axis] + ((),) + base.dims[axis:]
    return part.out(eqn, [dims], act=any(v.act for v in ins), xs=xs)


def op_unstack(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """``unstack`` along ``axis``: that dim whole, the others stay split; each result the
    operand's layout less that dim."""
    axis = eqn.params["axis"] % len(ins[0].shape)
    v = part.to(part.resolve(ins[0]), tuple(() if i == axis else d for i, d in enumerate(ins[0].dims)))
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [v.dims[:axis] + v.dims[axis + 1 :]] * len(eqn.outvars), act=v.act, xs=xs)


def _along(part: Partitioner, eqn: Any, ins: list[V], axes) -> list[V]:
    """Ops along some dims (cumsum, sort, argsort, rev): those dims whole, others stay split."""
    which = {a % len(ins[0].shape) for a in axes}
    vals = [part.to(part.resolve(v), tuple(() if i in which else d for i, d in enumerate(ins[0].dims)))
            for v in ins]  # fmt: skip
    xs = part.bind(eqn, [v.x for v in vals])
    return part.out(eqn, [vals[0].dims] * len(eqn.outvars), act=any(v.act for v in ins), xs=xs)


def op_cumsum(part: Partitioner, eqn, ins):
    return _along(part, eqn, ins, (eqn.params["axis"],))


def op_top_k(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    v = ins[0]
    axis = eqn.params.get("axis", len(v.shape) - 1) % len(v.shape)
    if v.dims[axis]:  # the k largest of a split dim: whole operands (a reported fallback)
        return None
    return _along(part, eqn, ins, (axis,))


# -- random numbers: a function of each key, so a batch of keys stays split ---------------
def _per_key(part: Partitioner, eqn: Any, ins: list[V], rank: int) -> list[V]:
    """An op of each key: the keys' layout on the leading ``rank`` dims (the key array's
    shape), the trailing output dims (bits per key, split keys, key data) whole."""
    keys = part.resolve(ins[0])
    lead = tuple(keys.dims[:rank])
    keys = part.to(keys, lead + ((),) * (len(keys.shape) - rank))
    rest = []
    for v in ins[1:]:
        v = part.resolve(v)
        rest.append(part.to(v, lead) if v.shape == keys.shape[:rank] and v.shape else part.whole(v))
    xs = part.bind(eqn, [keys.x, *[v.x for v in rest]])
    dims = [lead + ((),) * (len(getattr(o.aval, "shape", ())) - rank) for o in eqn.outvars]
    return part.out(eqn, dims, act=any(v.act for v in ins), xs=xs)


def op_random_bits(part: Partitioner, eqn, ins):
    return _per_key(part, eqn, ins, len(ins[0].shape))


def op_random_fold_in(part: Partitioner, eqn, ins):
    return _per_key(part, eqn, ins, len(ins[0].shape))


def op_random_wrap(part: Partitioner, eqn, ins):  # key data (..., 2) -> keys (...)
    return _per_key(part, eqn, ins, len(ins[0].shape) - 1)


def op_rev(part: Partitioner, eqn, ins):
    return _along(part, eqn, ins, eqn.params["dimensions"])


def op_sort(part: Partitioner, eqn, ins):
    if any(v.shape != ins[0].shape for v in ins):
        return None
    return _along(part, eqn, ins, (eqn.params["dimension"],))


# -- constraints ------------------------------------------------------------------------
def op_sharding_constraint(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    v = ins[0]
    tgt = constraint_target(eqn, v.dims)
    if tgt is None:
        return [v]
    tgt = tuple(tuple(a for a in d if a in part.mesh) for d in tgt)
    if not part.fits(v.shape, tgt):
        return [v]
    return [part.to(v, tgt)]


def op_empty2(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """An uninitialised buffer (a cond's placeholder for the residuals of the branch not taken):
    made whole on each device, nothing moved."""
    xs = part.bind(eqn, [])
    return part.out(eqn, [((),) * len(getattr(o.aval, "shape", ())) for o in eqn.outvars], xs=xs)


def op_ppermute(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """A permute the model wrote (inside a shard_map region): run on the local block as written."""
    (v,) = ins
    axes = eqn.params["axis_name"]
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    part.issue("collective-permute", axes, part.nbytes(v.shape, v.dims, v.dtype))
    xs = part.bind(eqn, [v.x])
    return part.out(eqn, [v.dims], [v.partial], v.act, xs)


RULES.ops.update(
    {
        "ppermute": op_ppermute,
        "empty2": op_empty2,
        "broadcast_in_dim": op_broadcast_in_dim,
        "transpose": op_transpose,
        "squeeze": op_squeeze,
        "reshape": op_reshape,
        "iota": op_iota,
        "slice": op_slice,
        "dynamic_slice": op_dynamic_slice,
        "dynamic_update_slice": op_dynamic_update_slice,
        "pad": op_pad,
        "split": op_split,
        "concatenate": op_concatenate,
        "stack": op_stack,
        "unstack": op_unstack,
        "cumsum": op_cumsum,
        "cumprod": op_cumsum,
        "cummax": op_cumsum,
        "cummin": op_cumsum,
        "cumlogsumexp": op_cumsum,
        "top_k": op_top_k,
        "random_bits": op_random_bits,
        "random_split": op_random_bits,
        "random_fold_in": op_random_fold_in,
        "random_seed": op_random_fold_in,
        "random_clone": op_random_fold_in,
        "random_unwrap": op_random_fold_in,
        "random_wrap": op_random_wrap,
        "rev": op_rev,
        "sort": op_sort,
        "sharding_constraint": op_sharding_constraint,
    }
)
RULES.elementwise = elementwise
