"""Costing many plans on one trace (what a plan search does): the re-cost equals the full fast-mode
analysis, and the step is traced once per set of what tracing applies, not once per plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardplan
from shardplan import api
from shardplan.runtime import fast
from tests.helpers import PLANS, ROOT

MODEL = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"
STEP = f"{ROOT / 'examples' / 'train.py'}:lm_loss"
BATCH = ["tokens=int32[8,16],labels=int32[8,16]"]


def _same(a, b):
    return replace(a, seconds=0) == replace(b, seconds=0)


def test_recost_equals_the_full_analysis_and_traces_once_per_mesh():
    coster = api.step_coster(MODEL, STEP, BATCH)
    mesh = {"data": 4, "model": 2}
    names = ["fsdp.splan", "gpt_tp.splan", "dp.splan", "fsdp_any_rank.splan"]
    for name in names + names[:2]:  # back and forth: nothing of one plan leaks into the next
        plan = shardplan.load(PLANS / name, mesh=dict(mesh))
        assert _same(coster.cost(plan), api.analyze(plan, model=MODEL, step=STEP, batch=BATCH, mode="fast")), name
    assert coster.traces == 1, "plans without act/axis rules on one mesh share one trace"
    coster.cost(PLANS / "gpt_2d.splan", devices=8)  # axis rules: traced under them
    assert coster.traces == 2


def test_each_costing_resolves_the_plan_once_and_both_backends_share_the_traces():
    """A costing reads the plan's resolution once (a pipeline plan's stage split included), on
    either backend; other plans with the same act/axis rules and mesh reuse the step's traces
    (the shard_map backend's gradient program is one more, once)."""
    coster = api.step_coster(MODEL, STEP, BATCH)
    mesh = {"data": 4, "model": 2}
    for k, name in enumerate(["fsdp.splan", "gpt_tp.splan", "dp.splan"]):
        plan = shardplan.load(PLANS / name, mesh=dict(mesh))
        for backend in ("auto", "shard_map"):
            before = coster.resolutions
            cost = coster.cost(plan, backend=backend)
            assert cost.backend == backend and coster.resolutions == before + 1, (name, backend)
        assert coster.traces == 2, "the auto step and the gradient program, traced once for every plan"
    deep = api.step_coster(f"{ROOT / 'examples' / 'models.py'}:llama_deep_scan", STEP,
                           ["tokens=int32[16,16],labels=int32[16,16]"])
    for backend in ("auto", "shard_map"):
        before = deep.resolutions
        deep.cost(PLANS / "llama_pp.splan", devices=8, backend=backend)
        assert deep.resolutions == before + 1, backend


def test_a_trace_is_not_reused_for_another_mesh_or_activation_rules():
    built_plan = shardplan.load(PLANS / "gpt_tp.splan", mesh={"data": 4, "model": 2})
    coster = api.step_coster(MODEL, STEP, BATCH)
    coster.cost(built_plan)
    res = coster.tracer.resolve(built_plan, built_plan.mesh_shape())
    traced = coster.tracer.step(built_plan, built_plan.mesh_shape(), res)
    assert coster.traces == 1  # the same trace
    other = shardplan.load(PLANS / "gpt_tp.splan", mesh={"data": 2, "model": 4})
    with pytest.raises(ValueError):
        fast.cost(traced, other, other.mesh_shape())
    with pytest.raises(ValueError):
        two_d = shardplan.load(PLANS / "gpt_2d.splan", mesh={"data": 4, "model": 2})
        fast.cost(traced, two_d, two_d.mesh_shape())


def test_bad_arguments_are_located():
    with pytest.raises(shardplan.ShardPlanError) as info:
        api.step_coster(MODEL, STEP, [])
    assert info.value.errors[0].path == "batch"
    with pytest.raises(shardplan.ShardPlanError):
        api.step_coster(MODEL, STEP, BATCH).cost(PLANS / "gpt_tp.splan", devices=3)


def test_a_plan_costed_again_is_read_back_not_costed_again():
    """The same plan (parsed again: equal, not the same object) on the same mesh, costed the same
    way, is the figure already made (a second search under another budget re-costs nothing);
    costed another way (with the constraints' delta, another compiler's rules) it is costed anew."""
    coster = api.step_coster(MODEL, STEP, BATCH)
    first = coster.cost(shardplan.load(PLANS / "gpt_tp.splan", mesh={"data": 4, "model": 2}), delta=False)
    again = coster.cost(shardplan.load(PLANS / "gpt_tp.splan", mesh={"data": 4, "model": 2}), delta=False)
    assert again is first and coster.memo_hits == 1
    tpu = coster.cost(PLANS / "gpt_tp.splan", mesh={"data": 4, "model": 2}, delta=False, compiler="tpu")
    assert tpu is not first and coster.memo_hits == 1
    other_mesh = coster.cost(PLANS / "gpt_tp.splan", mesh={"data": 2, "model": 4}, delta=False)
    assert other_mesh.bytes_by_kind() != first.bytes_by_kind()
