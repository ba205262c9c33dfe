"""The syntax tree of a .splan file: frozen dataclasses, each carrying its source span.

Later stages import this module, never Lark.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.core.plan import RuleKind
from shardplan.errors import Span


@dataclass(frozen=True)
class Dim:
    """One array dimension of a spec: the mesh axes it is split over (empty = whole)."""

    axes: tuple[str, ...]
    span: Span
    rest: bool = False  # ``...``: as many whole dims as the array has beyond the others


@dataclass(frozen=True)
class SpecNode:
    """A spec as written: ``(a, _, (b, c))`` or ``replicated``."""

    dims: tuple[Dim, ...]
    span: Span


@dataclass(frozen=True)
class PlanName:
    name: str
    span: Span


@dataclass(frozen=True)
class Extends:
    path: str
    span: Span


@dataclass(frozen=True)
class MeshAxisNode:
    name: str
    size: int | None  # None: inferred from the device count ('*')
    span: Span
    name_span: Span
    link: str | None = None  # "@ici" / "@dcn" as written
    link_span: Span | None = None
    type: str | None = None  # ``model = 2 : explicit``: the axis type as written
    type_span: Span | None = None


@dataclass(frozen=True)
class MeshNode:
    axes: tuple[MeshAxisNode, ...]
    span: Span
    type: str | None = None  # ``mesh explicit data = *``: every axis's type, as written
    type_span: Span | None = None


@dataclass(frozen=True)
class BackendNode:
    name: str
    span: Span


@dataclass(frozen=True)
class BatchNode:
    spec: SpecNode
    span: Span


@dataclass(frozen=True)
class RuleNode:
    """``param|opt|input "regex" spec``. ``pattern_span`` covers the text inside the quotes."""

    kind: RuleKind
    pattern: str
    pattern_span: Span
    spec: SpecNode
    span: Span


@dataclass(frozen=True)
class AxisNode:
    """``axis logical -> mesh_dim``: a Flax logical axis name mapped to mesh axes."""

    logical: str
    dim: Dim
    span: Span


@dataclass(frozen=True)
class DefaultNode:
    spec: SpecNode
    span: Span


@dataclass(frozen=True)
class CacheNode:
    """``cache spec``: how a generation cache's arrays are laid out."""

    spec: SpecNode
    span: Span


@dataclass(frozen=True)
class PipeOption:
    """``name = value`` in a pipeline statement (value: an int, or a word)."""

    name: str
    value: int | str
    span: Span
    value_span: Span


@dataclass(frozen=True)
class PipelineNode:
    """``pipeline axis, name = value, ...``: the stage-split layers run as a pipeline."""

    axis: str
    axis_span: Span
    options: tuple[PipeOption, ...]
    span: Span


Statement = (
    PlanName
    | Extends
    | MeshNode
    | BackendNode
    | BatchNode
    | RuleNode
    | AxisNode
    | DefaultNode
    | CacheNode
    | PipelineNode
)


@dataclass(frozen=True)
class Module:
    """A parsed file: its statements in order, its name and its text (for diagnostics)."""

    file: str
    text: str
    statements: tuple[Statement, ...]

    def line(self, n: int) -> str:
        lines = self.text.split("\n")
        return lines[n - 1] if 0 < n <= len(lines) else ""
