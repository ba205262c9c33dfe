"""Diagnostics and the one error root of shardplan.

Every problem shardplan finds is a :class:`Diagnostic`: where (a source span or a
parameter path), what is wrong, and what to change. Errors are raised together as one
:class:`ShardPlanError`; warnings travel as data on results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardplan.codes import CODES, Severity

MAX_SHOWN = 20


@dataclass(frozen=True)
class Span:
    """A region of a source file: 1-based line and column, end exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Diagnostic:
    """One problem: severity, a short code, a message, a hint and a location.

    ``span`` points into a plan file; ``path`` names a parameter (for problems found
    against a model). ``source_line`` is the text of the span's line, kept so the
    diagnostic renders with a caret without the source at hand.
    """

    severity: Severity
    code: str
    message: str
    hint: str = ""
    span: Span | None = None
    path: str | None = None
    source_line: str | None = None

    @property
    def location(self) -> str:
        if self.span is not None:
            where = str(self.span)
            return f"{where} ({self.path})" if self.path else where
        return self.path or "<plan>"

    def render(self) -> str:
        """file:line:col: severity[code]: message, then the line, a caret and the hint."""
        out = [f"{self.location}: {self.severity}[{self.code}]: {self.message}"]
        if self.span is not None and self.source_line is not None:
            col = max(self.span.column, 1)
            if self.span.end_line == self.span.line:
                width = max(self.span.end_column - col, 1)
            else:
                width = max(len(self.source_line) - col + 1, 1)
            line, caret = _excerpt(self.source_line, col, width)
            out.append(f"    {line}")
            out.append(f"    {caret}")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)

    def to_json(self) -> dict:
        d: dict = {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
        }
        if self.span is not None:
            d.update(
                file=self.span.file,
                line=self.span.line,
                column=self.span.column,
                end_line=self.span.end_line,
                end_column=self.span.end_column,
            )
        if self.path is not None:
            d["path"] = self.path
        return d


EXCERPT = 100  # characters of a source line shown around a caret


def _shown(text: str) -> str:
    """One character as shown: tabs as 4 spaces, other control characters escaped."""
    out = []
    for ch in text:
        if ch == "\t":
            out.append("    ")
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _excerpt(line: str, col: int, width: int) -> tuple[str, str]:
    """The source line (a window of it when long) and a caret under columns col..col+width,
    aligned after tabs and escapes are expanded."""
    start = max(0, min(col - 1 - EXCERPT // 4, len(line) - EXCERPT))
    end = min(len(line), start + EXCERPT)
    head = "..." if start > 0 else ""
    tail = "..." if end < len(line) else ""
    before = _shown(line[start : col - 1]) if col - 1 >= start else ""
    marked = _shown(line[col - 1 : min(col - 1 + width, end)]) or " "
    return head + _shown(line[start:end]) + tail, " " * (len(head) + len(before)) + "^" * max(len(marked), 1)


def render_all(diagnostics: Sequence[Diagnostic], limit: int = MAX_SHOWN) -> str:
    shown = [d.render() for d in diagnostics[:limit]]
    if len(diagnostics) > limit:
        shown.append(f"... and {len(diagnostics) - limit} more")
    return "\n".join(shown)


class ShardPlanError(Exception):
    """The root of every error shardplan raises on bad input.

    Carries all diagnostics found, not only the first.
    """

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)
        super().__init__(render_all(self.diagnostics))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")


class PlanSyntaxError(ShardPlanError):
    """The plan text does not parse."""


class PlanCheckError(ShardPlanError):
    """The plan parses but is inconsistent, or does not fit a model or mesh."""


class PlanApplyError(ShardPlanError):
    """Applying a plan to live devices, arrays or models failed."""


class ArgumentError(ShardPlanError):
    """A command-line or API argument is malformed or out of range."""


class LaunchError(PlanApplyError):
    """``shardplan launch`` could not start the command."""


class ShardMapFallbackWarning(UserWarning):
    """The shard_map backend runs some ops of the step on whole (gathered) operands: correct, but
    each gathers its operands on every device. Raised as ``PlanApplyError`` with ``strict=True``."""


_BY_STAGE: dict[str, type[ShardPlanError]] = {
    "syntax": PlanSyntaxError,
    "check": PlanCheckError,
    "apply": PlanApplyError,
    "argument": ArgumentError,
}


def as_error(diagnostics: Sequence[Diagnostic]) -> ShardPlanError:
    """The exception for these diagnostics: its class is the stage of the first error's code
    (``shardplan.codes``), whichever call path found it."""
    first = next((d for d in diagnostics if d.severity == "error"), None)
    stage = CODES[first.code].stage if first is not None else "check"
    return _BY_STAGE[stage](diagnostics)


def _make(
    severity: Severity, code: str, message: str, hint: str, span: Span | None, path: str | None, source_line: str | None
) -> Diagnostic:
    registered = CODES.get(code)
    if registered is None or registered.severity != severity:
        raise KeyError(f"diagnostic code {code!r} is not registered as an {severity} in shardplan.codes")
    return Diagnostic(severity, code, message, hint, span, path, source_line)


def error(
    code: str,
    message: str,
    hint: str = "",
    *,
    span: Span | None = None,
    path: str | None = None,
    source_line: str | None = None,
) -> Diagnostic:
    return _make("error", code, message, hint, span, path, source_line)


def warning(
    code: str,
    message: str,
    hint: str = "",
    *,
    span: Span | None = None,
    path: str | None = None,
    source_line: str | None = None,
) -> Diagnostic:
    return _make("warning", code, message, hint, span, path, source_line)


def fail(
    code: str,
    message: str,
    hint: str = "",
    *,
    span: Span | None = None,
    path: str | None = None,
    source_line: str | None = None,
) -> ShardPlanError:
    """One error as the exception of its stage: ``raise fail("code", "what", "hint", path=...)``."""
    return as_error([error(code, message, hint, span=span, path=path, source_line=source_line)])
