"""The partitioner's local rules for lookups: ``gather`` from a table split over its rows (a masked
local lookup and a pending sum) and ``scatter`` / ``scatter-add`` into one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardplan.runtime.partition.partitioner import RULES, Partitioner
from shardplan.runtime.partition.values import V, _t


# -- lookups ---------------------------------------------------------------------------
def op_gather(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    op, idx = ins
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(eqn.params["slice_sizes"])
    mode = eqn.params["mode"]
    mode_name = getattr(mode, "name", str(mode))
    if op.partial or idx.partial:
        op, idx = part.resolve(op), part.resolve(idx)
    r = len(op.shape)
    out_rank = len(eqn.outvars[0].aval.shape)
    batch_out = [k for k in range(out_rank) if k not in dn.offset_dims]
    ib = list(range(len(idx.shape) - 1))  # indices batch dims, in order -> batch_out
    idims = [list(d) for d in idx.dims[:-1]]
    odims = [list(d) for d in op.dims]
    # Operand batching dims follow the indices' layout.
    for od, idd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True):
        odims[od] = list(idims[idd])
    masked: list[int] = []
    for k, od in enumerate(dn.start_index_map):
        if odims[od]:
            if sizes[od] == 1 and od in dn.collapsed_slice_dims and part.fits(op.shape, _t(odims)):
                masked.append(k)
            else:
                odims[od] = []
    window = [d for d in range(r) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d in window:
        if odims[d] and sizes[d] != op.shape[d]:
            odims[d] = []
    # An axis on the indices and on a window/indexed dim of the table: the table gives it up.
    idx_axes = {a for d in idims for a in d}
    for d in range(r):
        if d not in dn.operand_batching_dims:
            odims[d] = [a for a in odims[d] if a not in idx_axes]
    masked = [k for k in masked if odims[dn.start_index_map[k]]]
    if masked and mode_name == "FILL_OR_DROP" and not jnp.issubdtype(op.dtype, jnp.floating):
        return None
    op2 = part.to(op, _t(odims))
    idx2 = part.to(idx, (*_t(idims), ()))
    out_dims: list[tuple[str, ...]] = [()] * out_rank
    for k, i in zip(batch_out, ib, strict=True):
        out_dims[k] = tuple(idims[i])
    for k, d in zip(dn.offset_dims, window, strict=True):
        out_dims[k] = tuple(odims[d])
    partial = frozenset(a for k in masked for a in odims[dn.start_index_map[k]])
    act = op.act or idx.act
    if part.dry:
        return part.out(eqn, [out_dims], [partial], act)
    loc_sizes = tuple(s // part.n(odims[d]) if d in window else s for d, s in enumerate(sizes))
    if not masked:
        xs = part.bind(eqn, [op2.x, idx2.x], slice_sizes=loc_sizes)
        return part.out(eqn, [out_dims], [partial], act, xs)
    indices = idx2.x
    valid: Any = None
    gvalid: Any = None
    cols = []
    for k, od in enumerate(dn.start_index_map):
        col = indices[..., k]
        if k in masked:
            n = part.n(odims[od])
            size = op.shape[od] // n
            if mode_name == "CLIP":
                col = jnp.clip(col, 0, op.shape[od] - 1)
            g_ok = (col >= 0) & (col < op.shape[od])
            gvalid = g_ok if gvalid is None else gvalid & g_ok
            col, ok = part.local_index(col, odims[od], size)
            valid = ok if valid is None else valid & ok
        cols.append(col)
    new_idx = jnp.stack(cols, axis=-1).astype(indices.dtype)
    bound = part.bind(eqn, [op2.x, new_idx], slice_sizes=loc_sizes, mode=jax.lax.GatherScatterMode.CLIP)
    assert bound is not None
    res = bound[0]
    bdims = tuple(batch_out)
    mask = jax.lax.broadcast_in_dim(valid, res.shape, bdims)
    res = jnp.where(mask, res, jnp.zeros((), res.dtype))
    if mode_name == "FILL_OR_DROP":
        fill = eqn.params.get("fill_value")
        fill = jnp.nan if fill is None else fill
        first = part.index(tuple(partial)) == 0
        bad = jax.lax.broadcast_in_dim(~gvalid & first, res.shape, bdims)
        res = jnp.where(bad, jnp.asarray(fill, res.dtype), res)
    return part.out(eqn, [out_dims], [partial], act, [res])


def op_scatter_add(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    op, idx, upd = ins
    dn = eqn.params["dimension_numbers"]
    if idx.partial:
        return None
    op = part.resolve(op)
    r = len(op.shape)
    uwin = list(dn.update_window_dims)
    uscat = [k for k in range(len(upd.shape)) if k not in uwin]
    owin = [d for d in range(r) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    # Indices and updates' scatter dims: the updates' layout (the activation's).
    udims = [list(d) for d in upd.dims]
    for n_, k in enumerate(uscat):  # the more split of updates and indices (slicing the other is free)
        if part.n(tuple(idx.dims[n_])) > part.n(tuple(udims[k])) and not set(idx.dims[n_]) & upd.partial:
            udims[k] = list(idx.dims[n_])
    seen: set[str] = set()
    for k in range(len(udims)):
        udims[k] = [a for a in udims[k] if a not in seen]
        seen |= set(udims[k])
    idims = [list(udims[k]) for k in uscat] + [[]]
    odims = [list(d) for d in op.dims]
    for d, k in zip(owin, uwin, strict=True):
        if udims[k] and op.shape[d] == upd.shape[k]:
            odims[d] = list(udims[k])
        else:
            udims[k] = []
            odims[d] = []
    for od, idd in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True):
        odims[od] = list(idims[idd])
    masked = [k for k, od in enumerate(dn.scatter_dims_to_operand_dims) if odims[od]]
    if masked and any(od not in dn.inserted_window_dims for od in dn.scatter_dims_to_operand_dims if odims[od]):
        for od in dn.scatter_dims_to_operand_dims:
            odims[od] = []
        masked = []
    scat_axes = {a for d in idims for a in d}
    for d in range(r):
        if d not in dn.operand_batching_dims:
            odims[d] = [a for a in odims[d] if a not in scat_axes]
    masked = [k for k in masked if odims[dn.scatter_dims_to_operand_dims[k]]]
    op2 = part.to(op, _t(odims))
    idx2 = part.to(idx, _t(idims))
    upd2 = part.to(upd, _t(udims), keep_partial=True)
    batch_axes = {a for d in idims for a in d} - {a for od in dn.operand_batching_dims for a in odims[od]}
    partial = frozenset(batch_axes | upd2.partial)
    act = op.act or idx.act or upd.act
    if part.dry:
        return part.out(eqn, [op2.dims], [partial], act)
    base = op2.x
    if partial:
        first = part.index(tuple(a for a in part.mesh if a in partial)) == 0
        base = jnp.where(first, base, jnp.zeros((), base.dtype))
    indices, updates = idx2.x, upd2.x
    if masked:
        cols: list = []
        valid: Any = None
        for k, od in enumerate(dn.scatter_dims_to_operand_dims):
            col = indices[..., k]
            if k in masked:
                col, ok = part.local_index(col, odims[od], op.shape[od] // part.n(odims[od]))
                valid = ok if valid is None else valid & ok
            cols.append(col)
        indices = jnp.stack(cols, axis=-1).astype(indices.dtype)
        mask = jax.lax.broadcast_in_dim(valid, updates.shape, tuple(uscat))
        updates = jnp.where(mask, updates, jnp.zeros((), updates.dtype))
    xs = part.bind(eqn, [base, indices, updates])
    return part.out(eqn, [op2.dims], [partial], act, xs)


def op_scatter(part: Partitioner, eqn: Any, ins: list[V]) -> list[V] | None:
    """``x.at[i].set(u)``: indices whole, the scattered dims whole; a window dim the update
    covers whole keeps one split on operand and update (each device writes its block)."""
    op, idx, upd = (part.resolve(v) for v in ins)
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims:
        return None
    owin = [d for d in range(len(op.shape)) if d not in dn.inserted_window_dims]
    scattered = set(dn.scatter_dims_to_operand_dims)
    odims: list[tuple[str, ...]] = [()] * len(op.shape)
    udims: list[tuple[str, ...]] = [()] * len(upd.shape)
    used: set[str] = set()
    for d, k in zip(owin, dn.update_window_dims, strict=True):
        cand = op.dims[d] or upd.dims[k]
        if d not in scattered and op.shape[d] == upd.shape[k] and cand and not set(cand) & used:
            odims[d] = udims[k] = cand
            used |= set(cand)
    op2, upd2, idx2 = part.to(op, _t(odims)), part.to(upd, _t(udims)), part.whole(idx)
    xs = part.bind(eqn, [op2.x, idx2.x, upd2.x])
    return part.out(eqn, [_t(odims)], act=op.act or idx.act or upd.act, xs=xs)


RULES.ops.update(
    {
        "gather": op_gather,
        "scatter_add": op_scatter_add,
        "scatter": op_scatter,
    }
)
