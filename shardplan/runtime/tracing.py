"""Tracing the step, once: the one place the training step is traced for costing.

A :class:`Tracer` holds one model (built abstractly), loss, batch and optimizer. Costing a plan
asks it for the plan's :class:`Resolution` (the plan resolved against the model, once per
costing) and for the traces that resolution needs: the auto backend's whole step (forward,
backward, optimizer update; fast mode propagates through it) and the shard_map backend's
gradient program (``value_and_grad`` of the loss over the flat params and batch; the partitioner
runs dry over it). Traces are keyed by what tracing applies of a plan (:func:`trace_key`), so
plans that differ elsewhere (param, opt and input rules, the batch split, the backend) share
them: a plan search traces once per key, not once per plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardplan.runtime.kernels import cudnn_traceable

LossFn = Callable[[Any, Any], Any]


def abstract_mesh(mesh: dict[str, int], plan: Any = None) -> Any:
    """The mesh the step is traced under: each axis typed as the plan says (auto without one)."""
    from jax.sharding import AbstractMesh, AxisType

    from shardplan.runtime.mesh import jax_axis_types

    kinds = jax_axis_types(plan, tuple(mesh)) if plan is not None else (AxisType.Auto,) * len(mesh)
    return AbstractMesh(tuple(mesh.values()), tuple(mesh), axis_types=kinds)


@dataclass(frozen=True)
class Resolution:
    """A plan resolved against the model, its optimizer state and the batch (``specs.Resolved``
    each): what one costing reads, made once."""

    params: Any
    opt: Any
    inputs: Any


@dataclass(frozen=True)
class Trace:
    """A training step traced once over abstract values: what costing another plan reuses.

    The jaxpr depends on a plan only through what is applied while tracing (its ``act`` and
    ``axis`` rules, its mesh as the mesh context, the mesh's axis types, a pipeline's stage
    split): plans that differ elsewhere cost on one trace.
    """

    key: tuple
    closed: Any
    abs_model: Any
    abs_opt: Any
    batch_abs: dict[str, Any]
    acts: Any  # the Activations the step was traced under (its notes and the logical names used)
    seconds: float
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-equation facts, kept between plans


def trace_key(plan: Any, mesh: dict[str, int], params: Any = None) -> tuple:
    """What of ``plan`` and ``mesh`` a traced step depends on (see :class:`Trace`). A pipeline
    rewrites the step around the params its axis splits and pins its buffers to the batch's rows:
    with ``params`` (the plan's resolution of them), which params the stage axis splits (plans that
    differ only in the other axes of their rules share a trace); without, the param rules themselves."""
    piped: tuple = ()
    if plan.pipeline is not None:
        p = plan.pipeline
        if params is not None:
            from shardplan.runtime import pipeline

            split: tuple = tuple(pipeline.stage_split(params, p.axis))
        else:
            split = (tuple((r.pattern, r.spec) for r in plan.params), plan.default)
        piped = (p.axis, p.microbatches, p.schedule, p.repeats, split, tuple(plan.batch_dim0_axes))
    return (
        tuple((r.pattern, r.spec) for r in plan.acts),
        tuple((a.logical, a.axes) for a in plan.axes),
        tuple(mesh.items()),
        tuple(plan.axis_types),
        piped,
    )


def pipelined(plan: Any, loss_fn: LossFn, mesh: dict[str, int], params: Any) -> LossFn:
    """``loss_fn`` with the plan's pipeline applied over the abstract mesh (``pipeline.pipelined``)."""
    from shardplan.runtime import pipeline

    return pipeline.pipelined(plan, loss_fn, mesh, params, abstract_mesh(mesh, plan))


def gradient_program(graphdef: Any, ptree: Any, btree: Any, loss_fn: LossFn, params: list, batch: list) -> Any:
    """The step's ``value_and_grad`` as a closed jaxpr over the flat params and the flat batch
    (loss first, then one gradient per param): what the shard_map backend partitions on each
    device, in the step and in fast mode's cost alike."""
    import jax
    from flax import nnx

    def loss_of(fp, fb):
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(ptree, fp))
        return loss_fn(model, jax.tree_util.tree_unflatten(btree, fb))

    return jax.make_jaxpr(jax.value_and_grad(loss_of))(params, batch)


class Tracer:
    """One model (``factory``, built abstractly once), loss, batch and optimizer, costed under
    many plans: each plan resolved once per costing (:meth:`resolve`; ``resolutions`` counts
    them), each trace made once per :func:`trace_key` (``traces`` counts them)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        loss_fn: LossFn,
        batch: dict[str, tuple[tuple[int, ...], str]],
        optimizer: str,
        built: tuple[Any, Any] | None = None,
    ):
        import jax
        import numpy as np

        from shardplan.runtime import model as model_mod
        from shardplan.runtime import specs

        self.factory, self.loss_fn, self.shapes, self.optimizer = factory, loss_fn, dict(batch), optimizer
        self.built = built or model_mod.abstract_model_and_optimizer(factory, model_mod.make_tx(optimizer))
        self.batch_abs = {k: jax.ShapeDtypeStruct(s, np.dtype(d)) for k, (s, d) in self.shapes.items()}
        self._resolver = specs.model_resolver(*self.built)  # the trees read once, not once per plan
        self._steps: dict[tuple, Trace] = {}
        self._gradients: dict[tuple, Any] = {}
        self.resolutions = 0

    @property
    def traces(self) -> int:
        return len(self._steps) + len(self._gradients)

    def resolve(self, plan: Any, mesh: dict[str, int]) -> Resolution:
        """The plan resolved against the model, its optimizer state and the batch."""
        from shardplan.runtime import specs

        self.resolutions += 1
        params, opt = self._resolver(plan, mesh)
        return Resolution(params, opt, specs.resolve_batch(plan, self.batch_abs, mesh=mesh))

    def step(self, plan: Any, mesh: dict[str, int], res: Resolution) -> Trace:
        """The auto backend's step (forward, backward, optimizer update) traced under ``plan``'s
        activation rules and mesh: once per trace key."""
        key = trace_key(plan, mesh, res.params)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = self._trace_step(plan, mesh, res, key)
        return hit

    def _trace_step(self, plan: Any, mesh: dict[str, int], res: Resolution, key: tuple) -> Trace:
        import jax
        from flax import nnx

        from shardplan.runtime import model as model_mod
        from shardplan.runtime.activations import Activations
        from shardplan.runtime.backends.auto import pure_step
        from shardplan.runtime.step import check_loss

        t0 = time.perf_counter()
        abs_model, abs_opt = self.built
        acts = Activations(plan, abstract_mesh(mesh, plan), "auto")
        wrapped = acts.wrap(pipelined(plan, self.loss_fn, mesh, res.params))
        with cudnn_traceable():
            check_loss(wrapped, abs_model, self.batch_abs, where="--step", plan=plan)
            step = pure_step(wrapped, nnx.graphdef(abs_model), nnx.graphdef(abs_opt))
            with nnx.use_eager_sharding(False), model_mod.quiet_tracer_origins():
                closed = jax.make_jaxpr(step)(nnx.state(abs_model), nnx.state(abs_opt), self.batch_abs)
        return Trace(key, closed, abs_model, abs_opt, self.batch_abs, acts, time.perf_counter() - t0)

    def gradients(self, plan: Any, mesh: dict[str, int], res: Resolution) -> Any:
        """The shard_map backend's gradient program (:func:`gradient_program`) under ``plan``'s
        activation rules, its pipeline and its mesh as the mesh context: once per trace key."""
        key = trace_key(plan, mesh, res.params)
        hit = self._gradients.get(key)
        if hit is None:
            import jax
            from flax import nnx

            from shardplan.runtime import model as model_mod
            from shardplan.runtime.activations import Activations

            abs_model = self.built[0]
            piped = pipelined(plan, self.loss_fn, mesh, res.params)
            wrapped = Activations(plan, abstract_mesh(mesh, plan), "shard_map").wrap(piped, mesh_context=True)
            gm, state = nnx.split(abs_model)
            flat, ptree = jax.tree_util.tree_flatten(state)
            bflat, btree = jax.tree_util.tree_flatten(self.batch_abs)
            with nnx.use_eager_sharding(False), model_mod.quiet_tracer_origins():
                abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
                hit = self._gradients[key] = gradient_program(gm, ptree, btree, wrapped, abstract, bflat)
        return hit
