"""Resolution: a plan x leaf shapes -> one decided spec per leaf, with every problem found.

Pure and jax-free: leaves are (path, shape, dtype) records, so a plan checks against a
shapes file without importing jax. ``shardplan.runtime.tree`` turns pytrees into leaves
and back.

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
from collections.abc import Callable, Sequence

from shardplan.core.automaton import Automaton
from shardplan.core.explain import first_hits, near_misses, nearest
from shardplan.core.format import fmt_bytes, fmt_shape
from shardplan.core.leaves import Decision, How, Leaf, Resolution, Role
from shardplan.core.meshes import closest
from shardplan.core.plan import Plan, Rule, RuleKind
from shardplan.core.spec import REPLICATED, Spec
from shardplan.errors import Diagnostic, PlanCheckError, error, warning

DEFAULT_REPLICATED_THRESHOLD = 64 * 2**20  # bytes; a larger replicated tensor is warned about
MAX_NEAR_MISSES = 20  # unused rules per kind whose near miss is searched for, where sampled
SAMPLE = 5000  # distinct match keys (paths) a sampled near miss is searched among


class _Resolver:
    """One resolution pass. Per-leaf work is lookups: rule matches are memoised per
    digit-normalised path (when the rules cannot tell digits apart, see RuleSet), fit
    checks and shard shapes per (shape, spec)."""

    def __init__(self, plan: Plan, mesh: dict[str, int], threshold: int):
        self.plan = plan
        self.mesh = mesh
        self.threshold = threshold
        self.diags: list[Diagnostic] = []
        self.axis_map = {a.logical: a for a in plan.axes}
        # Per rule kind: normalised path -> (winning index or -1, all hit indices), and how
        # many leaves each normalised path stood for (usage counts come from these at the end).
        self.memo: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {"param": {}, "opt": {}, "input": {}}
        self.seen: dict[str, dict[str, list]] = {"param": {}, "opt": {}, "input": {}}
        self.fit_memo: dict[tuple, tuple[bool, tuple[int, ...]]] = {}
        self.last_mirror = [""]
        self.grouped: dict[tuple[str, object], list] = {}

    # -- checking one decided spec against one leaf --------------------------------------
    def shard(self, shape: tuple[int, ...], spec: Spec) -> tuple[bool, tuple[int, ...]]:
        key = (shape, spec)
        hit = self.fit_memo.get(key)
        if hit is None:
            ok = len(spec.dims) <= len(shape) and all(
                shape[i] % math.prod(self.mesh[a] for a in axes) == 0 for i, axes in enumerate(spec.dims) if axes
            )
            hit = self.fit_memo[key] = (ok, spec.shard_shape(shape, self.mesh) if ok else shape)
        return hit

    def misfit(self, leaf: Leaf, spec: Spec, rule: Rule | None, what: str) -> None:
        """Report why ``spec`` does not fit ``leaf`` (only called when it does not)."""
        span = rule.spec_span if rule is not None else None
        line = rule.source_line if rule is not None else None
        if len(spec.dims) > len(leaf.shape):
            self.diags.append(
                error(
                    "spec-too-long",
                    f"{leaf.path} has rank {len(leaf.shape)} (shape {fmt_shape(leaf.shape)}) but "
                    f"{what} gives {len(spec.dims)} dims {spec}",
                    "shorten the spec to the array's rank, or narrow the rule's regex so it does not match this array",
                    span=span,
                    path=leaf.path,
                    source_line=line,
                )
            )
            return
        for i, axes in enumerate(spec.dims):
            n = math.prod(self.mesh[a] for a in axes) if axes else 1
            if leaf.shape[i] % n:
                sizes = " x ".join(f"{a}={self.mesh[a]}" for a in axes) + (f" = {n}" if len(axes) > 1 else "")
                self.diags.append(
                    error(
                        "indivisible",
                        f"{leaf.path} has shape {fmt_shape(leaf.shape)}: dim {i} ({leaf.shape[i]}) "
                        f"is not divisible by {sizes} from {what}",
                        f"split dim {i} over axes whose sizes divide {leaf.shape[i]}, leave it whole (_), "
                        "or change the mesh",
                        span=span,
                        path=leaf.path,
                        source_line=line,
                    )
                )

    def decide(
        self, leaf: Leaf, spec: Spec, how: How, origin: str, role: Role, rule: Rule | None, what: str
    ) -> Decision:
        if spec.open:
            concrete = spec.for_rank(len(leaf.shape))
            if concrete is None:
                self.diags.append(
                    error(
                        "spec-too-long",
                        f"{leaf.path} has rank {len(leaf.shape)} (shape {fmt_shape(leaf.shape)}) but {what} "
                        f"names {spec.named} dims {spec}",
                        "name fewer dims, or narrow the rule's regex so it does not match this array",
                        span=rule.spec_span if rule is not None else None,
                        path=leaf.path,
                        source_line=rule.source_line if rule is not None else None,
                    )
                )
                return Decision(
                    leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, REPLICATED, how, origin, role, leaf.shape
                )
            spec = concrete
        ok, shard = self.shard(leaf.shape, spec)
        if not ok:
            self.misfit(leaf, spec, rule, what)
            spec = REPLICATED
            shard = leaf.shape
        return Decision(leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, spec, how, origin, role, shard)

    # -- rule matching -------------------------------------------------------------------
    def match(self, kind: RuleKind, path: str) -> Rule | None:
        ruleset = self.plan.rule_sets[kind]
        if not ruleset.rules:
            return None
        key = ruleset.key(path)
        memo = self.memo[kind]
        hit = memo.get(key)
        if hit is None:
            hits = ruleset.matches(path)
            hit = memo[key] = (min(hits), tuple(hits)) if hits else (-1, ())
            self.seen[kind][key] = [0, path]
        self.seen[kind][key][0] += 1
        return ruleset.rules[hit[0]] if hit[0] >= 0 else None

    def note(self, code: str, key: object, leaf: Leaf | Decision) -> None:
        """A per-leaf warning, grouped with others of the same code and key (see flush)."""
        self.grouped.setdefault((code, key), []).append(leaf)

    def flush(self) -> None:
        """One warning per group of per-leaf warnings: 37 params annotated with one unmapped
        name are one warning naming a few of them, not 37."""
        for (code, key), items in self.grouped.items():
            self.diags.append(_grouped_warning(code, key, items))
        self.grouped.clear()

    def from_annotation(self, leaf: Leaf) -> Spec | None:
        if not self.axis_map or not leaf.names:
            return None
        if len(leaf.names) < len(leaf.shape):
            self.note("annotation-rank", None, leaf)
        dims: list[tuple[str, ...]] = []
        seen: dict[str, str] = {}
        for name in leaf.names:
            if name is None:
                dims.append(())
                continue
            rule = self.axis_map.get(name)
            if rule is None:
                self.note("unmapped-logical-axis", name, leaf)
                dims.append(())
                continue
            for a in rule.axes:
                if a in seen:
                    self.diags.append(
                        error(
                            "axis-reused",
                            f"{leaf.path}: logical axes '{seen[a]}' and '{name}' both map to mesh axis '{a}'",
                            "map them to different mesh axes, or one of them to _",
                            span=rule.span,
                            path=leaf.path,
                            source_line=rule.source_line,
                        )
                    )
                    return REPLICATED
                seen[a] = name
            dims.append(rule.axes)
        return Spec(tuple(dims))

    # -- params -------------------------------------------------------------------------
    def param(self, leaf: Leaf) -> Decision | None:
        plan = self.plan
        rule = self.match("param", leaf.path)
        if rule is not None:
            return self.decide(leaf, rule.spec, "rule", rule.origin, "param", rule, f"the rule at {rule.origin}")
        spec = self.from_annotation(leaf)
        if spec is not None:
            return self.decide(
                leaf,
                spec,
                "axes",
                "annotation",
                "param",
                None,
                f"its annotation {leaf.names} via the axis rules",
            )
        if plan.default is not None:
            where = f"{plan.default_span.file}:{plan.default_span.line}" if plan.default_span else "default"
            return self.decide(leaf, plan.default, "default", where, "param", None, f"the default at {where}")
        hint = 'add a rule for it, or a fallback: default replicated (or param ".*" replicated)'
        if leaf.path.startswith("opt_state/") or leaf.path == "step":
            hint = (
                "this looks like optimizer state resolved as params: use plan.resolve(opt_state, "
                "params=model_state) or plan.resolve_model(model, optimizer)"
            )
        self.diags.append(
            error(
                "unmatched-param",
                f"{leaf.path} (shape {fmt_shape(leaf.shape)}) matches no param rule",
                hint,
                path=leaf.path,
            )
        )
        return None

    # -- model state that is not a param -----------------------------------------------
    def state(self, leaf: Leaf) -> Decision:
        """BatchNorm statistics, RNG keys and counters, caches: placed by a ``param`` rule or an
        annotation that names them, else replicated; the ``default`` is for params only."""
        rule = self.match("param", leaf.path)
        if rule is not None:
            return self.decide(leaf, rule.spec, "rule", rule.origin, "state", rule, f"the rule at {rule.origin}")
        spec = self.from_annotation(leaf)
        if spec is not None:
            what = f"its annotation {leaf.names} via the axis rules"
            return self.decide(leaf, spec, "axes", "annotation", "state", None, what)
        origin = f"{leaf.kind}, not a param"
        return Decision(
            leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, REPLICATED, "state", origin, "state", leaf.shape
        )

    def stacked_splits(self, pdec: Sequence[Decision]) -> None:
        """Warn where a rule written for fewer dims splits the leading (layer) axis of stacked arrays.

        Stacked: under one top-level module, at least 3 arrays, no numbered path component, all of
        rank >= 2 with one leading dim >= 2 (what nnx.vmap / nnx.scan over layers produce; a
        norm's scale becomes (L, d)). The sign of the mistake: the rule names fewer dims than the
        array has, and splits dim 0.
        """
        groups: dict[str, list[Decision]] = {}
        for leaf in pdec:
            if leaf.role == "param":
                groups.setdefault(leaf.path.split("/", 1)[0], []).append(leaf)
        stacked: dict[str, int] = {}
        for top, leaves in groups.items():
            lead = {leaf.shape[0] if len(leaf.shape) >= 2 else -1 for leaf in leaves}
            numbered = any(part.isdigit() for leaf in leaves for part in leaf.path.split("/"))
            if len(leaves) >= 3 and len(lead) == 1 and min(lead) >= 2 and not numbered:
                stacked[top] = min(lead)
        if not stacked:
            return
        rules = {r.origin: r for r in self.plan.params}
        for d in pdec:
            rule = rules.get(d.origin) if d.how == "rule" else None
            top = d.path.split("/", 1)[0]
            if rule is not None and top in stacked and not rule.spec.open and rule.spec.dims and rule.spec.dims[0]:
                if len(rule.spec.dims) < len(d.shape) and d.shard_shape[0] != d.shape[0]:
                    self.note("stacked-axis-split", rule, d)

    def axis_usage(self, leaves: list[Leaf] | tuple[Leaf, ...]) -> None:
        """Warn at each ``axis`` rule whose logical name no leaf's annotation carries."""
        if not self.plan.axes:
            return
        names = {n for leaf in leaves if leaf.names for n in leaf.names if n is not None}
        for rule in self.plan.axes:
            if rule.logical in names:
                continue
            if not names:
                msg = (
                    f"axis rule '{rule.logical}' places no param: no array of this model carries logical-axis "
                    "annotations (nnx.with_partitioning); it applies only to activations the model constrains "
                    "with that name"
                )
                hint = (
                    "annotate the model's params with nnx.with_partitioning, or place them with param rules; "
                    "`check --step` lists the activations the model constrains"
                )
            else:
                msg = (
                    f"axis rule '{rule.logical}' maps a logical axis that no param is annotated with (it applies "
                    "only to activations the model constrains with that name)"
                )
                near = closest(rule.logical, names)
                hint = f"{near + ' ' if near else ''}the model's logical axes: {', '.join(sorted(names)[:12])}"
            self.diags.append(warning("unused-axis-rule", msg, hint, span=rule.span, source_line=rule.source_line))

    # -- optimizer state ----------------------------------------------------------------
    def opt(self, leaf: Leaf, params: dict[str, Decision]) -> Decision:
        rule = self.match("opt", leaf.path)
        if rule is not None:
            return self.decide(leaf, rule.spec, "rule", rule.origin, "opt", rule, f"the rule at {rule.origin}")
        mirrored = _mirror(leaf, params, self.last_mirror)
        if mirrored is not None:
            return Decision(
                leaf.path,
                leaf.shape,
                leaf.dtype,
                leaf.itemsize,
                mirrored.spec,
                "mirror",
                mirrored.path,
                "opt",
                mirrored.shard_shape,
            )
        if not leaf.shape:
            return Decision(leaf.path, (), leaf.dtype, leaf.itemsize, REPLICATED, "scalar", "scalar", "opt", ())
        return Decision(
            leaf.path,
            leaf.shape,
            leaf.dtype,
            leaf.itemsize,
            REPLICATED,
            "replicated",
            "mirrors no param",
            "opt",
            leaf.shape,
        )

    # -- rule usage warnings -------------------------------------------------------------
    def usage(
        self,
        kind: RuleKind,
        what: str,
        sample: Callable[[], list[str]] | None = None,
        walk: Callable[[Automaton], dict[int, str]] | None = None,
    ) -> None:
        """Unused and shadowed rules of one kind. An unused rule's near miss comes from one
        automaton run over every path (``explain.near_misses``; ``walk`` runs it over a shared
        tree, by default it reads the distinct match keys' paths). Where the automaton does not
        model the rules, near misses are searched among the paths of the first distinct match
        keys (``sample`` gives them where the memo holds fewer), for the first few rules."""
        ruleset = self.plan.rule_sets[kind]
        rules = ruleset.rules
        matched = [0] * len(rules)
        decided = [0] * len(rules)
        first_path: dict[int, str] = {}
        shadowed_by: dict[int, int] = {}
        for key, (win, hits) in self.memo[kind].items():
            count, path = self.seen[kind][key]
            for i in hits:
                matched[i] += count
                first_path.setdefault(i, path)
                if i != win:
                    shadowed_by.setdefault(i, win)
            if win >= 0:
                decided[win] += count
        unused = [i for i in range(len(rules)) if not matched[i]]
        seen = self.seen[kind]
        hints = near_misses(ruleset, unused, walk or (lambda auto: first_hits(auto, (p for _, p in seen.values()))))
        if hints is None:  # sampled: near misses for the first few unused rules only (bounded work)
            paths = sample() if sample is not None else [p for _, p in list(seen.values())[:SAMPLE]]
            found = {i: nearest(rules[i].pattern, paths) for i in unused[:MAX_NEAR_MISSES]} if paths else {}
            hints = {i: near for i, near in found.items() if near}
        for i, r in enumerate(rules):
            if not matched[i]:
                near = hints.get(i, "")
                self.diags.append(
                    warning(
                        "unused-rule",
                        f'{r.kind} rule "{r.pattern}" matches no {what}' + (f"; near miss: {near}" if near else ""),
                        "check the regex against the paths `shardplan check` lists (it must match the "
                        "whole path), or delete the rule; `shardplan explain PLAN PATH` shows every rule tried",
                        span=r.pattern_span,
                        source_line=r.source_line,
                    )
                )
            elif not decided[i]:
                by = rules[shadowed_by[i]]
                self.diags.append(
                    warning(
                        "shadowed-rule",
                        f'{r.kind} rule "{r.pattern}" matches {matched[i]} {what}(s), '
                        f"but an earlier rule decides each (e.g. {first_path[i]} by {by.origin})",
                        "move this rule above the broader one, or delete it",
                        span=r.span,
                        source_line=r.source_line,
                    )
                )

    def opt_less_sharded(self, odec: Sequence[Decision], params: dict[str, Decision]) -> None:
        """Optimizer state split less than the param it belongs to (Adam moments replicated
        beside sharded params: the optimizer's memory stops scaling with the mesh)."""
        last = [""]
        for d in odec:
            if d.how not in ("rule", "replicated") or not d.shape:
                continue
            leaf = Leaf(d.path, d.shape, d.dtype, d.itemsize)
            p = _mirror(leaf, params, last)
            if p is not None and d.bytes_per_device > p.bytes_per_device:
                rule = next((x for x in self.plan.opts if x.origin == d.origin), None) if d.how == "rule" else None
                self.note("opt-less-sharded", rule if rule is not None else d.origin, d)

    def big_replicated(self, decisions):
        threshold = self.threshold
        for d in decisions:
            # Whole on every device: no split, or split only over axes of size 1.
            if d.role != "input" and d.shard_shape == d.shape and d.nbytes > threshold:
                self.note("large-replicated", d.origin if d.how != "mirror" else "mirror", d)


def _examples(items: list, n: int = 3) -> str:
    shown = ", ".join(x.path for x in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _grouped_warning(code: str, key: object, items: list) -> Diagnostic:
    """The one warning for a group of leaves that share a problem."""
    first, n = items[0], len(items)
    where = first.path if n == 1 else f"{first.path} (+{n - 1} more)"
    if code == "unmapped-logical-axis":
        who = f"{first.path} is" if n == 1 else f"{n} arrays ({_examples(items)}) are"
        return warning(
            "unmapped-logical-axis",
            f"{who} annotated with logical axis '{key}', which no axis rule maps; that dimension stays whole",
            f"add 'axis {key} -> <mesh axis>' (or 'axis {key} -> _' to silence this)",
            path=where,
        )
    if code == "annotation-rank":
        if n == 1:
            msg = (
                f"{first.path} has rank {len(first.shape)} (shape {fmt_shape(first.shape)}) but its annotation "
                f"names {len(first.names)} dims {first.names}; the dims after them stay whole"
            )
        else:
            msg = (
                f"{n} arrays have annotations shorter than their rank ({_examples(items)}); "
                "the dims after them stay whole"
            )
        return warning("annotation-rank", msg, "annotate every dim (None for a dim that stays whole)", path=where)
    if code == "stacked-axis-split":
        assert isinstance(key, Rule)
        top = first.path.split("/", 1)[0]
        msg = (
            f"this rule names {len(key.spec.dims)} dims but splits dim 0 of {n} stacked array(s) under '{top}/' "
            f"(every array there has the same leading dim {first.shape[0]}: a layer axis from nnx.vmap/nnx.scan?), "
            f"e.g. {first.path} {fmt_shape(first.shape)} -> {fmt_shape(first.shard_shape)} per device: the layers "
            "are split across devices, not each layer's weights"
        )
        named = ", ".join(x[0] if len(x) == 1 else f"({', '.join(x)})" if x else "_" for x in key.spec.dims)
        hint = f"write (..., {named}) to name the "
        hint += "trailing dims whatever the rank, or give the layer dim its own entry: (_, ...)"
        return warning("stacked-axis-split", msg, hint, span=key.span, source_line=key.source_line)
    if code == "opt-less-sharded":
        rule = key if isinstance(key, Rule) else None
        by = f"the rule at {rule.origin}" if rule is not None else str(key)
        per_device = sum(d.bytes_per_device for d in items)
        msg = (
            f"{n} optimizer-state array(s) ({_examples(items)}; {fmt_bytes(per_device)} per device) are split less "
            f"than the params they belong to (decided by {by}): their memory does not shrink with the mesh"
        )
        hint = "give them the params' specs (delete the opt rule: state mirrors its param), or split them further"
        if rule is not None:
            return warning("opt-less-sharded", msg, hint, span=rule.span, source_line=rule.source_line)
        return warning("opt-less-sharded", msg, hint, path=where)
    # large-replicated
    total = sum(d.nbytes for d in items)
    big = max(items, key=lambda d: d.nbytes)
    by = "the params they mirror" if key == "mirror" else str(key)
    if n == 1:
        msg = (
            f"{big.path} ({fmt_shape(big.shape)} {big.dtype}, {fmt_bytes(big.nbytes)}) is "
            f"replicated on every device (decided by {by})"
        )
    else:
        msg = (
            f"{n} arrays ({fmt_bytes(total)} in all; largest {big.path}, {fmt_shape(big.shape)} {big.dtype}, "
            f"{fmt_bytes(big.nbytes)}) are replicated on every device (decided by {by})"
        )
    return warning(
        "large-replicated", msg, "shard them with a rule, or raise the threshold (--replicated-threshold)", path=where
    )


def _mirror(leaf: Leaf, params: dict[str, Decision], last: list) -> Decision | None:
    """The param whose path is the longest proper suffix of ``leaf.path``, with the same shape.

    ``last`` holds the prefix that mirrored last time (``opt_state/0/mu/``): optimizer
    states are laid out per param, so it almost always fits the next leaf too.
    """
    path = leaf.path
    prefix = last[0]
    if prefix and path.startswith(prefix):
        d = params.get(path[len(prefix) :])
        # Still the longest suffix? Only if no shorter prefix (a longer suffix) is a param too.
        if d is not None and d.shape == leaf.shape and not _longer_suffix(path, len(prefix), params, last):
            return d
    i = path.find("/")
    while i >= 0:
        d = params.get(path[i + 1 :])
        if d is not None and d.shape == leaf.shape:
            last[0] = path[: i + 1]
            return d
        i = path.find("/", i + 1)
    return None


def _longer_suffix(path: str, cut: int, params: dict[str, Decision], last: list) -> bool:
    """Whether a suffix of ``path`` longer than ``path[cut:]`` is a param path. Only one that
    starts with a component of the prefix can be, and only if some param path starts with that
    component: with a cache of the params' first components, most prefixes are ruled out once."""
    if len(last) < 3:
        last[1:] = [{p.split("/", 1)[0] for p in params}, {}]
    heads, ruled_out = last[1], last[2]
    prefix = path[:cut]
    hit = ruled_out.get(prefix)
    if hit is None:
        hit = ruled_out[prefix] = not any(c in heads for c in prefix.split("/")[1:])
    if hit:
        return False
    i = path.find("/")
    while 0 <= i < cut - 1:
        if path[i + 1 :] in params:
            return True
        i = path.find("/", i + 1)
    return False


def _prefix_hits(plan: Plan, leaves: Sequence[Leaf]) -> set[int]:
    """Indices of the ``act`` rules some module path matches, the module paths taken as the
    proper prefixes of the leaves' paths (the modules that hold arrays; '' is the root)."""
    ruleset = plan.rule_sets["act"]
    prefixes = {""}
    for leaf in leaves:
        parts = leaf.path.split("/")
        for i in range(1, len(parts)):
            prefixes.add("/".join(parts[:i]))
    return {i for p in prefixes for i in ruleset.matches(p)}


def act_usage(plan: Plan, hit: set[int]) -> list[Diagnostic]:
    """A warning at each ``act`` rule that no module path of the model matches."""
    out = []
    for i, r in enumerate(plan.acts):
        if i not in hit:
            out.append(
                warning(
                    "unused-rule",
                    f'act rule "{r.pattern}" matches no module of this model (a module path is a param path '
                    "without its last component(s), e.g. layers/0/attn)",
                    "check the regex against the module paths (it must match the whole path), or delete the rule",
                    span=r.pattern_span,
                    source_line=r.source_line,
                )
            )
    return out


def _raise_or_warnings(diags: list[Diagnostic], plan_warnings=()) -> tuple[Diagnostic, ...]:
    if any(d.severity == "error" for d in diags):
        # Errors first; warnings stay visible after them.
        raise PlanCheckError(sorted(diags, key=lambda d: d.severity != "error"))
    return tuple(plan_warnings) + tuple(diags)


def resolve_leaves(
    plan: Plan,
    mesh: dict[str, int],
    params: list[Leaf] | tuple[Leaf, ...],
    opt_state: list[Leaf] | tuple[Leaf, ...] = (),
    replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
    *,
    report_params: bool = True,
) -> Resolution:
    """Decide every param leaf, then every optimizer-state leaf (mirroring the params).

    Returns decisions for params and optimizer state (params omitted when
    ``report_params`` is false, as when resolving an optimizer state alone).

    Raises:
        PlanCheckError: every error found, together (warnings included after them).
    """
    _check_mesh_names(plan, mesh)
    r = _Resolver(plan, mesh, replicated_threshold)
    pdec = [d for d in (r.param(leaf) if leaf.is_param else r.state(leaf) for leaf in params) if d is not None]
    if report_params:
        r.usage("param", "param")
        if plan.acts:
            r.diags += act_usage(plan, _prefix_hits(plan, params))
        r.axis_usage(params)
        r.stacked_splits(pdec)
    else:
        r.grouped.clear()
        r.diags = [d for d in r.diags if d.severity == "error"]
    by_path = {d.path: d for d in pdec}
    odec = [r.opt(leaf, by_path) for leaf in opt_state]
    r.opt_less_sharded(odec, by_path)
    if opt_state:
        r.usage("opt", "optimizer-state leaf")
    decisions = (pdec if report_params else []) + odec
    r.big_replicated(decisions)
    r.flush()
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
    how: How
    for leaf in leaves:
        rule = r.match("input", leaf.path)
        if rule is not None:
            spec, origin, how, what = rule.spec, rule.origin, "rule", f"the input rule at {rule.origin}"
        elif plan.batch is not None:
            where = f"{plan.batch_span.file}:{plan.batch_span.line}" if plan.batch_span else "batch"
            spec, origin, how, what = plan.batch, where, "batch", f"the batch spec at {where}"
        else:
            spec, origin, how, what = REPLICATED, "no batch rule", "replicated", "no batch rule"
        spec = spec.for_rank(len(leaf.shape)) or spec  # too few dims: decide() reports it
        dims = spec.dims
        while len(dims) > len(leaf.shape) and not dims[-1]:
            dims = dims[:-1]
        out.append(r.decide(leaf, Spec(dims) if not spec.open else spec, how, origin, "input", rule, what))
    r.usage("input", "input")
    return Resolution(dict(mesh), tuple(out), _raise_or_warnings(r.diags))


def _check_mesh_names(plan: Plan, mesh: dict[str, int]):
    missing = [a for a in plan.axis_names if a not in mesh]
    if missing:
        raise PlanCheckError(
            [
                error(
                    "mesh-mismatch",
                    f"mesh sizes given for {sorted(mesh)} but the plan's mesh has axes {list(plan.axis_names)}",
                    "pass sizes for exactly the plan's axes",
                    path="mesh",
                )
            ]
        )
