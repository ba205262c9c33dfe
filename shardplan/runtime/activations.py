"""Activations under the plan: what a step's intermediates are constrained to while it is traced.

Three ways a model's activations meet the plan, all applied by wrapping the loss function the
backend differentiates (the model code is not edited and imports nothing from shardplan):

- Flax logical constraints in model code (``flax.linen.with_logical_constraint(x, ("batch",
  "length", "embed"))``) follow the plan's ``axis`` rules: the step is traced under Flax's
  logical-axis-rules context built from them, and under the plan's mesh as the mesh context
  (in Flax 0.12 a logical constraint does nothing unless both are active).
- Models that name mesh axes themselves (``out_sharding=P("data", None, "model")``) find the
  plan's mesh as the mesh context, so they trace; a name the mesh lacks is a diagnostic that
  names both.
- ``act "REGEX" SPEC`` rules constrain the output of every module whose path (from the model's
  root, '/'-joined like param paths) the regex fully matches; the first matching rule wins.

Both backends trace the loss over global values under these contexts: the auto backend hands
the constraints to XLA, the shard_map backend's partitioner reshards each constrained value to
its layout (``shardplan.runtime.partition``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.linen import spmd as flax_linen_spmd
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from shardplan.core.format import fmt_shape
from shardplan.core.hlo import LIBRARY_PATHS
from shardplan.core.notes import Note
from shardplan.core.plan import Plan, Rule
from shardplan.errors import PlanApplyError, error
from shardplan.runtime.specs import constrain, pspec

LossFn = Callable[[Any, Any], jax.Array]
Target = tuple[str, Rule, Any]  # (module path, the act rule that matched it, the module)


def logical_rules(plan: Plan) -> tuple[tuple[str, Any], ...]:
    """The plan's ``axis`` rules as Flax logical-axis rules: ``axis embed -> model`` is
    ``("embed", "model")``; several mesh axes a tuple, ``_`` None."""
    out = []
    for a in plan.axes:
        target: Any = None if not a.axes else a.axes[0] if len(a.axes) == 1 else tuple(a.axes)
        out.append((a.logical, target))
    return tuple(out)


def module_paths(model: Any) -> Iterator[tuple[str, Any]]:
    """(path, module) for every module of ``model``, paths '/'-joined like param paths (the root
    is '')."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            yield "/".join(str(p) for p in path), node


class _Calls(threading.local):
    def __init__(self) -> None:
        self.inside: set[int] = set()


_calls = _Calls()
_MISSING = object()


@contextlib.contextmanager
def _constrained_calls(
    targets: dict[int, Target], mesh: Mesh | AbstractMesh, applied: dict[str, int]
) -> Iterator[None]:
    """Module classes whose instances are targets get a ``__call__`` that constrains the output
    of those instances (and only those); restored on exit. (NNX has no method interceptor;
    the patch lives only while the loss is traced.)"""
    classes = {type(t[2]) for t in targets.values()}
    saved: dict[type, Any] = {}
    for cls in classes:
        saved[cls] = cls.__dict__.get("__call__", _MISSING)
        original = cls.__call__

        def call(self, *args, __original=original, **kwargs):
            key = id(self)
            if key not in targets or key in _calls.inside:
                return __original(self, *args, **kwargs)
            _calls.inside.add(key)
            try:
                out = __original(self, *args, **kwargs)
            finally:
                _calls.inside.discard(key)
            path, rule, _ = targets[key]
            applied[path] = applied.get(path, 0) + 1
            return _constrain(out, path, rule, mesh)

        cls.__call__ = call
    try:
        yield
    finally:
        for cls, before in saved.items():
            if before is _MISSING:
                del cls.__call__
            else:
                cls.__call__ = before


def _constrain(out: Any, path: str, rule: Rule, mesh: Mesh | AbstractMesh) -> Any:
    leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "ndim")]
    fitted = [
        x
        for x in leaves
        if rule.spec.for_rank(x.ndim) is not None and (rule.spec.open or x.ndim == len(rule.spec.dims))
    ]
    if not fitted:
        ranks = ", ".join(str(x.ndim) for x in leaves) or "no arrays"
        raise PlanApplyError(
            [
                error(
                    "act-rank",
                    f"the act rule at {rule.origin} matched module '{path}', whose output has rank {ranks}, "
                    f"not the {len(rule.spec.dims)} dims of {rule.spec}",
                    "write the spec with the output's rank (or (..., axis) for the trailing dims), or narrow the regex",
                    span=rule.spec_span,
                    source_line=rule.source_line,
                )
            ]
        )

    def one(x: Any) -> Any:
        if not hasattr(x, "ndim") or not any(x is f for f in fitted):
            return x
        spec = rule.spec.for_rank(x.ndim)
        assert spec is not None
        for i, axes in enumerate(spec.dims):
            n = 1
            for a in axes:
                n *= mesh.shape[a]
            if x.shape[i] % n:
                raise PlanApplyError(
                    [
                        error(
                            "indivisible",
                            f"module '{path}' outputs shape {fmt_shape(tuple(x.shape))}: dim {i} ({x.shape[i]}) is not "
                            f"divisible by {' x '.join(f'{a}={mesh.shape[a]}' for a in axes)} ({n}) from the act rule "
                            f"at {rule.origin}",
                            f"split dim {i} over axes whose sizes divide {x.shape[i]}, or leave it whole (_)",
                            span=rule.spec_span,
                            source_line=rule.source_line,
                        )
                    ]
                )
        # The scope names the rule, so the step-cost stage can say which constraint is whose.
        where = f"{os.path.basename(rule.span.file)}:{rule.span.line}"
        with jax.named_scope(f"act rule {where} on {path.replace('/', '.')}"):
            return constrain(x, NamedSharding(mesh, pspec(spec)))

    return jax.tree.map(one, out)


def _user_frame() -> str:
    """'file:line' of the innermost frame of the user's code on the stack (not jax, flax, shardplan)."""
    for frame in reversed(traceback.extract_stack()):
        if not any(p in frame.filename for p in LIBRARY_PATHS):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return ""


@contextlib.contextmanager
def _names_seen(rules: tuple, unknown: dict[str, str], used: set[str]) -> Iterator[None]:
    """Record the logical names model code constrains with (``used``), and those no rule maps
    (``unknown``): Flax keeps such a dim whole (replicated), which is rarely what a plan that
    maps the others meant."""
    module = flax_linen_spmd
    original = getattr(module, "_logical_to_mesh_axes", None)
    if original is None or not rules:
        yield
        return
    mapped = {name for name, _ in rules}

    def translate(array_dim_names, rules=None):
        for name in array_dim_names or ():
            if isinstance(name, str):
                used.add(name)
                if name not in mapped and name not in unknown:
                    unknown[name] = _user_frame()
        return original(array_dim_names, rules)

    module._logical_to_mesh_axes = translate
    try:
        yield
    finally:
        module._logical_to_mesh_axes = original


@contextlib.contextmanager
def _per_device_constraints() -> Iterator[None]:
    """Inside shard_map every mesh axis is manual and each device holds its local block: a
    model's own ``with_sharding_constraint`` (a global layout, e.g. ``P("data", None, "model")``)
    has nothing to constrain there, and JAX would reject it. While the loss is traced for the
    shard_map backend, constraints under an all-manual mesh are dropped (values are unchanged:
    a constraint never changes a value); any other constraint is passed on as written."""
    original = jax.lax.with_sharding_constraint

    def constraint(x, shardings):
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and mesh.axis_types and all(t == AxisType.Manual for t in mesh.axis_types):
            return x
        return original(x, shardings)

    jax.lax.with_sharding_constraint = constraint
    try:
        yield
    finally:
        jax.lax.with_sharding_constraint = original


class Activations:
    """How a plan constrains a step's activations on one mesh and backend.

    ``wrap(loss_fn)`` is the loss the backend differentiates; ``applied`` counts, per module
    path, the outputs an ``act`` rule constrained in the traces so far.
    """

    def __init__(self, plan: Plan, mesh: Mesh | AbstractMesh, backend: str = "auto"):
        self.plan = plan
        self.mesh = mesh
        self.backend = backend
        self.rules = logical_rules(plan)
        self.applied: dict[str, int] = {}
        # Logical names model code constrained with that no axis rule maps (Flax then keeps
        # those dims whole): name -> where the model first constrains with it ('file:line').
        self.unknown: dict[str, str] = {}
        self.used: set[str] = set()  # every logical name model code constrained with
        self.matched: dict[str, str] = {}  # module path -> origin of the act rule that matched it

    def notes(self) -> list[Note]:
        """What the traces so far say about the plan's activation rules, for reports."""
        out = []
        if self.unknown:
            names = ", ".join(f"'{n}'" + (f" (at {w})" if w else "") for n, w in sorted(self.unknown.items()))
            out.append(
                Note(
                    "act-names-unmapped",
                    f"the model constrains activations with logical name(s) {names} that no axis rule maps: Flax "
                    "keeps those dims whole (replicated); add axis rules for them (axis NAME -> _ leaves a dim "
                    "unsplit on purpose)",
                )
            )
        idle = sorted(p for p in self.matched if p not in self.applied)
        if idle:
            out.append(
                Note(
                    "act-rules-idle",
                    f"act rules matched module(s) {', '.join(idle[:4])}{' ...' if len(idle) > 4 else ''} whose calls "
                    "were not constrained: they run inside an nnx transform (scan, vmap, remat), which calls copies "
                    "of the module; constrain inside such layers with logical names in the model instead",
                )
            )
        return out

    def targets(self, model: Any) -> dict[int, Target]:
        if not self.plan.acts:
            return {}
        ruleset = self.plan.rule_sets["act"]
        out: dict[int, Target] = {}
        for path, module in module_paths(model):
            hits = ruleset.matches(path)
            if hits:
                rule = ruleset.rules[min(hits)]
                out[id(module)] = (path, rule, module)
                self.matched[path] = rule.origin
        return out

    @contextlib.contextmanager
    def tracing(self, mesh_context: bool | None = None) -> Iterator[None]:
        """The contexts a step is traced under: the plan's logical-axis rules, and (auto backend,
        or ``mesh_context``) the plan's mesh as the mesh context. The abstract mesh, which
        ``jax.jit`` allows inside a trace (``jax.set_mesh`` only outside)."""
        if mesh_context is None:
            mesh_context = self.backend == "auto"
        with flax_spmd.logical_axis_rules(self.rules), _names_seen(self.rules, self.unknown, self.used):
            if mesh_context:
                abstract = self.mesh if isinstance(self.mesh, AbstractMesh) else self.mesh.abstract_mesh
                with jax.sharding.use_abstract_mesh(abstract):
                    yield
            else:
                with _per_device_constraints():
                    yield

    def wrap(self, loss_fn: LossFn, mesh_context: bool | None = None) -> LossFn:
        """``loss_fn`` traced under the plan's activation constraints (``mesh_context``: see
        ``tracing``; the shard_map backend checks a loss outside shard_map with one)."""

        def constrained(model, batch):
            with self.tracing(mesh_context), _constrained_calls(self.targets(model), self.mesh, self.applied):
                return loss_fn(model, batch)

        constrained.__wrapped__ = loss_fn  # type: ignore[attr-defined]
        return constrained
