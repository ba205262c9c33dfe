"""A pipeline's schedule as data: which chunk of layers each stage runs on which microbatch at
each step of the loop, the idle stage-steps (the bubble), and the checks that need concrete
sizes (stages from the mesh, layers and batch from shapes).

The loop runs ``v*m + p - 1`` steps (``p`` stages, ``m`` microbatches, ``v`` repeats). At step
``t`` stage ``s`` works on the ``i = t - s``-th pass of the schedule when ``0 <= i < v*m``:
microbatch ``i mod m``, its ``i div m``-th time round the stages, so the chunk of layers
``(i div m) * p + s`` (chunk ``c`` holds layers ``c*k .. c*k+k-1``, ``k = L / (v*p)``). GPipe is
``v = 1``: stage ``s`` holds layers ``s*k ..``; circular (``v > 1``) needs ``m >= p`` so that a
microbatch is back at stage 0 no sooner than its previous pass left stage ``p-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.core.plan import Pipeline, Plan
from shardplan.core.stepcost import PipelineCost, StepCost
from shardplan.errors import Diagnostic, error


@dataclass(frozen=True)
class Slot:
    """What stage ``stage`` does at loop step ``step``: ``microbatch`` through ``chunk``, or idle."""

    step: int
    stage: int
    microbatch: int | None  # None: idle (the bubble)
    chunk: int | None


@dataclass(frozen=True)
class Schedule:
    stages: int
    microbatches: int
    repeats: int
    layers: int

    @property
    def steps(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def layers_per_chunk(self) -> int:
        return self.layers // (self.stages * self.repeats)

    def slot(self, step: int, stage: int) -> Slot:
        i = step - stage
        if not 0 <= i < self.repeats * self.microbatches:
            return Slot(step, stage, None, None)
        return Slot(step, stage, i % self.microbatches, (i // self.microbatches) * self.stages + stage)

    def table(self) -> tuple[tuple[Slot, ...], ...]:
        """Per loop step, per stage."""
        return tuple(tuple(self.slot(t, s) for s in range(self.stages)) for t in range(self.steps))

    @property
    def idle(self) -> int:
        """Idle stage-steps, counted from the table."""
        return sum(1 for row in self.table() for x in row if x.microbatch is None)

    @property
    def bubble(self) -> float:
        return self.idle / (self.steps * self.stages)

    def chunk_layers(self, chunk: int) -> range:
        k = self.layers_per_chunk
        return range(chunk * k, chunk * k + k)

    def stage_of_layer(self, layer: int) -> int:
        return (layer // self.layers_per_chunk) % self.stages


def problems(
    p: Pipeline, stages: int, layers: int | None = None, batch: int | None = None, batch_split: int = 1, where: str = ""
) -> list[Diagnostic]:
    """Why the pipeline cannot run with these sizes (stages from the mesh; layers: the stacked
    dim; batch: the global batch, ``batch_split`` devices dividing each microbatch)."""
    at = dict(span=p.span, source_line=p.source_line or None) if p.span is not None else dict(path=where or "pipeline")
    out = []
    if p.schedule == "circular" and p.microbatches < stages:
        out.append(
            error(
                "pipeline-option",
                f"circular schedule with microbatches = {p.microbatches} on {stages} stages",
                f"a circular schedule needs at least as many microbatches as stages: microbatches = {stages} or more",
                **at,
            )
        )
    if layers is not None and layers % (stages * p.repeats):
        out.append(
            error(
                "pipeline-layers",
                f"{layers} stacked layers do not split into {stages} stages x {p.repeats} "
                f"repeat{'s' if p.repeats > 1 else ''}",
                f"use a stage count and repeats whose product divides {layers}",
                **at,
            )
        )
    if batch is not None:
        if batch % p.microbatches:
            out.append(
                error(
                    "pipeline-batch",
                    f"a batch of {batch} does not split into {p.microbatches} microbatches",
                    f"use a microbatch count that divides {batch}",
                    **at,
                )
            )
        elif (batch // p.microbatches) % batch_split:
            out.append(
                error(
                    "pipeline-batch",
                    f"microbatches of {batch // p.microbatches} rows do not split over the batch's "
                    f"{batch_split} devices",
                    f"use fewer microbatches (the batch / microbatches a multiple of {batch_split}) or a larger batch",
                    **at,
                )
            )
    return out


def with_pipeline(cost: StepCost, plan: Plan) -> StepCost:
    """``cost`` with its pipeline's schedule, bubble and stage permutes (itself without one)."""
    from dataclasses import replace

    p = plan.pipeline
    if p is None or p.axis not in cost.mesh:
        return cost
    stages = cost.mesh[p.axis]
    s = Schedule(stages, p.microbatches, p.repeats, stages * p.repeats)
    permutes = [c for c in cost.communication if c.kind == "collective-permute" and c.axes == (p.axis,)]
    link = next((a.link for a in plan.mesh if a.name == p.axis), "ici")
    return replace(
        cost,
        pipeline=PipelineCost(
            p.axis,
            stages,
            p.microbatches,
            p.schedule,
            p.repeats,
            s.steps,
            s.idle,
            s.bubble,
            sum(c.bytes for c in permutes),
            sum(c.count for c in permutes),
            link,
        ),
    )
