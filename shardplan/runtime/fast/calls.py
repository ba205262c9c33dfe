"""Fast mode's rules for structure: calls (walked in place, as XLA inlines them), scans (the body
per trip), shard_map regions, Pallas kernels, fused attention and collectives written by hand.
"""

from __future__ import annotations

import copy
from typing import Any

from shardplan.core.notes import Note
from shardplan.runtime.fast.relayout import reshard, resolve, to_layout
from shardplan.runtime.fast.values import Dims, Val, _Boundary, _norm, _replicated, _spec_dims
from shardplan.runtime.fast.walker import Walker
from shardplan.runtime.kernels import fused_attention_cost, pallas_cost
from shardplan.runtime.primitives import itemsize
from shardplan.runtime.sharding import scan_counts, while_trips

# Collectives written inside shard_map, by the kind XLA names them.
_MANUAL_COLLECTIVES = {
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "psum2": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}


def inline(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
    """A call XLA inlines: its body walked in place (None: no body)."""
    sub = walk.body(eqn)
    if sub is None:
        return None
    for inner_var, outer_var in zip(sub.invars, eqn.invars, strict=False):
        if not hasattr(outer_var, "val"):
            walk.origin[inner_var] = walk.root(outer_var)
        if not hasattr(outer_var, "val") and outer_var in walk.sum_wants:
            walk.sum_wants.setdefault(inner_var, walk.sum_wants[outer_var])
        if hasattr(outer_var, "val") or outer_var in walk.constant:
            walk.constant.add(inner_var)
        else:
            walk.constant.discard(inner_var)
    for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
        if outer_var in walk.hints and not hasattr(inner_var, "val"):
            walk.hints.setdefault(inner_var, walk.hints[outer_var])
        if outer_var in walk.wants and not hasattr(inner_var, "val"):
            walk.wants.setdefault(inner_var, walk.wants[outer_var])
        if outer_var in walk.claimed and not hasattr(inner_var, "val"):
            walk.claimed.setdefault(inner_var, walk.claimed[outer_var])
        if outer_var in walk.back and not hasattr(inner_var, "val"):
            walk.back.setdefault(inner_var, walk.back[outer_var])
        if outer_var in walk.carried and not hasattr(inner_var, "val"):
            walk.carried.setdefault(inner_var, walk.carried[outer_var])
        if outer_var in walk.scattered and not hasattr(inner_var, "val"):
            walk.scattered.setdefault(inner_var, walk.scattered[outer_var])
    outer_call, walk.call_source = walk.call_source, walk.ctx.source
    outer = walk.frame
    assert outer is not None  # equations run inside a jaxpr
    for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
        made = walk.made_beside(outer, outer_var)
        if made is not None and not hasattr(inner_var, "val"):
            walk.siblings[inner_var] = made
    bound = [(i, o) for i, o in zip(sub.invars, eqn.invars, strict=False) if not hasattr(o, "val")]
    boundary = _Boundary(
        frozenset(i for i, o in bound if o in outer.stored),
        {i: outer.soft[o] for i, o in zip(sub.outvars, eqn.outvars, strict=False) if o in outer.soft},
        {} if walk.layouts_only else {i: walk.closure(outer, o) for i, o in bound if o not in outer.stored},
    )
    inner = walk.run(sub, dict(zip(sub.invars, ins, strict=False)), mult, boundary)
    walk.inlined, walk.inlined_peak = eqn, walk.peak_without_outputs
    body = walk.last_frame
    assert body is not None
    for i, o in zip(sub.outvars, eqn.outvars, strict=False):
        if hasattr(i, "val"):
            continue
        if i in body.stored:
            outer.stored.add(o)
        elif o in outer.soft:  # fused in the body and in the caller's readers: one chain
            outer.closures[o] = walk.closure(body, i)
    walk.call_source = outer_call
    for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
        if not hasattr(inner_var, "val") and walk.root(inner_var) is not outer_var:
            walk.origin[outer_var] = walk.root(inner_var)
    return inner


def kernel(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """A Pallas kernel (``kernels.pallas_cost``). XLA cannot split a custom call: outside
    shard_map every device runs it on whole operands (gathered first) and holds the whole result."""
    cost = pallas_cost(eqn)
    why = f"kernel {cost.name}"
    if any(v.axes or v.partial for v in ins):
        walk.ctx.kernels.append(
            Note(
                "kernel-outside-shard-map",
                f"kernel {cost.name} ({walk.ctx.source or 'step'}) runs outside shard_map on split operands: XLA "
                "gathers them whole on every device (wrap the kernel in jax.shard_map to run it on each device's "
                "block)",
                cost.name,
                walk.ctx.source,
            )
        )
    for x, v in zip(eqn.invars, ins, strict=True):
        if v.axes or v.partial:
            to_layout(walk, x, v, ((),) * len(v.shape), mult, why)
    walk.ctx.flops += cost.flops * mult
    walk.ctx.transcendentals += cost.transcendentals * mult
    walk.ctx.hbm += (cost.read + cost.written) * mult
    walk.ctx.kernels.extend(n for n in cost.notes if n not in walk.ctx.kernels)
    return [_replicated(o.aval) for o in eqn.outvars]


def fused_attention(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """cuDNN's flash attention (``kernels.fused_attention_cost``). jax partitions it over the
    batch and the heads: operands keep those splits (a key/value head split only where its
    query's is the same) and are gathered on the others; results take their operands' splits."""
    bnth = str(eqn.params.get("layout", "0")) in ("1", "Layout.BNTH", "BNTH")
    keep = (0, 1) if bnth else (0, 2)  # batch, heads
    q = ins[0]
    target_q = tuple(d if i in keep else () for i, d in enumerate(q.dims))
    moved: list[Val] = []
    for x, v in zip(eqn.invars, ins, strict=True):
        if len(v.shape) == 4 and all(v.shape):
            target = tuple(
                target_q[i] if i in keep and v.shape[i] % walk.ctx.split(target_q[i]) == 0 else () for i in range(4)
            )
        elif len(v.shape) == 3 and all(v.shape):  # the softmax statistics (batch, heads, time)
            target = (target_q[keep[0]], target_q[keep[1]], ())
        else:  # empty placeholders (no bias, no sequence lengths)
            target = ((),) * len(v.shape)
        moved.append(to_layout(walk, x, v, _norm(target, len(v.shape)), mult, "cudnn attention"))
    cost = fused_attention_cost(eqn)
    # Per device: the split of the queries' batch and heads.
    share = walk.ctx.split(tuple(a for i in keep for a in target_q[i]))
    walk.ctx.flops += cost.flops / share * mult
    walk.ctx.transcendentals += cost.transcendentals / share * mult
    walk.ctx.hbm += (sum(walk.ctx.local(v) for v in moved) + cost.written / share) * mult
    outs = []
    for o in eqn.outvars:
        shape = tuple(o.aval.shape)
        src = next((v for v in moved if v.shape == shape and len(shape) == 4), None)
        if src is not None:
            dims = src.dims
        elif len(shape) == 3:  # statistics
            dims = (target_q[keep[0]], target_q[keep[1]], ())
        else:
            dims = ((),) * len(shape)
        outs.append(Val(shape, itemsize(o.aval), _norm(dims, len(shape))))
    return outs


def shard_map(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """A ``jax.shard_map`` region: its operands set to ``in_specs`` over the manual axes (GSPMD's
    reshards; their splits over the axes it leaves automatic are kept), its body run per
    device on local blocks (the collectives in it are the user's own), its results laid out as
    ``out_specs`` plus the body's automatic splits."""
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    manual = set(eqn.params.get("newly_manual_axes") or eqn.params.get("manual_axes") or walk.ctx.mesh)
    env: dict[Any, Val] = {}
    for x, inner, v, spec in zip(eqn.invars, body.invars, ins, eqn.params["in_specs"], strict=True):
        wanted = _spec_dims(spec, len(v.shape))
        auto = tuple(tuple(a for a in d if a not in manual) for d in v.dims)
        to_layout(walk, x, v, tuple(w + a for w, a in zip(wanted, auto, strict=True)), mult, "shard_map in_specs")
        env[inner] = Val(tuple(inner.aval.shape), itemsize(inner.aval), auto)
    results = walk.run(body, env, mult, _Boundary(frozenset(body.invars), {}, {}))
    outs = []
    for o, spec, r in zip(eqn.outvars, eqn.params["out_specs"], results, strict=True):
        dims = _spec_dims(spec, len(o.aval.shape))
        auto = tuple(tuple(a for a in d if a not in manual) for d in r.dims) if len(r.dims) == len(dims) else ()
        if auto:
            dims = tuple(d + a for d, a in zip(dims, auto, strict=True))
        outs.append(Val(tuple(o.aval.shape), itemsize(o.aval), dims, frozenset(r.partial) - manual))
    return outs


def manual_collective(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """A collective the user wrote inside shard_map (``lax.psum``, ``all_gather``, ...), one
    per operand."""
    name = eqn.primitive.name
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if isinstance(a, str))
    kind = _MANUAL_COLLECTIVES[name]
    outs = []
    for v, o in zip(ins, eqn.outvars, strict=True):
        shape = tuple(o.aval.shape)
        out = Val(shape, itemsize(o.aval), v.dims if shape == tuple(v.shape) else ((),) * len(shape))
        walk.ctx.add(
            kind,
            axes,
            walk.ctx.local(out) if kind == "all-gather" else walk.ctx.local(v),
            mult,
            f"shard_map {name}",
        )
        outs.append(out)
    return outs


def scan(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    length = int(eqn.params["length"])
    body = eqn.params["jaxpr"].jaxpr

    nc, ncarry = scan_counts(eqn)
    env: dict[Any, Val] = {}
    # For the ledger's rows only: a layer's slice of a stacked param is the param its gathers
    # move, the body's slice of a stacked gradient the param its sums update.
    for var, outer in zip(body.invars, eqn.invars, strict=True):
        name = "" if hasattr(outer, "val") else walk.names.get(walk.root(outer)) or walk.labels.get(outer, "")
        if name:
            walk.labels.setdefault(var, name)
    for inner, outer in zip(body.outvars[ncarry:], eqn.outvars[ncarry:], strict=True):
        param = walk.updates.get(outer) or walk.labels.get(outer)
        if param and not hasattr(inner, "val"):
            walk.labels.setdefault(inner, param)
    for k, (var, v) in enumerate(zip(body.invars, ins, strict=True)):
        if k < nc:
            walk.invariant[var] = mult
        if k >= nc + ncarry:  # scanned over: the body sees one slice (the leading dim dropped)
            v = Val(v.shape[1:], v.itemsize, v.dims[1:], v.partial)
        claim = walk.claimed.get(var) if walk.xla_claims and not v.partial else None
        if (
            claim is not None
            and len(claim) == len(v.dims)
            and all(set(d) <= set(c) for d, c in zip(v.dims, claim, strict=True))
        ):
            # XLA's propagation splits the loop's slice further (a weight's rows over the axis
            # the activations' width is split over): slicing is free, the body sees that layout
            v = Val(v.shape, v.itemsize, tuple(tuple(c) for c in claim))
        env[var] = v
    # what the loop reads but does not carry (a layer's slices of stacked weights, weights it reads
    # whole) seeds its sums' layouts
    walk.seed_sum_wants(body, env, {var for k, var in enumerate(body.invars) if not nc <= k < nc + ncarry})
    carries = zip(body.outvars[:ncarry], body.invars[nc : nc + ncarry], strict=True)
    walk.carry_wants(body, {out: env[var].dims for out, var in carries})
    for inner, o in zip(body.outvars[ncarry:], eqn.outvars[ncarry:], strict=True):
        hint = walk.hints.get(o)
        if hint is not None and len(hint) == len(o.aval.shape) and not hasattr(inner, "val"):
            walk.scattered.setdefault(inner, tuple(hint[1:]))
    outs = walk.run_loop(body, env, mult * length)
    result = list(outs[:ncarry])
    for o, inner, v in zip(eqn.outvars[ncarry:], body.outvars[ncarry:], outs[ncarry:], strict=True):
        # Stacked outputs; a pending sum wanted split (a layer's weight gradient under FSDP)
        # is reduce-scattered in each iteration, so the stack is held split.
        hint = walk.hints.get(o)
        if v.partial and hint is not None and len(hint) == len(v.shape) + 1:
            v = resolve(walk, inner, v, hint[1:], mult * length, "scan")
        result.append(Val(tuple(o.aval.shape), v.itemsize, ((),) + v.dims, v.partial))
    return result


def _branch_env(jaxpr: Any, ins: list[Val]) -> dict[Any, Val]:
    """A branch's or loop body's environment: its operands' layouts, its constants whole."""
    env: dict[Any, Val] = dict(zip(jaxpr.invars, ins, strict=True))
    for c in jaxpr.constvars:
        env[c] = _replicated(c.aval)
    return env


def cond(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """``lax.cond`` / ``lax.switch``: XLA partitions every branch with the operands' layouts, and the
    program holds them all; which one runs depends on the data. Each branch is walked once (its
    collectives and FLOPs counted, as exact mode reads the program: every branch once; the peak is
    the largest branch's), its pending sums done at its end, and its results moved to the first
    branch's layouts (the conditional's)."""
    ops = ins[1:]  # the branch index first
    first: list[Val] | None = None
    for branch in eqn.params["branches"]:
        jaxpr = branch.jaxpr
        for inner, outer in zip(jaxpr.outvars, eqn.outvars, strict=True):
            if outer in walk.hints and not hasattr(inner, "val"):
                walk.hints.setdefault(inner, walk.hints[outer])
        outs = walk.run(jaxpr, _branch_env(jaxpr, ops), mult)
        done = []
        for k, (var, v) in enumerate(zip(jaxpr.outvars, outs, strict=True)):
            target = None if first is None else first[k].dims
            if v.partial or (target is not None and v.dims != target):
                v = to_layout(walk, var, v, v.dims if target is None else target, mult, "cond")
            done.append(v)
        first = first if first is not None else done
    assert first is not None  # a conditional has a branch
    return first


def while_loop(walk: Walker, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
    """``lax.while_loop``: the body walked once per trip where the jaxpr fixes the trip count
    (``sharding.while_trips``), else once, and said so in the step's notes; the condition once per
    trip and once more. The carry takes the layout the body first reads it in where that only
    splits it further (:func:`_read_layouts`: XLA's propagation gives the loop's state the layout of
    its readers, so a row-parallel matmul's sum is reduce-scattered onto the split its next trip
    reads, and the state leaves the loop split), else its initial one: the initial value sliced to
    it once, the body's results moved back to it in each trip (pending sums done), reshards of the
    body's constants hoisted out of the loop (as XLA does with a scan's)."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_j, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    trips = while_trips(eqn)
    if trips is None:
        walk.ctx.loops.append(walk.ctx.source)
    runs = mult * (1 if trips is None else trips)
    for var in body.invars[:nb]:
        walk.invariant[var] = mult
    env = _branch_env(body, list(ins[nc:]))
    reads = _read_layouts(walk, body, env, runs, body.invars[nb:])
    init = [
        v if read is None else reshard(walk, x, v, read, mult, "while")
        for x, v, read in zip(eqn.invars[nc + nb :], ins[nc + nb :], reads, strict=True)
    ]
    for out_var, read in zip(body.outvars, reads, strict=True):
        if read is not None and not hasattr(out_var, "val"):  # the next trip reads it so: made so
            walk.hints.setdefault(out_var, read)
    outs = walk.run_loop(body, _branch_env(body, list(ins[nc : nc + nb]) + init), runs)
    for var, v, start in zip(body.outvars, outs, init, strict=True):
        if v.partial or v.dims != start.dims:
            to_layout(walk, var, v, start.dims, runs, "while")
    walk.run(cond_j, _branch_env(cond_j, list(ins[:nc]) + init), runs + mult)
    return [Val(v.shape, v.itemsize, v.dims) for v in init]


def _read_layouts(walk: Walker, body: Any, env: dict[Any, Val], runs: int, carried: list[Any]) -> list[Dims | None]:
    """Per carried value of a loop body, the layout the body's equations read it in where that is
    one layout that only adds splits to the one it has (a matmul slicing the state over the axis its
    weight's rows are split on), else None: from a walk of the body on a scratch copy of the walker
    (its collectives, traffic and layouts thrown away)."""
    scratch = copy.copy(walk)
    for name, value in vars(walk).items():
        if isinstance(value, dict | set | list):
            setattr(scratch, name, type(value)(value))
    ctx = copy.copy(walk.ctx)
    for name, value in vars(walk.ctx).items():
        if isinstance(value, dict | set | list):
            setattr(ctx, name, type(value)(value))
    scratch.ctx = ctx
    scratch.layouts_only = True
    scratch.run(body, dict(env), runs)
    out: list[Dims | None] = []
    for var in carried:
        start = env[var].dims
        ident = id(scratch.root(var))
        wanted = {k[2] for k in ctx.cache if k[0] == "reshard" and k[1][0] == ident and k[2] != start}
        finer = [t for t in wanted if all(set(s) <= set(d) for s, d in zip(start, t, strict=True))]
        out.append(finer[0] if len(wanted) == 1 and finer else None)
    return out
