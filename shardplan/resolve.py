"""Stage 3: a plan x leaf shapes -> one decided spec per leaf, with every problem found.

Pure and jax-free: leaves are (path, shape, dtype) records, so a plan checks against a
shapes file without importing jax. ``shardplan.tree`` turns pytrees into leaves and back.

Precedence for a param leaf (documented in docs/language.md):
  1. ``param`` rules, in file order; the first whose regex full-matches the path wins;
  2. the param's Flax logical-axis annotation, mapped through ``axis`` rules;
  3. the ``default`` spec;
  4. otherwise an error: the param matches nothing.
For an optimizer-state leaf: ``opt`` rules; then the spec of the param it mirrors (same
path suffix and shape); scalars and everything else replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from shardplan.errors import Diagnostic, PlanCheckError, error, warning
from shardplan.plan import Plan, Rule, RuleSet, Spec

Role = Literal["param", "opt", "input"]
How = Literal["rule", "axes", "default", "mirror", "scalar", "replicated", "batch"]


@dataclass(frozen=True)
class Leaf:
    """What resolution needs of an array: its path, shape, dtype and Flax annotation."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    names: tuple | None = None  # nnx.with_partitioning logical names, if any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Decision:
    """The spec decided for one leaf and why."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    spec: Spec
    how: How
    origin: str  # 'file:line' of the deciding rule, or the mirrored param's path
    role: Role
    shard_shape: tuple[int, ...]

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def partition_spec(self):
        return self.spec.partition_spec()


@dataclass(frozen=True)
class Resolution:
    """The result of resolving a tree: per-leaf decisions, warnings, and the spec tree."""

    mesh: dict[str, int]
    decisions: tuple[Decision, ...]
    warnings: tuple[Diagnostic, ...]
    specs: Any = None  # PartitionSpec pytree shaped like the resolved tree

    def with_specs(self, rebuild: Callable[[list], Any]) -> "Resolution":
        return replace(self, specs=rebuild([d.partition_spec() for d in self.decisions]))

    def bytes_per_device(self, role: Role | None = None) -> int:
        return sum(d.bytes_per_device for d in self.decisions if role is None or d.role == role)

    def by_path(self) -> dict[str, Decision]:
        return {d.path: d for d in self.decisions}

    def shardings(self, mesh):
        """The spec tree as ``NamedSharding``s on a ``jax.sharding.Mesh``."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.tree.map(lambda p: NamedSharding(mesh, p), self.specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))


class _Resolver:
    def __init__(self, plan: Plan, mesh: dict[str, int], threshold: int):
        self.plan = plan
        self.mesh = mesh
        self.threshold = threshold
        self.diags: list[Diagnostic] = []
        self.axis_map = {a.logical: a for a in plan.axes}
        # Keyed by id(rule): hashing a frozen dataclass per leaf would dominate big states.
        self.matched: dict[int, int] = {}
        self.decided: dict[int, int] = {}
        self.first_path: dict[int, str] = {}
        self.shadowed_by: dict[int, Rule] = {}

    # -- checking one decided spec against one leaf --------------------------------------
    def fits(self, leaf: Leaf, spec: Spec, rule: Rule | None, what: str) -> bool:
        span = rule.spec_span if rule is not None else None
        line = rule.source_line if rule is not None else None
        ok = True
        if len(spec.dims) > len(leaf.shape):
            self.diags.append(error(
                "spec-too-long", f"{leaf.path} has rank {len(leaf.shape)} (shape {_shape(leaf.shape)}) but "
                f"{what} gives {len(spec.dims)} dims {spec}",
                "shorten the spec to the array's rank, or narrow the rule's regex so it does not "
                "match this array", span=span, path=leaf.path, source_line=line))
            return False
        for i, axes in enumerate(spec.dims):
            n = math.prod(self.mesh[a] for a in axes) if axes else 1
            if leaf.shape[i] % n:
                sizes = " x ".join(f"{a}={self.mesh[a]}" for a in axes)
                self.diags.append(error(
                    "indivisible", f"{leaf.path} has shape {_shape(leaf.shape)}: dim {i} ({leaf.shape[i]}) "
                    f"is not divisible by {sizes} ({n}) from {what}",
                    f"split dim {i} over axes whose sizes divide {leaf.shape[i]}, leave it whole (_), "
                    "or change the mesh", span=span, path=leaf.path, source_line=line))
                ok = False
        return ok

    def decision(self, leaf: Leaf, spec: Spec, how: How, origin: str, role: Role) -> Decision:
        return Decision(leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, spec, how, origin, role,
                        spec.shard_shape(leaf.shape, self.mesh))

    # -- params -------------------------------------------------------------------------
    def from_rules(self, leaf: Leaf, rules: tuple[Rule, ...], ruleset: RuleSet) -> Rule | None:
        hits = ruleset.matches(leaf.path)
        if not hits:
            return None
        first = min(hits)
        for i in hits:
            k = id(rules[i])
            self.matched[k] = self.matched.get(k, 0) + 1
            self.first_path.setdefault(k, leaf.path)
            if i != first:
                self.shadowed_by.setdefault(k, rules[first])
        winner = rules[first]
        self.decided[id(winner)] = self.decided.get(id(winner), 0) + 1
        return winner

    def from_annotation(self, leaf: Leaf) -> Spec | None:
        if not self.axis_map or not leaf.names:
            return None
        dims, seen = [], {}
        for name in leaf.names:
            if name is None:
                dims.append(())
                continue
            rule = self.axis_map.get(name)
            if rule is None:
                self.diags.append(warning(
                    "unmapped-logical-axis", f"{leaf.path} is annotated with logical axis '{name}', which "
                    "no axis rule maps; that dimension stays whole",
                    f"add 'axis {name} -> <mesh axis>' (or 'axis {name} -> _' to silence this)",
                    path=leaf.path))
                dims.append(())
                continue
            for a in rule.axes:
                if a in seen:
                    self.diags.append(error(
                        "axis-reused", f"{leaf.path}: logical axes '{seen[a]}' and '{name}' both map to "
                        f"mesh axis '{a}'", "map them to different mesh axes, or one of them to _",
                        span=rule.span, path=leaf.path, source_line=rule.source_line))
                    return Spec(())
                seen[a] = name
            dims.append(rule.axes)
        return Spec(tuple(dims))

    def param(self, leaf: Leaf) -> Decision | None:
        plan = self.plan
        rule = self.from_rules(leaf, plan.params, plan._sets["param"])
        if rule is not None:
            ok = self.fits(leaf, rule.spec, rule, f"the rule at {rule.origin}")
            return self.decision(leaf, rule.spec if ok else Spec(()), "rule", rule.origin, "param")
        spec = self.from_annotation(leaf)
        if spec is not None:
            ok = self.fits(leaf, spec, None, f"its annotation {tuple(leaf.names)} via the axis rules")
            return self.decision(leaf, spec if ok else Spec(()), "axes", "annotation", "param")
        if plan.default is not None:
            where = f"{plan.default_span.file}:{plan.default_span.line}" if plan.default_span else "default"
            ok = self.fits(leaf, plan.default, None, f"the default at {where}")
            return self.decision(leaf, plan.default if ok else Spec(()), "default", where, "param")
        self.diags.append(error(
            "unmatched-param", f"{leaf.path} (shape {_shape(leaf.shape)}) matches no param rule",
            'add a rule for it, or a fallback: default replicated (or param ".*" replicated)',
            path=leaf.path))
        return None

    # -- optimizer state ----------------------------------------------------------------
    def opt(self, leaf: Leaf, params: dict[str, Decision]) -> Decision:
        plan = self.plan
        rule = self.from_rules(leaf, plan.opts, plan._sets["opt"])
        if rule is not None:
            ok = self.fits(leaf, rule.spec, rule, f"the rule at {rule.origin}")
            return self.decision(leaf, rule.spec if ok else Spec(()), "rule", rule.origin, "opt")
        mirrored = _mirror(leaf, params)
        if mirrored is not None:
            return self.decision(leaf, mirrored.spec, "mirror", mirrored.path, "opt")
        if not leaf.shape:
            return self.decision(leaf, Spec(()), "scalar", "scalar", "opt")
        return self.decision(leaf, Spec(()), "replicated", "mirrors no param", "opt")

    # -- rule usage warnings -------------------------------------------------------------
    def usage(self, rules: tuple[Rule, ...], what: str):
        for r in rules:
            k = id(r)
            if not self.matched.get(k):
                self.diags.append(warning(
                    "unused-rule", f"{r.kind} rule \"{r.pattern}\" matches no {what}",
                    "check the regex against the paths `shardplan check` lists (it must match the "
                    "whole path), or delete the rule", span=r.pattern_span, source_line=r.source_line))
            elif not self.decided.get(k):
                by = self.shadowed_by[k]
                self.diags.append(warning(
                    "shadowed-rule", f"{r.kind} rule \"{r.pattern}\" matches {self.matched[k]} {what}(s), "
                    f"but an earlier rule decides each (e.g. {self.first_path[k]} by {by.origin})",
                    "move this rule above the broader one, or delete it",
                    span=r.span, source_line=r.source_line))

    def big_replicated(self, decisions):
        for d in decisions:
            if d.spec.is_replicated and d.nbytes > self.threshold and d.role != "input":
                self.diags.append(warning(
                    "large-replicated", f"{d.path} ({_shape(d.shape)} {d.dtype}, {_mib(d.nbytes)}) is "
                    f"replicated on every device (decided by {d.origin})",
                    "shard it with a rule, or raise the threshold (--replicated-threshold)", path=d.path))


def _mirror(leaf: Leaf, params: dict[str, Decision]) -> Decision | None:
    """The param whose path is the longest proper suffix of ``leaf.path``, with the same shape."""
    path = leaf.path
    i = path.find("/")
    while i >= 0:
        d = params.get(path[i + 1:])
        if d is not None and d.shape == leaf.shape:
            return d
        i = path.find("/", i + 1)
    return None


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _raise_or_warnings(diags: list[Diagnostic], plan_warnings=()) -> tuple[Diagnostic, ...]:
    if any(d.severity == "error" for d in diags):
        # Errors first; warnings stay visible after them.
        raise PlanCheckError(sorted(diags, key=lambda d: d.severity != "error"))
    return tuple(plan_warnings) + tuple(diags)


def resolve_leaves(plan: Plan, mesh: dict[str, int], params: list[Leaf] | tuple[Leaf, ...],
                   opt_state: list[Leaf] | tuple[Leaf, ...] = (),
                   replicated_threshold: int = 64 * 2**20, *, report_params: bool = True) -> Resolution:
    """Decide every param leaf, then every optimizer-state leaf (mirroring the params).

    Returns decisions for params and optimizer state (params omitted when
    ``report_params`` is false, as when resolving an optimizer state alone).

    Raises:
        PlanCheckError: every error found, together (warnings included after them).
    """
    _check_mesh_names(plan, mesh)
    r = _Resolver(plan, mesh, replicated_threshold)
    pdec = [d for d in (r.param(leaf) for leaf in params) if d is not None]
    if report_params:
        r.usage(plan.params, "param")
    else:
        r.diags = [d for d in r.diags if d.severity == "error"]
    by_path = {d.path: d for d in pdec}
    odec = [r.opt(leaf, by_path) for leaf in opt_state]
    if opt_state:
        r.usage(plan.opts, "optimizer-state leaf")
    decisions = (pdec if report_params else []) + odec
    r.big_replicated(decisions)
    warnings = _raise_or_warnings(r.diags, plan.warnings)
    return Resolution(dict(mesh), tuple(decisions), warnings)


def resolve_inputs(plan: Plan, mesh: dict[str, int], leaves: list[Leaf]) -> Resolution:
    """Specs for input-batch leaves: ``input`` rules by path, then the ``batch`` spec.

    Trailing whole (``_``) dims beyond an input's rank are dropped, so ``batch (data, _)``
    fits 1-D labels too; split dims beyond the rank are an error.
    """
    _check_mesh_names(plan, mesh)
    r = _Resolver(plan, mesh, 0)
    out = []
    for leaf in leaves:
        rule = r.from_rules(leaf, plan.inputs, plan._sets["input"])
        if rule is not None:
            spec, origin, how, what = rule.spec, rule.origin, "rule", f"the input rule at {rule.origin}"
        elif plan.batch is not None:
            where = f"{plan.batch_span.file}:{plan.batch_span.line}" if plan.batch_span else "batch"
            spec, origin, how, what = plan.batch, where, "batch", f"the batch spec at {where}"
        else:
            spec, origin, how, what = Spec(()), "no batch rule", "replicated", "no batch rule"
        dims = spec.dims
        while len(dims) > len(leaf.shape) and not dims[-1]:
            dims = dims[:-1]
        spec = Spec(dims)
        ok = r.fits(leaf, spec, rule, what)
        out.append(r.decision(leaf, spec if ok else Spec(()), how, origin, "input"))
    r.usage(plan.inputs, "input")
    return Resolution(dict(mesh), tuple(out), _raise_or_warnings(r.diags))


def _check_mesh_names(plan: Plan, mesh: dict[str, int]):
    missing = [a for a in plan.axis_names if a not in mesh]
    if missing:
        raise PlanCheckError([error("mesh-mismatch", f"mesh sizes given for {sorted(mesh)} but the plan's "
                                    f"mesh has axes {list(plan.axis_names)}",
                                    "pass sizes for exactly the plan's axes", path="mesh")])
