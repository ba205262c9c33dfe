"""Fast mode's rules for elementwise ops, broadcasts, reshapes, reductions, constraints, ops that
keep their operand's layout and ops along one dim (sort, cumsum, top_k).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from shardplan.core.stepcost import Constrained
from shardplan.runtime.fast.opsets import _LINEAR
from shardplan.runtime.fast.relayout import reshard, resolve, to_layout
from shardplan.runtime.fast.values import Dims, Val, _broadcast, _fits, _norm, _per_dim, _replicated, _tuple
from shardplan.runtime.fast.walker import Walker
from shardplan.runtime.primitives import itemsize
from shardplan.runtime.sharding import constraint_target
from shardplan.runtime.sources import INTERNAL_SCOPE


def broadcast(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    v = ins[0]
    bdims = eqn.params["broadcast_dimensions"]
    out_aval = eqn.outvars[0].aval
    shape = tuple(out_aval.shape)
    claim = walk.claimed.get(eqn.outvars[0]) if walk.xla_claims else None  # (XLA's propagation's)
    if claim is None and eqn.outvars[0] in walk.back:
        natural = tuple(
            v.dims[bdims.index(j)] if j in bdims and v.shape[bdims.index(j)] == shape[j] else ()
            for j in range(len(shape))
        )
        claim = walk.back_claim(eqn.outvars[0], natural)
    if claim is not None and not v.partial and _fits(shape, claim, walk.ctx):
        # Built in the layout its readers were given (Shardy): the operand moved first, at
        # its own (smaller) size; the new dims are split for free.
        mine = tuple(claim[j] if v.shape[i] == shape[j] else () for i, j in enumerate(bdims))
        if mine != v.dims and _fits(v.shape, mine, walk.ctx):
            reshard(walk, eqn.invars[0], v, mine, mult, "broadcast_in_dim")
            return [Val(shape, itemsize(out_aval), _norm(claim, len(shape)))]
    dims: list[tuple[str, ...]] = [()] * len(shape)
    for i, j in enumerate(bdims):
        if v.shape[i] == shape[j]:
            dims[j] = v.dims[i]
    if not v.partial and not hasattr(eqn.invars[0], "val") and math.prod(v.shape) < math.prod(shape):
        walk.expanded[eqn.outvars[0]] = (eqn.invars[0], v, tuple(bdims))
    return [Val(shape, itemsize(out_aval), tuple(dims), v.partial)]


def unstack(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """``unstack`` along ``axis``: that dim whole first (gathered where split), each result
    the operand's layout less that dim."""
    v = ins[0]
    axis = eqn.params["axis"] % len(v.shape)
    whole = to_layout(
        walk, eqn.invars[0], v, tuple(() if i == axis else d for i, d in enumerate(v.dims)), mult, "unstack"
    )
    dims = whole.dims[:axis] + whole.dims[axis + 1 :]
    return [Val(tuple(o.aval.shape), itemsize(o.aval), dims) for o in eqn.outvars]


def reshard_op(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
    """``jax.sharding.reshard`` in library code (e.g. an optimizer's scalar)."""
    target = constraint_target(eqn, ins[0].dims)
    if target is None:
        return None
    return [to_layout(walk, eqn.invars[0], ins[0], target, mult, "reshard")]


def _alike(eqn: Any, ins: list[Val]) -> tuple[tuple[int, ...], int, Dims] | None:
    """The result's shape, item size and layout where the operands of its rank (size-1 dims
    broadcast carry no split) are laid out alike with no pending sum: the layout they share.
    None where they differ, or none has the result's rank."""
    aval = eqn.outvars[0].aval
    shape = aval.shape
    rank = len(shape)
    if not rank:
        return None
    first: Dims | None = None
    for v in ins:
        if len(v.shape) != rank:
            continue
        if v.partial:
            return None
        dims = v.dims if v.shape == shape else tuple(d if v.shape[i] == shape[i] else () for i, d in enumerate(v.dims))
        if first is None:
            first = dims
        elif dims != first:
            return None
    if first is None:
        return None
    return tuple(shape), itemsize(aval), _norm(first, rank)


def _gathers_alike(walk: Walker, outvar: Any, full: list) -> bool:
    """Whether the layout a step output wants of ``outvar`` (``hints``) only gathers operands that
    are laid out alike with no pending sum: XLA computes the op where they lie and moves its
    result where the chain ends (measured: ZeRO-1's update ``mu / (sqrt(nu) + eps)`` over
    split moments is computed split and the new replicated param gathered once, 3.25 MiB on
    llama_small over 8 devices; computed whole, both operands were gathered: 6.5 MiB)."""
    hint = walk.hints[outvar]
    first = full[0][1].dims
    if any(v.partial or v.dims != first for _, v in full):
        return False
    return all(set(h) <= set(d) for h, d in zip(_norm(hint, len(first)), first, strict=True))


def quick(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val | None:
    """Most elementwise equations: operands laid out alike and nothing asks the result for
    another layout (or a step output's, which only gathers theirs: ``_gathers_alike``). Nothing
    moves: the result in the operands' layout, its flops counted. None: ``elementwise``."""
    outvar = eqn.outvars[0]
    if outvar in walk.back or outvar in walk.claimed or outvar in walk.free:
        return None
    alike = _alike(eqn, ins)
    if alike is None:
        return None
    hint = walk.hints.get(outvar)
    if hint is not None and not all(
        set(h) <= set(d) for h, d in zip(_norm(hint, len(alike[2])), alike[2], strict=True)
    ):
        return None
    out = Val(alike[0], alike[1], alike[2])
    walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, eqn.primitive.name)
    return out


def elementwise(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    """An elementwise equation the walker's ``quick`` rule did not answer (it asks that first)."""
    outvar = eqn.outvars[0]
    out_aval = eqn.outvars[0].aval
    shape = tuple(out_aval.shape)
    name = eqn.primitive.name
    # Operands of the output's rank (size-1 dims broadcast: they carry no split).
    rank = len(shape)
    full = [
        (x, v if v.shape == shape else _broadcast(v, shape))
        for x, v in zip(eqn.invars, ins, strict=True)
        if rank and len(v.shape) == rank
    ]
    outvar = eqn.outvars[0]
    back = None
    if (
        outvar in walk.back
        and full
        and outvar not in walk.hints
        and outvar not in walk.claimed
        and not any(v.partial for v in ins)
    ):
        back = walk.back_claim(outvar, max((v.dims for _, v in full), key=walk.ctx.split_dims))
    if back is not None and _fits(shape, back, walk.ctx):
        # Built in the layout propagated back from a constraint: each operand moved to it at its
        # own size (one broadcast over a size-1 dim is gathered there, not after; measured).
        for x, v in zip(eqn.invars, ins, strict=True):
            if len(v.shape) == rank:
                own = tuple(t if v.shape[i] == shape[i] else () for i, t in enumerate(_norm(back, rank)))
                if own != v.dims:
                    reshard(walk, x, v, own, mult, name)
        out = Val(shape, itemsize(out_aval), _norm(back, rank))
        walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, name)
        return out
    if (
        full
        and (outvar not in walk.hints or _gathers_alike(walk, outvar, full))
        and outvar not in walk.claimed
        and (outvar not in walk.free)
    ):
        first = full[0][1].dims
        if all(v.dims == first and not v.partial for _, v in full):  # operands laid out alike: nothing moves
            out = Val(shape, itemsize(out_aval), _norm(first, rank))
            walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, name)
            return out
    linear = name in _LINEAR or name in walk.ctx.book.sums
    partials = {v.partial for _, v in full}
    if linear and len(partials) == 1 and next(iter(partials)):
        # Every operand has the same pending sum: it stays pending (a sum of partial sums).
        target = max((v for _, v in full), key=lambda v: math.prod(walk.ctx.split(d) for d in v.dims)).dims
        for x, v in full:
            reshard(walk, x, replace(v, partial=frozenset()), target, mult, name)
        out = Val(shape, itemsize(out_aval), target, next(iter(partials)))
        walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, name)
        return out
    hint = walk.hints.get(outvar)
    claim = walk.claimed.get(outvar)
    if walk.xla_claims and claim is not None and hint is not None and hint != claim:
        # On XLA's layouts the value's own is XLA's, not the output's it leads to: the chain is
        # computed there and each output moved at its end (an Adam update of a replicated weight
        # whose gradient XLA lays out split: three gathers, one per output; measured)
        hint = claim
    if hint is None and claim is not None and len({v.dims for _, v in full}) > 1:
        # Computed in a constrained layout its operands do not share: XLA moves each operand to
        # it (a select's mask and values gathered apart, its constant fill whole already);
        # operands laid out alike are combined first and the result moved (measured).
        hint = claim
    if hint is not None and claim is None and not any(hint):
        # A step output wanted whole carries no layout back: XLA computes the op where its
        # operands lie and moves the result where the chain ends, once per output (measured:
        # Adam's update of a replicated weight whose gradient comes split over `expert` runs
        # split, and the new weight, mu and nu are each gathered, three gathers where moving
        # the gradient first is one). An output split anywhere is computed in its layout
        # (XLA computes that too where the operands lie, in their splits and the output's
        # together: tests/test_fast_rules.py, an xfail; followed, it moved other chains
        # of the backward pass that XLA computes in the output's layout).
        hint = None
    as_is = {id(x): v for x, v in zip(eqn.invars, ins, strict=True)}  # each at its own shape (size-1 dims)
    done = [(x, _resolved(walk, x, v, as_is[id(x)], hint, mult, name)) for x, v in full]
    if not done:
        return _replicated(out_aval)
    target = hint if hint is not None and _fits(shape, hint, walk.ctx) else _merged(walk, done, as_is, shape)
    hinted = target is hint
    free = walk.free.get(eqn.outvars[0])
    if free is not None and hint is None:
        used = {a for d in target for a in d}
        merged = tuple(
            f if f and f[: len(t)] == t and len(f) > len(t) and not any(a in used for a in f[len(t) :]) else t
            for t, f in zip(_norm(target, len(shape)), free, strict=True)
        )
        if _fits(shape, merged, walk.ctx):
            target = merged
    # With a hint and a broadcast operand, XLA computes on the hint's splits plus those the
    # operands add where their axes are free, moves each operand there at its own size (a norm's
    # scale gathered, not the activations moved) and moves the result to the hint (measured on
    # XLA:CPU and XLA:GPU: activations split on the batch times a scale split on the width over
    # the same axes, wanted as the activations lie, gather the scale; a row factor split on
    # (batch, seq) times activations split on the width is computed split three ways, its result
    # gathered twice).
    compute = target
    broadcasts = any(as_is[id(x)].shape != shape for x, _ in done)
    if hinted and not walk.xla_claims and broadcasts:
        compute = _computed_at(walk, target, done, as_is, shape)
    for x, v in done:
        if v.shape == shape and not hasattr(x, "val") and x not in walk.constant:
            whole = tuple(
                t if t and (not d or (len(t) > len(d) and t[: len(d)] == d)) else ()
                for d, t in zip(v.dims, _norm(compute, len(shape)), strict=True)
            )
            if any(whole) and x not in walk.kept_whole:
                walk.slices.setdefault(x, whole)
        if hinted and not walk.xla_claims and not broadcasts:
            # operands of the result's size moved to the wanted layout (what moving the result
            # would move, and shared with the other readers that move them there: Adam's moments)
            reshard(walk, x, v, target, mult, name)
        else:
            _moved(walk, x, v, as_is[id(x)], compute, mult, name)
    out = Val(shape, itemsize(out_aval), _norm(compute, len(shape)))
    walk.count_flops(walk.ctx.local(out) / out.itemsize, mult, name)
    if compute != target:
        out = reshard(walk, outvar, out, target, mult, name)
    return out


def _computed_at(
    walk: Walker, hint: Dims, done: list[tuple[Any, Val]], own: dict[int, Val], shape: tuple[int, ...]
) -> Dims:
    """Where XLA computes an elementwise op its result is wanted elsewhere from: the hint's
    splits, each operand's (the largest first, a broadcast at its operand's size) added on the
    dims still whole where all their axes are free."""
    out = [list(d) for d in _norm(hint, len(shape))]
    used = {a for d in out for a in d}
    for _, v in _largest_first(walk, done, own):
        for i, d in enumerate(_norm(v.dims, len(shape))):
            if d and not out[i] and not used & set(d):
                trial = _tuple([list(d) if k == i else t for k, t in enumerate(out)])
                if _fits(shape, trial, walk.ctx):
                    out[i] = list(d)
                    used |= set(d)
    return _tuple(out)


def _resolved(walk: Walker, x: Any, v: Val, own: Val, hint: Dims | None, mult: int, why: str) -> Val:
    """``v`` (``x`` seen at the result's shape) with its pending sum done. A broadcast operand
    (size-1 dims) is summed at its own size, then seen at the result's: XLA completes the sum
    of the value it has, not of the broadcast it is read as (measured: a softmax's denominators
    split over the keys are all-reduced at (b, h, q), not scattered at (b, h, q, k))."""
    if not v.partial or own.shape == v.shape or len(own.shape) != len(v.shape):
        return resolve(walk, x, v, hint, mult, why)
    target = None
    if hint is not None:
        target = tuple(d if own.shape[i] == v.shape[i] else () for i, d in enumerate(_norm(hint, len(v.shape))))
    return _broadcast(resolve(walk, x, own, target, mult, why), v.shape)


def _largest_first(walk: Walker, done: list[tuple[Any, Val]], own: dict[int, Val]) -> list[tuple[Any, Val]]:
    """An elementwise op's operands, the largest first (a broadcast at its operand's size; ties:
    the most split first)."""

    def real(x: Any) -> int:
        src = None if hasattr(x, "val") else walk.expanded.get(x)
        return math.prod(src[1].shape) if src is not None else math.prod(own[id(x)].shape)

    return sorted(done, key=lambda xv: (-real(xv[0]), -walk.ctx.split_dims(xv[1].dims)))


def _merged(walk: Walker, done: list[tuple[Any, Val]], own: dict[int, Val], shape: tuple[int, ...]) -> Dims:
    """An elementwise op's layout from its operands' (no hint): the largest operand's splits
    kept, each other's added where their axes are free, or in place of a split they extend (a
    broadcast counted at its operand's size; ties: the most split first). Measured: a norm's
    scale split over `data` on the width meets activations split over `data` on the batch; XLA
    gathers the scale (its own bytes), it does not move the activations' split."""

    order = _largest_first(walk, done, own)
    target: list[list[str]] = [[] for _ in shape]
    used: set[str] = set()
    for _, v in order:
        for i, d in enumerate(_norm(v.dims, len(shape))):
            free = [a for a in d if a not in used]
            if (
                free
                and not target[i]
                and _fits(shape, _tuple([free if k == i else t for k, t in enumerate(target)]), walk.ctx)
            ):
                target[i] = free
                used |= set(free)
            elif (
                target[i]
                and len(d) > len(target[i])
                and tuple(d[: len(target[i])]) == tuple(target[i])
                and not used & set(d[len(target[i]) :])
                and _fits(shape, _tuple([list(d) if k == i else t for k, t in enumerate(target)]), walk.ctx)
            ):
                # a split another operand extends (its axes free): the longer one (Shardy merges
                # a dim's shardings where one is a prefix of the other)
                used |= set(d[len(target[i]) :])
                target[i] = list(d)
    return _tuple(target)


def _moved(walk: Walker, x: Any, v: Val, mine: Val, target: Dims, mult: int, why: str) -> None:
    """``v`` (value ``x``, ``mine`` at its own shape) moved to ``target`` for an elementwise op:
    at its own size (size-1 dims carry no split), a broadcast's operand at that operand's size
    where it fits the projected layout."""
    full = _norm(target, len(v.shape))
    if full == v.dims:
        return
    src = None if hasattr(x, "val") else walk.expanded.get(x)
    if src is not None:
        var, sv, bdims = src
        shape = mine.shape
        proj = tuple(full[j] if sv.shape[i] == shape[j] and shape[j] == v.shape[j] else () for i, j in enumerate(bdims))
        if _fits(sv.shape, proj, walk.ctx):
            reshard(walk, var, sv, proj, mult, why)
            return
    if mine.shape != v.shape and len(mine.shape) == len(v.shape):
        reshard(walk, x, mine, tuple(t if mine.shape[i] == v.shape[i] else () for i, t in enumerate(full)), mult, why)
        return
    reshard(walk, x, v, target, mult, why)


def reduce(walk: Walker, eqn: Any, v: Val, mult: int) -> Val:
    axes = tuple(eqn.params.get("axes", ()))
    out_aval = eqn.outvars[0].aval
    kept = [i for i in range(len(v.shape)) if i not in axes]
    reduced = tuple(x for i in axes for x in v.dims[i])
    name = eqn.primitive.name
    out = Val(tuple(out_aval.shape), itemsize(out_aval), tuple(v.dims[i] for i in kept))
    # XLA's cost analysis: one per element reduced (the operand's elements less the result's)
    walk.count_flops(walk.ctx.local(v) / v.itemsize - walk.ctx.local(out) / out.itemsize, mult, name)
    # reduced dims split over different axes: XLA:CPU reduces over each dim's axes in turn
    summed = tuple(frozenset(v.dims[i]) for i in axes if v.dims[i]) if walk.ctx.book.sums_per_dim else ()
    if name == "reduce_sum":
        if len(summed) > 1 and not v.partial:
            walk.sum_dims[eqn.outvars[0]] = summed
        return replace(out, partial=v.partial | frozenset(reduced))
    if v.partial:  # max / min of a pending sum: the sum is done first
        resolve(walk, eqn.invars[0], v, None, mult, name)
    for part in _per_dim(reduced, summed):  # max / min / argmax over a split dim: a small all-reduce
        walk.ctx.add("all-reduce", part, walk.ctx.local(out), mult, name, itemsize=out.itemsize)
    return out


def reshape(walk: Walker, var: Any, v: Val, shape: tuple[int, ...], mult: int) -> Val:
    """Keep a split on the major factor of a merged/split dim; otherwise gather it."""
    out: list[tuple[str, ...]] = [()] * len(shape)
    i = j = 0
    gathered = list(v.dims)
    while i < len(v.shape) and j < len(shape):
        a, b = v.shape[i], shape[j]
        if a == b:
            out[j] = v.dims[i]
            i, j = i + 1, j + 1
            continue
        if b == 1:  # a size-1 dim inserted: the split stays for the dims that follow ([L] -> [1, P, K])
            j += 1
            continue
        if a == 1 and not v.dims[i]:  # a size-1 dim dropped
            i += 1
            continue
        if a > b:  # split dim i into several output dims: the major one keeps the split
            n = walk.ctx.split(v.dims[i])
            if v.dims[i] and b % n == 0:
                out[j] = v.dims[i]
            elif v.dims[i]:
                gathered[i] = ()
            prod = b
            j += 1
            while prod < a and j < len(shape):
                prod *= shape[j]
                j += 1
            i += 1
        else:  # merge dims i.. into output dim j: the major input dim's split carries over
            out[j] = v.dims[i]
            prod = a
            i += 1
            while prod < b and i < len(v.shape):
                if v.dims[i]:
                    gathered[i] = ()
                prod *= v.shape[i]
                i += 1
            j += 1
    if tuple(gathered) != v.dims and not v.partial:
        reshard(walk, var, v, tuple(gathered), mult, "reshape")
    return Val(shape, v.itemsize, tuple(out), v.partial)


def constraint(walk: Walker, eqn: Any, v: Val, mult: int) -> Val:
    """An activation constrained to a layout (``with_sharding_constraint``: a plan's ``act``
    rule, a logical name, the model's own): pending sums resolved onto it (a reduce-scatter
    where it splits a dim the sum leaves whole), then resharded to it."""

    scope = str(getattr(eqn.source_info, "name_stack", ""))
    internal = INTERNAL_SCOPE in scope  # shardplan's own (a pipeline's buffers): kept, not listed
    if walk.ignore_constraints and not internal:
        return v
    target = constraint_target(eqn, v.dims)
    if target is None:
        walk.ctx.unmodeled["sharding_constraint"] = walk.ctx.unmodeled.get("sharding_constraint", 0) + 1
        return v
    dims = _tuple(list(target))
    # An act rule's constraint runs in a named scope, which transforms wrap: jvp(act rule f:8 on m).
    named = re.search(r"act rule \S+ on [^()/]+", scope)
    what = named.group(0) if named else "sharding constraint"
    why = f"{what} (activation constraint)"
    out = to_layout(walk, eqn.invars[0], v, dims, mult, "pipeline buffer" if internal else why)
    if internal:
        return out
    written = ", ".join("_" if not d else d[0] if len(d) == 1 else f"({', '.join(d)})" for d in dims)
    walk.constrained.append(Constrained(what, walk.ctx.source, v.shape, f"({written})", walk.ctx.local(out), mult))
    return out


def stack(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> Val:
    axis = eqn.params["axis"]
    base = max(ins, key=lambda v: walk.ctx.split_dims(v.dims))
    for x, v in zip(eqn.invars, ins, strict=True):
        reshard(walk, x, resolve(walk, x, v, None, mult, "stack"), base.dims, mult, "stack")
    o = eqn.outvars[0]
    return Val(tuple(o.aval.shape), itemsize(o.aval), base.dims[:axis] + ((),) + base.dims[axis:])


def layout_preserving(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """Slices, pads, concatenations: keep splits on dims whose size is unchanged, gather the rest."""
    outs = []
    for o in eqn.outvars:
        shape = tuple(o.aval.shape)
        # A value made in the step from literals alone (a cache of ``jnp.zeros`` a
        # dynamic_update_slice writes) has no layout of its own: XLA splits it the way the
        # other operands are (measured: no collective; it was gathered whole to the zeros').
        same = [(x, v) for x, v in zip(eqn.invars, ins, strict=True) if len(v.shape) == len(shape)]
        made = [v for x, v in same if not (hasattr(x, "val") or x in walk.constant)]
        candidates = made or [v for _, v in same]
        base = candidates[0] if candidates else None
        if base is None:
            outs.append(_replicated(o.aval))
            continue
        dims = [d if base.shape[i] == shape[i] else () for i, d in enumerate(base.dims)]
        for x, v in zip(eqn.invars, ins, strict=True):
            if v is base or len(v.shape) == len(shape):
                v2 = resolve(walk, x, v, None, mult, eqn.primitive.name)
                reshard(
                    walk,
                    x,
                    v2,
                    _tuple([d if v.shape[i] == shape[i] else () for i, d in enumerate(dims)]),
                    mult,
                    eqn.primitive.name,
                )
        outs.append(Val(shape, itemsize(o.aval), _tuple(dims)))
    return outs


def top_k(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """``top_k`` along its last dim: laid out as a slice (that dim gathered), or on its whole
    operand where the compiler cannot split it (``Compiler.whole_top_k``; the results then
    sliced back to the operand's other splits, free)."""
    x, v = eqn.invars[0], ins[0]
    if not walk.ctx.book.whole_top_k or not (v.axes or v.partial):
        return layout_preserving(walk, eqn, ins, mult)
    to_layout(walk, x, v, ((),) * len(v.shape), mult, "top_k")
    kept = (*v.dims[:-1], ())
    return [Val(tuple(o.aval.shape), itemsize(o.aval), kept) for o in eqn.outvars]


def along(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """An op along a dim whose result depends on the whole dim, that dim split (measured on
    single ops): a scan (cumsum and kin) gathers it (its result sliced back, free); a sort
    moves its axes to the largest other dim they divide and its results back (all-to-alls;
    gathered where none does, a 1-D sort); a reverse swaps the blocks between devices (a
    collective-permute of each device's block)."""
    name = eqn.primitive.name
    dim = eqn.params["dimension"] if name == "sort" else eqn.params.get("axis")
    along = tuple(eqn.params["dimensions"]) if name == "rev" else (dim,)
    if not any(ins[0].dims[i] for i in along):
        return layout_preserving(walk, eqn, ins, mult)
    v0 = resolve(walk, eqn.invars[0], ins[0], None, mult, name)
    if name == "rev":
        for x, v in zip(eqn.invars, ins, strict=True):
            walk.ctx.add(
                "collective-permute",
                tuple(a for i in along for a in v.dims[i]),
                walk.ctx.local(v),
                mult,
                name,
                walk.names.get(walk.root(x), ""),
            )
        return [Val(tuple(o.aval.shape), itemsize(o.aval), v0.dims) for o in eqn.outvars]
    dims = [list(d) for d in v0.dims]
    moving = dims[dim]
    dims[dim] = []
    moved = False
    if name == "sort":
        others = sorted(
            (j for j in range(len(dims)) if j != dim and v0.shape[j] % walk.ctx.split((*dims[j], *moving)) == 0),
            key=lambda j: -v0.shape[j],
        )
        if others:
            dims[others[0]] = dims[others[0]] + moving
            moved = True
    target = _tuple(dims)
    for x, v in zip(eqn.invars, ins, strict=True):
        reshard(walk, x, resolve(walk, x, v, None, mult, name), target, mult, name)
    outs = []
    for o in eqn.outvars:
        out = Val(tuple(o.aval.shape), itemsize(o.aval), target)
        if moved and type(o).__name__ != "DropVar":
            # the result laid out as its operand was (Shardy's rule): moved back by all-to-all
            walk.ctx.add("all-to-all", tuple(moving), walk.ctx.local(out), mult, name)
        outs.append(Val(out.shape, out.itemsize, v0.dims) if moved or name != "sort" else out)
    return outs
