"""Pipelines: the `pipeline` statement, its schedule as data, and a scanned Llama trained
pipelined on the auto backend equal to plain NNX on one device, with the compiled program's
stage traffic read from XLA's HLO."""

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from flax import nnx

import shardplan
from examples import models
from examples import train as example
from shardplan.core import hlo
from shardplan.core.pipeline import Schedule
from shardplan.core.stepcost import StepCost
from tests import reference
from tests.helpers import PLANS

TX = optax.adamw(1e-2, eps=1e-5)
BASE = 'plan "p"\nmesh stage = 2, data = *\nbatch (data, _)\nparam "layers/.*" (stage, ...)\ndefault replicated\n'


def batches(n=3, rows=16):
    rng = np.random.default_rng(5)
    return [example.synthetic_batch(rng, 64, rows, 16) for _ in range(n)]


def plan_with(line: str, base: str = BASE):
    return shardplan.loads(base + line + "\n", "p.splan")


# -- the language ------------------------------------------------------------------------


def test_a_pipeline_statement_reads_into_the_plan():
    p = plan_with("pipeline stage, microbatches = 8, schedule = circular, repeats = 2").pipeline
    assert (p.axis, p.microbatches, p.schedule, p.repeats) == ("stage", 8, "circular", 2)
    assert p.span.line == 6
    g = plan_with("pipeline stage, microbatches = 4").pipeline
    assert (g.schedule, g.repeats) == ("gpipe", 1)
    assert shardplan.loads(BASE).pipeline is None


@pytest.mark.parametrize(
    "line, code, col, words",
    [
        ("pipeline stag, microbatches = 4", "unknown-axis", 10, "did you mean 'stage'"),
        ("pipeline stage", "pipeline-option", 1, "microbatches"),
        ("pipeline stage, microbatches = 0", "pipeline-option", 32, "between 1"),
        ("pipeline stage, microbatches = x", "pipeline-option", 32, "takes a number"),
        ("pipeline stage, microbatches = 4, microbatches = 8", "pipeline-option", 35, "twice"),
        ("pipeline stage, microbatches = 4, repeat = 2", "pipeline-option", 35, "did you mean 'repeats'"),
        ("pipeline stage, microbatches = 4, schedule = zigzag", "pipeline-option", 46, "unknown pipeline schedule"),
        ("pipeline stage, microbatches = 4, repeats = 2", "pipeline-option", 35, "schedule = circular"),
        ("pipeline stage, microbatches = 1, schedule = circular", "pipeline-option", 32, "at least as many"),
    ],
)
def test_pipeline_mistakes_are_located(line, code, col, words):
    with pytest.raises(shardplan.ShardPlanError) as info:
        plan_with(line)
    d = info.value.diagnostics[0]
    assert (d.code, d.span.line, d.span.column) == (code, 6, col), d
    assert words in d.message + " " + d.hint


@pytest.mark.parametrize(
    "rule, line",
    [
        ("batch ((data, stage), _)", None),
        ('param "embed/embedding" (_, stage)', None),
        ('param "layers/.*" ((stage, data), ...)', None),
        ('act "layers" (stage, _, _)', None),
        ("axis embed -> stage", None),
    ],
)
def test_the_stage_axis_splits_only_the_stacked_layer_dim(rule, line):
    text = BASE.replace("batch (data, _)\n", "") if rule.startswith("batch") else BASE
    text = text.replace('param "layers/.*" (stage, ...)\n', "") if "layers/.*" in rule else text
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.loads(text + rule + "\npipeline stage, microbatches = 4\n", "p.splan")
    (d,) = [x for x in info.value.diagnostics if x.code == "pipeline-axis"]
    assert d.span.line == text.count("\n") + 1 and "stage" in d.message


def test_a_mesh_without_the_pipeline_axis_is_refused_at_the_statement():
    plan = plan_with("pipeline stage, microbatches = 4")
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.with_mesh(plan, {"data": 8})
    assert any(d.code == "unknown-axis" and d.span.line == 6 for d in info.value.diagnostics)


def test_fmt_writes_the_pipeline_statement_canonically():
    from shardplan.lang.fmt import format_text

    text = BASE + "pipeline   stage,microbatches=4 ,schedule=circular,repeats=2\n"
    out = format_text(text)
    assert "pipeline stage, microbatches = 4, schedule = circular, repeats = 2\n" in out
    assert format_text(out) == out
    a, b = shardplan.loads(out).pipeline, shardplan.loads(text).pipeline
    assert (a.axis, a.microbatches, a.schedule, a.repeats) == (b.axis, b.microbatches, b.schedule, b.repeats)


# -- the schedule ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 3))
def test_the_schedule_runs_every_chunk_of_every_microbatch_once_in_layer_order(p, m, v):
    if v > 1 and m < p:
        m = p
    s = Schedule(p, m, v, layers=p * v * 2)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for row in s.table():
        for x in row:
            if x.microbatch is not None:
                seen.setdefault(x.microbatch, []).append((x.step, x.stage, x.chunk))
                assert x.chunk % p == x.stage  # chunk c lives on stage c mod p
    assert sorted(seen) == list(range(m))
    for runs in seen.values():
        assert [c for _, _, c in runs] == list(range(p * v))  # each chunk once, in layer order
        for (t0, s0, _), (t1, s1, _) in zip(runs, runs[1:]):
            assert t1 > t0 and (s1 == (s0 + 1) % p)  # the next chunk is on the next stage, later
            assert s1 != 0 or t1 - t0 >= 1
    # The bubble the cost report states is the table's count of idle stage-steps.
    assert s.idle == s.steps * p - m * v * p
    assert s.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    assert plan_with(f"pipeline stage, microbatches = {m}").pipeline.bubble(p) == pytest.approx((p - 1) / (m + p - 1))


# -- training ----------------------------------------------------------------------------


def train(plan, data, backend="auto"):
    model, optimizer, placement = shardplan.init_sharded(plan, models.llama_deep_scan, TX)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in data]
    return losses, model, optimizer, placement, step


def per_kind(ops) -> dict:
    out: dict = {}
    for kind, axes, count, nbytes in ops:
        c, b = out.get((kind, axes), (0, 0))
        out[(kind, axes)] = (c + count, b + nbytes)
    return out


@pytest.mark.parametrize(
    "file, mesh, backend",
    [
        ("llama_pp.splan", {"stage": 2, "data": 4}, "auto"),
        ("llama_pp.splan", {"stage": 4, "data": 2}, "auto"),
        ("llama_pp_circular.splan", {"stage": 4, "data": 2}, "auto"),
        ("llama_pp_circular.splan", {"stage": 2, "data": 4}, "auto"),
        ("llama_pp.splan", {"stage": 2, "data": 4}, "shard_map"),
        ("llama_pp_circular.splan", {"stage": 4, "data": 2}, "shard_map"),
    ],
)
def test_a_scanned_llama_trains_pipelined_equal_to_one_device(file, mesh, backend):
    plan = shardplan.with_mesh(shardplan.load(PLANS / file), mesh)
    data = batches()
    losses, model, optimizer, placement, step = train(plan, data, backend)
    one_losses, one_params = reference.train(models.llama_deep_scan, TX, example.lm_loss, data, key="adamw-1e-2")
    params = reference.params_of(model)
    assert params.keys() == one_params.keys()
    reference.assert_trains_alike(losses, params, one_losses, one_params)
    # Each stage holds only its layers (and their optimizer state).
    q = model.layers.attn.q.kernel[...]
    assert q.addressable_shards[0].data.shape[0] == 8 // mesh["stage"]
    stacked = [x for x in jax.tree.leaves(nnx.state(optimizer)) if getattr(x, "shape", ())[:1] == (8,)]
    assert len(stacked) == 2 * 9 and all(x.sharding.spec[0] == "stage" for x in stacked)  # adamw's mu and nu
    # XLA's program: activations cross stages as collective permutes over `stage`.
    ops = hlo.with_axes(hlo.parse(step.lower(model, optimizer, data[0]).compile().as_text(), 8), mesh)
    assert [o for o in ops if o.kind == "collective-permute" and o.axes == ("stage",)]
    gathers = [o for o in ops if o.kind == "all-gather" and "stage" in o.axes]
    if file == "llama_pp.splan":  # GPipe: each stage's layers are its block of the stacked dim; nothing gathers
        assert not gathers, [(o.moves, o.axes) for o in gathers]
    if backend == "shard_map":  # the partitioner's record is the compiled program, with nothing run whole
        record = step.fn.record(step.place(data[0]))
        assert record.fallbacks == []
        assert per_kind((o.kind, o.axes, o.runs, o.bytes_per_step) for o in ops) == per_kind(
            (c.kind, c.axes, c.count, c.bytes) for c in record.issued
        )


def test_a_model_without_a_scanned_stack_is_told_what_a_pipeline_needs():
    plan = shardplan.with_mesh(shardplan.load(PLANS / "llama_pp.splan"), {"stage": 2, "data": 4})
    text = plan.text.replace('param "layers/.*" (stage, ...)', 'param "layers/0/.*" (stage, ...)')
    plan = shardplan.with_mesh(shardplan.loads(text, "pp.splan"), {"stage": 2, "data": 4})
    model, optimizer, placement = shardplan.init_sharded(plan, models.llama_tiny, TX)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer)
    with pytest.raises(shardplan.ShardPlanError) as info:
        step(model, optimizer, batches(1)[0])
    d = info.value.diagnostics[0]
    assert (
        d.code == "pipeline-layers"
        and "nnx.scan" in d.hint
        and d.span.line == text.split("\n").index("pipeline stage, microbatches = 4") + 1
    )


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    plan = shardplan.with_mesh(shardplan.load(PLANS / "llama_pp.splan"), {"stage": 2, "data": 4})
    model, optimizer, placement = shardplan.init_sharded(plan, models.llama_deep_scan, TX)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer)
    with pytest.raises(shardplan.ShardPlanError) as info:
        step(model, optimizer, batches(1, rows=12)[0])  # 12 rows: 4 microbatches of 3 do not split over data=4
    assert info.value.diagnostics[0].code == "pipeline-batch"


def values(tree) -> dict:
    return {leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(tree)}


def test_pipelined_state_checkpoints_onto_fsdp_and_back_bit_exact(tmp_path):
    from shardplan import checkpoint

    pp = shardplan.with_mesh(shardplan.load(PLANS / "llama_pp.splan"), {"stage": 2, "data": 4})
    _, model, optimizer, placement, _ = train(pp, batches(2))
    saved = checkpoint.Checkpointer(tmp_path / "pp", placement)
    saved.save(2, model, optimizer)
    saved.wait()
    want = (values(model), values(optimizer))

    def restored(directory, plan):
        m, o, pl = shardplan.init_sharded(plan, lambda: models.llama_deep_scan(9), TX)
        assert checkpoint.Checkpointer(directory, pl).restore(m, o) == 2
        shardplan.verify(pl, m, o)  # every leaf laid out as the restoring plan says
        return m, o, pl

    fsdp = shardplan.load(PLANS / "fsdp_any_rank.splan")
    m, o, pl = restored(tmp_path / "pp", fsdp)
    for w, tree in zip(want, (m, o)):
        for path, v in w.items():
            np.testing.assert_array_equal(values(tree)[path], v, err_msg=path)
    again = checkpoint.Checkpointer(tmp_path / "fsdp", pl)
    again.save(2, m, o)
    again.wait()
    m2, o2, _ = restored(tmp_path / "fsdp", pp)
    assert m2.layers.attn.q.kernel[...].sharding.spec[0] == "stage"
    for w, tree in zip(want, (m2, o2)):
        for path, v in w.items():
            np.testing.assert_array_equal(values(tree)[path], v, err_msg=path)


STEP = dict(model="examples/models.py:llama_deep_scan", step="examples/train.py:lm_loss",
            batch=["tokens=int32[16,16]", "labels=int32[16,16]"], devices=8)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_the_step_cost_reports_the_schedule_and_its_stage_permutes(mode):
    cost = shardplan.api.analyze(PLANS / "llama_pp.splan", mode=mode, **STEP)
    pp = cost.pipeline
    assert (pp.axis, pp.stages, pp.microbatches, pp.steps) == ("stage", 2, 4, 5)
    assert pp.idle == Schedule(2, 4, 1, 8).idle == 2 and pp.bubble == pytest.approx(1 / 5)
    # One permute of a stage's activation block per loop step, forward and backward: 2 KiB each
    # (a microbatch of 4 rows over data=4, 16 x 32 float32).
    assert (pp.permute_count, pp.permute_bytes) == (10, 10 * 2048)
    assert StepCost.from_json(cost.to_json()).pipeline == pp
    if mode == "fast":  # the pipeline's own buffer constraints are not the user's: none listed
        assert cost.constrained == () and cost.constraint_delta == ()


def test_fast_mode_matches_exact_mode_on_a_gpipe_plan():
    fast = shardplan.api.analyze(PLANS / "llama_pp.splan", mode="fast", **STEP)
    exact = shardplan.api.analyze(PLANS / "llama_pp.splan", mode="exact", **STEP)
    f, e = fast.bytes_by_axes(), exact.bytes_by_axes()
    assert f["collective-permute"] == e["collective-permute"]
    assert f["all-gather"] == e["all-gather"] == {}
    assert f["all-reduce"]["stage"] == e["all-reduce"]["stage"]
    assert f["all-reduce"]["data"] == pytest.approx(e["all-reduce"]["data"], rel=0.05)
    assert fast.memory.peak == pytest.approx(exact.memory.peak, rel=0.05)


def test_quick_pipeline_benchmark_measures_side_by_side_and_reports_each_target_honestly():
    """benchmarks/pipeline.py's quick run: fast vs exact on the GPipe plan (rows whose errors are the
    two modes' figures, checks that say "yes" exactly where within target; the bubble's idle count
    equal to the schedule table's), and the offline plans costed side by side, pipelined or not."""
    from benchmarks import pipeline as bench

    res = bench.run(quick=True)
    (row,) = res["fast_vs_exact"]
    assert row["comm"]["collective-permute"]["exact"] > 0  # the compiled step's stage permutes
    checks = {c["measurement"]: c for c in bench.checks(res)}
    for kind, c in row["comm"].items():
        assert c["error"] == abs(c["fast"] - c["exact"]) / c["exact"]
        assert (checks[f"pipeline fast vs exact llama_pp.splan: {kind} bytes error"]["met"] == "yes") == (
            c["error"] <= 0.10)
    assert row["idle"] == row["schedule_idle"] > 0
    offline = {r["plan"]: r for r in res["offline"]}
    assert {r["pipelined"] for r in offline.values()} == {True, False}
    assert offline["pp-gpipe-dp"]["bubble"] > offline["pp-circular-dp"]["bubble"] > 0 == offline["fsdp-tp"]["bubble"]
    assert all(r["step_s"][0] <= r["step_s"][1] and r["peak"] > 0 for r in offline.values())
    assert any(line.startswith("  best pipelined") for line in bench.report(res))
    # ... and every deterministic target is met (fast mode equal to the compiled pipeline).
    assert [c["measurement"] for c in checks.values() if not c["timing"] and c["met"] != "yes"] == []


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(stages=st.integers(2, 8), repeats=st.integers(2, 4))
def test_a_circular_relayout_moves_each_chunk_once_to_the_stage_that_runs_it(stages, repeats):
    """The at-rest chunks (contiguous per stage) reach their stages in `repeats` collective
    permutes: each round a permutation (every stage sends one chunk, receives one), chunk c ends on
    stage c mod P as its pass c div P, and every chunk moves exactly once."""
    from shardplan.runtime.pipeline import circular_rounds

    rounds = circular_rounds(stages, repeats)
    assert len(rounds) == repeats
    placed: dict[tuple[int, int], int] = {}
    for offsets, dest, slots in rounds:
        assert sorted(dest) == list(range(stages))
        for d in range(stages):
            c = d * repeats + offsets[d]
            assert dest[d] == c % stages and slots[dest[d]] == c // stages
            placed[(dest[d], slots[dest[d]])] = c
    assert sorted(placed.values()) == list(range(stages * repeats))
