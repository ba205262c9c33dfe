"""Pipelines: a scanned stack of layers run in stages over a mesh axis, microbatched.

The plan's ``pipeline AXIS, microbatches = M, schedule = S, repeats = V`` statement and param
rules that split the stacked (leading) dim of a model's layers over ``AXIS`` are all it takes:
the model keeps its single-device code (layers stacked with ``nnx.vmap`` and run by
``nnx.scan``). :func:`wrap` turns the loss into one that traces the model's step, finds the
``scan`` whose stacked inputs are the stage-split params (by the arrays it iterates over, never by
names), and evaluates the traced program with that scan replaced by the schedule of
:mod:`shardplan.core.pipeline`, in one SPMD program as MaxText runs it:

- the stacked inputs ``[L, ...]`` are viewed as ``[V, P, K, ...]`` (chunk ``r*P + s`` on stage
  ``s``); with ``V = 1`` (GPipe) that view is the stage split itself, so nothing moves;
- the carried activations (and any loop constant with a batch dim) are cut into ``M``
  microbatches along the dim that grows with the batch (found by tracing the step again at twice
  the batch, so it works whatever the model calls its inputs), rows ``j*M + i`` in microbatch
  ``i``, so that a batch split over data stays split the same way in every microbatch;
- a loop of ``V*M + P - 1`` steps: every stage runs its current chunk (``jax.vmap`` over the stage
  dim, ``spmd_axis_name`` = the axis, so XLA keeps each stage's work on its devices), then the
  stage buffer shifts one stage on (``jnp.roll``: a collective permute over the axis); stage 0
  takes the next microbatch, or (circular) a microbatch back from the last stage;
- idle stage-steps (the bubble) compute on stale, finite activations whose results are never
  read, so they add nothing to the loss or the gradients.

The backward pass is JAX's transpose of that loop: the schedule in reverse. Outputs of the stack
that do not depend on the batch (NNX's scan returns the layers' own state) are computed by a
plain scan over the layers, which XLA removes when they are the inputs passed through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import core as jcore  # eval_jaxpr's pieces: Literal, the source-info context
from jax._src import source_info_util
from jax.extend import core as jex
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.core.pipeline import problems
from shardplan.core.plan import Pipeline
from shardplan.errors import ShardPlanError, as_error, error
from shardplan.runtime.primitives import CALLS, named
from shardplan.runtime.sources import INTERNAL_SCOPE

# Calls followed on the way to the stack's scan: plain calls only (not remat regions or custom
# derivatives), as before the catalogue.
_CALLS = CALLS - named(traits=("remat",)) - {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


@dataclass(frozen=True)
class Stack:
    """Where the pipelined scan is: eqn indices from the top jaxpr down through calls."""

    path: tuple[int, ...]


def stage_split(resolved: Any, axis: str) -> list[bool]:
    """Per state leaf of a resolution (``specs.Resolved``): is its leading dim split over the
    pipeline's axis (a stage holds a part of it)?"""
    from shardplan.core.leaves import records

    return [bool(d.spec.dims) and axis in d.spec.dims[0] for d in records(resolved.decisions)]


def _err(code: str, msg: str, hint: str, p: Pipeline) -> ShardPlanError:
    at = dict(span=p.span, source_line=p.source_line or None) if p.span is not None else dict(path="pipeline")
    return as_error([error(code, msg, hint, **at)])


def _eqn_jaxpr(eqn: Any) -> Any:
    j = eqn.params.get("jaxpr")
    return getattr(j, "jaxpr", j)


def pipelined(plan: Any, loss_fn: Any, mesh: dict[str, int], params: Any, where: Any) -> Any:
    """``loss_fn`` with the plan's pipeline applied (itself without one): the one program both
    backends run, in training (``where``: the placement's mesh) and in costing (the abstract
    mesh); ``params``: the plan's resolution of the model's params."""
    p = plan.pipeline
    if p is None:
        return loss_fn
    return wrap(loss_fn, p, mesh[p.axis], where, stage_split(params, p.axis), plan.batch_dim0_axes)


def find_stack(jaxpr: Any, split: Sequence[bool], p: Pipeline) -> Stack:
    """The scan whose iterated inputs are the stage-split params (followed through calls)."""
    marked = {v for v, s in zip(jaxpr.invars, split) if s}
    want = len(marked)
    found: list[tuple[tuple[int, ...], int]] = []

    def walk(j: Any, marks: set, path: tuple[int, ...]) -> None:
        for n, eqn in enumerate(j.eqns):
            hits = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jcore.Literal) and v in marks]
            if not hits:
                continue
            name = eqn.primitive.name
            if name == "scan":
                first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
                found.append((path + (n,), sum(1 for i in hits if i >= first_xs)))
            elif name in _CALLS:
                inner = _eqn_jaxpr(eqn)
                walk(inner, {inner.invars[i] for i in hits}, path + (n,))

    walk(jaxpr, marked, ())
    full = [path for path, k in found if k == want]
    if not full:
        best = max((k for _, k in found), default=0)
        raise _err(
            "pipeline-layers",
            f"the {want} params split over '{p.axis}' on their first dim are not the stacked inputs of one scan"
            + (f" (at most {best} of them reach one)" if found else " (no scan iterates over them)"),
            f"a pipeline runs a scanned stack: stack the layers with nnx.vmap and run them with nnx.scan, and "
            f"split only the stacked (first) dim of those layers' params over '{p.axis}'",
            p,
        )
    return Stack(full[0])


def _depends(j: Any, seeds: Sequence[bool]) -> list[bool]:
    """Per output of jaxpr ``j``: does it depend on an input marked in ``seeds``? (through calls)"""
    dep = {v for v, s in zip(j.invars, seeds) if s}
    for eqn in j.eqns:
        ins = [not isinstance(v, jcore.Literal) and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        inner = _eqn_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
            outs = _depends(inner, ins)
        else:
            outs = [True] * len(eqn.outvars)
        dep.update(v for v, d in zip(eqn.outvars, outs) if d)
    return [not isinstance(v, jcore.Literal) and v in dep for v in j.outvars]


def _eqn_at(jaxpr: Any, path: tuple[int, ...]) -> Any:
    eqn = jaxpr.eqns[path[0]]
    for n in path[1:]:
        eqn = _eqn_jaxpr(eqn).eqns[n]
    return eqn


def batch_dims(small: Any, large: Any, path: tuple[int, ...]) -> list[int | None]:
    """Per input of the scan: the dim that grows with the batch (traced at two batch sizes)."""
    a, b = _eqn_at(small, path), _eqn_at(large, path)
    if a.primitive.name != b.primitive.name or len(a.invars) != len(b.invars):
        raise ValueError("the step's structure changes with the batch size")
    out: list[int | None] = []
    for x, y in zip(a.invars, b.invars):
        sa, sb = getattr(x.aval, "shape", ()), getattr(y.aval, "shape", ())
        grown = [d for d, (u, w) in enumerate(zip(sa, sb)) if u != w]
        out.append(grown[0] if grown else None)
    return out


# -- the schedule, on values --------------------------------------------------------------


def _split(x: jax.Array, d: int, m: int) -> jax.Array:
    """[.., B, ..] (batch on dim d) -> [M, B/M, ..]: microbatch i holds rows j*M + i."""
    x = jnp.moveaxis(x, d, 0)
    x = x.reshape((x.shape[0] // m, m) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def _join(y: jax.Array, d: int) -> jax.Array:
    y = jnp.swapaxes(y, 0, 1)
    y = y.reshape((y.shape[0] * y.shape[1],) + y.shape[2:])
    return jnp.moveaxis(y, 0, d)


def _pin(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A constraint of shardplan's own (not the user's: reports leave it out)."""
    with jax.named_scope(INTERNAL_SCOPE):
        return jax.lax.with_sharding_constraint(x, sharding)


def _free(x: jax.Array, mesh: Any) -> jax.Array:
    return _pin(x, NamedSharding(mesh, P(*[P.UNCONSTRAINED] * x.ndim)))


def _shift(x: jax.Array, mesh: Any, axis: str, stages: int) -> jax.Array:
    """Stage s's block to stage s+1 (the last one's to stage 0): one collective permute over the
    axis, written as one (a shard_map manual over that axis alone, the other axes left to XLA)."""
    perm = [(s, (s + 1) % stages) for s in range(stages)]
    spec = P(axis)
    f = jax.shard_map(
        lambda b: jax.lax.ppermute(b, axis, perm),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        axis_names={axis},
        check_vma=False,
    )
    return f(x)


def circular_rounds(stages: int, repeats: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """How a circular pipeline's chunks reach their stages from the at-rest layout (stage d holds
    the contiguous chunks d*V .. d*V+V-1; chunk c runs on stage c mod P as its pass c div P): V
    rounds, each one collective permute in which every stage sends one chunk and receives one.
    Per round: (the chunk offset each stage sends, where it sends it, the pass slot each stage
    puts what it receives in). The sends form a V-regular bipartite multigraph between stages,
    cut into V perfect matchings (each found by augmenting paths)."""
    edges = {d: [(d * repeats + i) for i in range(repeats)] for d in range(stages)}  # chunks still to send
    rounds = []
    for _ in range(repeats):
        match: dict[int, int] = {}  # destination stage -> source stage
        for d in range(stages):
            _augment(edges, stages, match, d, set())
        sent = {d: t for t, d in match.items()}
        chunk = {d: next(c for c in edges[d] if c % stages == sent[d]) for d in range(stages)}
        for d in range(stages):
            edges[d].remove(chunk[d])
        rounds.append(
            (
                tuple(chunk[d] - d * repeats for d in range(stages)),
                tuple(sent[d] for d in range(stages)),
                tuple(chunk[match[t]] // stages for t in range(stages)),
            )
        )
    return rounds


def _augment(edges: dict[int, list[int]], stages: int, match: dict[int, int], d: int, seen: set[int]) -> bool:
    """One augmenting path from source stage ``d`` (Kuhn's bipartite matching) into ``match``."""
    for c in edges[d]:
        t = c % stages
        if t in seen:
            continue
        seen.add(t)
        if t not in match or _augment(edges, stages, match, match[t], seen):
            match[t] = d
            return True
    return False


def _circular(x: jax.Array, mesh: Any, axis: str, stages: int, repeats: int, k: int) -> jax.Array:
    """[L, ..] split over the stage axis (contiguous chunks) -> [V, P, K, ..] with chunk r*P + s on
    stage s: V collective permutes of one chunk per stage (``circular_rounds``), written as such (a
    shard_map manual over the stage axis alone) so that the step moves each chunk once."""
    rounds = circular_rounds(stages, repeats)
    # Per stage (a row each, split over the axis with the params, so the region reads its own with
    # static indices): which of its chunks it sends in each round, and for each pass the round
    # that brings that pass's chunk.
    starts = jnp.asarray([[off[d] for off, _, _ in rounds] for d in range(stages)], jnp.int32)
    which = jnp.asarray(
        [
            [next(m for m, (_, _, slots) in enumerate(rounds) if slots[t] == r) for r in range(repeats)]
            for t in range(stages)
        ],
        jnp.int32,
    )

    def local(b: jax.Array, start: jax.Array, pick: jax.Array) -> jax.Array:  # b: this stage's V*K layers
        # Only ops on what the region is given (static slices, selects by the tables): the shard_map
        # backend's partitioner re-binds this region's ops under its own, all-manual mesh.
        chunks = [jax.lax.slice_in_dim(b, i * k, (i + 1) * k, axis=0) for i in range(repeats)]
        got = [
            jax.lax.ppermute(
                jax.lax.select_n(jax.lax.index_in_dim(start[0], m, 0, False), *chunks),
                axis,
                [(d, t) for d, t in enumerate(dest)],
            )
            for m, (_, dest, _) in enumerate(rounds)
        ]
        passes = [jax.lax.select_n(jax.lax.index_in_dim(pick[0], r, 0, False), *got) for r in range(repeats)]
        return jnp.stack(passes)[:, None]

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(axis), P(axis), P(axis)),
        out_specs=P(None, axis),
        axis_names={axis},
        check_vma=False,
    )
    return f(x, starts, which)


def _on_stages(x: jax.Array, mesh: Any, axis: str, dim: int = 0, rows: tuple[str, ...] = ()) -> jax.Array:
    """``x`` with dim ``dim`` on the stage axis and, given ``rows``, the dim after it (a block of
    microbatch rows) over the batch's axes; the other dims left to the partitioner."""
    spec: list[Any] = [P.UNCONSTRAINED] * x.ndim
    spec[dim] = axis
    if rows:
        spec[dim + 1] = rows
    return _pin(x, NamedSharding(mesh, P(*spec)))


def _by_rows(x: jax.Array, mesh: Any, rows: tuple[str, ...]) -> jax.Array:
    """A buffer of microbatches [M, B/M, ..]: dim 0 whole, each microbatch's rows over the batch's
    axes (as ``_split`` leaves them), the other dims left to the partitioner."""
    if not rows:
        return x
    spec: list[Any] = [None, rows] + [P.UNCONSTRAINED] * (x.ndim - 2)
    return _pin(x, NamedSharding(mesh, P(*spec)))


def run_stack(
    eqn: Any,
    args: Sequence[Any],
    dims: Sequence[int | None],
    p: Pipeline,
    stages: int,
    mesh: Any,
    micro: Any,
    rows: tuple[str, ...] = (),
) -> list[Any]:
    """The scan ``eqn`` on ``args``, run as the pipeline's schedule: its outputs (carry, ys).
    ``micro``: the same scan traced at one microbatch (its body runs each stage's layers)."""
    prm = eqn.params
    nc, nk = prm["num_consts"], prm["num_carry"]
    body: Any = prm["jaxpr"]  # ClosedJaxpr, at the whole batch
    mbody: Any = micro.params["jaxpr"]  # the same layer at one microbatch's shapes
    consts, carry, xs = list(args[:nc]), list(args[nc : nc + nk]), list(args[nc + nk :])
    cdims, kdims = list(dims[:nc]), list(dims[nc : nc + nk])
    length, m, v, s_ = prm["length"], p.microbatches, p.repeats, stages
    batch = next((c.shape[d] for c, d in zip(carry, kdims) if d is not None), None)
    if prm["reverse"]:
        raise _err("pipeline-layers", "the stacked layers are scanned in reverse", "scan the layers forward", p)
    if any(d is None for d in kdims):
        bad = [c.shape for c, d in zip(carry, kdims) if d is None]
        raise _err(
            "pipeline-layers",
            f"the scanned layers carry a value without a batch dim ({', '.join(map(str, bad))}): a pipeline "
            "runs each microbatch through the layers on its own",
            "carry only the activations through the layers (return per-layer results as the scan's outputs)",
            p,
        )
    diags = problems(p, s_, layers=length, batch=batch)
    if diags:
        raise as_error(diags)
    ys_dep = _depends(body.jaxpr, [d is not None for d in cdims] + [True] * nk + [False] * len(xs))[nk:]
    if any(ys_dep):
        raise _err(
            "pipeline-layers",
            "the scanned layers return a per-layer value computed from the batch",
            "a pipeline carries only the activations between stages: return such values through the carry, "
            "or leave these layers out of the pipeline",
            p,
        )
    k = length // (s_ * v)

    def layer(cs: list, h: list, x: list) -> list:
        out = jex.jaxpr_as_fun(mbody)(*cs, *h, *x)
        return list(out[:nk])

    def chunk(ws: list, h: list, cb: list) -> list:
        """One stage's chunk: its K layers over one microbatch (cb: its batched consts)."""
        it = iter(cb)
        cs = [next(it) if d is not None else c for c, d in zip(consts, cdims)]

        def one(hh, ww):
            # Pinned: inside the stage vmap this is the stage split (spmd_axis_name) on each layer's slice,
            # which XLA otherwise gathers whole in the loop.
            return layer(cs, hh, [_free(w, mesh) for w in ww]), None

        h, _ = jax.lax.scan(one, h, ws)
        return h

    on_stages = jax.vmap(chunk, in_axes=(0, 0, 0), spmd_axis_name=p.axis)
    # [L, ..] -> [V, P, K, ..]: chunk r*P + s on stage s.
    if v > 1:  # the at-rest chunks are contiguous per stage: each moves to the stage that runs it, once
        ws = [_on_stages(_circular(x, mesh, p.axis, s_, v, k), mesh, p.axis, 1) for x in xs]
    else:
        ws = [_on_stages(x.reshape((v, s_, k) + x.shape[1:]), mesh, p.axis, 1) for x in xs]
    bdims = [d for d in kdims if d is not None]  # every carry has one (checked above)
    mb = [_split(c, d, m) for c, d in zip(carry, bdims)]  # [M, B/M, ..]
    mbc = [_split(c, d, m) for c, d in zip(consts, cdims) if d is not None]
    stage = jnp.arange(s_)

    def pick(x: jax.Array, i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)

    def step(state, t):
        buf, back, outs = state
        live = jnp.clip(t - stage, 0, v * m - 1)  # per stage: its pass of the schedule (clipped when idle)
        mbi, rep = live % m, live // m
        if v > 1:  # stage 0 takes a new microbatch, or one back from the last stage for its next pass
            fresh = [jnp.where(t < m, pick(x, t % m), pick(b, t % m)) for x, b in zip(mb, back)]
        else:
            fresh = [pick(x, t % m) for x in mb]
        buf = [jnp.where((stage == 0).reshape((s_,) + (1,) * f.ndim), f[None], b) for f, b in zip(fresh, buf)]
        if v > 1:  # per stage, its chunk of this pass: a one-hot contraction over repeats, local to the
            # stage (its backward keeps the [V, P] mask, not one broadcast to the weights' shape)
            hot = jnp.arange(v)[:, None] == rep[None, :]  # [V, P]
            w_s = [_on_stages(jnp.einsum("vp,vp...->p...", hot.astype(w.dtype), w), mesh, p.axis) for w in ws]
        else:
            w_s = [w[0] for w in ws]
        c_s = [_on_stages(jax.vmap(pick, in_axes=(None, 0))(c, mbi), mesh, p.axis, 0, rows) for c in mbc]
        new = [_on_stages(n, mesh, p.axis, 0, rows) for n in on_stages(w_s, buf, c_s)]
        j = t - (s_ - 1)  # the last stage's pass
        jl = jnp.clip(j, 0, v * m - 1)
        done = (j >= 0) & (j < v * m)
        # The last stage's block, on every stage (the head runs everywhere): a masked sum over the
        # stage dim, one all-reduce over the axis.
        at_last = stage == s_ - 1
        last = [jnp.where(at_last.reshape((s_,) + (1,) * (n.ndim - 1)), n, 0).sum(0) for n in new]
        slot = jl % m
        outs = [
            _by_rows(o.at[slot].set(jnp.where(done & (jl // m == v - 1), x, pick(o, slot))), mesh, rows)
            for o, x in zip(outs, last)
        ]
        if v > 1:
            back = [
                _by_rows(b.at[slot].set(jnp.where(done & (jl // m < v - 1), x, pick(b, slot))), mesh, rows)
                for b, x in zip(back, last)
            ]
        buf = [_on_stages(_shift(n, mesh, p.axis, s_), mesh, p.axis, 0, rows) for n in new]
        return (buf, back, outs), None

    # Every stage starts on real rows (microbatch 0), so idle steps compute on finite values.
    buf0 = [_on_stages(jnp.broadcast_to(x[0], (s_,) + x.shape[1:]), mesh, p.axis, 0, rows) for x in mb]
    back0 = [_by_rows(jnp.zeros_like(x), mesh, rows) for x in mb] if v > 1 else []
    outs0 = [_by_rows(jnp.zeros_like(x), mesh, rows) for x in mb]
    (_, _, outs), _ = jax.lax.scan(step, (buf0, back0, outs0), jnp.arange(p.iterations(s_)))
    final = [_join(o, d) for o, d in zip(outs, bdims)]
    ys = _layer_outputs(body, nc, nk, consts, cdims, carry, xs)
    return final + ys


def _layer_outputs(body: Any, nc: int, nk: int, consts: list, cdims: list, carry: list, xs: list) -> list:
    """The scan's per-layer outputs that do not depend on the batch, mapped over the layers."""
    n_ys = len(body.jaxpr.outvars) - nk
    if not n_ys:
        return []
    used = [False] * nk + [True] * n_ys
    j, used_in = pe.dce_jaxpr(body.jaxpr, used, instantiate=False)
    ins_c = [c for c, u in zip(consts, used_in[:nc]) if u]
    ins_k = [c for c, u in zip(carry, used_in[nc : nc + nk]) if u]
    xs_u = [x for x, u in zip(xs, used_in[nc + nk :]) if u]
    if ins_k or any(u and d is not None for u, d in zip(used_in[:nc], cdims)):
        raise AssertionError("a batch-free output reads the batch")  # _depends said it does not
    closed = jex.ClosedJaxpr(j, body.consts)

    def one(*x):
        return jex.jaxpr_as_fun(closed)(*ins_c, *x)

    # Independent of the carry, so layer by layer is a map: vmapped, the stage split of the layer dim
    # stays where it is (a scan would slice it layer by layer, and XLA gathers it whole for that).
    if not xs_u:
        return [jnp.broadcast_to(y, (xs[0].shape[0],) + jnp.shape(y)) for y in one()]
    return list(jax.vmap(one)(*xs_u))


# -- the traced step, evaluated with the stack pipelined --------------------------------


def _eval(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], path: tuple[int, ...], run: Callable[[Any, list], list]
) -> list:
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for n, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        if path and n == path[0]:
            if len(path) == 1:
                outs = run(eqn, ins)
            else:
                inner = eqn.params["jaxpr"]
                outs = _eval(inner.jaxpr, inner.consts, ins, path[1:], run)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                ans = eqn.primitive.bind(*ins, **params)
            outs = ans if eqn.primitive.multiple_results else [ans]
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _resized(batch: Any, num: int, den: int) -> Any:
    """The batch's shapes with the leading dim scaled by num/den."""

    def grow(x: Any) -> Any:
        shape = tuple(getattr(x, "shape", ()))
        if not shape:
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return jax.ShapeDtypeStruct((shape[0] * num // den,) + shape[1:], x.dtype)

    return jax.tree.map(grow, batch)


def wrap(
    loss_fn: Callable[[Any, Any], jax.Array],
    p: Pipeline,
    stages: int,
    mesh: Any,
    split: Sequence[bool],
    batch_axes: tuple[str, ...] = (),
) -> Callable[[Any, Any], jax.Array]:
    """``loss_fn(model, batch)`` with the model's stage-split scanned layers run as ``p``'s pipeline
    on ``mesh`` (a Mesh or an AbstractMesh); ``split``: per model state leaf, whether the plan splits
    its leading dim over the pipeline's axis (:func:`stage_split`); ``batch_axes``: the mesh axes the
    plan splits the batch's rows over (each microbatch is split the same way)."""
    split = list(split)

    def pipelined(model: Any, batch: Any) -> jax.Array:
        gdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        if len(leaves) != len(split):
            raise AssertionError("the model's state does not match the placement")

        def f(ls: list, b: Any):
            m = nnx.merge(gdef, jax.tree.unflatten(treedef, ls))
            loss = loss_fn(m, b)
            return loss, jax.tree.leaves(nnx.state(m))

        closed = jax.make_jaxpr(f)(leaves, batch)
        stack = find_stack(closed.jaxpr, split + [False] * (len(closed.jaxpr.invars) - len(split)), p)
        rows = sorted({x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)})
        if rows and rows[0] % p.microbatches:
            raise as_error(problems(p, stages, batch=rows[0]))
        batch_split = math.prod(dict(mesh.shape)[a] for a in batch_axes)
        if rows and problems(p, stages, batch=rows[0], batch_split=batch_split):
            raise as_error(problems(p, stages, batch=rows[0], batch_split=batch_split))
        large = jax.make_jaxpr(f)(leaves, _resized(batch, 2, 1))
        micro = jax.make_jaxpr(f)(leaves, _resized(batch, 1, p.microbatches))
        try:
            dims = batch_dims(closed.jaxpr, large.jaxpr, stack.path)
            batch_dims(closed.jaxpr, micro.jaxpr, stack.path)
        except ValueError as e:
            raise _err(
                "pipeline-batch",
                f"cannot find the batch dim of the layers' inputs: {e}",
                "the model's step must have the same structure at every batch size",
                p,
            ) from None
        micro_eqn = _eqn_at(micro.jaxpr, stack.path)

        def run(eqn: Any, ins: list) -> list:
            return run_stack(eqn, ins, dims, p, stages, mesh, micro_eqn, batch_axes)

        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves((leaves, batch)), stack.path, run)
        loss, new_leaves = outs[0], outs[1:]
        nnx.update(model, jax.tree.unflatten(treedef, new_leaves))
        return loss

    pipelined.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return pipelined
