"""`shardplan lsp`: the language server for `.splan` files (pygls, over stdio).

- Diagnostics as you type: the checker's codes, spans and hints; against a model when the plan
  names one, in a comment ``# shardplan: --model FILE.py:FACTORY [--devices N] [--mesh ...]``
  (or ``--shapes FILE.json``; paths relative to the plan), or through the initialization options
  ``{"model": ..., "shapes": ..., "devices": ...}``. The model's shapes come from the shapes
  cache after the first check (``shardplan.core.shapecache``).
- Hover on a rule: the arrays it decides (count, bytes per device, grouped by layer as in
  ``check``); without a model, its regex and spec.
- Go to definition on ``extends "base.splan"``: the base file.
- Completion: statements, the plan's mesh axis names, the model's logical axis names.
- Formatting: ``shardplan fmt``'s layout.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from lsprotocol import types
from pygls.lsp.server import LanguageServer

from shardplan import api
from shardplan.core import shapecache
from shardplan.core.format import fmt_bytes, layer_group
from shardplan.core.leaves import Resolution
from shardplan.core.meshes import parse_mesh_arg
from shardplan.core.plan import Plan
from shardplan.errors import Diagnostic, ShardPlanError, error
from shardplan.lang.fmt import format_text
from shardplan.lang.loader import loads
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


@dataclass
class _State:
    plan: Plan | None = None
    resolution: Resolution | None = None
    logical: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


server = LanguageServer("shardplan", version())
_states: dict[str, _State] = {}
_defaults: dict[str, Any] = {}


def _path(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


def _options(text: str, folder: Path) -> dict[str, Any]:
    """The model a plan is checked against: its ``# shardplan:`` comment, else the client's options."""
    out = dict(_defaults)
    for line in text.splitlines():
        if not line.strip().startswith(DIRECTIVE):
            continue
        words = shlex.split(line.strip()[len(DIRECTIVE) :])
        for flag, value in zip(words[::2], words[1::2]):
            name = flag.lstrip("-")
            if name == "model":  # FILE.py:FACTORY relative to the plan, or package.module:FACTORY
                target, sep, factory = value.rpartition(":")
                if target.endswith(".py") and not Path(target).is_absolute():
                    value = f"{folder / target}{sep}{factory}"
            elif name == "shapes" and not Path(value).is_absolute():
                value = str(folder / value)
            out[name] = value
    return out


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
    state.options = _options(text, path.parent)
    found: list[Diagnostic] = []
    try:
        plan = loads(text, str(path), base_dir=path.parent)
        state.plan = plan
        found += plan.warnings
        model, shapes = state.options.get("model"), state.options.get("shapes")
        if model or shapes:
            mesh = parse_mesh_arg(state.options["mesh"]) if state.options.get("mesh") else None
            devices = int(state.options["devices"]) if state.options.get("devices") else None
            leaves, state.logical = _model_leaves(model, shapes, state.options.get("optimizer", "adam"))
            result = api.check(plan, leaves=leaves, mesh=mesh, devices=devices)
            state.resolution = result.resolution
            found = list(result.warnings)
    except ShardPlanError as e:
        found += e.diagnostics
    except Exception as e:  # the model failed to import or build: say so at the directive
        found.append(error("model-build", f"checking against the model failed: {type(e).__name__}: {e}"))
    own = [d for d in found if d.span is None or d.span.file == str(path)]
    return [_lsp(d) for d in own]


_leaves: dict[tuple, tuple[api.ModelLeaves, tuple[str, ...]]] = {}
_LEAVES_KEEP = 4


def _model_leaves(model: str | None, shapes: str | None, optimizer: str) -> tuple[api.ModelLeaves, tuple[str, ...]]:
    """The model's leaves and logical axis names, kept between edits while the model's sources
    (or the shapes file) are unchanged: an edit re-checks the plan, not the model."""
    fresh: object = shapecache.key(model) if model else _stat(shapes)
    key = (model, shapes, optimizer, fresh)
    hit = _leaves.get(key) if fresh is not None else None
    if hit is None:
        leaves = api.model_leaves(model=model, shapes=shapes, optimizer=optimizer)
        logical = tuple(sorted({n for leaf in leaves[0] if leaf.names for n in leaf.names if n}))
        hit = (leaves, logical)
        if fresh is not None:
            _leaves[key] = hit
            for old in list(_leaves)[:-_LEAVES_KEEP]:
                del _leaves[old]
    return hit


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
    if state.resolution is None:
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
