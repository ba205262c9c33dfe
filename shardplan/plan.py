"""The checked, immutable plan: what the checker produces and every later stage reads."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import re2

from shardplan.errors import PlanCheckError, Span, error

if TYPE_CHECKING:
    from shardplan.resolve import Resolution

Backend = Literal["auto", "shard_map"]
BACKENDS: tuple[str, ...] = ("auto", "shard_map")

DEFAULT_REPLICATED_THRESHOLD = 64 * 2**20  # bytes; a larger replicated tensor is warned about


@dataclass(frozen=True)
class Spec:
    """A partition spec: per array dimension, the mesh axes it is split over (``()`` = whole).

    ``Spec(())`` is fully replicated. Trailing dimensions beyond ``dims`` are whole.
    """

    dims: tuple[tuple[str, ...], ...] = ()

    def __hash__(self) -> int:  # cached: specs key the per-(shape, spec) memo of every leaf
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(self.dims)
        return h

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    @functools.cached_property
    def is_replicated(self) -> bool:
        return not self.axes

    def partition_spec(self):
        """The ``jax.sharding.PartitionSpec`` for this spec (trailing whole dims dropped)."""
        cached = _PSPECS.get(self)
        if cached is None:
            cached = _PSPECS[self] = self._partition_spec()
        return cached

    def _partition_spec(self):
        from jax.sharding import PartitionSpec

        entries = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def shard_shape(self, shape: tuple[int, ...], mesh: dict[str, int]) -> tuple[int, ...]:
        out = list(shape)
        for i, d in enumerate(self.dims[: len(shape)]):
            out[i] = shape[i] // math.prod(mesh[a] for a in d) if d else shape[i]
        return tuple(out)

    def __str__(self) -> str:
        if self.is_replicated:
            return "replicated"
        parts = ["_" if not d else d[0] if len(d) == 1 else "(" + ", ".join(d) + ")" for d in self.dims]
        return "(" + ", ".join(parts) + ")"


_PSPECS: dict[Spec, Any] = {}


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int | None  # None: inferred from the device count
    span: Span | None


@dataclass(frozen=True)
class Rule:
    """One path rule (``param``, ``opt`` or ``input``) in the order it is tried."""

    kind: Literal["param", "opt", "input"]
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


_DIGITS = str.maketrans("0123456789", "0000000000")
# Inside a character class, a range whose ends are not both letters (e.g. [!-@]) can hold
# digits without naming one; such a pattern is treated as able to tell digits apart.
_CLASS_RANGE = re.compile(r"\[[^\]]*[^A-Za-z\]]-[^\]]*\]|\[[^\]]*-[^A-Za-z\]][^\]]*\]")


def digit_blind(pattern: str) -> bool:
    """True if the regex cannot tell one digit from another: it names no digit (outside
    repetition counts like {2,3}) and has no class range that could hold digits. Then every
    path matches exactly as the path with each digit replaced by 0 does, so paths that
    differ only in layer or expert numbers (of equal length) share one match."""
    stripped = re.sub(r"\{\d+(,\d*)?\}", "", pattern)
    return not any(c.isdigit() for c in stripped) and not _CLASS_RANGE.search(stripped)


class RuleSet:
    """Rules of one kind compiled once into an RE2 full-match set (linear time, first wins)."""

    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self.blind = all(digit_blind(r.pattern) for r in rules)
        self._set = None
        if rules:
            opts = re2.Options()
            opts.log_errors = False
            s = re2.Set.FullMatchSet(opts)
            for r in rules:
                s.Add(r.pattern)
            s.Compile()
            self._set = s

    def key(self, path: str) -> str:
        """What a match can depend on: the path, with digits zeroed when every rule is digit-blind."""
        return path.translate(_DIGITS) if self.blind else path

    def matches(self, path: str) -> list[int] | None:
        """Indices of every rule whose regex full-matches ``path``, or None."""
        return self._set.Match(path) if self._set is not None else None


@dataclass(frozen=True)
class Plan:
    """A checked plan. Build one with :func:`shardplan.load` or :func:`shardplan.loads`."""

    name: str | None
    files: tuple[str, ...]
    mesh: tuple[MeshAxis, ...]
    mesh_span: Span | None
    backend: Backend
    batch: Spec | None
    batch_span: Span | None
    params: tuple[Rule, ...]
    opts: tuple[Rule, ...]
    inputs: tuple[Rule, ...]
    axes: tuple[AxisRule, ...]
    default: Spec | None
    default_span: Span | None
    warnings: tuple = ()
    text: str = ""
    mesh_source_line: str = ""
    _sets: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        # Compile once, match many: one RE2 set per rule kind, built when the plan is made.
        self._sets.update(param=RuleSet(self.params), opt=RuleSet(self.opts), input=RuleSet(self.inputs))

    # -- mesh ---------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.mesh)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (from ``batch`` and ``input`` rules)."""
        seen: list[str] = []
        for spec in [self.batch] + [r.spec for r in self.inputs]:
            for a in spec.axes if spec is not None else ():
                if a not in seen:
                    seen.append(a)
        return tuple(seen)

    def mesh_shape(self, devices: int | None = None) -> dict[str, int]:
        """Concrete axis sizes, inferring a ``*`` axis from ``devices``.

        Raises:
            PlanCheckError: the sizes do not fit the device count.
        """
        known = math.prod(a.size for a in self.mesh if a.size is not None)
        star = [a for a in self.mesh if a.size is None]
        where = dict(span=self.mesh_span, source_line=self.mesh_source_line)
        written = ", ".join(f"{a.name}={a.size if a.size is not None else '*'}" for a in self.mesh)
        if devices is None:
            if star:
                raise PlanCheckError([error(
                    "mesh-needs-devices", f"mesh {written} has a '*' axis and no device count was given",
                    "pass the device count (--devices N), or give every axis a size (--mesh data=8,model=4)",
                    **where)])
            return {a.name: a.size for a in self.mesh}
        if star:
            if devices % known:
                raise PlanCheckError([error(
                    "mesh-devices", f"mesh {written}: {devices} devices do not divide into "
                    f"groups of {known}", f"use a device count that is a multiple of {known}, "
                    "or change the fixed axis sizes", **where)])
            return {a.name: (a.size if a.size is not None else devices // known) for a in self.mesh}
        if known != devices:
            verb = "needs" if known > devices else "uses"
            raise PlanCheckError([error(
                "mesh-devices", f"mesh {written} {verb} {known} devices; {devices} are available",
                f"make the sizes multiply to {devices}, or write one size as * to use all devices",
                **where)])
        return {a.name: a.size for a in self.mesh}

    def with_mesh(self, sizes: dict[str, int | None]) -> "Plan":
        """A copy of the plan on another mesh (e.g. from ``--mesh data=8,model=4``).

        The new mesh replaces the file's; every axis a rule names must still exist.
        """
        from shardplan.checker import check_mesh_override

        return check_mesh_override(self, sizes)

    # -- resolution ---------------------------------------------------------------------
    def resolve(self, tree: Any, *, params: Any = None, devices: int | None = None,
                mesh: dict[str, int] | None = None,
                replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD) -> "Resolution":
        """Map a pytree of arrays or shapes to a PartitionSpec tree, with a record per leaf.

        Args:
            tree: an NNX ``State`` or ``Module``, or any pytree of arrays /
                ``ShapeDtypeStruct``s. Leaves are params, matched by ``param`` rules,
                unless ``params`` is given.
            params: the model's params (state or pytree). When given, ``tree`` is
                optimizer state: leaves mirror these params' specs.
            devices: device count used to infer a ``*`` mesh axis (default: local devices).
            mesh: concrete axis sizes, overriding ``devices``.
            replicated_threshold: warn for replicated tensors larger than this (bytes).

        Raises:
            PlanCheckError: with every problem found (unmatched params, spec too long,
                indivisible dimensions, ...).
        """
        from shardplan import resolve as _resolve
        from shardplan import tree as _tree

        mesh = mesh or self.mesh_shape(_tree.device_count() if devices is None else devices)
        if params is None:
            leaves, rebuild = _tree.flatten(tree)
            res = _resolve.resolve_leaves(self, mesh, leaves, (), replicated_threshold)
        else:
            pleaves, _ = _tree.flatten(params)
            leaves, rebuild = _tree.flatten(tree)
            res = _resolve.resolve_leaves(self, mesh, pleaves, leaves, replicated_threshold,
                                          report_params=False)
        return res.with_specs(rebuild)

    def resolve_model(self, model: Any, optimizer: Any = None, *, devices: int | None = None,
                      mesh: dict[str, int] | None = None,
                      replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD) -> tuple["Resolution", "Resolution | None"]:
        """Resolve a model's state and its optimizer's in one pass: (params, optimizer state).

        Warnings are carried on the params' resolution.
        """
        from shardplan import resolve as _resolve
        from shardplan import tree as _tree

        mesh = mesh or self.mesh_shape(_tree.device_count() if devices is None else devices)
        pleaves, prebuild = _tree.flatten(model)
        oleaves, orebuild = _tree.flatten(optimizer) if optimizer is not None else ([], None)
        res = _resolve.resolve_leaves(self, mesh, pleaves, oleaves, replicated_threshold)
        n = len(pleaves)
        params = _resolve.Resolution(res.mesh, res.decisions[:n], res.warnings, prebuild)
        opt = _resolve.Resolution(res.mesh, res.decisions[n:], (), orebuild) if optimizer is not None else None
        return params, opt

    def resolve_batch(self, tree: Any, *, devices: int | None = None,
                      mesh: dict[str, int] | None = None) -> "Resolution":
        """Specs for an input batch: ``input`` rules by path, then the ``batch`` spec."""
        from shardplan import resolve as _resolve
        from shardplan import tree as _tree

        mesh = mesh or self.mesh_shape(_tree.device_count() if devices is None else devices)
        leaves, rebuild = _tree.flatten(tree)
        return _resolve.resolve_inputs(self, mesh, leaves).with_specs(rebuild)
