"""The step as a compiler schedules it: XLA:GPU's schedule read from its program (``hlo.schedule``),
the time it takes (``timing.scheduled``), and fast mode's model of the same (``timing.step_time``)."""

import json
from pathlib import Path

import pytest

import shardplan
from shardplan.core import hlo, timing
from shardplan.core.chips import Chip
from shardplan.core.stepcost import StepCost
from shardplan.ledger import Communication
from tests.helpers import HAS_GPU, PLANS, ROOT

HLO = Path(__file__).parent / "fixtures" / "hlo"

# Round numbers, so every time below is a hand sum: 1 GFLOP/s, 1 GB/s of HBM, 1 GB/s of links,
# no latency, no launches.
UNIT = Chip("unit", 1e9, 1e12, 1e9, 1e9, 1e9, "test", ici_latency=0.0, dcn_latency=0.0, launch_s=0.0)


def test_xla_gpus_schedule_is_read_in_the_order_it_runs():
    """An FSDP MLP layer compiled by XLA:GPU offline (8 H100s): the first gather waited for at
    once; the second in flight over one matmul; the gradient's reduce-scatter over another."""
    text = (HLO / "gpu_h100_8.hlo").read_text()
    steps = hlo.schedule(text, hlo.with_axes(hlo.parse(text, 8), {"data": 8, "model": 1}))
    assert [s.kind for s in steps] == ["start", "done", "work", "start", "work", "done", "start", "work", "done", "work"]
    assert [(s.collective, s.moved) for s in steps if s.kind == "start"] == [
        ("all-gather", 2 * 1024 * 1024 * 4),  # two weights combined in one gather
        ("all-gather", 512 * 1024 * 4),
        ("reduce-scatter", 1024 * 1024 * 4),
    ]
    assert all(s.axes == ("data",) for s in steps if s.kind == "start")
    assert [s.key for s in steps if s.kind == "done"] == [s.key for s in steps if s.kind == "start"]
    # every kernel's FLOPs, in order: two matmuls, one, one, then the add
    assert sum(s.flops for s in steps) == pytest.approx(hlo.program_flops(text))
    assert [s.kernels for s in steps if s.kind == "work"] == [3, 1, 1, 1]


def test_a_scheduled_collective_is_hidden_by_the_kernels_between_its_start_and_its_done():
    S = hlo.Step
    kernel = S("work", flops=1e9, kernels=1)  # 1 s
    # an all-reduce over 2 devices moves 2 x 1/2 of its bytes: 1 GB -> 1 s
    ar = {"collective": "all-reduce", "axes": ("data",), "moved": 10**9}
    mesh, links = {"data": 2}, {}
    # hidden: 2 s of kernels while it moves
    assert timing.scheduled((S("start", key="a", **ar), kernel, kernel, S("done", key="a")), mesh, links, UNIT) == 2.0
    # half hidden: its done after one 0.5 s kernel
    half = S("work", flops=5e8, kernels=1)
    assert timing.scheduled((S("start", key="a", **ar), half, S("done", key="a"), kernel), mesh, links, UNIT) == 2.0
    # synchronous: after the kernel, before the next
    assert timing.scheduled((kernel, S("sync", **ar), kernel), mesh, links, UNIT) == 3.0
    # two in flight at once share the links: the second starts when the first is done
    two = (S("start", key="a", **ar), S("start", key="b", **ar), kernel, S("done", key="a"), S("done", key="b"))
    assert timing.scheduled(two, mesh, links, UNIT) == 2.0
    # a loop runs its body's schedule each trip
    body = (S("start", key="a", **ar), half, S("done", key="a"))
    assert timing.scheduled((S("loop", trips=3, body=body),), mesh, links, UNIT) == 3.0


def _cost(rows, schedule=()):
    return StepCost("fast" if not schedule else "exact", "auto", {"data": 2}, 1e9, shardplan.core.stepcost.Memory(0, 0, 0),
                    tuple(rows), schedule=schedule)


def test_fast_mode_waits_for_activations_the_first_gather_and_the_last_gradient_sum():
    plan = shardplan.loads('plan "p"\nmesh data = 2\nbatch (data)\ndefault replicated\n', "p.splan")
    gb = timing.COMBINE_BYTES
    act = Communication("all-reduce", ("data",), gb // 2, 1)  # 1/2 of COMBINE_BYTES, twice 1/2 each way
    gather = Communication("all-gather", ("data",), 4 * gb, 4, moves="w")  # four buffers: one waited for
    grad = Communication("reduce-scatter", ("data",), 2 * gb, 2, moves="w")  # two buffers: one waited for
    t = timing.step_time(_cost([act, gather, grad]), plan, UNIT)
    secs = {k: timing.collective_seconds(c.kind, c.bytes, 2, 1e9) for k, c in (("a", act), ("g", gather), ("r", grad))}
    exposed = secs["a"] + secs["g"] / 4 + secs["r"] / 2
    assert t.exposed_s == pytest.approx(exposed)
    assert t.overlapped_s < t.scheduled_s < t.serial_s
    # little work to hide behind: no more hidden than the step's own work
    small = timing.step_time(StepCost("fast", "auto", {"data": 2}, 1e6, shardplan.core.stepcost.Memory(0, 0, 0),
                                      (act, gather, grad)), plan, UNIT)
    assert small.scheduled_s == pytest.approx(small.serial_s - small.compute_s)


def test_an_exact_steps_schedule_survives_its_json():
    S = hlo.Step
    steps = (S("work", 1.0, 2.0, 3), S("loop", trips=4, body=(S("start", collective="all-gather", axes=("data",),
                                                                   moved=8, key="k"), S("done", key="k"))))
    cost = _cost([], schedule=steps)
    assert StepCost.from_json(json.loads(json.dumps(cost.to_json()))).schedule == steps


@pytest.mark.skipif(not HAS_GPU, reason="needs the CUDA plugin: pip install 'shardplan[gpu]'")
def test_xla_gpus_schedule_hides_part_of_an_fsdp_steps_communication():
    """gpt_small under FSDP on 8 H100s, compiled offline: XLA:GPU combines the gathers into one at
    the start (waited for) and the gradients' reduce-scatters into one in flight over the last
    kernels; 13.7 of 44.5 us exposed on an H100 (2026-12-04)."""
    kw = dict(model=f"{ROOT / 'examples' / 'models.py'}:gpt_small", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
              batch=["tokens=int32[32,32],labels=int32[32,32]"], devices=8, target="h100:8")
    exact = shardplan.api.analyze(PLANS / "fsdp.splan", mode="exact", **kw)
    t = timing.step_time(exact, shardplan.load(PLANS / "fsdp.splan"), shardplan.core.chips.lookup("h100"))
    assert exact.schedule
    assert t.overlapped_s < t.scheduled_s < t.serial_s
    assert 0 < t.exposed_s < 0.5 * t.comm_s


def test_combined_collectives_launch_once_per_buffer_or_once_each_when_larger():
    gb = timing.COMBINE_BYTES
    small = [Communication("all-gather", ("data",), gb // 4, 1, moves=f"w{i}") for i in range(8)]
    big = [Communication("all-gather", ("model",), 3 * gb, 1, moves=f"v{i}") for i in range(3)]
    groups = timing.combined(small + big)
    assert groups[("all-gather", ("data",), 1)] == (2 * gb, 8) and groups[("all-gather", ("model",), 1)] == (9 * gb, 3)
    # 8 quarter-buffers pack into 2; 3 collectives of 3 buffers each are not cut up: 3 launches, not 9
    assert timing.combined_launches(groups) == 2 + 3


def test_a_scanned_layers_collectives_name_the_params_they_move():
    """Inside a scan over stacked layers each gather and gradient sum is the layer's slice of a
    stacked param: the ledger names the param and its plan rule (it named none before), and the
    scheduled step hides them behind the layers' compute as it does an unscanned model's."""
    kw = dict(model=f"{ROOT / 'examples' / 'models.py'}:llama_tiny_scan", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
              batch=["tokens=int32[8,16],labels=int32[8,16]"], devices=8)
    cost = shardplan.api.analyze(PLANS / "llama_scan_2d.splan", mode="fast", **kw)
    looped = [c for c in cost.communication if c.count > 1 and c.kind in ("all-gather", "reduce-scatter")]
    assert looped and all(c.moves.startswith("layers/") and "llama_scan_2d.splan:" in c.rule
                          for c in looped), looped


def test_the_backward_passs_activation_collectives_run_beside_the_weight_gradients():
    """gpt_small under Megatron TP (data=4, model=2), 16 x 32 tokens, on an H100: XLA:GPU's schedule
    (compiled offline, 2026-12-04) leaves 45.8 of the 76.2 us of all-reduces exposed: the forward
    pass's wait, the backward pass's run beside the weight gradients' matmuls. Fast mode waited
    for all 76.2 us; it now lets the backward pass's hide behind up to a third of the step's work."""
    kw = dict(model=f"{ROOT / 'examples' / 'models.py'}:gpt_small", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
              batch=["tokens=int32[16,32],labels=int32[16,32]"], devices=8, target="h100:8")
    fast = shardplan.api.analyze(PLANS / "gpt_tp.splan", mode="fast", **kw)
    assert fast.backward and all(kind == "all-reduce" and axes == ("model",) for kind, axes, _, _ in fast.backward)
    t = timing.step_time(fast, shardplan.load(PLANS / "gpt_tp.splan"), shardplan.core.chips.lookup("h100"))
    assert t.exposed_s == pytest.approx(45.8e-6, rel=0.15)
    # a third of the step's work is the most that hides
    plan = shardplan.loads('plan "p"\nmesh data = 2\nbatch (data)\ndefault replicated\n', "p.splan")
    ar = Communication("all-reduce", ("data",), 10**9, 1)  # 1 s over 2 devices at 1 GB/s

    def step(flops: float) -> timing.StepTime:
        cost = StepCost("fast", "auto", {"data": 2}, flops, shardplan.core.stepcost.Memory(0, 0, 0), (ar,),
                        backward=((ar.kind, ar.axes, ar.bytes, ar.count),))
        return timing.step_time(cost, plan, UNIT)

    assert step(3e9).serial_s == pytest.approx(4.0) and step(3e9).scheduled_s == pytest.approx(3.0)  # hidden
    assert step(1.5e9).scheduled_s == pytest.approx(2.0)  # 1.5 s of work: 0.5 s of it beside the all-reduce
