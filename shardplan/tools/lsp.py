"""`shardplan lsp`: the language server for `.splan` files (pygls, over stdio).

- Diagnostics as you type: the checker's codes, spans and hints; against a model when the plan
  names one, in a comment ``# shardplan: --model FILE.py:FACTORY [--devices N] [--mesh ...]``
  (or ``--shapes FILE.json``; paths relative to the plan), or through the initialization options
  ``{"model": ..., "shapes": ..., "devices": ...}``. The model's shapes come from the shapes
  cache after the first check (``shardplan.core.shapecache``).
- Model code runs only in a trusted workspace: the client passes ``{"trustModelCode": true}`` at
  ``initialize`` (the VS Code extension passes its workspace trust), and even then only from a file
  inside a workspace folder (``shardplan.tools.trust``). Untrusted, the shapes come from the shapes
  cache or a shapes file, and one notice at the directive says how to enable model builds.
- Hover on a rule: the arrays it decides (count, bytes per device, grouped by layer as in
  ``check``); without a model, its regex and spec.
- Go to definition on ``extends "base.splan"``: the base file.
- Completion: statements, the plan's mesh axis names, the model's logical axis names.
- Formatting: ``shardplan fmt``'s layout.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from lsprotocol import types
from pygls.lsp.server import LanguageServer

from shardplan import api
from shardplan.core import optimizers, shapecache
from shardplan.core.format import fmt_bytes, layer_group
from shardplan.core.leaves import Resolution
from shardplan.core.meshes import parse_mesh_arg
from shardplan.core.plan import Plan
from shardplan.errors import Diagnostic, ShardPlanError, Span, as_error, error
from shardplan.lang.fmt import format_text
from shardplan.lang.loader import loads
from shardplan.tools import trust
from shardplan.version import version

STATEMENTS = (
    "plan",
    "extends",
    "mesh",
    "backend",
    "batch",
    "input",
    "param",
    "opt",
    "act",
    "axis",
    "default",
    "cache",
    "replicated",
)
DIRECTIVE = "# shardplan:"
# The language server's own notice (an editor session's state, not a problem of the plan, so not
# in shardplan.codes): the model's code was not run in an untrusted workspace.
NOT_RUN = "model-not-run"


@dataclass
class _State:
    plan: Plan | None = None
    resolution: Resolution | None = None
    logical: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    not_run: bool = False  # a model is named, and its code was not run (an untrusted workspace)


@dataclass(frozen=True)
class _Shapes:
    """What a plan is checked against: leaves (None: the plan alone), refusals, and the notice
    that the model's code was not run."""

    leaves: api.ModelLeaves | None = None
    logical: tuple[str, ...] = ()
    problems: tuple[Diagnostic, ...] = ()
    notice: types.Diagnostic | None = None


server = LanguageServer("shardplan", version())
_states: dict[str, _State] = {}
_defaults: dict[str, Any] = {}
_trusted = {"model_code": False}  # set once at initialize from the client's trustModelCode


def _path(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


def _roots() -> tuple[Path, ...]:
    """The workspace folders (symlinks resolved); the root path when the client sends no folders."""
    try:
        ws = server.workspace
    except RuntimeError:  # not initialized
        return ()
    folders = [_path(f.uri) for f in ws.folders.values()] or ([Path(ws.root_path)] if ws.root_path else [])
    return tuple(p.resolve() for p in folders)


def _options(text: str, path: Path) -> tuple[dict[str, Any], Span | None]:
    """The model a plan is checked against: its ``# shardplan:`` comment, else the client's options;
    and the comment's line when it names the model (a model relative to the plan's folder)."""
    out, where = dict(_defaults), None
    for i, line in enumerate(text.splitlines()):
        if not line.strip().startswith(DIRECTIVE):
            continue
        span = Span(str(path), i + 1, 1, i + 1, len(line) + 1)
        try:
            words = shlex.split(line.strip()[len(DIRECTIVE) :])
        except ValueError as e:
            bad = error("bad-argument", f"cannot read the comment: {e}", "close the quote", span=span)
            raise as_error([bad]) from None
        for flag, value in zip(words[::2], words[1::2]):
            name = flag.lstrip("-")
            if name == "model":
                where = span
            elif name == "shapes" and not Path(value).is_absolute():
                value = str(path.parent / value)
            out[name] = value
    return out, where


def _range(d: Diagnostic) -> types.Range:
    if d.span is None:
        return types.Range(types.Position(0, 0), types.Position(0, 0))
    start = types.Position(max(d.span.line - 1, 0), max(d.span.column - 1, 0))
    end = types.Position(max(d.span.end_line - 1, 0), max(d.span.end_column - 1, 0))
    return types.Range(start, end)


def _lsp(d: Diagnostic) -> types.Diagnostic:
    severity = types.DiagnosticSeverity.Error if d.severity == "error" else types.DiagnosticSeverity.Warning
    message = (
        d.message + (f" ({d.path})" if d.path and d.span is not None else "") + (f"\nhint: {d.hint}" if d.hint else "")
    )
    return types.Diagnostic(range=_range(d), message=message, severity=severity, code=d.code, source="shardplan")


def validate(uri: str, text: str) -> list[types.Diagnostic]:
    """Parse, check and (with a model) resolve; keep what hover and completion need."""
    path = _path(uri)
    state = _states.setdefault(uri, _State())
    state.resolution, state.not_run = None, False  # until this text is checked against a model
    found: list[Diagnostic] = []
    notice: types.Diagnostic | None = None
    where: Span | None = None
    try:
        state.options, where = _options(text, path)
        plan = loads(text, str(path), base_dir=path.parent)
        state.plan = plan
        found += plan.warnings
        shapes = _shapes(state.options, path.parent, where)
        found += shapes.problems
        notice, state.logical = shapes.notice, shapes.logical
        state.not_run = notice is not None
        if shapes.leaves is not None:
            mesh = parse_mesh_arg(state.options["mesh"]) if state.options.get("mesh") else None
            devices = int(state.options["devices"]) if state.options.get("devices") else None
            result = api.check(plan, leaves=shapes.leaves, mesh=mesh, devices=devices)
            state.resolution = result.resolution
            found = list(shapes.problems) + list(result.warnings)
    except ShardPlanError as e:
        found += e.diagnostics
    except Exception as e:  # the model failed to import or build: say so at the directive
        found.append(error("model-build", f"checking against the model failed: {type(e).__name__}: {e}", span=where))
    own = [d for d in found if d.span is None or d.span.file == str(path)]
    return [_lsp(d) for d in own] + ([notice] if notice is not None else [])


_leaves: dict[tuple, tuple[api.ModelLeaves, tuple[str, ...]]] = {}
_LEAVES_KEEP = 4


def _shapes(options: dict[str, Any], folder: Path, where: Span | None) -> _Shapes:
    """The leaves a plan is checked against: the model's (from the shapes cache, or built when the
    workspace is trusted), else the shapes file's; a model that may not be built says why."""
    model, shapes, optimizer = options.get("model"), options.get("shapes"), options.get("optimizer", "adam")
    problems: tuple[Diagnostic, ...] = ()
    notice = None
    if model:
        roots = _roots()
        base = folder if where is not None or not roots else roots[0]  # a client option: the workspace's
        source = trust.locate(str(model), base, roots, where)
        if isinstance(source, Diagnostic):
            problems = (source,)
        else:
            fresh = shapecache.key(source.cache_spec)  # hashes the model's sources; imports nothing
            hit = _kept(("model", source.cache_spec, optimizer), fresh, lambda: _model(source, optimizer, where))
            if hit is not None:
                return _Shapes(hit[0], hit[1])
            notice = _not_run(source.spec, shapes, where)
    if shapes:
        read = _kept(
            ("shapes", shapes, optimizer), _stat(shapes), lambda: api.model_leaves(shapes=shapes, optimizer=optimizer)
        )
        assert read is not None  # a shapes file is read or raises
        return _Shapes(read[0], read[1], problems, notice)
    return _Shapes(None, (), problems, notice)


def _kept(
    key: tuple, fresh: object, make: Callable[[], api.ModelLeaves | None]
) -> tuple[api.ModelLeaves, tuple[str, ...]] | None:
    """Leaves and logical axis names kept between edits while ``fresh`` (the model's shapes cache
    key, the shapes file's stat) is unchanged: an edit re-checks the plan, not the model."""
    full = (*key, fresh)
    hit = _leaves.get(full) if fresh is not None else None
    if hit is not None:
        return hit
    leaves = make()
    if leaves is None:
        return None
    hit = (leaves, tuple(sorted({n for leaf in leaves[0] if leaf.names for n in leaf.names if n})))
    if fresh is not None:
        _leaves[full] = hit
        for old in list(_leaves)[:-_LEAVES_KEEP]:
            del _leaves[old]
    return hit


def _model(source: trust.ModelSource, optimizer: str, where: Span | None) -> api.ModelLeaves | None:
    """The model's leaves from the shapes cache (read without importing it); else, in a trusted
    workspace only, built (its shapes then go into the cache); else None."""
    params = shapecache.read(source.cache_spec)
    if params is not None:
        return params, optimizers.optimizer_leaves(params, optimizer)
    if not _trusted["model_code"]:
        return None
    with trust.importable(source, where):
        leaves = api.model_leaves(model=source.spec, optimizer=optimizer, cache=False)
    shapecache.write(source.cache_spec, leaves[0])
    return leaves


def _not_run(model: str, shapes: str | None, where: Span | None) -> types.Diagnostic:
    """The one notice of an untrusted workspace whose model's shapes are not in the cache."""
    instead = f"checked against {shapes} instead" if shapes else "the plan is checked without it"
    message = (
        f"not checked against --model {model}: the language server runs a model's code only in a trusted "
        f"workspace, and its shapes are not in the shapes cache; {instead}"
        f"\nhint: trust this workspace (VS Code: 'Workspaces: Manage Workspace Trust'), or start the server "
        f'with initializationOptions {{"{trust.OPTION}": true}}; or fill the shapes cache from a terminal: '
        f"shardplan check PLAN --model {model}; or name a shapes file: --shapes FILE.json"
    )
    span = where or Span("", 1, 1, 1, 1)
    start = types.Position(span.line - 1, 0)
    return types.Diagnostic(
        range=types.Range(start, types.Position(span.line - 1, span.end_column - 1)),
        message=message,
        severity=types.DiagnosticSeverity.Information,
        code=NOT_RUN,
        source="shardplan",
    )


def _stat(path: str | None) -> tuple[int, int] | None:
    try:
        st = Path(path).stat() if path else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st else None


def _publish(uri: str, text: str) -> None:
    server.text_document_publish_diagnostics(types.PublishDiagnosticsParams(uri=uri, diagnostics=validate(uri, text)))


@server.feature(types.INITIALIZE)
def initialize(ls: LanguageServer, params: types.InitializeParams) -> None:
    options = params.initialization_options or {}
    if isinstance(options, dict):
        _defaults.update({k: v for k, v in options.items() if k in ("model", "shapes", "devices", "mesh")})
        _trusted["model_code"] = options.get(trust.OPTION) is True  # only a literal true allows it


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: LanguageServer, params: types.DidOpenTextDocumentParams) -> None:
    _publish(params.text_document.uri, params.text_document.text)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: LanguageServer, params: types.DidChangeTextDocumentParams) -> None:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    _publish(doc.uri, doc.source)


@server.feature(types.TEXT_DOCUMENT_DID_SAVE)
def did_save(ls: LanguageServer, params: types.DidSaveTextDocumentParams) -> None:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    _publish(doc.uri, doc.source)


@server.feature(types.TEXT_DOCUMENT_HOVER)
def hover(ls: LanguageServer, params: types.HoverParams) -> types.Hover | None:
    state = _states.get(params.text_document.uri)
    if state is None or state.plan is None:
        return None
    line = params.position.line + 1
    rule = next((r for r in state.plan.params + state.plan.opts + state.plan.inputs if r.span.line == line), None)
    if rule is None:
        return None
    head = f"**{rule.kind}** `{rule.pattern}` -> `{rule.spec}`"
    if state.resolution is None and state.not_run:
        body = "not checked against the model: its code runs only in a trusted workspace (see the notice)"
    elif state.resolution is None:
        body = "no model: name one with `# shardplan: --model FILE.py:FACTORY` to see what this rule decides"
    else:
        decided = [d for d in state.resolution.decisions if d.how == "rule" and d.origin == rule.origin]
        groups: dict[str, int] = {}
        for d in decided:
            groups[layer_group(d.path)] = groups.get(layer_group(d.path), 0) + 1
        shown = "\n".join(f"- `{g}`" + (f" x{n}" if n > 1 else "") for g, n in list(groups.items())[:12])
        more = f"\n- ... and {len(groups) - 12} more" if len(groups) > 12 else ""
        per_device = sum(d.bytes_per_device for d in decided)
        body = f"decides {len(decided)} arrays, {fmt_bytes(per_device)} per device:\n{shown}{more}"
    return types.Hover(contents=types.MarkupContent(kind=types.MarkupKind.Markdown, value=f"{head}\n\n{body}"))


@server.feature(types.TEXT_DOCUMENT_DEFINITION)
def definition(ls: LanguageServer, params: types.DefinitionParams) -> types.Location | None:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    lines = doc.source.splitlines()
    line = lines[params.position.line] if params.position.line < len(lines) else ""
    stripped = line.strip()
    if not stripped.startswith("extends") or '"' not in stripped:
        return None
    target = _path(doc.uri).parent / stripped.split('"')[1]
    if not target.is_file():
        return None
    start = types.Position(0, 0)
    return types.Location(uri=target.resolve().as_uri(), range=types.Range(start, start))


@server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=["(", ",", " "]))
def completion(ls: LanguageServer, params: types.CompletionParams) -> types.CompletionList:
    state = _states.get(params.text_document.uri) or _State()
    items = [types.CompletionItem(label=s, kind=types.CompletionItemKind.Keyword) for s in STATEMENTS]
    if state.plan is not None:
        items += [
            types.CompletionItem(label=a.name, kind=types.CompletionItemKind.Variable, detail="mesh axis")
            for a in state.plan.mesh
        ]
    items += [
        types.CompletionItem(label=n, kind=types.CompletionItemKind.Field, detail="logical axis") for n in state.logical
    ]
    return types.CompletionList(is_incomplete=False, items=items)


@server.feature(types.TEXT_DOCUMENT_FORMATTING)
def formatting(ls: LanguageServer, params: types.DocumentFormattingParams) -> list[types.TextEdit]:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    try:
        formatted = format_text(doc.source, doc.uri)
    except ShardPlanError:
        return []  # a plan that does not parse is not reformatted; its diagnostics say why
    if formatted == doc.source:
        return []
    lines = doc.source.split("\n")
    end = types.Position(len(lines) - 1, len(lines[-1]))
    return [types.TextEdit(range=types.Range(types.Position(0, 0), end), new_text=formatted)]


def main() -> None:
    server.start_io()
