"""Syntax modules (a plan and the bases it extends) -> a checked :class:`Plan`.

Every problem is collected; errors are raised together as one PlanCheckError, warnings
are kept on the plan.
"""

from __future__ import annotations

import re
from typing import cast

import re2

from shardplan.core.backends import NAMES as BACKENDS
from shardplan.core.meshes import MeshSizes, closest, size_problems
from shardplan.core.plan import (
    AXIS_TYPES,
    LINKS,
    MAX_DEVICES,
    MAX_MICROBATCHES,
    SCHEDULES,
    AxisRule,
    AxisTypeName,
    MeshAxis,
    Pipeline,
    Plan,
    Rule,
    RuleKind,
)
from shardplan.core.spec import Spec
from shardplan.errors import Diagnostic, PlanCheckError, Span, error, warning
from shardplan.lang import syntax as ast

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


class _Checker:
    def __init__(self, modules: tuple[ast.Module, ...]):
        self.modules = modules
        self.diags: list[Diagnostic] = []
        self._lines = {m.file: m.text.split("\n") for m in modules}

    def line(self, span: Span) -> str:
        lines = self._lines.get(span.file, [])
        return lines[span.line - 1] if 0 < span.line <= len(lines) else ""

    def err(self, code, msg, hint, span, path=None):
        self.diags.append(error(code, msg, hint, span=span, path=path, source_line=self.line(span)))

    def warn(self, code, msg, hint, span, path=None):
        self.diags.append(warning(code, msg, hint, span=span, path=path, source_line=self.line(span)))

    # -- per-file statements ------------------------------------------------------------
    def singles(self, module: ast.Module, kind: type) -> list:
        found = [s for s in module.statements if isinstance(s, kind)]
        label = {
            ast.PlanName: "plan",
            ast.MeshNode: "mesh",
            ast.BatchNode: "batch",
            ast.BackendNode: "backend",
            ast.DefaultNode: "default",
            ast.CacheNode: "cache",
            ast.PipelineNode: "pipeline",
        }.get(kind, "statement")
        for extra in found[1:]:
            self.err(
                "duplicate-statement",
                f"'{label}' given twice in one file (first on line {found[0].span.line})",
                f"keep one '{label}' statement",
                extra.span,
            )
        return found[:1]

    def nearest(self, kind: type):
        """The statement of this kind from the nearest file: a plan overrides what it extends."""
        for m in self.modules:
            found = self.singles(m, kind)
            if found:
                return found[0]
        return None

    # -- mesh ---------------------------------------------------------------------------
    def mesh(self, node: ast.MeshNode | None) -> tuple[MeshAxis, ...]:
        if node is None:
            return ()
        seen: dict[str, ast.MeshAxisNode] = {}
        stars = []
        for a in node.axes:
            if a.name == "_":
                self.err(
                    "reserved-axis-name",
                    "'_' cannot name a mesh axis: it means 'not split'",
                    "pick another name, e.g. data or model",
                    a.name_span,
                )
            if a.name in seen:
                self.err(
                    "duplicate-axis",
                    f"mesh axis '{a.name}' is declared twice (first at column {seen[a.name].span.column})",
                    "give each mesh axis a distinct name",
                    a.name_span,
                )
            seen.setdefault(a.name, a)
            if a.size is None:
                stars.append(a)
            elif a.size <= 0:
                self.err(
                    "axis-size",
                    f"mesh axis '{a.name}' has size {a.size}; sizes must be positive",
                    "use a positive size, or * to take the remaining devices",
                    a.span,
                )
            elif a.size > MAX_DEVICES:
                self.err(
                    "axis-size",
                    f"mesh axis '{a.name}' has size {a.size:,}; a mesh has at most {MAX_DEVICES:,} devices",
                    "check the size (a typo with extra digits?)",
                    a.span,
                )
        for extra in stars[1:]:
            self.err(
                "two-inferred-sizes",
                f"mesh axes '{stars[0].name}' and '{extra.name}' are both '*'",
                "at most one axis size can be inferred from the device count; give the other a number",
                extra.span,
            )
        for a in node.axes:
            if a.link is not None and a.link not in LINKS:
                near = closest(a.link, LINKS)
                self.err(
                    "unknown-link",
                    f"unknown link '@{a.link}' for mesh axis '{a.name}'",
                    (near + " " if near else "") + "write @ici (inside a host or slice, the default) or @dcn "
                    "(the network between hosts or slices)",
                    a.link_span or a.span,
                )
        if node.type is not None:
            self.axis_type(node.type, node.type_span or node.span, "the mesh")
        for a in node.axes:
            if a.type is not None:
                self.axis_type(a.type, a.type_span or a.span, f"mesh axis '{a.name}'")
        return tuple(MeshAxis(a.name, a.size, a.span, a.link if a.link in LINKS else "ici") for a in node.axes)

    def axis_type(self, kind: str, span: Span, what: str) -> None:
        if kind in AXIS_TYPES:
            return
        if kind.lower() == "manual":
            hint = (
                "a plan's mesh axes are auto or explicit; manual axes are what shard_map makes inside its "
                "body (backend shard_map runs the step that way by itself)"
            )
        else:
            near = closest(kind, AXIS_TYPES)
            hint = (near + " " if near else "") + (
                "write explicit (shardings are part of array types: models that pass out_sharding= or call "
                "jax.sharding.reshard) or auto (the default)"
            )
        self.err("unknown-axis-type", f"unknown axis type '{kind}' for {what}", hint, span)

    def axis_types(self, node: ast.MeshNode | None) -> tuple[AxisTypeName, tuple[tuple[str, AxisTypeName], ...]]:
        """The mesh's type and each axis's own, where written and valid."""
        if node is None:
            return "auto", ()
        mesh_type = cast(AxisTypeName, node.type) if node.type in AXIS_TYPES else "auto"
        own = tuple((a.name, cast(AxisTypeName, a.type)) for a in node.axes if a.type in AXIS_TYPES)
        return mesh_type, own

    # -- specs --------------------------------------------------------------------------
    def spec(self, node: ast.SpecNode, axis_names: tuple[str, ...], where: str = "") -> Spec:
        """A spec as data; ``where`` names a statement whose specs may not hold ``...``."""
        used: dict[str, Span] = {}
        for d in node.dims:
            if d.rest and where:
                self.err(
                    "misplaced-ellipsis",
                    f"'...' is not allowed in {where}: its specs name leading dims, and the dims after "
                    "them are whole already",
                    "drop the '...' (a shorter spec leaves the remaining dims whole)",
                    d.span,
                )
        for d in node.dims:
            self.dim_axes(d, axis_names, used)
        rests = [i for i, d in enumerate(node.dims) if d.rest]
        if len(rests) > 1:
            self.err(
                "two-ellipses",
                "a spec has at most one '...' (the dims between the ones it names)",
                "keep one '...': (data, ..., model) names the first and the last dim",
                node.dims[rests[1]].span,
            )
        if rests:
            k = rests[0]
            return Spec(tuple(d.axes for d in node.dims[:k]), tail=tuple(d.axes for d in node.dims[k + 1 :]), open=True)
        return Spec(tuple(d.axes for d in node.dims))

    def dim_axes(self, d: ast.Dim, axis_names, used: dict[str, Span]):
        for a in d.axes:
            if a not in axis_names:
                if a in ("None", "none", "null"):
                    hint = "write _ for a dimension that is not split"
                else:
                    near = closest(a, axis_names)
                    hint = (near + " " if near else "") + (
                        f"the mesh axes are: {', '.join(axis_names)}"
                        if axis_names
                        else "declare the axis in a mesh statement"
                    )
                self.err("unknown-axis", f"unknown mesh axis '{a}'", hint, d.span)
            elif a in used:
                self.err(
                    "axis-reused",
                    f"mesh axis '{a}' is used twice in one spec",
                    "a mesh axis can split at most one dimension of an array; "
                    "to split one dimension over several axes write (a, b)",
                    d.span,
                )
            used[a] = d.span

    # -- regexes ------------------------------------------------------------------------
    def regex(self, r: ast.RuleNode) -> bool:
        ps = r.pattern_span
        if len(r.pattern) > MAX_REGEX_LENGTH:  # Python's regex parser takes seconds per megabyte
            self.err(
                "unsupported-regex",
                f"regex of {len(r.pattern):,} characters (at most {MAX_REGEX_LENGTH:,})",
                "match params by a shorter pattern (a path regex needs a few dozen characters)",
                ps,
            )
            return False
        depth = _depth(r.pattern)
        if depth > MAX_REGEX_DEPTH:  # Python's regex parser recurses per group: its stack sets no fixed limit
            self.err(
                "unsupported-regex",
                f"regex nested too deeply ({depth} levels of groups; at most {MAX_REGEX_DEPTH})",
                "rewrite with fewer nested groups (a few levels say the same thing)",
                ps,
            )
            return False
        try:
            re.compile(r.pattern)
        except re.error as e:
            pos = e.pos or 0
            col = ps.column + pos
            span = Span(ps.file, ps.line, col, ps.line, col + 1)
            self.err(
                "invalid-regex",
                f"invalid regex: {e.msg}",
                "fix the regex (RE2 syntax, matched against the whole path)",
                span,
            )
            return False
        try:
            re2.compile(r.pattern, _RE2_OPTIONS)
        except re2.error as e:
            text = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
            what = text.split(": ", 1)[-1]
            pos = r.pattern.find(what) if what else -1
            col = ps.column + max(pos, 0)
            span = Span(ps.file, ps.line, col, ps.line, col + max(len(what), 1) if pos >= 0 else ps.end_column)
            self.err(
                "unsupported-regex",
                f"regex construct not supported: {text}",
                "shardplan matches with RE2 (linear time): lookaround, backreferences and "
                "repetition counts above 1000 are not available; rewrite without them",
                span,
            )
            return False
        return True

    def rules(self, kind: RuleKind, axis_names) -> tuple[Rule, ...]:
        out = []
        for m in self.modules:  # the plan's own rules first, then each base's
            for s in m.statements:
                if isinstance(s, ast.RuleNode) and s.kind == kind:
                    ok = self.regex(s)
                    spec = self.spec(s.spec, axis_names, "an input rule" if kind == "input" else "")
                    if ok:
                        out.append(Rule(kind, s.pattern, spec, s.span, s.pattern_span, s.spec.span, self.line(s.span)))
        self.shadowing(tuple(out))
        return tuple(out)

    def shadowing(self, rules: tuple[Rule, ...]):
        """Static shadowing: a rule after a catch-all, or a repeat of an earlier regex."""
        first: dict[str, Rule] = {}
        catch_all = None
        for r in rules:
            if catch_all is not None:
                self.warn(
                    "shadowed-rule",
                    f'{r.kind} rule "{r.pattern}" can never apply: the catch-all '
                    f'"{catch_all.pattern}" at {catch_all.origin} matches every path first',
                    "move this rule above the catch-all, or delete it",
                    r.span,
                )
            elif r.pattern in first:
                self.warn(
                    "shadowed-rule",
                    f'{r.kind} rule "{r.pattern}" repeats the regex of '
                    f"{first[r.pattern].origin}, which always matches first",
                    "delete one of the two rules",
                    r.span,
                )
            first.setdefault(r.pattern, r)
            if r.is_catch_all and catch_all is None:
                catch_all = r

    def axis_rules(self, axis_names) -> tuple[AxisRule, ...]:
        out: dict[str, AxisRule] = {}
        for m in self.modules:
            local: dict[str, ast.AxisNode] = {}
            for s in m.statements:
                if not isinstance(s, ast.AxisNode):
                    continue
                if s.logical in local:
                    self.err(
                        "duplicate-axis-rule",
                        f"logical axis '{s.logical}' is mapped twice (first on line {local[s.logical].span.line})",
                        "keep one axis rule per name",
                        s.span,
                    )
                    continue
                local[s.logical] = s
                if s.dim.rest:
                    self.err(
                        "misplaced-ellipsis",
                        f"axis {s.logical} -> ...: an axis rule maps a logical axis to mesh axes, or to _",
                        f"write axis {s.logical} -> _ to leave it whole",
                        s.dim.span,
                    )
                self.dim_axes(s.dim, axis_names, {})
                # A plan's own mapping overrides the one in a base it extends.
                out.setdefault(s.logical, AxisRule(s.logical, s.dim.axes, s.span, self.line(s.span)))
        return tuple(out.values())

    # -- pipeline -----------------------------------------------------------------------
    def pipeline(self, node: ast.PipelineNode | None, mesh: tuple[MeshAxis, ...]) -> Pipeline | None:
        if node is None:
            return None
        axis_names = tuple(a.name for a in mesh)
        if node.axis not in axis_names:
            self.dim_axes(ast.Dim((node.axis,), node.axis_span), axis_names, {})
        known = {"microbatches": int, "schedule": str, "repeats": int}
        given: dict[str, ast.PipeOption] = {}
        for o in node.options:
            if o.name not in known:
                near = closest(o.name, tuple(known))
                self.err(
                    "pipeline-option",
                    f"unknown pipeline setting '{o.name}'",
                    (near + " " if near else "") + "the settings are microbatches, schedule and repeats",
                    o.span,
                )
            elif o.name in given:
                self.err(
                    "pipeline-option", f"pipeline setting '{o.name}' given twice", f"keep one '{o.name} ='", o.span
                )
            elif not isinstance(o.value, known[o.name]):
                want = "a number" if known[o.name] is int else "a name (" + ", ".join(SCHEDULES) + ")"
                self.err(
                    "pipeline-option",
                    f"pipeline setting '{o.name}' takes {want}, not {o.value}",
                    f"write {o.name} = " + ("8" if known[o.name] is int else "gpipe"),
                    o.value_span,
                )
            else:
                given[o.name] = o
        ok = True
        m = given.get("microbatches")
        if m is None and not any(o.name == "microbatches" for o in node.options):
            ok = False
            self.err(
                "pipeline-option",
                "a pipeline needs its number of microbatches",
                "add microbatches = M (M pieces of the batch flow through the stages; at least the number "
                "of stages keeps the bubble small)",
                node.span,
            )
        for name in ("microbatches", "repeats"):
            got = given.get(name)
            if got is not None and not 1 <= int(got.value) <= MAX_MICROBATCHES:
                ok = False
                self.err(
                    "pipeline-option",
                    f"{name} = {got.value}: it must be between 1 and {MAX_MICROBATCHES:,}",
                    f"write a positive {name}",
                    got.value_span,
                )
        schedule = str(given["schedule"].value) if "schedule" in given else "gpipe"
        if "schedule" in given and schedule not in SCHEDULES:
            ok = False
            near = closest(schedule, SCHEDULES)
            self.err(
                "pipeline-option",
                f"unknown pipeline schedule '{schedule}'",
                (near + " " if near else "") + "schedules: gpipe (each stage runs its layers once per "
                "microbatch), circular (with repeats = V, each stage holds V chunks of layers)",
                given["schedule"].value_span,
            )
        repeats = int(given["repeats"].value) if "repeats" in given else 1
        if repeats > 1 and schedule == "gpipe":
            ok = False
            self.err(
                "pipeline-option",
                f"repeats = {repeats} with the gpipe schedule",
                "repeats go with schedule = circular (gpipe runs each stage's layers once)",
                given["repeats"].span,
            )
        stages = next((a.size for a in mesh if a.name == node.axis), None)
        if ok and m is not None and schedule == "circular" and stages is not None and int(m.value) < stages:
            ok = False
            self.err(
                "pipeline-option",
                f"circular schedule with microbatches = {m.value} on {stages} stages",
                f"a circular schedule needs at least as many microbatches as stages: microbatches = {stages} or more",
                m.value_span,
            )
        if not ok or m is None or node.axis not in axis_names:
            return None
        return Pipeline(node.axis, int(m.value), schedule, repeats, node.span, self.line(node.span))

    def pipeline_axis_uses(self, p: Pipeline, statements, rules, axes) -> None:
        """The stage axis splits the stacked layer dim of params (and their optimizer state) only.
        ``statements``: (keyword, spec, span) of the batch, default and cache statements."""
        a = p.axis
        what = "every stage sees every microbatch in turn, so the stage axis cannot split"
        for keyword, spec, span in statements:
            if spec is not None and a in spec.axes:
                self.err(
                    "pipeline-axis",
                    f"{what} the {keyword}: '{a}' is the pipeline's axis",
                    f"take '{a}' out of the {keyword} statement",
                    span,
                )
        for r in rules:
            if a not in r.spec.axes:
                continue
            lead = r.spec.dims[0] if r.spec.dims else ()
            if r.kind in ("input", "act"):
                self.err(
                    "pipeline-axis",
                    f"{what} an {r.kind}: '{a}' is the pipeline's axis",
                    f"take '{a}' out of this rule",
                    r.spec_span,
                )
            elif lead != (a,) or any(a in d for d in r.spec.dims[1:] + r.spec.tail):
                self.err(
                    "pipeline-axis",
                    f"'{a}' is the pipeline's axis: it splits the stacked layer dim (the first) of a param, alone",
                    f"write ({a}, ...) or ({a}, <the other dims>) with '{a}' only first",
                    r.spec_span,
                )
        for x in axes:
            if a in x.axes:
                self.err(
                    "pipeline-axis",
                    f"logical axis '{x.logical}' is mapped to the pipeline's axis '{a}'",
                    f"map it to another axis; '{a}' splits only the stacked layer dim, through param rules",
                    x.span,
                )


def check(modules: tuple[ast.Module, ...], mesh_override: MeshSizes | None = None) -> Plan:
    """Check a plan and the chain of plans it extends (the plan first) into a :class:`Plan`.

    Raises:
        PlanCheckError: every error found, together.
    """
    c = _Checker(modules)
    name_node = c.nearest(ast.PlanName)
    mesh_node = c.nearest(ast.MeshNode)
    backend_node = c.nearest(ast.BackendNode)
    batch_node = c.nearest(ast.BatchNode)
    default_node = c.nearest(ast.DefaultNode)
    cache_node = c.nearest(ast.CacheNode)

    mesh = c.mesh(mesh_node)
    mesh_type, axis_type_of = c.axis_types(mesh_node)
    if mesh_override is not None:
        written = {a.name: a.link for a in mesh}  # links tagged in the file carry over by name
        mesh = tuple(MeshAxis(n, s, None, written.get(n, "ici")) for n, s in mesh_override.items())
        c.diags.extend(size_problems(mesh_override, "mesh"))
    elif mesh_node is None:
        m0 = modules[0]
        c.err(
            "no-mesh",
            "the plan declares no mesh",
            "add a mesh statement, e.g. mesh data = *, or give one on the command line (--mesh data=8)",
            Span(m0.file, 1, 1, 1, 2),
        )
    axis_names = tuple(a.name for a in mesh)

    backend = "auto"
    if backend_node is not None:
        if backend_node.name in BACKENDS:
            backend = backend_node.name
        else:
            near = closest(backend_node.name, BACKENDS)
            c.err(
                "unknown-backend",
                f"unknown backend '{backend_node.name}'",
                (near + " " if near else "") + "backends: " + ", ".join(BACKENDS),
                backend_node.span,
            )

    batch = c.spec(batch_node.spec, axis_names, "a batch statement") if batch_node else None
    default = c.spec(default_node.spec, axis_names) if default_node else None
    cache = c.spec(cache_node.spec, axis_names) if cache_node else None
    params = c.rules("param", axis_names)
    opts = c.rules("opt", axis_names)
    inputs = c.rules("input", axis_names)
    acts = c.rules("act", axis_names)
    axes = c.axis_rules(axis_names)
    pipeline_node = c.nearest(ast.PipelineNode)
    pipeline = c.pipeline(pipeline_node, mesh)
    if pipeline is not None:
        statements = [
            (k, spec, node.span)
            for k, spec, node in (
                ("batch", batch, batch_node),
                ("default", default, default_node),
                ("cache", cache, cache_node),
            )
            if node is not None
        ]
        c.pipeline_axis_uses(pipeline, statements, params + opts + inputs + acts, axes)

    catch = next((r for r in params if r.is_catch_all), None)
    if catch is not None and axes:
        c.warn(
            "annotations-unreachable",
            f'param rule "{catch.pattern}" matches every param, so the '
            "axis rules (Flax annotations) are never consulted",
            "path rules are tried before annotations; for the fallback write 'default replicated' "
            "instead of a catch-all param rule",
            catch.span,
        )

    errors = [d for d in c.diags if d.severity == "error"]
    if errors:
        raise PlanCheckError(c.diags)
    return Plan(
        name=name_node.name if name_node else None,
        files=tuple(m.file for m in modules),
        mesh=mesh,
        mesh_span=mesh_node.span if mesh_node and mesh_override is None else None,
        backend=backend,
        batch=batch,
        batch_span=batch_node.span if batch_node else None,
        params=params,
        opts=opts,
        inputs=inputs,
        acts=acts,
        axes=axes,
        default=default,
        default_span=default_node.span if default_node else None,
        warnings=tuple(d for d in c.diags if d.severity == "warning"),
        sources=tuple((m.file, m.text) for m in modules),
        mesh_source_line=c.line(mesh_node.span) if mesh_node else "",
        cache=cache,
        cache_span=cache_node.span if cache_node else None,
        mesh_type=mesh_type,
        axis_type_of=axis_type_of,
        mesh_type_span=mesh_node.type_span if mesh_node is not None else None,
        pipeline=pipeline,
    )


MAX_REGEX_DEPTH = 100
MAX_REGEX_LENGTH = 10_000


def _depth(pattern: str) -> int:
    """The deepest nesting of unescaped parentheses in a regex."""
    depth = deepest = 0
    escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
    return deepest
