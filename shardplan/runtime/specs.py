"""Resolution on live or abstract pytrees: a plan x an NNX model / state / batch -> specs.

The pure resolver (``shardplan.core.resolve``) works on leaf records; these functions
flatten pytrees into leaves and give back PartitionSpec and NamedSharding trees shaped
like the input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardplan.core import resolve as core
from shardplan.core.leaves import Leaf, Resolution, records
from shardplan.core.plan import Plan
from shardplan.core.shared import resolve_tree
from shardplan.core.spec import Spec
from shardplan.runtime import tree

_PSPECS: dict[Spec, PartitionSpec] = {}


def pspec(spec: Spec) -> PartitionSpec:
    """The ``jax.sharding.PartitionSpec`` of a spec (one object per spec)."""
    hit = _PSPECS.get(spec)
    if hit is None:
        hit = _PSPECS[spec] = PartitionSpec(*spec.entries)
    return hit


def entry(axes: Sequence[str]) -> Any:
    """A PartitionSpec entry for one dim split over ``axes``: None, one name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _only(spec: PartitionSpec, keep: set[str]) -> PartitionSpec:
    """``spec`` with the mesh axes not in ``keep`` dropped (a dim left with none is whole)."""
    return PartitionSpec(*(entry([a for a in (e if isinstance(e, tuple) else (e,)) if a in keep]) for e in spec))


def constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` laid out as ``sharding`` inside a traced function, on a mesh of any axis types: JAX's
    ``reshard`` moves the explicit axes (those are in ``x``'s type), ``with_sharding_constraint``
    the auto ones (it refuses explicit axes, and asserts instead of moving on an all-explicit
    mesh)."""
    mesh = sharding.mesh
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    explicit = {a for a, t in types.items() if t == jax.sharding.AxisType.Explicit}
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    spec = sharding.spec
    x = jax.sharding.reshard(x, NamedSharding(mesh, _only(spec, explicit)))
    auto = set(mesh.axis_names) - explicit
    if not auto:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _only(spec, auto)))


@dataclass(frozen=True)
class Resolved(Resolution):
    """A resolution of a pytree: the decisions, and the tree's shape to put specs back in."""

    rebuild: Callable[[list], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def specs(self) -> Any:
        """PartitionSpec pytree shaped like the resolved tree."""
        return self._tree([pspec(d.spec) for d in records(self.decisions)])

    def shardings(self, mesh: Mesh) -> Any:
        """The spec tree as ``NamedSharding``s on ``mesh`` (one object per spec)."""
        made: dict[Spec, NamedSharding] = {}
        out = []
        for d in records(self.decisions):
            s = made.get(d.spec)
            if s is None:
                s = made[d.spec] = NamedSharding(mesh, pspec(d.spec))
            out.append(s)
        return self._tree(out)

    def _tree(self, values: list) -> Any:
        if self.rebuild is None:
            raise ValueError("this resolution was made from leaves, not a pytree: it has no tree shape")
        return self.rebuild(values)


def _mesh(plan: Plan, devices: int | None, mesh: dict[str, int] | None) -> dict[str, int]:
    return mesh or plan.mesh_shape(jax.device_count() if devices is None else devices)


def _tree(res: Resolution, rebuild: Callable[[list], Any] | None) -> Resolved:
    return Resolved(res.mesh, res.decisions, res.warnings, rebuild)


def resolve(
    plan: Plan,
    tree_: Any,
    *,
    params: Any = None,
    devices: int | None = None,
    mesh: dict[str, int] | None = None,
    replicated_threshold: int = core.DEFAULT_REPLICATED_THRESHOLD,
) -> Resolved:
    """Map a pytree of arrays or shapes to a PartitionSpec tree, with a record per leaf.

    Args:
        plan: a checked plan.
        tree_: an NNX ``State`` or ``Module``, or any pytree of arrays /
            ``ShapeDtypeStruct``s. Leaves are params, matched by ``param`` rules,
            unless ``params`` is given.
        params: the model's params (state or pytree). When given, ``tree_`` is
            optimizer state: leaves mirror these params' specs.
        devices: device count used to infer a ``*`` mesh axis (default: all devices).
        mesh: concrete axis sizes, overriding ``devices``.
        replicated_threshold: warn for replicated tensors larger than this (bytes).

    Raises:
        PlanCheckError: with every problem found (unmatched params, spec too long,
            indivisible dimensions, ...).
    """
    sizes = _mesh(plan, devices, mesh)
    shared = tree.shared(tree_)
    pshared = tree.shared(params) if params is not None and shared is not None else None
    if shared is not None and (params is None or pshared is not None):
        res = (
            resolve_tree(plan, sizes, shared, None, replicated_threshold)
            if pshared is None
            else resolve_tree(plan, sizes, pshared, shared, replicated_threshold, report_params=False)
        )
        return _tree(res, tree.rebuilder(tree_))
    leaves, rebuild = tree.flatten(tree_)
    if params is None:
        res = core.resolve_leaves(plan, sizes, leaves, (), replicated_threshold)
    else:
        pleaves, _ = tree.flatten(params)
        res = core.resolve_leaves(plan, sizes, pleaves, leaves, replicated_threshold, report_params=False)
    return _tree(res, rebuild)


def resolve_model(
    plan: Plan,
    model: Any,
    optimizer: Any = None,
    *,
    devices: int | None = None,
    mesh: dict[str, int] | None = None,
    replicated_threshold: int = core.DEFAULT_REPLICATED_THRESHOLD,
) -> tuple[Resolved, Resolved | None]:
    """Resolve a model's state and its optimizer's in one pass: (params, optimizer state).

    Warnings are carried on the params' resolution.
    """
    sizes = _mesh(plan, devices, mesh)
    pshared = tree.shared(model)
    oshared = tree.shared(optimizer) if optimizer is not None and pshared is not None else None
    if pshared is not None and (optimizer is None or oshared is not None):
        res = resolve_tree(plan, sizes, pshared, oshared, replicated_threshold)
        n = pshared.leaves if not isinstance(pshared, Leaf) else 1
        params = Resolved(res.mesh, res.decisions[:n], res.warnings, tree.rebuilder(model))
        opt = Resolved(res.mesh, res.decisions[n:], (), tree.rebuilder(optimizer)) if optimizer is not None else None
        return params, opt
    pleaves, prebuild = tree.flatten(model)
    oleaves, orebuild = tree.flatten(optimizer) if optimizer is not None else ([], None)
    res = core.resolve_leaves(plan, sizes, pleaves, oleaves, replicated_threshold)
    n = len(pleaves)
    params = Resolved(res.mesh, res.decisions[:n], res.warnings, prebuild)
    opt = Resolved(res.mesh, res.decisions[n:], (), orebuild) if optimizer is not None else None
    return params, opt


def model_resolver(model: Any, optimizer: Any) -> Callable[..., tuple[Resolved, Resolved]]:
    """``resolve_model`` for one model and optimizer under many plans: the trees are read once
    (what a plan search costs again and again). Returns ``fn(plan, mesh=...) -> (params, opt)``."""
    pshared = tree.shared(model)
    oshared = tree.shared(optimizer) if pshared is not None else None
    if pshared is None or oshared is None:
        return lambda plan, mesh: resolve_model(plan, model, optimizer, mesh=mesh)  # type: ignore[return-value]
    n = pshared.leaves if not isinstance(pshared, Leaf) else 1
    prebuild, orebuild = tree.rebuilder(model), tree.rebuilder(optimizer)

    def resolve_for(plan: Plan, mesh: dict[str, int]) -> tuple[Resolved, Resolved]:
        res = resolve_tree(plan, _mesh(plan, None, mesh), pshared, oshared, core.DEFAULT_REPLICATED_THRESHOLD)
        return (
            Resolved(res.mesh, res.decisions[:n], res.warnings, prebuild),
            Resolved(res.mesh, res.decisions[n:], (), orebuild),
        )

    return resolve_for


def resolve_batch(
    plan: Plan, batch: Any, *, devices: int | None = None, mesh: dict[str, int] | None = None
) -> Resolved:
    """Specs for an input batch: ``input`` rules by path, then the ``batch`` spec."""
    leaves, rebuild = tree.flatten(batch)
    return _tree(core.resolve_inputs(plan, _mesh(plan, devices, mesh), leaves), rebuild)
