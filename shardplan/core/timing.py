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

from shardplan.core import hlo, routing
from shardplan.core.chips import Chip
from shardplan.core.plan import Plan
from shardplan.core.routing import ExpertLoad
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
    # As an accelerator's compiler schedules the step: its asynchronous collectives run while the
    # kernels between their start and their done run, the others wait (see :func:`scheduled`).
    scheduled_s: float = 0.0
    exposed_s: float = 0.0  # of comm_s, what the schedule does not hide
    # The busiest expert shard (``busiest``): its tokens over the mean under a stated expert load
    # (``core.routing``), the largest of the step's split grouped matmuls', and the compute that
    # adds over an even routing (the step waits for that shard: compute_s includes it, and counts
    # the rows each shard's grouped kernels run, not every row the program's buffers hold).
    imbalance: float = 1.0
    imbalance_s: float = 0.0

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


def collective_latency(count: int, group: int, latency: float, kind: str = "") -> float:
    """``count`` collectives over ``group`` devices: ``latency`` per doubling of the group each
    (the steps of a reduction's or a gather's tree or ring); a collective-permute, one send to one
    device whatever the group (a pipeline's stage hand-off, a windowed einsum's ring step), one
    ``latency`` each."""
    if group <= 1:
        return 0.0
    return count * latency * (1 if kind == "collective-permute" else math.ceil(math.log2(group)))


# XLA combines the collectives that move params or their gradients (all independent of each
# other until the optimizer update) into buffers of up to this many bytes: its GPU default
# combine thresholds (xla_gpu_all_reduce_combine_threshold_bytes and the all-gather and
# reduce-scatter ones) are 30 MiB. Seen: gpt_small's 41 gradient all-reduces under data
# parallelism are one tuple all-reduce in XLA:GPU's (h100:8) and XLA:TPU's (tpu-v5e:2x4) programs.
COMBINE_BYTES = 30 * 2**20


def combined(rows: Iterable[Communication]) -> dict[tuple[str, tuple[str, ...], int], tuple[int, int]]:
    """Fast mode's rows that XLA combines, as (kind, axes, runs) -> (bytes per run, collectives per
    run): those that move a param, optimizer state or input (gathers) or sum a param's gradient
    (their rows name what they move), combined within one run (a scanned layer's gathers run once
    per layer, not across runs)."""
    out: dict[tuple[str, tuple[str, ...], int], tuple[int, int]] = {}
    for c in rows:
        if c.moves:
            key = (c.kind, c.axes, max(c.count, 1))
            nbytes, ops = out.get(key, (0, 0))
            out[key] = (nbytes + c.bytes // key[2], ops + 1)
    return out


def combined_launches(groups: dict[tuple[str, tuple[str, ...], int], tuple[int, int]]) -> int:
    """Collectives launched for :func:`combined`'s groups: per run, the collectives packed into
    buffers of up to COMBINE_BYTES (one per COMBINE_BYTES of them, or one each where each is larger)."""
    return sum(
        runs * min(ops, max(1, math.ceil(nbytes / COMBINE_BYTES))) for (_, _, runs), (nbytes, ops) in groups.items()
    )


def _one(
    kind: str,
    nbytes: float,
    axes: tuple[str, ...],
    count: int,
    mesh: dict[str, int],
    links: dict[str, str],
    chip: Chip,
    latency: bool = True,
) -> tuple[dict[str, float], float]:
    """Seconds of ``count`` collectives of ``kind`` moving ``nbytes`` (per device, all runs) over
    ``axes``, per link, and their latency (``latency=False``: counted elsewhere, see COMBINE_BYTES)."""
    group = math.prod(mesh.get(a, 1) for a in axes)
    link = "dcn" if any(links.get(a) == "dcn" for a in axes) else "ici"
    lat = (
        collective_latency(count, group, chip.dcn_latency if link == "dcn" else chip.ici_latency, kind)
        if latency
        else 0.0
    )
    inside = math.prod(mesh.get(a, 1) for a in axes if links.get(a) != "dcn")
    if link == "dcn" and inside > 1 and kind in ("all-reduce", "all-gather", "reduce-scatter"):
        # Over axes inside and across hosts: hierarchically, the fast links first over the whole
        # buffer, then the network over the 1/inside of it each device holds.
        return {
            "ici": collective_seconds(kind, nbytes, inside, chip.ici_bandwidth),
            "dcn": lat + collective_seconds(kind, nbytes / inside, group // inside, chip.dcn_bandwidth),
        }, lat
    bw = chip.dcn_bandwidth if link == "dcn" else chip.ici_bandwidth
    return {link: collective_seconds(kind, nbytes, group, bw) + lat}, lat


def scheduled(steps: tuple[hlo.Step, ...], mesh: dict[str, int], links: dict[str, str], chip: Chip) -> float:
    """A compiled program's step as its schedule runs it: its kernels one after another (FLOPs at
    the chip's peak, memory traffic at its bandwidth, a launch each); a synchronous collective
    after the kernels before it; an asynchronous one from its start, on the links (one collective
    at a time), its done waiting for it. A loop runs its body's schedule ``trips`` times."""
    t = net = 0.0
    pending: dict[str, float] = {}
    for s in steps:
        if s.kind == "work":
            t += s.flops / chip.peak_flops + s.bytes / chip.hbm_bandwidth + s.kernels * chip.launch_s
        elif s.kind in ("sync", "start"):
            seconds = sum(_one(s.collective, s.moved, s.axes, 1, mesh, links, chip)[0].values())
            begin = max(t, net)
            net = begin + seconds
            if s.kind == "sync":
                t = net + chip.launch_s
            else:
                pending[s.key] = net
                t += chip.launch_s
        elif s.kind == "done":
            t = max(t, pending.pop(s.key, t))
        elif s.kind == "loop":
            t = max(t, net) + s.trips * scheduled(s.body, mesh, links, chip)
            net = t
    return max([t, *pending.values()])


def busiest(cost: StepCost, load: ExpertLoad | None) -> tuple[float, float, float]:
    """The step's split grouped matmuls (``StepCost.grouped``) on the busiest expert shard under
    ``load`` (None: every expert alike): (the largest busiest-shard factor ``f``; the FLOPs its
    kernels run beyond the program's count of them, ``sum mean x (f - n)`` over ``n`` shards: the
    program counts every row its buffers hold, ``n`` times the mean routed to a shard; the FLOPs
    the imbalance adds over an even routing, ``sum mean x (f - 1)``)."""
    worst, delta, extra = 1.0, 0.0, 0.0
    for _, groups, axes, mean in cost.grouped:
        shards = math.prod(cost.mesh.get(a, 1) for a in axes)
        f = routing.imbalance(load, groups, shards) if load is not None else 1.0
        worst, delta, extra = max(worst, f), delta + (f - shards) * mean, extra + (f - 1) * mean
    return worst, delta, extra


def step_time(cost: StepCost, plan: Plan, chip: Chip, load: ExpertLoad | None = None) -> StepTime:
    """``load``: how tokens are routed to experts (default: alike, every expert shard the mean).

    Raises:
        ArgumentError: ``load`` does not fit the step's grouped matmuls (``routing.shares``).
    """
    links = {a.name: a.link for a in plan.mesh}
    by_link: dict[str, float] = {}
    latency = 0.0
    # Fast mode's gathers of params, state and inputs, and its sums of gradients: (seconds, bytes)
    gathers, sums = [0.0, 0.0], [0.0, 0.0]
    # A moved param, state or input (gathered), or a gradient's sum (its row names the param):
    # combined with the others of its kind (see COMBINE_BYTES). Exact mode's rows are the
    # program's own launches (a combined all-reduce counts once).
    groups = combined(cost.communication) if cost.mode == "fast" else {}
    for c in cost.communication:
        # a fast row that moves a param, state or input: its latency is its combined group's, below
        secs, lat = _one(
            c.kind, c.bytes, c.axes, c.count, cost.mesh, links, chip, not (c.moves and cost.mode == "fast")
        )
        latency += lat
        for link, x in secs.items():
            by_link[link] = by_link.get(link, 0.0) + x
        if c.moves:
            acc = gathers if c.kind == "all-gather" else sums
            acc[0] += sum(secs.values())
            acc[1] += c.bytes
    for key, packed in groups.items():
        _, axes, _ = key
        group = math.prod(cost.mesh.get(a, 1) for a in axes)
        link = "dcn" if any(links.get(a) == "dcn" for a in axes) else "ici"
        lat = collective_latency(
            combined_launches({key: packed}), group, chip.dcn_latency if link == "dcn" else chip.ici_latency
        )
        latency += lat
        by_link[link] = by_link.get(link, 0.0) + lat
        (gathers if key[0] == "all-gather" else sums)[0] += lat
    worst, delta, extra = busiest(cost, load)
    compute = (cost.flops + delta) / chip.peak_flops  # the busiest expert shard's
    useful = compute - extra / chip.peak_flops  # (MFU's: the work with every expert alike)
    memory = cost.hbm_bytes / chip.hbm_bandwidth
    launch = cost.kernels * chip.launch_s
    comm = sum(by_link.values())
    work = compute + memory + launch
    serial, overlapped = work + comm, max(work, comm)
    if cost.schedule:  # the compiled program's own schedule
        sched = max(overlapped, min(serial, scheduled(cost.schedule, cost.mesh, links, chip)))
    elif cost.mode == "fast":
        # No schedule: what XLA's scheduler does with them on an accelerator (read from XLA:GPU's
        # programs, docs/stepcost.md): a collective of activations is waited for where its result
        # is read; the gathers of params, state and inputs are combined into buffers of up to
        # COMBINE_BYTES, the first waited for at the start, the others run while the layers before
        # their readers compute; the sums of gradients likewise, the last waited for at the end.
        first = gathers[0] * min(1.0, COMBINE_BYTES / gathers[1]) if gathers[1] else gathers[0]
        last = sums[0] * min(1.0, COMBINE_BYTES / sums[1]) if sums[1] else sums[0]
        hidden = gathers[0] - first + sums[0] - last
        # The backward pass's collectives of activations (an input gradient's all-reduce) run beside
        # the weight gradients' matmuls, which do not read them: a third of a step's matmul work.
        beside = sum(
            sum(_one(kind, n, axes, count, cost.mesh, links, chip)[0].values())
            for kind, axes, n, count in cost.backward
        )
        hidden += min(beside, work / 3)
        sched = max(overlapped, serial - min(hidden, work))
    else:  # a program that runs its collectives synchronously (XLA:CPU)
        sched = serial
    return StepTime(
        chip.name,
        compute,
        memory,
        comm,
        by_link,
        serial,
        overlapped,
        useful / serial if serial else 0.0,
        useful / overlapped if overlapped else 0.0,
        latency,
        launch,
        sched,
        sched - work,
        worst,
        extra / chip.peak_flops,
    )
