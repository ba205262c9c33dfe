"""`shardplan fmt`: one canonical layout for a plan, comments kept where they were.

Each statement on its own line, written the canonical way (``replicated`` for an empty spec,
``(a, _, (b, c))``, ``name = 8 @dcn``); the specs of consecutive rules aligned in one column, the
arrows of consecutive ``axis`` rules too; full-line comments and blank lines kept (runs of blank
lines become one), a comment after a statement kept after it. Formatting is idempotent and never
changes what the plan means (the checked plan before and after is equal; tested on every plan
in plans/, the docs and the fuzz corpus).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.lang import syntax
from shardplan.lang.parser import parse


def _dim(d: syntax.Dim) -> str:
    if d.rest:
        return "..."
    if not d.axes:
        return "_"
    return d.axes[0] if len(d.axes) == 1 else "(" + ", ".join(d.axes) + ")"


def _spec(s: syntax.SpecNode) -> str:
    return "replicated" if not s.dims else "(" + ", ".join(_dim(d) for d in s.dims) + ")"


def _name(logical: str) -> str:
    return logical if logical.isidentifier() else f'"{logical}"'


@dataclass(frozen=True)
class _Stmt:
    head: str  # what goes before the aligned column ('param "x"', 'axis embed')
    tail: str  # the aligned part ('(data, _)', '-> model'); '' for statements without one
    group: str  # statements of one group, consecutive, share a column


def _statement(s: syntax.Statement) -> _Stmt:
    if isinstance(s, syntax.PlanName):
        return _Stmt(f'plan "{s.name}"', "", "")
    if isinstance(s, syntax.Extends):
        return _Stmt(f'extends "{s.path}"', "", "")
    if isinstance(s, syntax.MeshNode):
        axes = [
            f"{a.name} = {'*' if a.size is None else a.size}"
            + (f" @{a.link}" if a.link is not None else "")
            + (f" : {a.type}" if a.type is not None else "")
            for a in s.axes
        ]
        return _Stmt("mesh " + (f"{s.type} " if s.type is not None else "") + ", ".join(axes), "", "")
    if isinstance(s, syntax.BackendNode):
        return _Stmt(f"backend {s.name}", "", "")
    if isinstance(s, syntax.BatchNode):
        return _Stmt(f"batch {_spec(s.spec)}", "", "")
    if isinstance(s, syntax.RuleNode):
        return _Stmt(f'{s.kind} "{s.pattern}"', _spec(s.spec), "rule")
    if isinstance(s, syntax.AxisNode):
        return _Stmt(f"axis {_name(s.logical)}", f"-> {_dim(s.dim)}", "axis")
    if isinstance(s, syntax.CacheNode):
        return _Stmt(f"cache {_spec(s.spec)}", "", "")
    if isinstance(s, syntax.PipelineNode):
        return _Stmt("pipeline " + ", ".join([s.axis] + [f"{o.name} = {o.value}" for o in s.options]), "", "")
    assert isinstance(s, syntax.DefaultNode)
    return _Stmt(f"default {_spec(s.spec)}", "", "")


def _comment_at(line: str) -> int:
    """Where a '#' comment starts on a line (outside a string), or -1."""
    in_string = False
    for i, ch in enumerate(line):
        if ch == '"':
            in_string = not in_string
        elif ch == "#" and not in_string:
            return i
    return -1


def format_text(text: str, file: str = "<string>") -> str:
    """The canonical layout of a plan's text.

    Raises:
        PlanSyntaxError: the text does not parse (formatting never guesses).
    """
    text = text.removeprefix("\ufeff")
    module = parse(text, file)
    lines = text.split("\n")
    starts: dict[int, list[syntax.Statement]] = {}
    inside: set[int] = set()
    for s in module.statements:
        span = s.span
        starts.setdefault(span.line, []).append(s)
        inside.update(range(span.line + 1, span.end_line + 1))
    out: list[tuple[str, _Stmt | None, str]] = []  # (kind, statement, comment text)
    for n, raw in enumerate(lines, 1):
        at = _comment_at(raw)
        comment = raw[at:].rstrip() if at >= 0 else ""
        code = (raw[:at] if at >= 0 else raw).strip()
        if n in starts:
            stmts = [_statement(s) for s in starts[n]]
            for k, st in enumerate(stmts):
                out.append(("stmt", st, comment if k == len(stmts) - 1 else ""))
        elif n in inside:
            if comment:  # a comment inside a statement written over several lines: after it
                out.append(("comment", None, comment))
        elif not code and comment:
            out.append(("comment", None, comment))
        elif not code:
            out.append(("blank", None, ""))
    return _render(out)


def _render(items: list[tuple[str, _Stmt | None, str]]) -> str:
    # Column widths per run of consecutive statements of one group.
    widths: dict[int, int] = {}
    i = 0
    while i < len(items):
        kind, st, _ = items[i]
        if kind == "stmt" and st is not None and st.group:
            j = i
            while j < len(items) and items[j][0] == "stmt" and items[j][1].group == st.group:  # type: ignore[union-attr]
                j += 1
            width = max(len(items[k][1].head) for k in range(i, j))  # type: ignore[union-attr]
            for k in range(i, j):
                widths[k] = width
            i = j
        else:
            i += 1
    rendered: list[str] = []
    for k, (kind, st, comment) in enumerate(items):
        if kind == "blank":
            if rendered and rendered[-1] != "":
                rendered.append("")
            continue
        if kind == "comment":
            rendered.append(comment)
            continue
        assert st is not None
        if st.tail:
            gap = "  " if st.group == "rule" else " "  # specs stand two spaces off; arrows one
            line = st.head + " " + st.tail if _alone(items, k) else st.head.ljust(widths[k]) + gap + st.tail
        else:
            line = st.head
        rendered.append(line + (f"  {comment}" if comment else ""))
    while rendered and rendered[-1] == "":
        rendered.pop()
    return "\n".join(rendered) + "\n" if rendered else ""


def _alone(items: list[tuple[str, _Stmt | None, str]], k: int) -> bool:
    """A statement with no neighbour of its group: one space before its column, no alignment."""
    group = items[k][1].group  # type: ignore[union-attr]

    def same(j: int) -> bool:
        return 0 <= j < len(items) and items[j][0] == "stmt" and items[j][1].group == group  # type: ignore[union-attr]

    return not same(k - 1) and not same(k + 1)
