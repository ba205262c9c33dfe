"""Fast mode's entry points: a plan's step cost from a traced step (``step_cost``, ``cost``), and
the collectives one function's equations need under given input layouts (``propagate_function``,
for rule tests).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from shardplan.core.leaves import records
from shardplan.core.notes import Note
from shardplan.core.stepcost import Communication, Constrained, Memory, StepCost
from shardplan.core.timing import combined, combined_launches
from shardplan.ledger import merged
from shardplan.runtime import gather_reuse
from shardplan.runtime.fast.books import COMPILERS
from shardplan.runtime.fast.relayout import reshard, resolve
from shardplan.runtime.fast.rules import RULE_BOOK
from shardplan.runtime.fast.values import Dims, Val, _Ctx, _norm, _replicated, tiled_bytes
from shardplan.runtime.fast.walker import Walker
from shardplan.runtime.primitives import itemsize
from shardplan.runtime.sharding import update_paths
from shardplan.runtime.tracing import Resolution, Trace, trace_key


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a plan is propagated: the walk makes many small
    short-lived objects, and each collection of the oldest generation walks every object the
    traced step holds (measured on gpt_small, re-costing gpt_2d.splan: 63.7 ms best and 75.9 ms
    mean with it on, 56.8 and 60.5 ms with it off). The next collection comes after the walk's
    objects are freed: it finds few young ones, and what the walk left in cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def step_cost(
    tracer: Any,
    plan: Any,
    mesh: dict[str, int],
    *,
    delta: bool = True,
    compiler: str = "cpu",
    propagation: str = "shardplan",
) -> StepCost:
    """The auto backend's step cost in fast mode (the backend registry's entry): ``plan``
    resolved once and propagated through the step ``tracer`` (a ``tracing.Tracer``) traced once
    per trace key. ``delta``: also what the step's constraints change. ``compiler``: the platform
    whose compiler's program is predicted (``cpu``, ``cuda``, ``tpu``: :data:`COMPILERS`).
    ``propagation``: whose layouts the walker partitions (see :func:`cost`)."""
    t0 = time.perf_counter()
    res = tracer.resolve(plan, mesh)
    traced = tracer.step(plan, mesh, res)
    got = cost(traced, plan, mesh, delta=delta, res=res, compiler=compiler, propagation=propagation)
    return replace(got, seconds=time.perf_counter() - t0)


def chosen(
    tracer: Any, plan: Any, mesh: dict[str, int], compiler: str = "cpu"
) -> list[tuple[str, str, tuple[int, ...], Dims]]:
    """Fast mode's layout of every value it computes (those without a pending sum), in program
    order: (source line, primitive, shape, per-dim axes), to set beside XLA's
    (``core.hlo.shardings.layouts``) where the two go different ways."""
    res = tracer.resolve(plan, mesh)
    seen: list = []
    cost(tracer.step(plan, mesh, res), plan, mesh, delta=False, res=res, compiler=compiler, seen=seen)
    return [(src, op, v.shape, v.dims) for src, op, outs in seen for v in outs if not v.partial]


def _xla_claims(traced: Trace, plan: Any, mesh: dict[str, int], res: Resolution) -> dict[Any, Dims]:
    """Each value of the traced step as Shardy's propagation lays it out under ``plan`` (the
    trace's module imported once, kept in its memo), by variable."""
    from shardplan.runtime import shardy
    from shardplan.runtime.tracing import abstract_mesh

    jaxpr = traced.closed.jaxpr
    kept = [*res.params.decisions, *res.opt.decisions]
    args, results = shardy.given(jaxpr, [*kept, *res.inputs.decisions], kept)
    try:
        propagator = traced.memo.get("shardy")
        if propagator is None:
            propagator = traced.memo["shardy"] = shardy.Propagator(traced.closed, abstract_mesh(mesh, plan))
        return shardy.claims(jaxpr, propagator.layouts(args, results))
    except Exception as err:  # jaxlib's MLIR errors have no common root
        raise shardy.Failed(shardy.reason(err)) from None


@_collector_paused()
def cost(
    traced: Trace,
    plan: Any,
    mesh: dict[str, int],
    *,
    delta: bool = True,
    res: Resolution | None = None,
    compiler: str = "cpu",
    how: bool = True,
    seen: list | None = None,
    propagation: str = "shardplan",
    grouped: bool = True,
) -> StepCost:
    """``plan``'s step cost on ``mesh`` over a step traced once (:func:`trace`), without tracing
    again: the plan's shardings resolved (``res``: already, by ``Tracer.resolve``) and propagated
    through the traced jaxpr. ``delta``: also what the step's constraints change (a second
    propagation without them). ``compiler``: whose program (:data:`COMPILERS`). ``how``: the
    notes begin with how the auto backend's step is costed (the shard_map backend, which says
    its own, passes False). ``seen``: filled with each equation's results as laid out
    (``Walker.seen``; with ``delta``, the unconstrained pass's). ``propagation``: ``shardplan``,
    the walker lays each value out by its own rules (GSPMD's common patterns; a search's choice:
    no more than the walk); ``xla``, by Shardy's propagation, the pass XLA lays the step out with,
    run offline (``runtime.shardy``: 0.2-1 s more for a plan on a fresh trace, its module imported
    once per trace, then 0.15-0.3 s per plan, on the random-plan pool's models), the walker's
    rules then saying what moves to give each value that layout (XLA's partitioner's part);
    ``auto``: ``xla`` where Shardy's propagation runs over the step on automatic axes, else
    ``shardplan`` (a note says why Shardy could not). ``grouped``: False leaves the grouped
    matmuls' FLOPs out (a caller that counts them its own way: the shard_map backend).

    Raises:
        ValueError: ``traced`` was traced under other activation rules, mesh or axis types.
        shardy.Failed: ``propagation="xla"`` and Shardy's propagation cannot run over the step.
    """
    import jax
    import numpy as np

    from shardplan.runtime import shardy, specs

    if res is None:
        params, opt = specs.model_resolver(traced.abs_model, traced.abs_opt)(plan, mesh)
        res = Resolution(params, opt, specs.resolve_batch(plan, traced.batch_abs, mesh=mesh))
    book = COMPILERS[compiler]
    if trace_key(plan, mesh, res.params) != traced.key:
        raise ValueError("the plan's act/axis rules, mesh or axis types differ from the ones the step was traced under")
    t0 = time.perf_counter()
    acts, closed = traced.acts, traced.closed
    params, opt, inputs = res.params, res.opt, res.inputs
    assert opt is not None
    jaxpr = closed.jaxpr
    xla, fell_back = None, ""
    if propagation == "xla":
        xla = _xla_claims(traced, plan, mesh, res)
    elif propagation == "auto" and not plan.explicit_axes:
        # (over explicit axes the program's types give the layouts, which the walk reads itself:
        # typed_tp on typed_tiny costs XLA's collectives so, where on Shardy's layouts it adds an
        # all-gather over model of 393,216 B and twice the all-reduce over data)
        try:
            xla = _xla_claims(traced, plan, mesh, res)
        except shardy.Failed as err:  # a step Shardy's import cannot read (a Pallas kernel's call)
            fell_back = str(err)
    decisions = list(params.decisions) + list(opt.decisions) + list(inputs.decisions)
    prefixes = ["param"] * len(params.decisions) + ["opt"] * len(opt.decisions) + ["input"] * len(inputs.decisions)
    if len(decisions) != len(jaxpr.invars):
        raise RuntimeError(f"traced {len(jaxpr.invars)} inputs for {len(decisions)} leaves")
    out_specs = list(params.decisions) + list(opt.decisions)

    def propagate(
        ignore_constraints: bool, free: dict[Any, Dims] | None = None, layouts_only: bool = False
    ) -> tuple[_Ctx, Walker]:
        ctx = _Ctx(dict(mesh), plan.batch_axes, book=book, grouped_memory=grouped)
        names: dict[Any, str] = {}
        env: dict[Any, Val] = {}
        for var, d, role in zip(jaxpr.invars, decisions, prefixes, strict=True):
            env[var] = Val(tuple(var.aval.shape), itemsize(var.aval), _norm(d.spec.dims, len(var.aval.shape)))
            if role != "input":
                names[var] = d.path
        for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
            env[var] = _replicated(jax.ShapeDtypeStruct(np.shape(c), np.result_type(c)))
        prop = Walker(RULE_BOOK, ctx, names, ignore_constraints, free)
        prop.layouts_only = layouts_only
        if xla is not None and not ignore_constraints:  # (the pass without constraints: the walker's own)
            prop.xla_claims = True
            for var, dims in xla.items():
                prop.claimed.setdefault(var, dims)
        prop.seen = seen
        prop.memo = traced.memo
        # The step's outputs keep the plan's layout (the backend's out_shardings).
        for var, d in zip(jaxpr.outvars, out_specs, strict=False):
            if not hasattr(var, "val"):
                prop.hints[var] = _norm(d.spec.dims, len(var.aval.shape))
        prop.aliased = {v for v in jaxpr.outvars[: len(out_specs)] if not hasattr(v, "val")}
        updates = traced.memo.get("updates")
        if updates is None:  # what depends on the trace alone: once per trace
            updates = traced.memo["updates"] = update_paths(jaxpr, [d.path for d in params.decisions])
        prop.updates = updates
        updated = traced.memo.get("updated")
        if updated is None:  # a param -> the step's outputs its update writes (it and its state)
            updated = traced.memo["updated"] = dict(
                Counter(updates[v] for v in jaxpr.outvars if not hasattr(v, "val") and v in updates)
            )
        prop.updated = updated
        if book.gather_cse is not None:
            shared = traced.memo.get(("gathers", book.gather_cse))
            if shared is None:
                shared = traced.memo[("gathers", book.gather_cse)] = gather_reuse.shares(jaxpr, book.gather_cse)
            prop.shares = shared
        outs = prop.run(jaxpr, env, 1)
        for var, v, d in zip(jaxpr.outvars, outs, out_specs, strict=False):
            target = _norm(d.spec.dims, len(v.shape))
            done = resolve(prop, var, v, target, 1, "out_shardings")
            reshard(prop, var, done, target, 1, "out_shardings")
        if len(outs) > len(out_specs):  # the loss: a scalar, summed over the batch axes
            loss = outs[-1]
            resolve(prop, jaxpr.outvars[-1], loss, (), 1, "loss")
        return ctx, prop

    def settled(ignore_constraints: bool) -> tuple[_Ctx, Walker]:
        # Whole values that met split ones (``slices``) need a second pass with them computed
        # split; when the last plan costed on this trace had some, the first pass is run for its
        # layouts only (its collectives and traffic are thrown away). The figures are the same
        # either way: a guess that turns out wrong costs one more pass.
        guess = ("slices", ignore_constraints, compiler)
        lite = bool(traced.memo.get(guess))
        ctx, prop = propagate(ignore_constraints, layouts_only=lite)
        traced.memo[guess] = bool(prop.slices)
        if prop.slices:  # whole values met split ones: propagate again with them computed split
            return propagate(ignore_constraints, prop.slices)
        if lite:
            return propagate(ignore_constraints)
        return ctx, prop

    ctx, prop = settled(False)
    changed: tuple[tuple[str, str, int], ...] = ()
    if prop.constrained and delta:  # what the constraints change: the same step propagated without them
        bare, _ = settled(True)
        changed = _delta(ctx.comm, bare.comm)
    comm = merge_communication(ctx.comm, params, opt)
    # the collectives XLA combines for the kernel count: those that move a param by its own name
    combining = [c for k, c in enumerate(ctx.comm) if c.moves and k not in ctx.labelled]
    # the backward pass's collectives of activations (for the scheduled step: ``timing.step_time``)
    backward: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for k in sorted(ctx.backward_rows):
        c = ctx.comm[k]
        if not c.moves:
            acc = backward.setdefault((c.kind, c.axes), [0, 0])
            acc[0] += c.bytes
            acc[1] += c.count
    notes: list[Note] = []
    if how:
        notes.append(
            Note(
                "fast-how",
                (
                    "fast mode: every value laid out by Shardy's propagation (XLA's own pass, run offline), "
                    "the collectives that layout needs by GSPMD's rules for common patterns"
                    if xla is not None
                    else "fast mode: shardings propagated through the step's jaxpr as GSPMD does for common patterns"
                    + (f" (Shardy's propagation could not run over the step: {fell_back})" if fell_back else "")
                )
                + (f", with {book.name}'s own choices (its casts, sums and gathers)" if compiler != "cpu" else "")
                + "; XLA may choose other collectives (compare with --compile)",
            )
        )
    two_d = [
        d.path
        for d in params.decisions
        if any(a in plan.batch_axes for a in d.spec.axes) and any(a not in plan.batch_axes for a in d.spec.axes)
    ]
    if two_d and not prop.constrained:
        notes.append(
            Note(
                "fast-2d-params",
                f"{len(two_d)} param(s) are split over a batch axis and another axis (e.g. {two_d[0]}) and the step "
                "constrains no activation: where such a split meets the batch's, XLA may carry it into the "
                "activations and move them (all-gathers, all-to-alls) in ways fast mode does not predict; pin the "
                "residual stream (an act rule, or axis rules for the model's logical names, as plans/gpt_2d.splan "
                "does) or use --compile for this plan's communication",
            )
        )
    if ctx.lookups:
        first = sorted(set(ctx.lookups))[0]
        notes.append(
            Note(
                "fast-lookup-ways",
                f"lookups in a table split over an axis that also splits their indices ({first}): "
                "fast mode counts two of XLA's ways by size (up to the table's bytes of output per device the "
                "lookup done where the table's width is split and moved onto the batch split by all-to-all, past "
                "them the table regathered and the output all-gathered), but XLA's gather partitioner picks its "
                "way by a dry-run cost of each, which depends on the mesh and the sizes (on a 256x128 table on "
                "data=4,model=2, 8 sequences of 32 tokens are looked up a third way, the table's rows gathered): "
                "use --compile for this lookup's cost",
                "gather",
                first,
            )
        )
    if ctx.dense_grouped:
        notes.append(dense_grouped_note(book.name, ctx.dense_grouped, ctx.flops, book.whole_ragged == "kernel"))
    notes += acts.notes()
    notes += ctx.kernels
    if ctx.loops:
        notes.append(
            Note(
                "fast-loop-trips",
                "while loops whose trip count the step does not fix, costed for one trip: "
                + ", ".join(sorted(set(ctx.loops))),
                "while",
            )
        )
    if ctx.unmodeled:
        notes.append(
            Note(
                "fast-not-modelled",
                "not modelled (outputs taken as replicated, no communication counted): "
                + ", ".join(f"{k} x{n}" for k, n in sorted(ctx.unmodeled.items())),
                ", ".join(sorted(ctx.unmodeled)),
            )
        )
    p_bytes, o_bytes, b_bytes = params.bytes_per_device(), opt.bytes_per_device(), inputs.bytes_per_device()
    if book.tile:  # the step's arguments laid out in the compiler's tiles too
        p_bytes, o_bytes, b_bytes = (
            sum(tiled_bytes(d.shard_shape, d.itemsize, book.tile) for d in records(r.decisions))
            for r in (params, opt, inputs)
        )
    # The step's arguments stay alive (updated params and moments alias them); on top, the
    # most its intermediates (activations saved for the backward pass, gradients, gathered
    # weights, temporaries) hold at once in program order, or, where XLA reduces the gradients
    # in one combined collective, what was held then with its results beside the unreduced
    # gradients (measured: data parallel on a 254 KB model, 1 sequence per device: XLA:CPU's
    # temporaries 552 KB, XLA:GPU's 519 KB, program order 280 KB).
    temporaries = max(prop.peak, (ctx.reduced_from or 0) + ctx.reduced)
    memory = Memory(
        params=p_bytes,
        opt_state=o_bytes,
        batch=b_bytes,
        gradients=p_bytes,
        gathered=ctx.gathered_peak,
        temporaries=temporaries,
        peak=p_bytes + o_bytes + b_bytes + temporaries,
    )
    matmuls = dict(ctx.matmul_flops)
    flops = ctx.flops
    if not grouped:
        flops -= ctx.grouped_total
        matmuls = {k: v - ctx.grouped_flops.get(k, 0.0) for k, v in matmuls.items()}
        matmuls = {k: v for k, v in matmuls.items() if v > 0}
    return StepCost(
        "fast",
        "auto",
        dict(mesh),
        flops,
        memory,
        tuple(comm),
        ctx.transcendentals,
        time.perf_counter() - t0,
        tuple(notes),
        _merge_constrained(prop.constrained),
        tuple(sorted(acts.used)),
        changed,
        hbm_bytes=ctx.hbm,
        # each collective counted once above; XLA launches a combined group's together
        kernels=ctx.launches - sum(c.count for c in combining) + combined_launches(combined(combining)),
        compiler="" if compiler == "cpu" else book.name,
        backward=tuple((kind, axes, n, count) for (kind, axes), (n, count) in backward.items()),
        propagation="xla" if xla is not None else "shardplan",  # what ``auto`` came to
        matmul_flops=tuple(sorted(matmuls.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def dense_grouped_note(compiler: str, lines: dict[str, tuple[int, float]], flops: float, gradients: bool) -> Note:
    """``compiler`` runs grouped matmuls densely at ``lines`` (line -> (groups, the FLOPs of it
    there)): every row through each group, the groups' multiple of the useful work.
    ``gradients``: only their weight gradients (the rows contracted; XLA:TPU's forward is a kernel)."""
    worst = max(g for g, _ in lines.values())
    spent = sum(n for _, n in lines.values())
    where = ", ".join(f"{os.path.basename(k)} ({g} experts)" for k, (g, _) in sorted(lines.items()))
    what = (
        "the weight gradients of grouped matmuls (jax.lax.ragged_dot, the rows contracted)"
        if gradients
        else ("grouped matmuls (jax.lax.ragged_dot)")
    )
    return Note(
        "grouped-dense",
        f"{compiler} runs {what} densely at {where}: every row through each expert, up to {worst}x the useful "
        f"work ({spent / flops:.0%} of the step's FLOPs); a grouped kernel does each row once (on TPU, the "
        "Pallas megablox kernels jax ships: gmm, tgmm)",
        "ragged_dot_general",
        sorted(lines)[0],
    )


def merge_communication(comm: list[Communication], params: Any, opt: Any) -> tuple[Communication, ...]:
    """The ledger's rows merged (``ledger.merged``), each named with the plan rule that placed
    what it moves (``params``/``opt``: the resolutions that name them)."""
    rules = {d.path: d.origin for d in list(params.decisions) + list(opt.decisions) if d.how in ("rule", "default")}
    return merged(comm, lambda moves: (moves, rules.get(moves, "")))


def _merge_constrained(items: list[Constrained]) -> tuple[Constrained, ...]:
    """One row per (what, source, shape, spec): the forward constraint and its transpose in the
    backward pass, and the same act rule on every layer, are counted together."""
    out: dict[tuple, Constrained] = {}
    for c in items:
        what = c.what.split(" on ")[0] if c.what.startswith("act ") else c.what
        key = (what, c.source, c.shape, c.spec)
        prev = out.get(key)
        out[key] = replace(c, what=what, count=c.count + (prev.count if prev else 0))
    return tuple(out.values())


def _delta(with_: list[Communication], without: list[Communication]) -> tuple[tuple[str, str, int], ...]:
    """Per (kind, axes), the bytes the constraints add (> 0) or remove (< 0)."""
    totals: dict[tuple[str, str], int] = {}
    for sign, comm in ((1, with_), (-1, without)):
        for c in comm:
            key = (c.kind, ",".join(c.axes))
            totals[key] = totals.get(key, 0) + sign * c.bytes
    return tuple((kind, axes, n) for (kind, axes), n in sorted(totals.items()) if n)


@dataclass(frozen=True)
class Ledger:
    """What fast mode's rules predict for one function (``propagate_function``): per device, the
    collective ledger's rows (merged), FLOPs, memory traffic and the intermediates' peak."""

    communication: tuple[Communication, ...]
    flops: float
    hbm_bytes: float
    temporaries: int
    unmodeled: tuple[str, ...]
    loops: tuple[str, ...] = ()  # sources of while loops of unknown trip count (costed for one trip)

    def bytes_of(self, kind: str) -> int:
        return sum(c.bytes for c in self.communication if c.kind == kind)


def propagate_function(
    fn: Callable[..., Any],
    avals: tuple[Any, ...],
    in_dims: tuple[Dims, ...],
    mesh: dict[str, int],
    out_dims: tuple[Dims | None, ...] | None = None,
    propagation: str = "shardplan",
    compiler: str = "cpu",
) -> Ledger:
    """Fast mode's rules on ``fn(*avals)`` (abstract inputs split as ``in_dims``: per input, per dim
    the mesh axes), its outputs set to ``out_dims`` (None: where the rules leave them), as
    ``jax.jit(fn, in_shardings=..., out_shardings=...)`` would compile it. For testing a rule
    against XLA one or two ops at a time (tests/test_fast_rules.py). ``propagation="xla"``: every
    value laid out by Shardy's propagation first (as :func:`cost`'s). ``compiler``: the book of
    the compiler whose program is predicted (``cpu``, ``tpu``, ``cuda``: :data:`COMPILERS`)."""
    import jax
    import numpy as np

    from shardplan.runtime import shardy
    from shardplan.runtime.tracing import abstract_mesh

    closed = jax.make_jaxpr(fn)(*avals)
    jaxpr = closed.jaxpr
    targets = list(out_dims or (None,) * len(jaxpr.outvars))
    laid_out = None
    if propagation == "xla":
        given = [_norm(d, len(v.aval.shape)) for v, d in zip(jaxpr.invars, in_dims, strict=True)]
        wanted = [None if d is None else _norm(d, len(v.aval.shape)) for v, d in zip(jaxpr.outvars, targets)]
        laid_out = shardy.Propagator(closed, abstract_mesh(dict(mesh))).layouts(given, wanted)

    def run(free: dict[Any, Dims] | None) -> tuple[_Ctx, Walker]:
        ctx = _Ctx(dict(mesh), book=COMPILERS[compiler])
        env = {
            var: Val(tuple(var.aval.shape), itemsize(var.aval), _norm(d, len(var.aval.shape)))
            for var, d in zip(jaxpr.invars, in_dims, strict=True)
        }
        for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
            env[var] = _replicated(jax.ShapeDtypeStruct(np.shape(c), np.result_type(c)))
        prop = Walker(RULE_BOOK, ctx, {}, free=free)
        if laid_out is not None:
            prop.xla_claims = True
            prop.claimed.update(shardy.claims(jaxpr, laid_out))
        for var, d in zip(jaxpr.outvars, targets, strict=True):
            if d is not None and not hasattr(var, "val"):
                prop.hints[var] = _norm(d, len(var.aval.shape))
        outs = prop.run(jaxpr, env, 1)
        for var, v, d in zip(jaxpr.outvars, outs, targets, strict=True):
            target = _norm(d, len(v.shape)) if d is not None else None
            done = resolve(prop, var, v, target if target is not None else v.dims, 1, "out_shardings")
            if target is not None:
                reshard(prop, var, done, target, 1, "out_shardings")
        return ctx, prop

    # whole values that met split ones are computed split on a second pass, as :func:`cost` does
    ctx, prop = run(None)
    if prop.slices:
        ctx, prop = run(prop.slices)
    return Ledger(
        merged(ctx.comm), ctx.flops, ctx.hbm, prop.peak, tuple(sorted(ctx.unmodeled)), tuple(sorted(set(ctx.loops)))
    )
