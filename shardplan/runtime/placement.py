"""Placement: resolved specs -> arrays placed on a mesh.

Shard an existing NNX model and optimizer in place, build them directly sharded, and
shard input batches. Both backends start from the :class:`Placement` made here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardplan.core.plan import Plan
from shardplan.errors import PlanApplyError, error
from shardplan.runtime import specs
from shardplan.runtime.mesh import AxisTypes, has_explicit_axes, make_mesh, mesh_shape_of
from shardplan.runtime.model import abstract_model_and_optimizer
from shardplan.runtime.specs import Resolved


@dataclass(frozen=True)
class Placement:
    """A plan bound to a mesh, with the resolved specs of a model (and its optimizer)."""

    plan: Plan
    mesh: Mesh
    params: Resolved
    opt: Resolved | None = None

    @property
    def mesh_shape(self) -> dict[str, int]:
        return mesh_shape_of(self.mesh)

    def model_shardings(self):
        return self.params.shardings(self.mesh)

    def opt_shardings(self):
        return self.opt.shardings(self.mesh) if self.opt is not None else None

    def batch_shardings(self, batch: Any):
        """NamedShardings for an input batch (checked: split dims must divide)."""
        return specs.resolve_batch(self.plan, batch, mesh=self.mesh_shape).shardings(self.mesh)

    def shard_batch(self, batch: Any) -> Any:
        return shard_batch(self.plan, batch, self.mesh)

    def constrain(self, model: Any, optimizer: Any = None) -> None:
        """Inside your own jitted step (``nnx.jit``, ``jax.jit``): pin every model and optimizer
        leaf to the plan's sharding, in place. Call it after the update, as the step's last line:
        without it XLA picks the updated state's shardings itself and may move a replicated
        leaf to another layout after one step (``verify`` then names it)."""
        for obj, res in ((model, self.params), (optimizer, self.opt)):
            if obj is None or res is None:
                continue
            state = nnx.state(obj)
            leaves, treedef = jax.tree.flatten(state)
            shardings = jax.tree.leaves(res.shardings(self.mesh), is_leaf=lambda x: isinstance(x, NamedSharding))
            if len(leaves) != len(shardings):
                raise PlanApplyError(
                    [
                        error(
                            "sharding-mismatch",
                            f"constrain: the state has {len(leaves)} arrays, the placement {len(shardings)}",
                            "pass the model (and optimizer) this placement was made for",
                            path="constrain",
                        )
                    ]
                )
            pinned = [specs.constrain(x, s) for x, s in zip(leaves, shardings)]
            nnx.update(obj, jax.tree.unflatten(treedef, pinned))


def _ensure_mesh(plan: Plan, mesh: Mesh | None, axis_types: AxisTypes | None) -> Mesh:
    if mesh is None:
        return make_mesh(plan, axis_types=axis_types)
    missing = [a for a in plan.axis_names if a not in mesh.axis_names]
    if missing:
        raise PlanApplyError(
            [
                error(
                    "mesh-mismatch",
                    f"the mesh has axes {list(mesh.axis_names)}; the plan needs {list(plan.axis_names)}",
                    "build the mesh with shardplan.make_mesh(plan), or use plan.with_mesh(...)",
                    path="mesh",
                )
            ]
        )
    return mesh


def _check_model(model: Any, what: str) -> None:
    if not isinstance(model, (nnx.Module, nnx.Pytree, nnx.State, dict, list, tuple)):
        raise PlanApplyError(
            [
                error(
                    "not-a-model",
                    f"{what} is a {type(model).__name__}, not an NNX Module, State or pytree",
                    f"pass the {what} object itself (an nnx.Module / nnx.Optimizer) or nnx.state(...)",
                    path=what,
                )
            ]
        )


def resolve_model(plan: Plan, model: Any, optimizer: Any = None, *, mesh: Mesh) -> Placement:
    """Resolve specs for a model (and optimizer) on ``mesh``; moves nothing."""
    _check_model(model, "model")
    if optimizer is not None:
        _check_model(optimizer, "optimizer")
    params, opt = specs.resolve_model(plan, model, optimizer, mesh=mesh_shape_of(mesh))
    return Placement(plan, mesh, params, opt)


def place(plan: Plan, tree: Any, mesh: Mesh, *, params: Any = None) -> Any:
    """A pytree of arrays placed per the plan (functional: returns the placed tree).

    ``params`` given: ``tree`` is optimizer state mirroring those params.
    """
    res = specs.resolve(plan, tree, params=params, mesh=mesh_shape_of(mesh))
    return jax.device_put(tree, res.shardings(mesh))


def shard_model(
    plan: Plan,
    model: Any,
    optimizer: Any = None,
    *,
    mesh: Mesh | None = None,
    axis_types: AxisTypes | None = None,
) -> Placement:
    """Place an existing NNX model (and ``nnx.Optimizer``) per the plan, in place.

    nnx.state -> NamedSharding tree -> jax.device_put -> nnx.update, for the model's
    state and the optimizer's (which mirrors the params).

    Raises:
        ShardPlanError: the plan does not fit the model or the devices.
    """
    mesh = _ensure_mesh(plan, mesh, axis_types)
    placement = resolve_model(plan, model, optimizer, mesh=mesh)
    for obj, res in ((model, placement.params), (optimizer, placement.opt)):
        if obj is None or res is None:
            continue
        state = nnx.state(obj)
        nnx.update(obj, jax.device_put(state, res.shardings(mesh)))
    return placement


def init_sharded(
    plan: Plan,
    factory: Callable[[], Any],
    tx: optax.GradientTransformation | None = None,
    *,
    wrt=nnx.Param,
    mesh: Mesh | None = None,
    axis_types: AxisTypes | None = None,
) -> tuple[Any, Any, Placement]:
    """Build a model (and its ``nnx.Optimizer``) directly sharded: no device ever holds a
    whole array that the plan shards.

    The model is first built abstractly (``nnx.eval_shape``) to resolve the plan, then
    initialised under ``jax.jit`` with ``out_shardings`` from the plan, so XLA computes
    each shard on its own device.

    Args:
        plan: the plan.
        factory: builds the model with no arguments (fixed seeds inside).
        tx: an optax transformation; when given, an ``nnx.Optimizer`` is built too.
        wrt: the optimizer's variable filter.
        mesh: the mesh (default: ``make_mesh(plan, axis_types=axis_types)``).
        axis_types: every axis ``"auto"`` or ``"explicit"``; by default each as the plan says.
            Under explicit axes the factory runs with the mesh as the mesh context, so model code
            may call ``jax.sharding.get_abstract_mesh()`` and pass ``out_sharding=`` as it builds.

    Returns:
        (model, optimizer or None, placement)
    """
    mesh = _ensure_mesh(plan, mesh, axis_types)

    def build():
        model = factory()
        return model, (nnx.Optimizer(model, tx, wrt=wrt) if tx is not None else None)

    # Eager sharding off: annotated variables would otherwise need a mesh with their
    # *logical* names; placement comes from the plan's out_shardings instead.
    with mesh_context(mesh):
        abs_model, abs_opt = abstract_model_and_optimizer(factory, tx, wrt=wrt, path="factory")
    with nnx.use_eager_sharding(False), mesh_context(mesh):
        placement = resolve_model(plan, abs_model, abs_opt, mesh=mesh)
        gm, _ = nnx.split(abs_model)
        go = nnx.split(abs_opt)[0] if abs_opt is not None else None
        out_sh = (placement.model_shardings(), placement.opt_shardings())

        def _init():
            m, o = build()
            return nnx.state(m), (nnx.state(o) if o is not None else None)

        init = jax.jit(_init, out_shardings=out_sh)
        sm, so = init()
    model = nnx.merge(gm, sm)
    optimizer = nnx.merge(go, so) if go is not None else None
    return model, optimizer, placement


def mesh_context(mesh: Mesh) -> contextlib.AbstractContextManager:
    """``jax.set_mesh(mesh)`` when ``mesh`` has explicit axes (model code typed by them reads the
    mesh from the context); nothing otherwise, as before axis types existed."""
    return jax.set_mesh(mesh) if has_explicit_axes(mesh) else contextlib.nullcontext()


def shard_batch(plan: Plan, batch: Any, mesh: Mesh) -> Any:
    """Place an input batch (any pytree of arrays) per the plan's ``batch``/``input`` rules.

    Under ``jax.distributed`` each process passes its local part; the global array is
    assembled with ``jax.make_array_from_process_local_data``.

    Raises:
        PlanCheckError: a split dimension does not divide over its mesh axes.
    """
    shape = mesh_shape_of(mesh)
    nproc = jax.process_count()
    if nproc > 1:
        local_leaves, treedef = jax.tree.flatten(batch)
        global_tree = jax.tree.unflatten(
            treedef, [jax.ShapeDtypeStruct((x.shape[0] * nproc, *x.shape[1:]), x.dtype) for x in local_leaves]
        )
        res = specs.resolve_batch(plan, global_tree, mesh=shape)
        shardings = jax.tree.leaves(res.shardings(mesh), is_leaf=lambda s: isinstance(s, NamedSharding))
        arrays = [
            jax.make_array_from_process_local_data(s, x, g.shape)
            for s, x, g in zip(shardings, local_leaves, jax.tree.leaves(global_tree))
        ]
        return jax.tree.unflatten(treedef, arrays)
    res = specs.resolve_batch(plan, batch, mesh=shape)
    return jax.device_put(batch, res.shardings(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
