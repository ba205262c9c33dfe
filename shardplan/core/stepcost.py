"""What one training step costs per device: the step-cost stage's result, as data.

Made by the exact mode (``shardplan.runtime.exact``: XLA's compiled program of the chosen
backend) or the fast mode (``shardplan.runtime.fast``: the step's jaxpr, no compile). Every
figure says which backend and mode it is for; what a mode does not model is listed in
``notes``, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardplan.core import hlo
from shardplan.core.hlo import KINDS
from shardplan.core.notes import Note
from shardplan.ledger import Communication as Communication  # the collective ledger's row

Mode = Literal["fast", "exact"]


@dataclass(frozen=True)
class Constrained:
    """An activation the step constrains to a layout: by a plan's ``act`` rule, a Flax logical
    name through the plan's ``axis`` rules, or the model's own sharding constraint."""

    what: str  # "act rule plans/x.splan:12 on layers/0/attn", or "sharding constraint"
    source: str  # model source 'file:line'
    shape: tuple[int, ...]
    spec: str  # the layout, e.g. (data, model, _)
    bytes: int  # per device, one instance
    count: int  # instances per step (a constraint inside a scanned layer counts per layer)


@dataclass(frozen=True)
class Memory:
    """Per-device bytes. ``peak`` is what the step needs at once."""

    params: int
    opt_state: int
    batch: int
    gradients: int = 0
    activations: int = 0  # saved for the backward pass
    gathered: int = 0  # most gathered weight bytes alive at once
    temporaries: int = 0  # XLA's temp buffers (exact mode)
    outputs: int = 0
    aliased: int = 0  # outputs that reuse argument buffers (donation)
    peak: int = 0


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline plan's schedule in the step: its loop, its bubble and its stage-to-stage traffic."""

    axis: str
    stages: int
    microbatches: int
    schedule: str
    repeats: int
    steps: int  # loop steps: repeats * microbatches + stages - 1
    idle: int  # idle stage-steps, counted from the schedule's table
    bubble: float  # idle / (steps * stages)
    permute_bytes: int  # collective permutes over the axis, per device per step (forward and backward)
    permute_count: int
    link: str = "ici"  # what the axis crosses (@dcn: the network between hosts)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class StepCost:
    """Per-device cost of one training step of a plan on its mesh."""

    mode: Mode
    backend: str
    mesh: dict[str, int]
    flops: float  # per device, forward + backward + optimizer update
    memory: Memory
    communication: tuple[Communication, ...]
    transcendentals: float = 0.0
    seconds: float = 0.0  # how long the analysis took
    notes: tuple[Note, ...] = field(default=())
    constrained: tuple[Constrained, ...] = field(default=())  # fast mode: activations with a set layout
    logical_names: tuple[str, ...] = field(default=())  # names the model's activation constraints use
    # Fast mode, when activations are constrained: per (collective, mesh axes), the bytes per
    # device the constraints add (> 0) or remove (< 0), against the same step without them.
    constraint_delta: tuple[tuple[str, str, int], ...] = field(default=())
    # Bytes read and written in device memory (HBM) per device per step: exact mode, every kernel
    # of the compiled program (hlo.memory_bytes: each loop iteration, library calls included);
    # fast mode, each op's operands and results with XLA's fusion of elementwise chains assumed.
    hbm_bytes: float = 0.0
    # The shard_map backend's ops that ran on whole (gathered) operands: (op, source, bytes per device).
    fallbacks: tuple[tuple[str, str, int], ...] = field(default=())
    # Kernels launched per device per step (each loop iteration counts): exact mode, the compiled
    # program's instructions outside fusions (a fusion is one); fast mode, the equations whose
    # results XLA's fusion stores, collectives included. The step time's launch overhead.
    kernels: float = 0.0
    pipeline: PipelineCost | None = None  # a pipeline plan's schedule (the bubble, the stage permutes)
    # Exact mode: the compiler that made the program ("XLA:CPU", "XLA:TPU tpu-v5p:2x2x2", ...) and
    # that compiler's own estimate of the step's seconds where it gives a meaningful one (XLA:TPU
    # v5p's cost analysis ``optimal_seconds``; None elsewhere).
    compiler: str = ""
    compiler_seconds: float | None = None
    # Exact mode, where the program runs collectives asynchronously (XLA:GPU): its schedule
    # (``hlo.schedule``: kernels and collectives in the order they run), for the step time.
    schedule: tuple[hlo.Step, ...] = ()
    # Fast mode: the backward pass's collectives of activations, (kind, axes, bytes, launches) per
    # step, that run beside its weight gradients' matmuls (``timing.step_time``).
    backward: tuple[tuple[str, tuple[str, ...], int, int], ...] = ()
    # Fast mode: whose layouts it partitioned: its own propagation's ("shardplan") or Shardy's,
    # XLA's own pass run offline ("xla": ``check --propagation xla``)
    propagation: str = "shardplan"
    # Matmul FLOPs per device per step by the model's source line, largest first: fast mode's
    # rules, or the compiled program's dots and convolutions (``hlo.matmul_by_source``): where the
    # two modes' FLOPs part.
    matmul_flops: tuple[tuple[str, float], ...] = ()
    # Grouped matmuls each device runs on its own groups of a split, where the compiler's grouped
    # kernel does as much work as rows were routed to them (the shard_map backend's experts over
    # an expert axis on XLA:TPU): (source, groups, the groups' axes, FLOPs per device per step with
    # every group routed alike). A stated routing (``core.routing``) scales the busiest shard's.
    grouped: tuple[tuple[str, int, tuple[str, ...], float], ...] = ()

    def bytes_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for c in self.communication:
            out[c.kind] = out.get(c.kind, 0) + c.bytes
        return out

    def bytes_by_axes(self) -> dict[str, dict[str, int]]:
        """{kind: {"data,model": bytes}} per device per step."""
        out: dict[str, dict[str, int]] = {k: {} for k in KINDS}
        for c in self.communication:
            key = ",".join(c.axes) or "-"
            out.setdefault(c.kind, {})
            out[c.kind][key] = out[c.kind].get(key, 0) + c.bytes
        return out

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "propagation": self.propagation,
            "backend": self.backend,
            "mesh": dict(self.mesh),
            "flops_per_device": self.flops,
            "transcendentals_per_device": self.transcendentals,
            "hbm_bytes_per_device": self.hbm_bytes,
            "memory_per_device": self.memory.__dict__,
            "communication_per_device": {
                "by_kind": self.bytes_by_kind(),
                "by_axes": self.bytes_by_axes(),
                "collectives": [c.__dict__ for c in self.communication],
            },
            "analysis_seconds": self.seconds,
            "notes": [n.to_json() for n in self.notes],
            "constrained_activations": [dict(c.__dict__, shape=list(c.shape)) for c in self.constrained],
            "logical_names": list(self.logical_names),
            "constraint_delta": [list(x) for x in self.constraint_delta],
            "fallbacks": [{"op": op, "source": src, "bytes": n} for op, src, n in self.fallbacks],
            "kernels_per_device": self.kernels,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
            **({"compiler": self.compiler, "compiler_seconds": self.compiler_seconds} if self.compiler else {}),
            **({"schedule": [_step_json(x) for x in self.schedule]} if self.schedule else {}),
            **({"backward_activations": [[k, list(a), n, c] for k, a, n, c in self.backward]} if self.backward else {}),
            "matmul_flops_by_source": [[line, n] for line, n in self.matmul_flops],
            **({"grouped_matmuls": [[src, g, list(a), n] for src, g, a, n in self.grouped]} if self.grouped else {}),
        }

    @staticmethod
    def from_json(doc: dict) -> StepCost:
        comm = tuple(
            Communication(**dict(c, axes=tuple(c["axes"]))) for c in doc["communication_per_device"]["collectives"]
        )
        return StepCost(
            doc["mode"],
            doc["backend"],
            dict(doc["mesh"]),
            doc["flops_per_device"],
            Memory(**doc["memory_per_device"]),
            comm,
            doc.get("transcendentals_per_device", 0.0),
            doc.get("analysis_seconds", 0.0),
            tuple(Note.from_json(n) for n in doc.get("notes", ())),
            tuple(Constrained(**dict(c, shape=tuple(c["shape"]))) for c in doc.get("constrained_activations", ())),
            tuple(doc.get("logical_names", ())),
            tuple((k, a, int(n)) for k, a, n in doc.get("constraint_delta", ())),
            doc.get("hbm_bytes_per_device", 0.0),
            tuple((f["op"], f["source"], int(f["bytes"])) for f in doc.get("fallbacks", ())),
            doc.get("kernels_per_device", 0.0),
            PipelineCost(**doc["pipeline"]) if doc.get("pipeline") else None,
            doc.get("compiler", ""),
            doc.get("compiler_seconds"),
            tuple(_step_of(x) for x in doc.get("schedule", ())),
            tuple((k, tuple(a), int(n), int(c)) for k, a, n, c in doc.get("backward_activations", ())),
            doc.get("propagation", "shardplan"),
            tuple((line, float(n)) for line, n in doc.get("matmul_flops_by_source", ())),
            tuple((src, int(g), tuple(a), float(n)) for src, g, a, n in doc.get("grouped_matmuls", ())),
        )


def _step_json(s: hlo.Step) -> list:
    return [
        s.kind,
        s.flops,
        s.bytes,
        s.kernels,
        s.collective,
        list(s.axes),
        s.moved,
        s.key,
        s.trips,
        [_step_json(x) for x in s.body],
    ]


def _step_of(doc: list) -> hlo.Step:
    kind, flops, nbytes, kernels, collective, axes, moved, key, trips, body = doc
    return hlo.Step(
        kind, flops, nbytes, kernels, collective, tuple(axes), moved, key, trips, tuple(_step_of(x) for x in body)
    )
