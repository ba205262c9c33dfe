"""The plan search behind ``shardplan suggest``: candidate plans written as .splan text from
the model's param families, and a local search over them by a cost the caller supplies.

Pure: the families come from ``shardplan.runtime.roles`` (what each param dim is, read from
the step's computation), the cost from the step-cost engine, through ``Search.cost``.

The space, per mesh (the device count factored into ``data`` x ``expert`` x ``model``, the
model axis inside a host, axes that cross hosts tagged ``@dcn``):
- which of the model's logical dims are split over ``model`` (tensor parallel): one decision
  per dim, shared by every param that has it (the layers of a list, the column side of one
  matmul and the row side of the next);
- experts (a dim a matmul batches over) over ``expert``, the expert axis also splitting the
  batch outside the expert blocks;
- ``data``: the batch, plus the params and their optimizer state (FSDP), or the optimizer
  state alone (ZeRO-1), or neither (data parallel): a lookup table split by its rows, each
  matrix on its dim of the model's most common width where it divides, else its largest free dim;
- a pipeline, where the mesh crosses hosts and the model has one stack of scanned layers: a
  ``stage`` axis across hosts (outermost, ``@dcn``) splitting the stacked layer dim, with the
  microbatch count and the schedule (GPipe or circular with 2 repeats) searched;
- vectors (norm scales, biases) stay whole; stacked layer dims are split only by a pipeline.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

FSDP_MODES = ("params", "opt", "none")
# The kinds of parallelism a plan of the space may use (``Choice.kinds``): suggest shows the best
# plan of each beside the winner.
KINDS = ("data-parallel", "FSDP", "ZeRO-1", "tensor-parallel", "expert-parallel", "pipeline")
DATA_AXES = ("data", "fsdp", "seq")  # FSDP's axes: across hosts, inside each (hybrid), the sequence's
_FSDP_WORDS = {
    "params": "FSDP (params and optimizer state over data)",
    "opt": "optimizer state over data (ZeRO-1)",
    "none": "data parallel (params whole)",
}


@dataclass(frozen=True)
class Family:
    """Params that share a path template (list indices generalised) and a shape."""

    template: str  # a full-match regex over the param paths
    shape: tuple[int, ...]
    units: tuple[int, ...]  # the logical dim deciding each dim's split
    tags: tuple[frozenset[str], ...]
    count: int  # arrays in the family

    @property
    def elements(self) -> int:
        return self.count * math.prod(self.shape)


@dataclass(frozen=True)
class Space:
    families: tuple[Family, ...]
    sizes: dict[int, int]  # logical dim -> size
    batch: tuple[int, ...]  # the batch's leading dim size per input (the dim the batch splits)
    names: dict[int, str] = field(default_factory=dict)  # logical dim -> a readable name for comments
    seq: tuple[int, ...] = ()  # the inputs' second dim (a sequence), for a seq axis when the batch runs out
    opt_prefixes: tuple[str, ...] = ()  # what optimizer-state paths put before the param path (opt rules)
    backend: str = "auto"  # the backend the plans name (a ``backend`` statement where it is not the default)

    @property
    def opt_regex(self) -> str:
        """An ``opt`` rule's regex before a family's template: exactly the optimizer's prefixes."""
        if not self.opt_prefixes:
            return ".*/"
        if len(self.opt_prefixes) == 1:
            return re.escape(self.opt_prefixes[0])
        split = [p.rstrip("/").split("/") for p in self.opt_prefixes]
        head = 0
        while all(len(x) > head + 1 for x in split) and len({x[head] for x in split}) == 1:
            head += 1
        tail = 0
        while all(len(x) > head + tail + 1 for x in split) and len({x[-1 - tail] for x in split}) == 1:
            tail += 1
        mids = sorted({"/".join(x[head : len(x) - tail]) for x in split})
        parts = [re.escape("/".join(split[0][:head])), "(?:" + "|".join(re.escape(m) for m in mids) + ")"]
        parts.append(re.escape("/".join(split[0][len(split[0]) - tail :])) if tail else "")
        return "/".join(x for x in parts if x) + "/"

    @cached_property
    def experts(self) -> tuple[int, ...]:
        """Dims a matmul batches over on a param (stacked experts)."""
        return tuple(sorted({u for f in self.families for u, t in zip(f.units, f.tags) if "batch" in t}))

    @cached_property
    def stacked(self) -> tuple[int, ...]:
        return tuple(sorted({u for f in self.families for u, t in zip(f.units, f.tags) if "stack" in t}))

    @cached_property
    def tensor(self) -> tuple[int, ...]:
        """Dims tensor parallelism may split: those of matrices, not stacked nor experts, the
        biggest families' first."""
        skip = set(self.experts) | set(self.stacked)
        weight: Counter[int] = Counter()
        for f in self.families:
            if len(f.shape) >= 2:
                for u in set(f.units) - skip:
                    weight[u] += f.elements
        return tuple(sorted(weight, key=lambda u: (-weight[u], self.signature(u))))

    def signature(self, u: int) -> tuple:
        """Where a logical dim occurs, by shapes and uses alone (ties broken without names)."""
        return tuple(
            sorted(
                (f.shape, i, tuple(sorted(f.tags[i])), f.count)
                for f in self.families
                for i, x in enumerate(f.units)
                if x == u
            )
        )

    @cached_property
    def width(self) -> int | None:
        """The dim most matrices share (the residual stream's width): FSDP's first choice."""
        seen: Counter[int] = Counter()
        for f in self.families:
            if len(f.shape) >= 2:
                seen.update(set(f.units) - set(self.stacked) - set(self.experts))
        return max(seen, key=lambda u: (seen[u], self.signature(u))) if seen else None


@dataclass(frozen=True)
class Choice:
    mesh: tuple[tuple[str, int, str], ...]  # (axis, size, link)
    tp: frozenset[int] = frozenset()  # logical dims split over model
    fsdp: str = "none"
    sp: bool = False  # sequence parallel: the outputs of the row-split matmuls' modules split by sequence
    pin: bool = False  # the residual stream (the blocks' outputs) pinned to the batch's layout
    micro: int = 0  # a pipeline over the mesh's stage axis: its microbatches (0: no pipeline)
    circular: bool = False  # the pipeline's schedule: circular with 2 repeats (else GPipe)
    whole: frozenset[str] = frozenset()  # families FSDP leaves whole (``Search.refine``)

    @property
    def sizes(self) -> dict[str, int]:
        return {a: n for a, n, _ in self.mesh}

    def kinds(self) -> tuple[str, ...]:
        """The kinds of parallelism the choice uses, in :data:`KINDS`' words (none: every device
        runs the whole step)."""
        sizes = self.sizes
        data = math.prod(sizes.get(a, 1) for a in DATA_AXES) > 1
        out = []
        if data and self.fsdp == "none":
            out.append("data-parallel")
        if data and self.fsdp == "params":
            out.append("FSDP")
        if data and self.fsdp == "opt":
            out.append("ZeRO-1")
        if sizes.get("model", 1) > 1 and self.tp:
            out.append("tensor-parallel")
        if sizes.get("expert", 1) > 1:
            out.append("expert-parallel")
        if self.micro and sizes.get("stage", 1) > 1:
            out.append("pipeline")
        return tuple(out)

    def describe(self, space: Space) -> str:
        sizes = self.sizes
        mesh = " x ".join(f"{a}={n}" + (" @dcn" if link == "dcn" else "") for a, n, link in self.mesh)
        batch = math.prod(sizes.get(a, 1) for a in (*DATA_AXES, "expert"))
        n = math.prod(sizes.values())
        if batch == 1 and not (self.tp and sizes.get("model", 1) > 1) and not self.micro:
            return (
                f"{n} devices, nothing split: every device runs the whole step (on this "
                "chip splitting costs this model more than it saves)"
            )
        if _batch_spec(space, self) == "replicated" and not any(
            any(param_dims(f, space, self)) for f in space.families
        ):
            rows = "/".join(map(str, sorted(set(space.batch)))) or "no"
            rows_split = math.prod(sizes.get(a, 1) for a in (*DATA_AXES, "expert"))
            if any(any(param_dims(f, space, replace(self, fsdp="params"))) for f in space.families):
                # weights could be split over the mesh: the search found splitting them costs more
                return (
                    f"{n} devices, nothing split: the batch's {rows} rows do not divide over {mesh}, and "
                    f"splitting the weights alone costs this model more than it saves on this chip, so every device "
                    f"runs the whole step; a batch of a multiple of {rows_split} rows splits the work"
                )
            return (
                f"{n} devices, nothing split: no weight dim and not the batch's {rows} rows divide over {mesh}, so "
                f"every device runs the whole step; a device count that divides them splits the work"
            )
        parts = [mesh]
        if math.prod(sizes.get(a, 1) for a in DATA_AXES) > 1:
            parts.append(_FSDP_WORDS[self.fsdp] + self._whole_words(space))
        if sizes.get("model", 1) > 1:
            split = split_words(space, self, "model")
            parts.append("tensor parallel over model: " + split if split else "model: replicas (nothing split over it)")
        if sizes.get("expert", 1) > 1:
            parts.append("experts over expert")
        if self.micro and sizes.get("stage", 1) > 1:
            parts.append(f"pipeline over stage ({self._schedule()})")
        if self.sp:
            parts.append("sequence parallel (act rules)")
        if self.pin:
            parts.append("the residual stream pinned to the batch's layout (act rule)")
        return "; ".join(parts)

    def _whole_words(self, space: Space) -> str:
        if not self.whole or self.fsdp != "params":
            return ""
        names = ", ".join(short_name(t, space) for t in sorted(self.whole))
        return f" except {names} (whole: splitting costs more time than the memory it saves is worth)"

    def _schedule(self) -> str:
        kind = "circular, 2 repeats" if self.circular else "GPipe"
        return f"{self.sizes.get('stage', 1)} stages, {self.micro} microbatches, {kind}"

    def versus(self, other: Choice, space: Space) -> str:
        """What ``self`` changes against ``other``, for a runner-up beside the winner."""
        if self.mesh != other.mesh:
            return self.describe(space)
        out = []
        if self.fsdp != other.fsdp or self.whole != other.whole:
            out.append(_FSDP_WORDS[self.fsdp] + self._whole_words(space))
        if (self.micro, self.circular) != (other.micro, other.circular):
            out.append(f"pipeline: {self._schedule()}")
        if self.sp != other.sp:
            out.append("sequence parallel" if self.sp else "no sequence parallelism")
        if self.pin != other.pin:
            out.append("the residual stream pinned" if self.pin else "the residual stream not pinned")
        moved: dict[str, list[str]] = {"also": [], "not": []}  # one phrase each, whatever the dims
        for u in space.tensor:
            if (u in self.tp) != (u in other.tp):
                mine = self if u in self.tp else other
                what = split_words(space, mine, "model", only=u) or _unsplit(space, mine, u)
                moved["also" if u in self.tp else "not"].append(what)
        out += [f"{way} over model: " + "; ".join(whats) for way, whats in moved.items() if whats]
        return "the same " + ("but " + "; ".join(out) if out else "plan")


def _unsplit(space: Space, c: Choice, u: int) -> str:
    """A logical dim ``c`` puts on ``model`` that no matrix splits there, in words: which dim, and
    why nothing changes (a matrix splits ``model`` once, on its first such dim; a dim that does not
    divide stays whole)."""
    name = space.names.get(u, f"the {space.sizes[u]}-wide dim")
    n = c.sizes.get("model", 1)
    where = [f.shape[i] for f in space.families if len(f.shape) >= 2 for i, x in enumerate(f.units) if x == u]
    if where and all(w % n for w in where):
        return f"{name}, which changes no matrix (it does not divide by model = {n})"
    return f"{name}, which changes no matrix (model already splits another dim of each that has it)"


def short_name(template: str, space: Space) -> str:
    """A family's params as a reader names them: its path less the layer index and what comes
    before it, and less the last part every family's path shares (``kernel``), unescaped."""
    path = template.replace("\\", "")
    path = re.sub(r"^.*?d\+/", "", path)  # "blocks/d+/attn/q/kernel" (unescaped) -> "attn/q/kernel"
    lasts = {f.template.rsplit("/", 1)[-1] for f in space.families if len(f.shape) >= 2}
    if len(lasts) == 1 and "/" in path:
        path = path.rsplit("/", 1)[0]
    return path


def split_words(space: Space, choice: Choice, axis: str, only: int | None = None) -> str:
    """How ``axis`` splits the matrices under ``choice``, in Megatron's words: the columns of
    those it splits on a dim they write (a matmul's output side), the rows of those it splits on
    a dim they read, the rows of lookup tables; ``only``: where that logical dim is split alone."""
    groups: dict[str, list[str]] = {"columns": [], "rows": [], "table rows": [], "dims": []}
    for f in space.families:
        if len(f.shape) < 2:
            continue
        for i, axes in enumerate(param_dims(f, space, choice)):
            if axis not in axes or (only is not None and f.units[i] != only):
                continue
            tags = f.tags[i]
            key = (
                "table rows"
                if "rows" in tags
                else "columns"
                if "free" in tags
                else "rows"
                if "contract" in tags
                else "dims"
            )
            name = short_name(f.template, space)
            if key == "dims":  # no matmul role: which dim (two plans may differ in it alone)
                name = f"dim {i} of {name}"
            if name not in groups[key]:
                groups[key].append(name)
    out = []
    for key, names in groups.items():
        if names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            out.append(shown if key == "dims" else f"the {key} of {shown}")
    return "; ".join(out)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MAX_STAGES = 16


def pipeline_layers(space: Space) -> int | None:
    """The layer count a pipeline can split: the model has one stack of scanned layers, the stacked
    dim first in every param that has it (a plan's stage axis splits dim 0)."""
    stacked = space.stacked
    if len(stacked) != 1:
        return None
    u = stacked[0]
    if any(u in f.units[1:] for f in space.families):
        return None
    return space.sizes[u]


def meshes(space: Space, devices: int, per_host: int | None = None) -> list[tuple[tuple[str, int, str], ...]]:
    """Every factoring of ``devices`` into data x expert x model that the model's dims allow:
    experts divisible by the expert axis, some matrix dim by the model axis, the model axis
    inside a host. Axes that span more devices than a host holds cross hosts (``@dcn``). Where
    the devices span hosts and the model has a stack of layers, also each of those behind a
    ``stage`` axis across the hosts (a pipeline), its size dividing the hosts and the layers; where
    they fit in one host, behind a ``stage`` axis inside it (over the chips' own links), its size
    dividing the devices and the layers."""
    out = _flat_meshes(space, devices, per_host)
    layers = pipeline_layers(space)
    if not layers:
        return out
    if per_host and devices > per_host:
        if devices % per_host == 0:
            hosts = devices // per_host
            for s in divisors(math.gcd(hosts, layers)):
                if 1 < s <= MAX_STAGES:
                    out += [(("stage", s, "dcn"), *m) for m in _flat_meshes(space, devices // s, per_host)]
        return out
    for s in divisors(math.gcd(devices, layers)):
        if 1 < s <= MAX_STAGES:
            out += [(("stage", s, "ici"), *m) for m in _flat_meshes(space, devices // s, per_host)]
    return out


def _flat_meshes(space: Space, devices: int, per_host: int | None) -> list[tuple[tuple[str, int, str], ...]]:
    out = []
    experts = [space.sizes[u] for u in space.experts]
    tensor = [space.sizes[u] for u in space.tensor]
    for e in divisors(devices):
        if e > 1 and (not experts or any(x % e for x in experts)):
            continue
        for t in divisors(devices // e):
            if t > 1 and not any(x % t == 0 for x in tensor):
                continue
            if per_host and t > per_host:
                continue
            d = devices // (e * t)
            if space.batch and space.seq and any(b % d for b in space.batch):
                # the batch runs out of rows: split the sequence too (a seq axis inside the data axis)
                rows = math.gcd(d, *space.batch)
                q = d // rows
                if q > 1 and all(n % q == 0 for n in space.seq):
                    axes = [(a, n) for a, n in (("data", rows), ("seq", q), ("expert", e), ("model", t)) if n > 1]
                    inner, linked = 1, []
                    for a, n in reversed(axes):
                        inner *= n
                        linked.append((a, n, "dcn" if per_host and inner > per_host else "ici"))
                    out.append(tuple(reversed(linked)))
            splits = [(d, 1)]
            inside = per_host // (e * t) if per_host and per_host % (e * t) == 0 else 1
            if per_host and d * e * t > per_host and inside > 1 and d % inside == 0:
                splits.append((d // inside, inside))  # data across hosts x fsdp inside each (hybrid)
            for dd, f in splits:
                axes = [(a, n) for a, n in (("data", dd), ("fsdp", f), ("expert", e), ("model", t)) if n > 1]
                inner, linked = 1, []
                for a, n in reversed(axes or [("data", 1)]):
                    inner *= n
                    linked.append((a, n, "dcn" if per_host and inner > per_host else "ici"))
                out.append(tuple(reversed(linked)))
    return out


def microbatch_counts(space: Space, c: Choice) -> list[int]:
    """Microbatch counts the batch allows under ``c``'s mesh: each microbatch's rows divide over
    the batch's axes (at least as many microbatches as stages)."""
    split = math.prod(c.sizes[a] for a in _batch_rows(space, c))
    rows = math.gcd(*space.batch) if space.batch else 0
    stages = c.sizes.get("stage", 1)
    return [m for m in divisors(rows // split) if m >= stages] if rows and rows % split == 0 else []


def pipeline_micro(space: Space, c: Choice) -> list[int]:
    """The microbatch counts next to ``c``'s: half and twice (where the batch allows them)."""
    counts = microbatch_counts(space, c)
    lower = [m for m in counts if m < c.micro]
    higher = [m for m in counts if m > c.micro]
    return lower[-1:] + higher[:1]


def first_micro(space: Space, c: Choice) -> int:
    """A pipeline's first microbatch count: the batch's count nearest 4 x the stages (a bubble of
    about a fifth), or 0 where the batch allows none."""
    counts = microbatch_counts(space, c)
    stages = c.sizes.get("stage", 1)
    return min(counts, key=lambda m: (abs(m - 4 * stages), m)) if counts else 0


def can_circle(space: Space, c: Choice) -> bool:
    layers = pipeline_layers(space) or 0
    stages = c.sizes.get("stage", 1)
    return bool(layers) and layers % (2 * stages) == 0 and c.micro >= stages


def _axes_text(axes: list[str]) -> str:
    return "_" if not axes else axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def param_dims(f: Family, space: Space, c: Choice) -> list[list[str]]:
    """The mesh axes over which each dim of the family's arrays is split."""
    sizes = c.sizes
    dims: list[list[str]] = [[] for _ in f.shape]
    stacked = set(space.stacked)
    if c.micro and sizes.get("stage", 1) > 1 and f.units and f.units[0] in stacked:
        dims[0] = ["stage"]  # a pipeline: each stage holds its layers (vectors too)
    if sum(u not in stacked for u in f.units) < 2:  # vectors (norm scales, biases; stacked or not) stay whole
        return dims
    used: set[str] = set()

    def put(i: int, *axes: str) -> None:
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1 and a not in used)
        n = math.prod(sizes[a] for a in axes)
        if axes and f.shape[i] % (math.prod(sizes[a] for a in dims[i]) * n) == 0:
            dims[i].extend(axes)
            used.update(axes)

    for i, u in enumerate(f.units):
        if u in stacked:
            continue
        if u in space.experts and "batch" in f.tags[i]:
            # the experts' own dim (a matmul batches over it), not a matrix's column that scores
            # them (a router's): splitting that only moves the scores (the GShard MoE of
            # tests/fixtures/engine_models.py, experts over expert = 4: 0.509 ms compiled with the
            # router's columns split, 0.489 ms whole)
            put(i, "expert")
    for i, u in enumerate(f.units):
        if u in stacked:
            continue
        if u in c.tp and u not in space.experts:
            put(i, "model")
    if c.fsdp != "none" and f.template not in c.whole:
        free = [i for i, u in enumerate(f.units) if u not in stacked and not dims[i]]
        # a table by its rows (split on its width over a batch axis, the lookup carries that split into
        # the activations and XLA moves them: measured), a matrix on its outermost dim: XLA:CPU and
        # XLA:GPU gather and scatter an inner dim through copies laid out with it outermost (fast
        # mode's ``Compiler.minor_gather``; the GPT-2-style decoder's row-side projections split on
        # the residual width: 8 more kernels than on their rows); XLA:TPU either way
        order = sorted(free, key=lambda i: ("rows" not in f.tags[i], i))
        for i in order:
            before = len(dims[i])
            put(i, *DATA_AXES)
            if len(dims[i]) > before:
                break
    return dims


def sp_modules(space: Space, c: Choice) -> list[str]:
    """The modules whose outputs sequence parallelism splits by sequence: those holding a matrix
    split over ``model`` on the side a matmul contracts and writing the residual width (the
    row-parallel projections that end an attention or MLP block). Not inside stacked (scanned)
    layers: an ``act`` rule does not reach calls inside an NNX transform."""
    out = []
    for f in space.families:
        if set(f.units) & set(space.stacked) or "/" not in f.template:
            continue
        dims = param_dims(f, space, c)
        row = any("model" in d and "contract" in t for d, t in zip(dims, f.tags, strict=True))
        writes = any(u == space.width and "free" in t for u, t in zip(f.units, f.tags, strict=True))
        if row and writes:
            out.append(f.template.rsplit("/", 1)[0])
    return out


def residual_module(space: Space) -> str | None:
    """The modules whose outputs are the residual stream: the deepest common parent of the
    modules that write the residual width from another dim (a block holding an attention's
    output projection and an MLP's down projection), outside stacked layers."""
    writers = []
    for f in space.families:
        if set(f.units) & set(space.stacked) or len(f.shape) < 2:
            continue
        writes = any(u == space.width and "free" in t for u, t in zip(f.units, f.tags, strict=True))
        reads_other = any(u != space.width and "contract" in t for u, t in zip(f.units, f.tags, strict=True))
        if writes and reads_other and "rows" not in frozenset().union(*f.tags):
            writers.append(f.template.split("/")[:-1])
    if len(writers) < 2:
        return None
    common: list[str] = []
    for parts in zip(*writers, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "/".join(common) if common and all(len(w) > len(common) for w in writers) else None


def _spec(dims: list[list[str]]) -> str:
    return "(" + ", ".join(_axes_text(d) for d in dims) + ")"


def _batch_rows(space: Space, c: Choice) -> list[str]:
    """The axes the batch's rows split over: data, fsdp and expert, as far as the rows divide."""
    sizes = c.sizes
    axes = [a for a in ("data", "fsdp", "expert") if sizes.get(a, 1) > 1]
    while axes and any(b % math.prod(sizes[a] for a in axes) for b in space.batch):
        axes.pop()
    return axes


def _batch_spec(space: Space, c: Choice) -> str:
    axes = _batch_rows(space, c)
    if c.sizes.get("seq", 1) > 1:
        return f"({_axes_text(axes)}, seq)"
    return f"({_axes_text(axes)})" if axes else "replicated"


def plan_text(space: Space, c: Choice, name: str = "suggested", header: Iterable[str] = ()) -> str:
    """The plan of a choice as .splan text (one rule per family that is split; the rest
    ``default replicated``)."""
    lines = [f"# {h}" if h else "#" for h in header]
    mesh = ", ".join(f"{a} = {n}" + (" @dcn" if link == "dcn" else "") for a, n, link in c.mesh)
    batch = _batch_spec(space, c)
    if batch == "replicated" and not c.pin and not any(any(param_dims(f, space, c)) for f in space.families):
        # nothing split: every device runs the whole step, whatever the axes are called
        mesh = f"data = {math.prod(c.sizes.values())}"
    lines += [f'plan "{name}"', f"mesh {mesh}"]
    if space.backend != "auto":
        lines.append(f"backend {space.backend}")
    if c.micro and c.sizes.get("stage", 1) > 1:
        sched = ", schedule = circular, repeats = 2" if c.circular else ""
        lines.append(f"pipeline stage, microbatches = {c.micro}{sched}")
    lines.append(f"batch {batch}")
    opt = []
    for f in space.families:
        dims = param_dims(f, space, c)
        if c.fsdp == "opt":
            with_data = dims
            dims = [[a for a in d if a not in DATA_AXES] for d in dims]
            if with_data != dims:
                opt.append(f'opt "{space.opt_regex}{f.template}" {_spec(with_data)}')
        if any(dims):
            lines.append(f'param "{f.template}" {_spec(dims)}')
    lines += opt
    rows = _axes_text(_batch_rows(space, c))
    seq = c.sizes.get("seq", 1) > 1
    if c.sp and not seq:
        for m in sp_modules(space, c):
            lines.append(f'act "{m}" ({rows}, model, ...)')
    if c.pin and (block := residual_module(space)):
        lines.append(f'act "{block}" ({rows}, seq, ...)' if seq else f'act "{block}" ({rows}, ...)')
    lines.append("default replicated")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Scored:
    choice: Choice
    text: str
    seconds: float  # the step time the score ranks by
    peak: int
    fits: bool
    cost: Any = field(compare=False, repr=False)  # the StepCost
    time: Any = field(compare=False, repr=False)  # the StepTime

    @property
    def key(self) -> tuple:
        return (not self.fits, self.seconds if self.fits else self.peak)

    @property
    def rank(self) -> tuple:
        """``key``, ties broken by the other figure (a fitting plan's peak, an unfitting one's step
        time), then by the plan's text: a total order, so that no choice depends on the order the
        search meets plans in, nor (where the figures differ) on what the model calls its params."""
        return (*self.key, self.peak if self.fits else self.seconds, self.text)


_SCALARS = ("fsdp", "sp", "pin", "micro", "circular")


def _combined(c: Choice, a: Choice, b: Choice) -> Choice | None:
    """``c`` with the change that makes ``a`` and the one that makes ``b`` (None: both change one
    decision)."""
    fields = {}
    for name in _SCALARS:
        mine, x, y = getattr(c, name), getattr(a, name), getattr(b, name)
        if x != mine and y != mine:
            return None
        fields[name] = x if x != mine else y
    if a.tp != c.tp and b.tp != c.tp and (a.tp ^ c.tp) == (b.tp ^ c.tp):
        return None
    return replace(c, tp=c.tp ^ (a.tp ^ c.tp) ^ (b.tp ^ c.tp), **fields)


@dataclass
class Search:
    """A local search over choices. ``score(text) -> (cost, time, seconds, peak)`` or None when
    the plan does not apply (a dim that does not divide, say); ``budget``: bytes per device."""

    space: Space
    score: Callable[[str], tuple | None]
    budget: float | None = None
    progress: Callable[[str], None] | None = None
    seen: dict[str, Scored | None] = field(default_factory=dict)
    aside: int = 0  # plans costed but not kept among the runners-up (``refine``'s variants)

    @property
    def costed(self) -> int:
        """Plans costed so far."""
        return len(self.seen) + self.aside

    def evaluate(self, c: Choice) -> Scored | None:
        text = plan_text(self.space, c)
        if text not in self.seen:
            self.seen[text] = self._scored(c, text)
        return self.seen[text]

    def _scored(self, c: Choice, text: str) -> Scored | None:
        got = self.score(text)
        if self.progress:
            self.progress(c.describe(self.space))
        if got is None:
            return None
        cost, time, seconds, peak = got
        return Scored(c, text, seconds, peak, self.budget is None or peak <= self.budget, cost, time)

    def neighbours(self, c: Choice) -> list[Choice]:
        out = []
        sizes = c.sizes
        if math.prod(sizes.get(a, 1) for a in DATA_AXES) > 1:
            out += [replace(c, fsdp=m) for m in FSDP_MODES if m != c.fsdp]
        if sizes.get("model", 1) > 1:
            out += [replace(c, tp=c.tp ^ {u}) for u in self.space.tensor]
            if c.sp or (sp_modules(self.space, c) and sizes.get("seq", 1) == 1):
                out.append(replace(c, sp=not c.sp))
        if c.pin or (residual_module(self.space) and len([a for a in sizes if sizes[a] > 1]) > 1):
            out.append(replace(c, pin=not c.pin))
        if c.micro:
            out += [replace(c, micro=m) for m in pipeline_micro(self.space, c) if m != c.micro]
            if c.circular or can_circle(self.space, c):
                out.append(replace(c, circular=not c.circular))
        return out

    def pairs(self, c: Choice) -> list[Choice]:
        """Two changes at once, where no one alone pays: every two of :meth:`neighbours`' changes
        that touch different decisions (the FSDP mode with a tensor-parallel dim: memory moved from
        one to the other; sequence parallelism off and the residual stream pinned: measured on
        llama_tiny, 4 devices at half the free best's peak, the best plan two such changes away)."""
        singles = self.neighbours(c)
        out = []
        for i, a in enumerate(singles):
            for b in singles[i + 1 :]:
                both = _combined(c, a, b)
                if both is not None:
                    out.append(both)
        return out

    def descend(self, start: Choice) -> Scored | None:
        """Steepest descent from ``start``: every single change costed, the best taken while it
        improves; then pairs of changes where no single one pays. Each step takes the best of all
        its neighbours by a total order (``Scored.rank``), so the path, and the plans costed on
        it, do not depend on the order the neighbours are listed in."""
        best = self.evaluate(start)
        while best is not None:
            moves = [got for n in self.neighbours(best.choice) if (got := self.evaluate(n)) is not None]
            step = min(moves, key=lambda s: s.rank, default=None)
            if step is None or not step.key < best.key:
                moves = [got for n in self.pairs(best.choice) if (got := self.evaluate(n)) is not None]
                step = min(moves, key=lambda s: s.rank, default=None)
                if step is None or not step.key < best.key:
                    return best
            best = step
        return best

    def choices(self, mesh: tuple[tuple[str, int, str], ...]) -> list[Choice]:
        """Every choice of the space on ``mesh``: each subset of the tensor-parallel dims, each FSDP
        mode, sequence parallelism and the pinned residual stream where they apply, a pipeline's
        microbatch counts and schedules (the decisions :meth:`neighbours` changes one at a time)."""
        sizes = {a: n for a, n, _ in mesh}
        modes = FSDP_MODES if math.prod(sizes.get(a, 1) for a in DATA_AXES) > 1 else ("none",)
        tensor = self.space.tensor if sizes.get("model", 1) > 1 else ()
        subsets = [frozenset(c) for r in range(len(tensor) + 1) for c in itertools.combinations(tensor, r)]
        pins = (
            (False, True) if residual_module(self.space) and len([a for a in sizes if sizes[a] > 1]) > 1 else (False,)
        )
        base = Choice(mesh)
        pipelines = [(0, False)]
        if sizes.get("stage", 1) > 1:
            counts = microbatch_counts(self.space, base)
            pipelines = [
                (m, c) for m in counts for c in (False, True) if not c or can_circle(self.space, replace(base, micro=m))
            ]
        out = []
        for tp in subsets:
            for fsdp in modes:
                c = Choice(mesh, tp, fsdp)
                sps = (
                    (False, True)
                    if sizes.get("model", 1) > 1 and sizes.get("seq", 1) == 1 and sp_modules(self.space, c)
                    else (False,)
                )
                for sp in sps:
                    for pin in pins:
                        for micro, circular in pipelines:
                            if micro or sizes.get("stage", 1) == 1:
                                out.append(Choice(mesh, tp, fsdp, sp, pin, micro, circular))
        return out

    def exhaustive(self, mesh_list: list[tuple[tuple[str, int, str], ...]]) -> list[Scored]:
        """Every choice on every mesh costed: the space's best by the cost model, whatever order the
        search would meet it in (for small spaces, and to check :meth:`run` against)."""
        for m in mesh_list:
            for c in self.choices(m):
                self.evaluate(c)
        return sorted((s for s in self.seen.values() if s is not None), key=lambda s: s.rank)

    def run(self, mesh_list: list[tuple[tuple[str, int, str], ...]], descents: int = 3) -> list[Scored]:
        """Every mesh's starting points costed (data parallel or FSDP, with no tensor parallel
        and with all of it; where none of those fits the budget, also Megatron's split with every
        memory-saving decision taken), then a local search from the best ``descents`` of them."""
        starts: list[Scored] = []
        bases = []
        for m in mesh_list:
            sizes = {a: n for a, n, _ in m}
            fsdp = "params" if math.prod(sizes.get(a, 1) for a in DATA_AXES) > 1 else "none"
            base = Choice(m, frozenset(), fsdp)
            if sizes.get("stage", 1) > 1:
                base = replace(base, micro=first_micro(self.space, base))
                if not base.micro:
                    continue
            bases.append(base)
            choices = [base]
            if sizes.get("model", 1) > 1:
                choices.append(replace(base, tp=frozenset(self.space.tensor)))
            if fsdp != "none":
                choices.append(replace(base, fsdp="none"))
            starts += [got for c in choices if (got := self.evaluate(c)) is not None]
        if not any(s.fits for s in starts):
            # Each dim but the residual stream's width over model (Megatron's columns, then rows),
            # FSDP and sequence parallelism: the start that may fit where the others' descents end
            # in plans that do not (measured on gpt_tiny, 4 devices, 35% of the free best's peak).
            for base in bases:
                if base.sizes.get("model", 1) > 1:
                    most = replace(base, tp=frozenset(self.space.tensor) - {self.space.width})
                    if base.sizes.get("seq", 1) == 1 and sp_modules(self.space, most):
                        most = replace(most, sp=True)
                    if (got := self.evaluate(most)) is not None:
                        starts.append(got)
        for s in sorted(starts, key=lambda s: s.rank)[:descents]:
            self.descend(s.choice)
        best = min((s for s in self.seen.values() if s is not None), key=lambda s: s.rank, default=None)
        if best is not None:
            self.refine(best)
        return sorted((s for s in self.seen.values() if s is not None), key=lambda s: s.rank)

    def refine(self, best: Scored) -> Scored:
        """The winner with the families FSDP splits left whole where that still fits and ranks
        better: a small table or matrix whose split saves less memory than its collectives cost
        (the GPT-J-style decoder's learned positions, (32, 64) f32: a gather and a reduce-scatter
        for 24 KiB of params and state). Families alike but for their names (the same shape, roles
        and count) are left whole together, the groups tried smallest first: nothing here depends
        on what the model calls its params."""
        if best.choice.fsdp != "params" or not best.fits:
            return best
        groups: dict[tuple, list[str]] = {}
        for f in self.space.families:
            if (
                f.template not in best.choice.whole
                and any(param_dims(f, self.space, best.choice))
                and not any(param_dims(f, self.space, replace(best.choice, fsdp="none")))
            ):
                key = (f.elements, f.shape, f.count, tuple(tuple(sorted(t)) for t in f.tags))
                groups.setdefault(key, []).append(f.template)
        start = best
        for key in sorted(groups):  # costed aside: the variants are not runners-up of their own
            c = replace(best.choice, whole=best.choice.whole | set(groups[key]))
            got = self._scored(c, plan_text(self.space, c))
            self.aside += 1
            if got is not None and got.fits and got.key < best.key:
                best = got
        if best is not start:
            self.seen[best.text] = best
        return best
