"""Source text -> syntax tree, with Lark's LALR parser and positions (the only place Lark runs)."""

from __future__ import annotations

import difflib
import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any

import lark
from lark import Lark, Token, Transformer, v_args

from shardplan.core.plan import AXIS_TYPES
from shardplan.errors import PlanSyntaxError, Span, error
from shardplan.lang import syntax

# Common mistakes, recognised with Lark's match_examples: label -> (examples, hint).
_EXAMPLES: dict[str, tuple[list[str], str]] = {
    "unquoted-regex": (
        [
            "param blocks/.* (model, _)",
            "param .* replicated",
            "opt mu (data)",
            "input labels (data)",
            "param blocks (model)",
        ],
        'a rule\'s regex goes in double quotes: param "blocks/.*/kernel" (model, _)',
    ),
    "mesh-missing-equals": (
        ["mesh data 8", "mesh data = 8, model 2", "mesh data: 8"],
        "write each mesh axis as name = size, comma-separated: mesh data = *, model = 2",
    ),
    "mesh-bad-size": (
        ["mesh data = two", "mesh data = -1", 'mesh data = "8"'],
        "a mesh size is a positive integer, or * for the remaining devices",
    ),
    "spec-without-parens": (
        ['param "x" model', 'param "x" model, _', "batch data", 'input "x" data', "default _"],
        "a spec is a parenthesised list of dims, e.g. (data, _), or the word replicated",
    ),
    "axis-missing-arrow": (
        ["axis embed model", "axis embed = model", "axis embed: model"],
        "map a logical axis with an arrow: axis embed -> model",
    ),
}

_FRIENDLY = {
    "STRING": 'a quoted string ("...")',
    "NAME": "a name",
    "INT": "a number",
    "STAR": "'*'",
    "$END": "end of file",
}


def _grammar_text() -> str:
    try:
        return resources.files("shardplan.grammar").joinpath("splan.lark").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        # Running from a source tree without installing: grammar/ sits beside shardplan/.
        return (Path(__file__).resolve().parents[2] / "grammar" / "splan.lark").read_text()


@functools.cache
def _parser() -> Lark:
    return Lark(_grammar_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


def _span(file: str, meta: Any) -> Span:
    return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)


def _tok_span(file: str, tok: Token) -> Span:
    # Tokens from the lexer always carry positions (Lark types them as optional).
    return Span(file, tok.line or 1, tok.column or 1, tok.end_line or 1, tok.end_column or 1)


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _s(self, meta) -> Span:
        return _span(self.file, meta)

    def start(self, meta, children):
        return tuple(children)

    def plan_stmt(self, meta, c):
        return syntax.PlanName(c[0][1:-1], self._s(meta))

    def extends_stmt(self, meta, c):
        return syntax.Extends(c[0][1:-1], self._s(meta))

    def axis_link(self, meta, c):
        return ("link", c[0])

    def axis_kind(self, meta, c):
        return ("kind", c[0])

    def mesh_axis(self, meta, c):
        name, size = c[0], c[1]
        tags = dict(c[2:])  # ``@dcn`` and ``: explicit``, each optional
        link, kind = tags.get("link"), tags.get("kind")
        value = None if size.type == "STAR" else int(size)
        return syntax.MeshAxisNode(
            str(name),
            value,
            self._s(meta),
            _tok_span(self.file, name),
            str(link) if link is not None else None,
            _tok_span(self.file, link) if link is not None else None,
            str(kind) if kind is not None else None,
            _tok_span(self.file, kind) if kind is not None else None,
        )

    def mesh_type(self, meta, c):
        return c[0]

    def mesh_stmt(self, meta, c):
        kind = c[0] if isinstance(c[0], Token) else None
        axes = tuple(c[1:] if kind is not None else c)
        return syntax.MeshNode(
            axes,
            self._s(meta),
            str(kind) if kind is not None else None,
            _tok_span(self.file, kind) if kind is not None else None,
        )

    def backend_stmt(self, meta, c):
        return syntax.BackendNode(str(c[0]), self._s(meta))

    def batch_stmt(self, meta, c):
        return syntax.BatchNode(c[0], self._s(meta))

    def _rule(self, kind, meta, c):
        tok, spec = c
        inner = Span(self.file, tok.line, tok.column + 1, tok.end_line, tok.end_column - 1)
        return syntax.RuleNode(kind, tok[1:-1], inner, spec, self._s(meta))

    def param_stmt(self, meta, c):
        return self._rule("param", meta, c)

    def opt_stmt(self, meta, c):
        return self._rule("opt", meta, c)

    def act_stmt(self, meta, c):
        return self._rule("act", meta, c)

    def input_stmt(self, meta, c):
        return self._rule("input", meta, c)

    def axis_stmt(self, meta, c):
        name, dim = c
        logical = name[1:-1] if name.type == "STRING" else str(name)
        return syntax.AxisNode(logical, dim, self._s(meta))

    def default_stmt(self, meta, c):
        return syntax.DefaultNode(c[0], self._s(meta))

    def cache_stmt(self, meta, c):
        return syntax.CacheNode(c[0], self._s(meta))

    def pipe_opt(self, meta, c):
        name, value = c
        v: int | str = int(value) if value.type == "INT" else str(value)
        return syntax.PipeOption(str(name), v, self._s(meta), _tok_span(self.file, value))

    def pipeline_stmt(self, meta, c):
        axis = c[0]
        return syntax.PipelineNode(str(axis), _tok_span(self.file, axis), tuple(c[1:]), self._s(meta))

    def spec_dims(self, meta, c):
        return syntax.SpecNode(tuple(c), self._s(meta))

    def spec_replicated(self, meta, c):
        return syntax.SpecNode((), self._s(meta))

    def dim_one(self, meta, c):
        name = str(c[0])
        return syntax.Dim(() if name == "_" else (name,), self._s(meta))

    def dim_many(self, meta, c):
        return syntax.Dim(tuple(str(t) for t in c), self._s(meta))

    def dim_rest(self, meta, c):
        return syntax.Dim((), self._s(meta), rest=True)


@functools.cache
def _example_states() -> tuple[tuple[str, Any, str], ...]:
    """(label, LALR state, token type) of each example mistake."""
    out = []
    for label, (examples, _) in _EXAMPLES.items():
        for text in examples:
            try:
                _parser().parse(text)
            except lark.exceptions.UnexpectedInput as e:
                state = getattr(getattr(e, "state", None), "position", None)
                tok = getattr(getattr(e, "token", None), "type", None)
                out.append((label, state, tok or type(e).__name__))
    return tuple(out)


def _label(exc: lark.exceptions.UnexpectedInput) -> str | None:
    """Which common mistake this error looks like. Lark's match_examples also compares the
    parse stack depth, so it misses mistakes after the first statement; the LALR state and
    the offending token type alone identify them."""
    state = getattr(getattr(exc, "state", None), "position", None)
    if state is None:
        return None
    tok = getattr(getattr(exc, "token", None), "type", None) or type(exc).__name__
    fallback = None
    for label, s, t in _example_states():
        if s == state:
            if t == tok:
                return label
            fallback = fallback or label
    return fallback


def _describe_expected(parser: Lark, names) -> str:
    out = set()
    for n in names:
        if n in _FRIENDLY:
            out.add(_FRIENDLY[n])
            continue
        try:
            pat = parser.get_terminal(n).pattern
            out.add(f"'{pat.value}'" if isinstance(pat, lark.lexer.PatternStr) else n)
        except KeyError:
            out.add(n)
    return ", ".join(sorted(out))


def _syntax_error(text: str, file: str, exc: lark.exceptions.UnexpectedInput) -> PlanSyntaxError:
    parser = _parser()
    lines = text.split("\n")
    line = max(getattr(exc, "line", 1) or 1, 1)
    col = max(getattr(exc, "column", 1) or 1, 1)
    label = _label(exc)
    # The parser stopped inside a statement (it could not have ended there): a ')' or ',' missing.
    mid_statement = isinstance(exc, lark.exceptions.UnexpectedToken) and "$END" not in (exc.accepts or exc.expected)
    if isinstance(exc, lark.exceptions.UnexpectedToken):
        tok = exc.token
        if tok.type == "$END":
            # Point just past the last character of the file.
            line = max(len(lines), 1)
            col = len(lines[-1]) + 1 if lines else 1
            found = "end of file"
            width = 1
        else:
            found = f"'{tok}'"
            width = max(len(str(tok)), 1)
        expected = _describe_expected(parser, exc.accepts or exc.expected)
        message = f"unexpected {found}; expected {expected}"
    elif isinstance(exc, lark.exceptions.UnexpectedCharacters):
        pos = exc.pos_in_stream or 0
        ch = text[pos] if pos < len(text) else ""
        width = 1
        if ch == '"':
            message = "unterminated string: a string must close with '\"' on the same line"
            label = None
        else:
            message = f"unexpected character {ch!r}; expected {_describe_expected(parser, exc.allowed)}"
    else:  # UnexpectedEOF
        line = max(len(lines), 1)
        col = len(lines[-1]) + 1 if lines else 1
        width = 1
        message = "unexpected end of file"
    hint = _EXAMPLES[label][1] if label else "see docs/language.md for the statements a plan may contain"
    if isinstance(exc, lark.exceptions.UnexpectedToken) and str(exc.token) in AXIS_TYPES:
        hint = (
            f"an axis's type follows a colon after its size (model = 2 : {exc.token}), or 'mesh' for every axis "
            f"(mesh {exc.token} data = *, model = 2)"
        )
    misspelt = _misspelt_keyword(lines[line - 1] if 0 < line <= len(lines) else "", col)
    if misspelt is not None:  # `params "x" ...`: the lexer read `param` and then choked on `s`
        word, start, keyword = misspelt
        message = f"unknown statement '{word}'; did you mean '{keyword}'?"
        col, width, hint = start, len(word), f"statements start with a keyword: {', '.join(_keywords())}"
    elif mid_statement and (line, col) != (ended := _end_of_previous_statement(lines, line, col)):
        # The statement ran out on an earlier line (a missing ')' or ','): point at where it stopped.
        line, col = ended
        width = 1
        message = f"line {line} ends before its statement is complete; {message.split('; ', 1)[-1]}"
    if isinstance(exc, lark.exceptions.UnexpectedCharacters) and text[exc.pos_in_stream or 0 :][:1] == '"':
        hint = "close the string with '\"' before the end of the line"
    source_line = lines[line - 1] if 0 < line <= len(lines) else ""
    span = Span(file, line, col, line, col + width)
    return PlanSyntaxError([error("syntax", message, hint, span=span, source_line=source_line)])


@functools.cache
def _keywords() -> tuple[str, ...]:
    """The words a statement starts with, read from the grammar (``param_stmt: "param" ...``)."""
    return tuple(re.findall(r'^\w+_stmt: "(\w+)"', _grammar_text(), re.M))


def _misspelt_keyword(line: str, col: int) -> tuple[str, int, str] | None:
    """(word, its 1-based column, the keyword meant) when the error falls in the line's first word
    and that word is not a keyword but close to one."""
    m = re.match(r"\s*([A-Za-z_]\w*)", line)
    if m is None or not m.start(1) < col <= m.end(1) + 1 or m.group(1) in _keywords():
        return None
    near = difflib.get_close_matches(m.group(1), _keywords(), n=1, cutoff=0.6)
    return (m.group(1), m.start(1) + 1, near[0]) if near else None


def _end_of_previous_statement(lines: list[str], line: int, col: int) -> tuple[int, int]:
    """Where the text before (line, col) ends: (line, col) itself when something precedes it on its
    line, else just past the last code character of the nearest earlier line with code."""
    if lines[line - 1][: col - 1].strip() if 0 < line <= len(lines) else False:
        return line, col
    for n in range(min(line, len(lines) + 1) - 1, 0, -1):
        code = lines[n - 1].split("#", 1)[0].rstrip() if '"' not in lines[n - 1] else lines[n - 1].rstrip()
        if code:
            return n, len(code) + 1
    return line, col


def parse(text: str, file: str = "<string>") -> syntax.Module:
    """Parse plan text into an :class:`syntax.Module`.

    Raises:
        PlanSyntaxError: the text does not follow the grammar.
    """
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as exc:
        raise _syntax_error(text, file, exc) from None
    statements = _ToAst(file).transform(tree)
    return syntax.Module(file, text, statements)
