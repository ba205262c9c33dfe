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
from collections.abc import Iterable
from dataclasses import dataclass

from shardplan.core.chips import Chip
from shardplan.core.plan import Plan
from shardplan.core.stepcost import StepCost
from shardplan.ledger import Communication


@dataclass(frozen=True)
class StepTime:
    chip: str
    compute_s: float  # FLOPs at peak
    memory_s: float  # bytes read and written in HBM, at its bandwidth
    comm_s: float  # every collective, one after another (its latency included)
    comm_by_link: dict[str, float]
    serial_s: float  # compute, memory traffic, launches, then communication: no overlap
    overlapped_s: float  # communication hidden behind compute + memory traffic + launches: the larger
    mfu_serial: float  # model FLOPs utilisation if the step took serial_s
    mfu_overlapped: float
    latency_s: float = 0.0  # of comm_s, the collectives' latency (count x per-collective latency)
    launch_s: float = 0.0  # kernel launches (the cost's kernels x the chip's launch overhead)

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


def collective_latency(count: int, group: int, latency: float) -> float:
    """``count`` collectives over ``group`` devices: ``latency`` per doubling of the group each."""
    return count * latency * math.ceil(math.log2(group)) if group > 1 else 0.0


# XLA combines the collectives that move params or their gradients (all independent of each
# other until the optimizer update) into buffers of up to this many bytes: its GPU default
# combine thresholds (xla_gpu_all_reduce_combine_threshold_bytes and the all-gather and
# reduce-scatter ones) are 30 MiB. Seen: gpt_small's 41 gradient all-reduces under data
# parallelism are one tuple all-reduce in XLA:GPU's (h100:8) and XLA:TPU's (tpu-v5e:2x4) programs.
COMBINE_BYTES = 30 * 2**20


def combined(rows: Iterable[Communication]) -> dict[tuple[str, tuple[str, ...], int], int]:
    """Fast mode's rows that XLA combines, as (kind, axes, runs) -> bytes per run: those that move
    a param, optimizer state or input (gathers) or sum a param's gradient (their rows name what they
    move), combined within one run (a scanned layer's gathers run once per layer, not across runs)."""
    out: dict[tuple[str, tuple[str, ...], int], int] = {}
    for c in rows:
        if c.moves:
            key = (c.kind, c.axes, max(c.count, 1))
            out[key] = out.get(key, 0) + c.bytes // key[2]
    return out


def combined_launches(groups: dict[tuple[str, tuple[str, ...], int], int]) -> int:
    """Collectives launched for :func:`combined`'s groups: one per run per COMBINE_BYTES."""
    return sum(runs * max(1, math.ceil(nbytes / COMBINE_BYTES)) for (_, _, runs), nbytes in groups.items())


def step_time(cost: StepCost, plan: Plan, chip: Chip) -> StepTime:
    links = {a.name: a.link for a in plan.mesh}
    by_link: dict[str, float] = {}
    latency = 0.0
    # A moved param, state or input (gathered), or a gradient's sum (its row names the param):
    # combined with the others of its kind (see COMBINE_BYTES). Exact mode's rows are the
    # program's own launches (a combined all-reduce counts once).
    groups = combined(cost.communication) if cost.mode == "fast" else {}
    for c in cost.communication:
        group = math.prod(cost.mesh.get(a, 1) for a in c.axes)
        link = "dcn" if any(links.get(a) == "dcn" for a in c.axes) else "ici"
        if c.moves and cost.mode == "fast":  # its latency is its combined group's, below
            lat = 0.0
        else:
            lat = collective_latency(c.count, group, chip.dcn_latency if link == "dcn" else chip.ici_latency)
        latency += lat
        inside = math.prod(cost.mesh.get(a, 1) for a in c.axes if links.get(a) != "dcn")
        if link == "dcn" and inside > 1 and c.kind in ("all-reduce", "all-gather", "reduce-scatter"):
            # Over axes inside and across hosts: hierarchically, the fast links first over the whole
            # buffer, then the network over the 1/inside of it each device holds.
            by_link["ici"] = by_link.get("ici", 0.0) + collective_seconds(c.kind, c.bytes, inside, chip.ici_bandwidth)
            by_link["dcn"] = (
                by_link.get("dcn", 0.0)
                + lat
                + collective_seconds(c.kind, c.bytes / inside, group // inside, chip.dcn_bandwidth)
            )
            continue
        bw = chip.dcn_bandwidth if link == "dcn" else chip.ici_bandwidth
        by_link[link] = by_link.get(link, 0.0) + collective_seconds(c.kind, c.bytes, group, bw) + lat
    for key, nbytes in groups.items():
        _, axes, _ = key
        group = math.prod(cost.mesh.get(a, 1) for a in axes)
        link = "dcn" if any(links.get(a) == "dcn" for a in axes) else "ici"
        lat = collective_latency(
            combined_launches({key: nbytes}), group, chip.dcn_latency if link == "dcn" else chip.ici_latency
        )
        latency += lat
        by_link[link] = by_link.get(link, 0.0) + lat
    compute = cost.flops / chip.peak_flops
    memory = cost.hbm_bytes / chip.hbm_bandwidth
    launch = cost.kernels * chip.launch_s
    comm = sum(by_link.values())
    serial, overlapped = compute + memory + launch + comm, max(compute + memory + launch, comm)
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
        latency,
        launch,
    )
