"""The shard_map backend: the plan lowered to explicit per-device code.

The step's ``value_and_grad`` is traced over global abstract values and partitioned op by op
by ``shardplan.runtime.partition`` inside ``jax.shard_map``: matmuls and lookups on local
shards, collectives only where a layout needs one, every collective recorded
(:meth:`ShardMapStep.record`). The optimizer update runs outside shard_map, on global arrays,
so transformations such as ``optax.clip_by_global_norm`` see the global norm.

``gather_whole_step`` keeps the earlier lowering (every sharded param gathered whole, the model
run per device on its batch slice, gradients reduced per ``shardplan.core.lowering``): the
emitted module's ``make_gather_whole_step``, and the benchmarks' baseline.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardplan.core.leaves import records
from shardplan.core.lowering import Collective, Lowering, lower
from shardplan.core.notes import Note
from shardplan.core.stepcost import StepCost
from shardplan.errors import Diagnostic, PlanApplyError, ShardMapFallbackWarning, error
from shardplan.runtime import partition, specs
from shardplan.runtime.mesh import has_explicit_axes
from shardplan.runtime.placement import Placement, replicated
from shardplan.runtime.tracing import gradient_program

LossFn = Callable[[Any, Any], jax.Array]


def gather(x: jax.Array, c: Collective) -> jax.Array:
    axes = c.axes if len(c.axes) > 1 else c.axes[0]
    return jax.lax.all_gather(x, axes, axis=c.dim, tiled=True, to="invarying")


def reduce_one(g: jax.Array, c: Collective) -> jax.Array:
    if c.kind == "psum_scatter":
        return jax.lax.psum_scatter(g, c.axes[0], scatter_dimension=c.dim, tiled=True)
    if c.kind == "slice":
        size = g.shape[c.dim] // jax.lax.axis_size(c.axes[0])
        start = jax.lax.axis_index(c.axes[0]) * size
        return jax.lax.dynamic_slice_in_dim(g, start, size, axis=c.dim)
    if c.kind == "psum":
        return jax.lax.psum(g, c.axes)
    raise ValueError(c.kind)


def local_grads(lowering: Lowering, loss_fn: LossFn, gm) -> Callable:
    """The per-device function: local shards + local batch -> (mean loss, local grad shards)."""
    batch_axes = lowering.batch_axes
    scale = 1.0 / lowering.batch_axis_size

    def fn(sm, batch):
        leaves, treedef = jax.tree_util.tree_flatten(sm)
        full = []
        for x, p in zip(leaves, lowering.params):
            for c in p.gather:
                x = gather(x, c)
            full.append(jax.lax.pcast(x, batch_axes, to="varying") if batch_axes else x)

        def loss_of(flat):
            return loss_fn(nnx.merge(gm, jax.tree_util.tree_unflatten(treedef, flat)), batch)

        loss, grads = jax.value_and_grad(loss_of)(full)
        out = []
        for g, p in zip(grads, lowering.params):
            for c in p.reduce:
                g = reduce_one(g, c)
            out.append(g * jnp.asarray(scale, g.dtype))
        if batch_axes:
            loss = jax.lax.pmean(loss, batch_axes)
        return loss, jax.tree_util.tree_unflatten(treedef, out)

    return fn


def typed_like(x: Any, explicit: bool) -> jax.ShapeDtypeStruct:
    """The abstract value the gradient program is traced over. Under explicit axes it keeps
    ``x``'s sharding type, so the model's sharding-typed code sees the types the auto backend's
    step sees (the partitioner reads them as layouts and runs untyped per-device code)."""
    if explicit:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def fast_cost(tracer: Any, plan: Any, mesh: dict[str, int], *, delta: bool = True, compiler: str = "cpu") -> StepCost:
    """This backend's step cost in fast mode: its collectives exactly (the partitioner run dry
    over the step's gradient program: what the per-device code issues, each named with what it
    moves: written out, so the same for every compiler), FLOPs and memory as the auto backend's
    propagation reads them for ``compiler`` (both backends compute the same local shards).
    ``tracer``: a ``tracing.Tracer`` of the model, loss, batch and optimizer."""
    import time
    from dataclasses import replace

    from shardplan.runtime import fast

    t0 = time.perf_counter()
    res = tracer.resolve(plan, mesh)
    base = fast.cost(
        tracer.step(plan, mesh, res), plan, mesh, delta=False, res=res, compiler=compiler, how=False, grouped=False
    )
    params, inputs = res.params, res.inputs
    record = partition.predict(
        tracer.gradients(plan, mesh, res),
        mesh,
        [_dims(d.spec.dims, len(d.shape)) for d in records(params.decisions)],
        [_dims(d.spec.dims, len(d.shape)) for d in records(inputs.decisions)],
        paths=[d.path for d in params.decisions],
    )
    notes = [
        Note(
            "shard-map-how",
            "fast mode, shard_map backend: the collectives are the partitioned per-device code's own (a dry run "
            "of shardplan's partitioner; the compiled step issues exactly these, tests/test_shard_map.py); FLOPs"
            + (" (the grouped matmuls' aside: counted as this backend runs them)" if record.grouped else "")
            + ", memory and memory traffic are the auto backend's propagation; the optimizer update runs on global "
            "arrays outside shard_map, and collectives XLA adds there (a global-norm clip's all-reduce) are not "
            "listed",
        )
    ]
    notes += [
        Note(
            "shard-map-fallback",
            f"fell back to whole operands: {f.op} at {f.source or '?'} ({f.why})",
            f.op,
            f.source,
        )
        for f in record.fallbacks
    ]
    book = fast.COMPILERS[compiler]
    counted, grouped, dense, masks = grouped_flops(
        record.grouped, mesh, book.whole_ragged == "kernel", book.dense_ragged
    )
    matmuls = dict(base.matmul_flops)
    for line, n in counted.items():
        matmuls[line] = matmuls.get(line, 0.0) + n
    # Grouped matmuls on each device's own experts: the work follows the routing where the
    # compiler's grouped matmul is a kernel over the rows routed (XLA:TPU's); where it runs every
    # row through every local group (jax's dense decomposition on XLA:CPU, XLA:GPU's), it is fixed.
    if grouped:
        notes.append(
            Note(
                "grouped-routed",
                f"{book.name}'s grouped matmuls on each device's own experts (at "
                + ", ".join(sorted({os.path.basename(src) for src, *_ in grouped}))
                + ") run the rows routed to them: the step time counts a shard's share of the rows (the mean with "
                "every expert alike, the busiest shard's under --expert-load), where the FLOPs count every row the "
                "program's buffers hold (assumed from jax's TPU grouped kernel, megablox, which runs only its "
                "groups' tiles; not measured on a TPU)",
                "ragged_dot_general",
                grouped[0][0],
            )
        )
    if not grouped and any(axes and forward for _, _, axes, forward, *_ in record.grouped):
        notes.append(
            Note(
                "expert-load-static",
                f"{book.name} runs each grouped matmul densely (every row through every local "
                "expert): the step's work does not follow how tokens are routed, and a stated expert load does "
                "not change it",
                "ragged_dot_general",
                record.grouped[0][0],
            )
        )
    flops = base.flops + sum(counted.values()) + masks
    if dense and not book.dense_ragged:
        notes.append(fast.dense_grouped_note(book.name, dense, flops, book.whole_ragged == "kernel"))
    return replace(
        base,
        backend="shard_map",
        communication=fast.merge_communication(record.issued, params, params),
        notes=tuple(notes) + tuple(n for n in base.notes if n.code != "grouped-dense"),  # its own, above
        seconds=time.perf_counter() - t0,
        constraint_delta=(),
        fallbacks=tuple((f.op, f.source, f.bytes) for f in record.fallbacks),
        flops=flops,
        matmul_flops=tuple(sorted(matmuls.items(), key=lambda kv: (-kv[1], kv[0]))),
        grouped=grouped,
    )


def grouped_flops(
    rows: list[tuple[str, int, tuple[str, ...], bool, int, float, float]],
    mesh: dict[str, int],
    kernel: bool,
    masked: bool = False,
) -> tuple[dict[str, float], tuple[tuple[str, int, tuple[str, ...], float], ...], dict[str, tuple[int, float]], float]:
    """The partitioner's grouped matmuls (``Record.grouped``) as the compiler runs them: (FLOPs
    per device per step by line, as its program counts them; the rows whose work follows the
    routing, ``StepCost.grouped``; the lines run densely over more than one local group, as
    (groups, FLOPs), for note ``grouped-dense``). ``kernel``: the compiler runs a grouped matmul as a kernel
    that takes each row through its own group's weights (XLA:TPU: the rows whole in the program,
    each device's groups' rows, a mean share with every group routed alike, at run time); else
    every row through every local group (jax's dense decomposition on XLA:CPU, XLA:GPU's dense
    matmuls). A weight gradient (the ragged rows contracted) runs densely on every compiler.
    ``masked``: jax's dense decomposition (XLA:CPU), whose masks of each group's rows add
    elementwise FLOPs, the fourth figure: 4 per lhs element and local group forward, 4 per lhs
    and rhs element and local group for a weight gradient (XLA:CPU's cost analysis of single
    ``jax.lax.ragged_dot``s and their weight gradients, 256-512 rows, 1-4 groups, 2026-12-07)."""
    counted: dict[str, float] = {}
    masks = 0.0
    routed: dict[tuple[str, int, tuple[str, ...]], float] = {}
    dense: dict[str, tuple[int, float]] = {}
    for src, groups, axes, forward, ragged, other, mask in rows:
        shards = math.prod(mesh[a] for a in axes)
        each = 1 if forward and kernel else groups // shards
        flops = 2.0 * ragged * other * each
        counted[src] = counted.get(src, 0.0) + flops
        if masked:
            masks += 4.0 * ragged * (groups // shards) * mask
        if forward and kernel and axes:
            key = (src, groups, axes)
            routed[key] = routed.get(key, 0.0) + 2.0 * ragged / shards * other
        if each > 1:
            dense[src] = (each, dense.get(src, (each, 0.0))[1] + flops)
    return counted, tuple((*k, v) for k, v in sorted(routed.items(), key=lambda kv: -kv[1])), dense, masks


def _dims(dims, rank: int) -> partition.Dims:
    return tuple(tuple(d) for d in dims) + ((),) * (rank - len(dims))


def _pspec(dims: partition.Dims) -> P:
    return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])


def params_only(model) -> None:
    """The shard_map backend differentiates and returns Params only: a model with other state
    (batch statistics, RNG streams) cannot be lowered (also what ``shardplan lower`` checks, so
    it never emits a module that fails when run).

    Raises:
        PlanApplyError: ``cannot-lower``, naming the first non-Param leaf.
    """
    others = nnx.state(model, nnx.Not(nnx.Param))
    bad = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(others)]
    if bad:
        raise PlanApplyError(
            [
                error(
                    "cannot-lower",
                    f"the model has non-Param state ({', '.join(bad[:3])}"
                    f"{', ...' if len(bad) > 3 else ''}); the shard_map backend differentiates and returns Params only",
                    "use backend auto for models with batch statistics, RNG state or other mutable variables",
                    path=bad[0],
                )
            ]
        )


def fallback_diagnostics(fallbacks: list[partition.Fallback]) -> list[Diagnostic]:
    """One ``cannot-lower`` diagnostic per op (and source line) the partitioner ran on whole
    operands: what ``strict=True`` raises, and what the warning says."""
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for f in fallbacks:
        acc = grouped.setdefault((f.op, f.source, f.why), [0, 0])
        acc[0] += 1
        acc[1] += f.bytes
    out = []
    for (op, source, why), (count, nbytes) in grouped.items():
        times = f" ({count} times)" if count > 1 else ""
        out.append(
            error(
                "cannot-lower",
                f"shard_map runs {op} at {source or 'library code'}{times} on whole (gathered) operands ({why}): "
                f"{nbytes:,} B made whole per device per step",
                "give the op operands in a layout it runs on locally (docs/backends.md lists the partitioner's "
                "rules), or use backend auto; without strict=True the step runs, correctly, with the gather",
                path=source or op,
            )
        )
    return out


def report_fallbacks(fallbacks: list[partition.Fallback], strict: bool, stacklevel: int = 2) -> None:
    """Fallbacks are loud: a ``ShardMapFallbackWarning`` naming each one, or with ``strict`` a
    ``PlanApplyError`` listing them."""
    if not fallbacks:
        return
    diags = fallback_diagnostics(fallbacks)
    if strict:
        raise PlanApplyError(diags)
    lines = "\n".join(f"  {d.message}" for d in diags)
    warnings.warn(
        f"shardplan: the shard_map step runs {len(diags)} op(s) on whole operands, with no local rule for their "
        f"layout (correct, but every device gathers them):\n{lines}\n"
        "see docs/backends.md for the ops it runs locally; strict=True makes this an error",
        ShardMapFallbackWarning,
        stacklevel=stacklevel + 1,
    )


class ShardMapStep:
    """Jitted step per batch structure (the in_specs depend on the batch's leaves).

    The step is traced at its first call (or ``lower``) for a batch structure; then, once, any
    op that ran on whole operands is reported: a ``ShardMapFallbackWarning``, or with ``strict``
    a ``PlanApplyError`` raised before the step runs."""

    def __init__(self, placement: Placement, loss_fn: LossFn, model: Any, optimizer: Any, strict: bool = False):
        params_only(model)
        self.placement = placement
        self.loss_fn = loss_fn
        self.strict = strict
        self.gm = nnx.graphdef(model)
        self.go = nnx.graphdef(optimizer)
        self._cache: dict = {}
        self._reported: set = set()
        self.records: dict = {}

    @staticmethod
    def _key(batch: Any) -> tuple:
        leaves, btree = jax.tree_util.tree_flatten(batch)
        return (btree, tuple((x.shape, str(x.dtype)) for x in leaves))

    def _ready(self, sm, so, batch, stacklevel: int):
        """The jitted step for this batch structure, traced, its fallbacks reported (once)."""
        fn = self._jitted(batch)
        key = self._key(batch)
        if key not in self._reported:
            fn.trace(sm, so, batch)  # fills the record; jit reuses this trace for the call
            self._reported.add(key)
            report_fallbacks(self.records[key].fallbacks, self.strict, stacklevel + 1)
        return fn

    def _jitted(self, batch: Any):
        key = self._key(batch)
        _, btree = jax.tree_util.tree_flatten(batch)
        if key in self._cache:
            return self._cache[key]
        p = self.placement
        batch_res = specs.resolve_batch(p.plan, batch, mesh=p.mesh_shape)
        param_dims = [_dims(d.spec.dims, len(d.shape)) for d in records(p.params.decisions)]
        batch_dims = [_dims(d.spec.dims, len(d.shape)) for d in records(batch_res.decisions)]
        pspecs, bspecs = [_pspec(d) for d in param_dims], [_pspec(d) for d in batch_dims]
        record = partition.Record()
        gm, go, loss_fn, mesh_shape = self.gm, self.go, self.loss_fn, p.mesh_shape
        explicit = has_explicit_axes(p.mesh)

        def step(sm, so, batch):
            flat, ptree = jax.tree_util.tree_flatten(sm)
            bflat = jax.tree_util.tree_leaves(batch)
            abstract = [typed_like(x, explicit) for x in flat]
            babstract = [typed_like(x, explicit) for x in bflat]
            closed = gradient_program(gm, ptree, btree, loss_fn, abstract, babstract)
            fn = jax.shard_map(
                partition.local_step(closed, mesh_shape, param_dims, batch_dims, record),
                mesh=p.mesh,
                in_specs=(pspecs, bspecs),
                out_specs=(P(), pspecs),
                check_vma=False,
            )
            loss, grads = fn(flat, bflat)
            grads = jax.tree_util.tree_unflatten(ptree, grads)
            model, optimizer = nnx.merge(gm, sm), nnx.merge(go, so)
            optimizer.update(model, grads)
            return nnx.state(model), nnx.state(optimizer), loss

        out = (p.model_shardings(), p.opt_shardings(), replicated(p.mesh))
        fn = jax.jit(step, out_shardings=out, donate_argnums=(0, 1))
        self._cache[key] = fn
        self.records[key] = record
        return fn

    def record(self, batch: Any) -> partition.Record:
        """What the per-device code traced for this batch structure issues (after a trace)."""
        return self.records[self._key(batch)]

    def __call__(self, sm, so, batch):
        return self._ready(sm, so, batch, stacklevel=3)(sm, so, batch)

    def lower(self, sm, so, batch):
        return self._ready(sm, so, batch, stacklevel=3).lower(sm, so, batch)


def gather_whole_step(placement: Placement, loss_fn: LossFn, model: Any, optimizer: Any, batch: Any):
    """The lowering before the step was partitioned, jitted: every sharded param gathered whole
    at the start, the model run whole per device on its batch slice, gradients reduced per
    ``shardplan.core.lowering`` (the emitted module's ``make_gather_whole_step``). The benchmarks'
    baseline."""
    params_only(model)
    p = placement
    batch_res = specs.resolve_batch(p.plan, batch, mesh=p.mesh_shape)
    low = lower(p.plan, p.params, batch_res)
    gm, go = nnx.graphdef(model), nnx.graphdef(optimizer)
    grads_fn = jax.shard_map(
        local_grads(low, loss_fn, gm),
        mesh=p.mesh,
        in_specs=(p.params.specs, batch_res.specs),
        out_specs=(P(), p.params.specs),
    )

    def step(sm, so, batch):
        loss, grads = grads_fn(sm, batch)
        m, o = nnx.merge(gm, sm), nnx.merge(go, so)
        o.update(m, grads)
        return nnx.state(m), nnx.state(o), loss

    out = (p.model_shardings(), p.opt_shardings(), replicated(p.mesh))
    return jax.jit(step, out_shardings=out, donate_argnums=(0, 1))


def build(placement: Placement, loss_fn: LossFn, model: Any, optimizer: Any, strict: bool = False) -> ShardMapStep:
    """The partitioned step; ``strict``: an op run on whole operands is a ``PlanApplyError``."""
    return ShardMapStep(placement, loss_fn, model, optimizer, strict)
