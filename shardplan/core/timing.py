"""A step-time estimate for a named chip from a step's cost: compute at the chip's peak FLOP/s,
memory traffic at its HBM bandwidth, each collective over the links of its mesh axes (ring
algorithms), with and without communication overlapping the chip's own work.

The chip's own work is compute plus memory traffic (a kernel is bound by one or the other; the
sum does not let a matmul's reads hide behind its arithmetic, so it is an estimate, not a
bound a step cannot beat). Rates are the datasheet's, not a simulation: real kernels reach a
fraction of them. docs/stepcost.md compares it
with steps measured on a GPU and with published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardplan.core.chips import Chip
from shardplan.core.plan import Plan
from shardplan.core.stepcost import StepCost


@dataclass(frozen=True)
class StepTime:
    chip: str
    compute_s: float  # FLOPs at peak
    memory_s: float  # bytes read and written in HBM, at its bandwidth
    comm_s: float  # every collective, one after another
    comm_by_link: dict[str, float]
    serial_s: float  # compute, memory traffic, then communication: no overlap
    overlapped_s: float  # communication hidden behind compute + memory traffic: the larger of the two
    mfu_serial: float  # model FLOPs utilisation if the step took serial_s
    mfu_overlapped: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float) -> float:
    """Ring algorithms: per device, an all-gather or reduce-scatter moves (n-1)/n of the
    gathered (or scattered) buffer, an all-reduce twice that, an all-to-all (n-1)/n."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    frac = (group - 1) / group
    factor = {"all-reduce": 2 * frac, "all-gather": frac, "reduce-scatter": frac, "all-to-all": frac}.get(kind, 1.0)
    return nbytes * factor / bandwidth


def step_time(cost: StepCost, plan: Plan, chip: Chip) -> StepTime:
    links = {a.name: a.link for a in plan.mesh}
    by_link: dict[str, float] = {}
    for c in cost.communication:
        group = math.prod(cost.mesh.get(a, 1) for a in c.axes)
        link = "dcn" if any(links.get(a) == "dcn" for a in c.axes) else "ici"
        bw = chip.dcn_bandwidth if link == "dcn" else chip.ici_bandwidth
        by_link[link] = by_link.get(link, 0.0) + collective_seconds(c.kind, c.bytes, group, bw)
    compute = cost.flops / chip.peak_flops
    memory = cost.hbm_bytes / chip.hbm_bandwidth
    comm = sum(by_link.values())
    serial, overlapped = compute + memory + comm, max(compute + memory, comm)
    return StepTime(
        chip.name,
        compute,
        memory,
        comm,
        by_link,
        serial,
        overlapped,
        compute / serial if serial else 0.0,
        compute / overlapped if overlapped else 0.0,
    )
