"""The checked, immutable plan: what the checker produces and every later stage reads.

A :class:`Plan` is data. Stages are functions of it: ``shardplan.core.resolve`` (plan x
leaves -> specs), ``shardplan.core.meshes.with_mesh`` (the plan on another mesh), and the
backends.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

from shardplan.core.matching import RuleSet
from shardplan.core.spec import Spec
from shardplan.errors import Diagnostic, PlanCheckError, Span, error

MAX_DEVICES = 2**24  # 16.7M: beyond any machine built; a larger mesh or device count is a typo
RuleKind = Literal["param", "opt", "input", "act"]
LINKS = ("ici", "dcn")  # what a mesh axis's collectives cross: fast links in a host/slice, or the network
# A mesh axis's type (JAX's AxisType): "auto", XLA propagates shardings; "explicit", shardings are
# part of array types (sharding in types: out_sharding=, jax.sharding.reshard in model code).
AXIS_TYPES = ("auto", "explicit")
AxisTypeName = Literal["auto", "explicit"]


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int | None  # None: inferred from the device count
    span: Span | None
    link: str = "ici"  # "ici": fast links inside a host or slice; "dcn": the network between them


@dataclass(frozen=True)
class Rule:
    """One path rule (``param``, ``opt``, ``input`` or ``act``) in the order it is tried."""

    kind: RuleKind
    pattern: str
    spec: Spec
    span: Span
    pattern_span: Span
    spec_span: Span
    source_line: str

    @property
    def origin(self) -> str:
        return f"{self.span.file}:{self.span.line}"

    @property
    def is_catch_all(self) -> bool:
        return self.pattern in (".*", ".+", "(.*)", "(.+)")


@dataclass(frozen=True)
class AxisRule:
    """``axis logical -> mesh axes``: resolves Flax ``nnx.with_partitioning`` names."""

    logical: str
    axes: tuple[str, ...]
    span: Span
    source_line: str

    @property
    def origin(self) -> str:
        return f"{self.span.file}:{self.span.line}"


SCHEDULES = ("gpipe", "circular")  # how microbatches visit the stages (docs/language.md, Pipelines)
MAX_MICROBATCHES = 2**20


@dataclass(frozen=True)
class Pipeline:
    """``pipeline AXIS, microbatches = M, schedule = S, repeats = V``: the params whose stacked
    (leading) dim is split over ``axis`` are the layers of a scanned stack, run as ``stages``
    (the axis's size) x ``repeats`` chunks, ``microbatches`` of the batch flowing through them."""

    axis: str
    microbatches: int
    schedule: str = "gpipe"  # a name in SCHEDULES
    repeats: int = 1  # chunks of layers per stage (circular: microbatches go round the stages this often)
    span: Span | None = None
    source_line: str = ""

    def iterations(self, stages: int) -> int:
        """Loop steps of the schedule: every stage runs one chunk per step."""
        return self.microbatches * self.repeats + stages - 1

    def bubble(self, stages: int) -> float:
        """The fraction of stage-steps that are idle: (p-1) / (v*m + p-1)."""
        return (stages - 1) / self.iterations(stages)


@dataclass(frozen=True)
class Plan:
    """A checked plan. Build one with :func:`shardplan.load` or :func:`shardplan.loads`."""

    name: str | None
    files: tuple[str, ...]
    mesh: tuple[MeshAxis, ...]
    mesh_span: Span | None
    backend: str  # a name in shardplan.core.backends.BACKENDS
    batch: Spec | None
    batch_span: Span | None
    params: tuple[Rule, ...]
    opts: tuple[Rule, ...]
    inputs: tuple[Rule, ...]
    axes: tuple[AxisRule, ...]
    default: Spec | None
    default_span: Span | None
    warnings: tuple[Diagnostic, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()  # (file, text) of the plan and every base it extends
    mesh_source_line: str = ""
    cache: Spec | None = None  # the ``cache`` statement: a generation cache's layout
    cache_span: Span | None = None
    acts: tuple[Rule, ...] = ()  # ``act`` rules: module outputs constrained, by module path
    # Axis types, kept by axis name so a mesh given on the command line keeps them: the type a
    # file gives every axis (``mesh explicit ...``), and each axis's own (``model = 2 : explicit``).
    mesh_type: AxisTypeName = "auto"
    axis_type_of: tuple[tuple[str, AxisTypeName], ...] = ()
    mesh_type_span: Span | None = None
    pipeline: Pipeline | None = None  # the ``pipeline`` statement

    @property
    def text(self) -> str:
        """The text of the plan's own file (its bases are in ``sources``)."""
        return self.sources[0][1] if self.sources else ""

    @functools.cached_property
    def rule_sets(self) -> dict[RuleKind, RuleSet[Rule]]:
        """Compile once, match many: one RE2 set per rule kind, built on first use."""
        return {
            "param": RuleSet(self.params),
            "opt": RuleSet(self.opts),
            "input": RuleSet(self.inputs),
            "act": RuleSet(self.acts),
        }

    # -- mesh ---------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.mesh)

    def axis_type(self, name: str) -> AxisTypeName:
        """The type of mesh axis ``name``: its own, else the mesh's, else auto."""
        return dict(self.axis_type_of).get(name, self.mesh_type)

    @property
    def axis_types(self) -> tuple[AxisTypeName, ...]:
        """Per mesh axis, in order, its type ("auto" or "explicit")."""
        return tuple(self.axis_type(a.name) for a in self.mesh)

    @property
    def explicit_axes(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.mesh if self.axis_type(a.name) == "explicit")

    @property
    def batch_dim0_axes(self) -> tuple[str, ...]:
        """The axes the ``batch`` spec splits dim 0 over (what offline cost figures assume)."""
        return tuple(self.batch.dims[0]) if self.batch is not None and self.batch.dims else ()

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (from ``batch`` and ``input`` rules)."""
        seen: list[str] = []
        specs = ([self.batch] if self.batch is not None else []) + [r.spec for r in self.inputs]
        for spec in specs:
            for a in spec.axes:
                if a not in seen:
                    seen.append(a)
        return tuple(seen)

    def mesh_shape(self, devices: int | None = None) -> dict[str, int]:
        """Concrete axis sizes, inferring a ``*`` axis from ``devices``.

        Raises:
            PlanCheckError: the sizes do not fit the device count.
        """
        if devices is not None and not 1 <= devices <= MAX_DEVICES:
            raise PlanCheckError(
                [
                    error(
                        "mesh-devices",
                        f"a device count of {devices}: it must be between 1 and {MAX_DEVICES:,}",
                        "pass a positive device count (--devices 8)",
                        path="--devices",
                    )
                ]
            )
        known = math.prod(a.size for a in self.mesh if a.size is not None)
        star = [a for a in self.mesh if a.size is None]
        # A mesh from the command line or the API (with_mesh) has no span: the flag is the location.
        where: dict[str, Any] = (
            dict(span=self.mesh_span, source_line=self.mesh_source_line)
            if self.mesh_span is not None
            else dict(path="--mesh")
        )
        written = ", ".join(f"{a.name}={a.size if a.size is not None else '*'}" for a in self.mesh)
        if known > MAX_DEVICES:
            raise PlanCheckError(
                [
                    error(
                        "axis-size",
                        f"mesh {written} has {known:,} devices; a mesh has at most {MAX_DEVICES:,}",
                        "check the sizes (a typo with extra digits?)",
                        **where,
                    )
                ]
            )
        if devices is None:
            if star:
                raise PlanCheckError(
                    [
                        error(
                            "mesh-needs-devices",
                            f"mesh {written} has a '*' axis and no device count was given",
                            "pass the device count (--devices N), or give every axis a size (--mesh data=8,model=4)",
                            **where,
                        )
                    ]
                )
            return {a.name: a.size for a in self.mesh if a.size is not None}
        if star:
            if devices % known:
                raise PlanCheckError(
                    [
                        error(
                            "mesh-devices",
                            f"mesh {written}: {devices} devices do not divide into groups of {known}",
                            f"use a device count that is a multiple of {known}, or change the fixed axis sizes",
                            **where,
                        )
                    ]
                )
            return {a.name: (a.size if a.size is not None else devices // known) for a in self.mesh}
        if known != devices:
            verb = "needs" if known > devices else "uses"
            raise PlanCheckError(
                [
                    error(
                        "mesh-devices",
                        f"mesh {written} {verb} {known} devices; {devices} are available",
                        f"make the sizes multiply to {devices}, or write one size as * to use all devices",
                        **where,
                    )
                ]
            )
        return {a.name: a.size for a in self.mesh if a.size is not None}
