"""Layouts carried backwards through a jaxpr: the splits a value's readers want, and the layouts
that closed sharding constraints give the ops computing their operands (Shardy's
``apply-sharding-constraints``). Pure functions of the jaxpr and the seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardplan.runtime.fast.opsets import _LAYOUT_PRESERVING
from shardplan.runtime.fast.values import Dims
from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS
from shardplan.runtime.primitives import subjaxpr as _subjaxpr
from shardplan.runtime.sharding import constraint_target, permuted


def reshaped_back(xs: tuple[int, ...], shape: tuple[int, ...], out: Dims) -> Dims:
    """The layout of a reshape's operand (shape ``xs``) that its result (``shape``) wanted as
    ``out`` asks for: the leading dims both shapes share keep their axes, the rest whole."""
    dims: list[tuple[str, ...]] = [()] * len(xs)
    for i in range(min(len(xs), len(shape))):
        if xs[i] != shape[i]:
            break
        dims[i] = tuple(out[i])
    return tuple(dims)


def _spread(jaxpr: Any, table: dict[Any, Dims], constraints: str | None) -> None:
    """Wanted splits (``table``: var -> per-dim axes) carried from values back to the values they
    are computed from, through elementwise, layout and reduction ops and matmuls. ``constraints``:
    "seed" starts a want at each constrained activation (its layout), "stop" ends one there, None
    passes through."""

    def want(x: Any, dims: Dims) -> None:
        if not hasattr(x, "val") and any(dims) and len(dims) == len(getattr(x.aval, "shape", ())):
            table.setdefault(x, dims)

    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "sharding_constraint" and constraints is not None:
            x = eqn.invars[0]
            target = constraint_target(eqn, ((),) * len(getattr(x.aval, "shape", ())))
            if target is not None and constraints == "seed":
                want(x, target)
            continue
        out = table.get(eqn.outvars[0]) if eqn.outvars else None
        if out is None:
            continue
        shape = tuple(eqn.outvars[0].aval.shape)
        if name in ELEMENTWISE or name in _LAYOUT_PRESERVING:
            for x in eqn.invars:
                xs = tuple(getattr(x.aval, "shape", ()))
                if len(xs) == len(shape):
                    want(x, tuple(d if xs[i] == shape[i] else () for i, d in enumerate(out)))
        elif name == "transpose":
            want(eqn.invars[0], permuted(out, eqn.params["permutation"]))
        elif name in ("reshape", "squeeze", "expand_dims"):
            want(eqn.invars[0], reshaped_back(tuple(eqn.invars[0].aval.shape), shape, out))
        elif name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
            axes = tuple(eqn.params.get("axes", ()))
            xs = tuple(eqn.invars[0].aval.shape)
            kept = [i for i in range(len(xs)) if i not in axes]
            red: list[tuple[str, ...]] = [()] * len(xs)
            for k, i in enumerate(kept):
                red[i] = out[k]
            want(eqn.invars[0], tuple(red))
        elif name == "broadcast_in_dim":
            xs = tuple(eqn.invars[0].aval.shape)
            want(
                eqn.invars[0],
                tuple(out[j] if xs[i] == shape[j] else () for i, j in enumerate(eqn.params["broadcast_dimensions"])),
            )
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lx, rx = eqn.invars
            lfree = [i for i in range(len(lx.aval.shape)) if i not in lc and i not in lb]
            rfree = [i for i in range(len(rx.aval.shape)) if i not in rc and i not in rb]
            ld: list[tuple[str, ...]] = [()] * len(lx.aval.shape)
            rd: list[tuple[str, ...]] = [()] * len(rx.aval.shape)
            k = 0
            for i, j in zip(lb, rb, strict=True):
                ld[i] = rd[j] = out[k]
                k += 1
            for i in lfree:
                ld[i] = out[k]
                k += 1
            for j in rfree:
                rd[j] = out[k]
                k += 1
            want(lx, tuple(ld))
            want(rx, tuple(rd))


def _adapts(eqn: Any) -> bool:
    """A reader that takes its operand in any layout (an elementwise op, a matmul or a call of one,
    ``jnp.einsum``'s body, a reduction of one operand: a norm's mean), where a gather keeps the
    layout it finds."""
    if eqn is None:
        return False
    if eqn.primitive.name == "dot_general" or eqn.primitive.name in ELEMENTWISE:
        return True
    if eqn.primitive.name in REDUCTIONS and len(eqn.invars) == 1:
        return True
    sub = _subjaxpr(eqn) if eqn.primitive.name in ("jit", "pjit", "closed_call") else None
    return sub is not None and any(e.primitive.name == "dot_general" for e in sub.eqns)


def _claims_back(jaxpr: Any, claimed: dict[Any, Dims], split: Callable[[Dims], int]) -> dict[Any, Dims]:
    """The layouts Shardy's propagation gives the ops that build a claimed value, walking back
    from it: through transposes and elementwise ops (to operands of the same shape: an operand
    broadcast over a size-1 dim, or by ``broadcast_in_dim``, keeps its own layout), through
    reductions (the kept dims as the result's, the reduced whole: a norm), into calls
    (an einsum's body) and through a batched matmul to its operands (batch and free dims as the
    result's, contracting dims whole). Only values made in ``jaxpr`` (or a call's inputs, mapped
    out to the caller's values) are claimed; params and inputs keep their own layouts. Where a
    claim applies is ``Walker.back_claim``'s decision. Pure: returns the claims, ``claimed`` included."""
    out = dict(claimed)
    made = {o for eqn in jaxpr.eqns for o in eqn.outvars} | set(jaxpr.invars)  # invars: a call's, mapped out
    readers: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):
                readers.setdefault(x, []).append(eqn)
    for x in jaxpr.outvars:
        if not hasattr(x, "val"):
            readers.setdefault(x, []).append(None)
    proposed: dict[Any, dict] = {}  # value -> {reading eqn id: the layout it asks for}
    reader: list = [None]

    def claim(x: Any, dims: Dims) -> None:
        if not hasattr(x, "val") and x in made and x not in out and any(dims):
            proposed.setdefault(x, {})[id(reader[0])] = tuple(dims)

    def settle(x: Any) -> None:
        # Claimed where every reader asks for it or takes any layout (an elementwise op, a matmul);
        # a reader that keeps the value's own layout (a reduction, a gather) keeps it. Readers that
        # ask for different layouts: the most split wins (a tie, neither).
        asks = proposed.get(x)
        if x in out or not asks or not all(id(r) in asks or _adapts(r) for r in readers.get(x, [])):
            return
        ranked = sorted(set(asks.values()), key=lambda d: -split(d))
        if len(ranked) == 1 or split(ranked[0]) > split(ranked[1]):
            out[x] = ranked[0]

    for eqn in reversed(jaxpr.eqns):
        for o in eqn.outvars:
            settle(o)
        reader[0] = eqn
        target = next((out[o] for o in eqn.outvars if o in out), None)
        if target is None:
            continue
        name = eqn.primitive.name
        shape = tuple(eqn.outvars[0].aval.shape)
        if name == "transpose":
            inner: list = [()] * len(shape)
            for k, p in enumerate(eqn.params["permutation"]):
                inner[p] = target[k]
            claim(eqn.invars[0], tuple(inner))
        elif name in ELEMENTWISE or name == "convert_element_type":
            for x in eqn.invars:
                if tuple(getattr(x.aval, "shape", ())) == shape and shape:  # not through a size-1 broadcast
                    claim(x, target)
        elif name in REDUCTIONS and len(eqn.invars) == 1:
            # through a reduction (a norm's mean): the kept dims as the result's, the reduced whole
            axes = set(eqn.params.get("axes", ()))
            kept = iter(target)
            x = eqn.invars[0]
            claim(x, tuple(() if i in axes else next(kept, ()) for i in range(len(x.aval.shape))))
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            if not lb:
                continue  # a plain matmul: its operands keep their own splits (weights, sequence)
            lx, rx = eqn.invars
            lfree = [i for i in range(len(lx.aval.shape)) if i not in lc and i not in lb]
            rfree = [i for i in range(len(rx.aval.shape)) if i not in rc and i not in rb]
            ld: list = [()] * len(lx.aval.shape)
            rd: list = [()] * len(rx.aval.shape)
            for k, (i, j) in enumerate(zip(lb, rb, strict=True)):
                ld[i], rd[j] = target[k], target[k]
            for p, i in enumerate(lfree):
                ld[i] = target[len(lb) + p]
            for q, j in enumerate(rfree):
                rd[j] = target[len(lb) + len(lfree) + q]
            claim(lx, tuple(ld))
            claim(rx, tuple(rd))
        elif name in ("jit", "pjit", "closed_call", "core_call"):
            sub = _subjaxpr(eqn)
            if sub is None:
                continue
            pairs = zip(sub.outvars, eqn.outvars, strict=False)
            seeds = {i: out[o] for i, o in pairs if o in out and not hasattr(i, "val")}
            inner_claims = _claims_back(sub, seeds, split)
            for i, o in zip(sub.invars, eqn.invars, strict=False):
                if i in inner_claims and not hasattr(o, "val"):
                    claim(o, inner_claims[i])
    for x in jaxpr.invars:
        settle(x)
    return out


def passed_layouts(jaxpr: Any, seeds: dict[Any, Dims]) -> dict[Any, Dims]:
    """Shardy's first phase of propagation (``OpPriorityPropagation``: elementwise ops first, in
    both directions, before any matmul's): the layouts the step's split inputs give the values an
    unbroken chain of elementwise ops of one shape links them to (the first seed reaching a value
    wins)."""
    table = dict(seeds)
    eqns = [e for e in jaxpr.eqns if e.primitive.name in ELEMENTWISE and e.outvars]
    for _ in range(3):
        grew = False
        for eqn in (*eqns, *reversed(eqns)):
            shape = tuple(eqn.outvars[0].aval.shape)
            links = (*eqn.invars, eqn.outvars[0])
            members = [x for x in links if not hasattr(x, "val") and tuple(x.aval.shape) == shape]
            known = next((table[x] for x in members if x in table), None)
            if known is None:
                continue
            for x in members:
                if x not in table:
                    table[x] = known
                    grew = True
        if not grew:
            break
    return {x: d for x, d in table.items() if x not in seeds}
