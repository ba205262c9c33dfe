"""Mixture of experts (issue 31, first part): the example MoE (top-k router, renormalised weights,
load-balancing loss; capacity and dropless dispatch) under the expert-parallel plan trains equal to
a plain-NNX run on one device, on both backends."""

from __future__ import annotations

import warnings

import numpy as np
import optax
import pytest

import shardplan
from examples import models
from examples import train as example
from tests import reference
from tests.helpers import HAS_GPU, HAS_TPU, PLANS

# float32 round-off differs with the reduction order (the dispatch einsums, the experts' split)


def _batches():
    rng = np.random.default_rng(0)
    return [example.synthetic_batch(rng, 64, 16, 16) for _ in range(3)]


MOE_PLANS = ("moe_ep.splan", "moe_ep_tp.splan", "moe_ep_fsdp.splan")


@pytest.mark.parametrize("factory", ["moe_tiny", "moe_tiny_dropless"])
@pytest.mark.parametrize("backend", ["auto", "shard_map"])
@pytest.mark.parametrize("plan_name", MOE_PLANS)
def test_every_moe_plan_trains_as_on_one_device(plan_name, factory, backend):
    tx = optax.adamw(1e-2, eps=1e-5)
    batches = _batches()
    ref_losses, ref_params = reference.train(getattr(models, factory), tx, example.moe_lm_loss, batches,
                                             key="adamw-1e-2-moe")
    plan = shardplan.load(PLANS / plan_name)
    model, optimizer, placement = shardplan.init_sharded(plan, getattr(models, factory), tx)
    assert model.blocks[0].moe.w_in[...].sharding.spec[0] == "expert"  # each expert on one slice
    with warnings.catch_warnings():
        # shard_map runs both dispatch paths on local shards: a fallback is an error here
        warnings.simplefilter("error", shardplan.ShardMapFallbackWarning)
        step = shardplan.train_step(placement, example.moe_lm_loss, model, optimizer, backend=backend)
        losses = [float(step(model, optimizer, b)) for b in batches]
    reference.assert_trains_alike(losses, reference.params_of(model), ref_losses, ref_params)
    assert losses[-1] < losses[0]


def test_moe_shapes_check_offline():
    """Mixtral-8x7B and DeepSeek-V3 shapes build abstractly and their experts split over `expert`."""
    for factory, experts in (("mixtral_8x7b", 8), ("deepseek_v3", 256)):
        res = shardplan.check(PLANS / "moe_ep.splan", model=f"{PLANS.parent / 'examples' / 'models.py'}:{factory}",
                              devices=64)
        w_in = next(d for d in res.resolution.decisions if d.path == "blocks/0/moe/w_in")
        assert w_in.shape[0] == experts and w_in.spec.dims[0] == ("expert",)


def test_expert_weights_stay_on_their_slice_in_the_compiled_step():
    """Under the expert-parallel plan XLA's program moves tokens, not expert weights: no collective
    of the compiled step gathers w_in or w_out (their gradients stay on their slice, summed over
    `data` only)."""
    cost = shardplan.api.analyze(PLANS / "moe_ep.splan", model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny",
                                 step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
                                 batch=["tokens=int32[16,16],labels=int32[16,16]"], mode="exact", devices=8)
    # the expert matmuls (the model's einsums "egcd,edf->egcf" and "egcf,efd->egcd") communicate
    # only to sum their weights' gradients over `data`: no gather of a weight, nothing over `expert`
    experts = [c for c in cost.communication if "egcd,edf" in c.op or "egcf,efd" in c.op]
    assert experts and all(c.kind == "all-reduce" and c.axes == ("data",) for c in experts), experts


def test_fast_mode_costs_the_dropless_path_as_xla_cpu_compiles_it():
    """The dropless path (a global argsort of the tokens by expert, a lookup of the sorted tokens,
    grouped matmuls) on XLA:CPU: the argsort gathers the expert ids, the lookup with those whole
    indices runs where the tokens lie and all-reduces, and each grouped matmul is jax's dense
    decomposition (a masked copy of the tokens per expert). Fast mode had counted no FLOPs and no
    collective for the grouped matmuls (5.4x under XLA's FLOPs, all-reduce 82 KiB of 1,110).

    The first grouped matmul's decomposition (the tokens' masked copies, computed, times the
    experts' weights split over `expert` on the group dim they contract) runs each device's own
    groups and all-reduces the result over `expert` (256 KiB, XLA's row exactly). XLA does the
    same for the other three grouped matmuls. Fast mode had carried the lookup's pending sum into
    the four groups' masked copies (1 MiB) and reduce-scattered the backward pass's lookup onto the
    batch rows, gathering it again (all-reduce 1,378, all-gather 1,164, reduce-scatter 328 KiB
    against 1,110, 12 and 0); it now sums each lookup where it is made, as XLA does: 982, 12 and 64
    KiB (2026-12-07)."""
    kw = dict(model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny_dropless",
              step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
              batch=["tokens=int32[16,16],labels=int32[16,16]"], devices=8)
    fast, exact = (shardplan.api.analyze(PLANS / "moe_ep.splan", mode=m, **kw) for m in ("fast", "exact"))
    assert not any(n.code == "fast-not-modelled" for n in fast.notes), fast.notes
    f, e = fast.bytes_by_kind(), exact.bytes_by_kind()
    def over_expert(cost):
        return sorted(c.bytes for c in cost.communication
                      if c.kind == "all-reduce" and c.axes == ("expert",) and c.source.endswith("models.py:620"))

    assert 262144 in over_expert(fast) and 262144 in over_expert(exact)
    assert f["all-reduce"] == pytest.approx(e["all-reduce"], rel=0.15)
    assert f["all-gather"] == pytest.approx(e["all-gather"], rel=0.05)  # the expert ids for the sort
    assert 0.5 * exact.flops <= fast.flops <= 2.0 * exact.flops  # 0.68x


def test_shard_map_dispatches_tokens_with_all_to_alls_and_compiles_what_it_records():
    """On the capacity path the shard_map backend moves the dispatched tokens to their experts'
    devices and back with all-to-alls over `expert` (not a gather of every device's tokens), runs
    nothing on whole operands, and XLA's compiled program has exactly the collectives it recorded."""
    from tests.test_shard_map import compiled_vs_predicted

    got, want, record = compiled_vs_predicted("moe_ep.splan", "moe_tiny", example.moe_lm_loss)
    assert got == want
    assert record.fallbacks == []
    a2a = [c for c in record.issued if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {("expert",)}
    # the dispatched tokens (models.py's "gsec,gsd->egcd", constrained to the expert axis) and
    # the experts' outputs (its "egcf,efd->egcd") each cross once forward, as one device's buffer
    lines = {c.source.rsplit(":", 1)[1] for c in a2a if c.op == "sharding_constraint"}
    assert len(lines) == 2, a2a
    # no gather of the tokens forward: what is gathered over `expert` is smaller than the buffers
    assert sum(c.bytes for c in record.issued if c.kind == "all-gather") < sum(c.bytes for c in a2a)


@pytest.mark.parametrize("plan_name", MOE_PLANS)
def test_shard_map_runs_the_dropless_path_on_each_devices_experts(plan_name):
    """On the dropless path the shard_map backend runs each grouped matmul on the devices that
    hold its experts, on their rows of the sorted tokens: no fallback, no expert weight gathered
    for a grouped matmul (under expert parallelism alone the only gathers are the expert ids for
    the global sort), nothing summed between the two grouped matmuls; XLA's compiled program has
    exactly the collectives it recorded."""
    from tests.test_shard_map import compiled_vs_predicted

    got, want, record = compiled_vs_predicted(plan_name, "moe_tiny_dropless", example.moe_lm_loss)
    assert got == want
    assert record.fallbacks == []
    gathers = [c for c in record.issued if c.kind == "all-gather"]
    if plan_name == "moe_ep.splan":
        assert gathers and {c.op for c in gathers} == {"sort"}, gathers
    # (moe_ep_fsdp gathers its FSDP-split expert weights over `data`, once per matmul, as FSDP does)
    assert not any(c.op == "ragged_dot_general" and "expert" in c.axes and c.kind == "all-gather"
                   for c in record.issued), gathers
    # models.py's `h = jax.nn.gelu(jax.lax.ragged_dot(...))`: the gelu runs on each device's rows
    line = next(c.source for c in record.issued if c.op == "ragged_dot_general").rsplit(":", 1)[1]
    between = [c for c in record.issued if c.source.endswith(":" + line) and c.op != "ragged_dot_general"]
    assert between == [], between


def test_each_data_replica_of_an_expert_shard_runs_its_share_of_the_rows(monkeypatch):
    """moe_ep (data = 2, expert = 4) on the dropless path: the two devices that hold the same
    experts each run half of those experts' sorted rows (buffers of 256 of the 512 routed rows at
    16 x 16 tokens, top-2), where each had run all of them. The ground truth is XLA:CPU's cost
    analysis of the compiled step, against the same step with every row run on both replicas
    (the split turned off): the FLOPs it saves are the grouped matmuls' (jax's dense decomposition,
    its masks included) that fast mode counts for the rows no longer run (12.67 M saved against
    13.37 M counted, 2026-12-07: the split's own bookkeeping, each replica's group sizes and its
    result placed back among the rows, costs the rest)."""
    from shardplan.runtime.backends.shard_map import grouped_flops
    from shardplan.runtime.partition import ops_contract

    def compiled():
        plan = shardplan.load(PLANS / "moe_ep.splan")
        model, optimizer, placement = shardplan.init_sharded(plan, models.moe_tiny_dropless, optax.adamw(1e-3))
        step = shardplan.train_step(placement, example.moe_lm_loss, model, optimizer, backend="shard_map")
        batch = _batches()[0]
        costs = step.lower(model, optimizer, batch).compile().cost_analysis()
        costs = costs[0] if isinstance(costs, list) else costs
        record = step.fn.record(step.place(batch))
        counted, _, _, masks = grouped_flops(record.grouped, placement.mesh_shape, kernel=False, masked=True)
        return costs["flops"], {r[4] for r in record.grouped}, sum(counted.values()) + masks

    split, split_rows, split_counted = compiled()
    monkeypatch.setattr(ops_contract, "_chunk", lambda *args: ())
    whole, whole_rows, whole_counted = compiled()
    assert (split_rows, whole_rows) == ({256}, {512})
    assert whole - split == pytest.approx(whole_counted - split_counted, rel=0.07)
    assert split < 0.75 * whole


def test_a_dropless_moe_of_our_own_trains_on_local_shards_as_on_one_device():
    """A routed layer nobody tuned the partitioner for (tests/fixtures/engine_models.py's
    sorted_experts: top-1 routing, SiLU between the grouped matmuls, its own names) under expert
    parallelism on the shard_map backend: no op on whole operands, the loss and params equal to
    plain NNX on one device, and the compiled program's collectives the ones recorded."""
    import importlib.util

    from shardplan.core import hlo as collectives

    path = PLANS.parent / "tests" / "fixtures" / "engine_models.py"
    spec = importlib.util.spec_from_file_location("engine_models_moe", path)
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    tx = optax.adamw(1e-2, eps=1e-5)
    batches = _batches()
    ref_losses, ref_params = reference.train(engine.sorted_experts, tx, engine.lm_loss, batches)
    plan = shardplan.load(PLANS.parent / "tests" / "fixtures" / "experts_ep.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, engine.sorted_experts, tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardplan.ShardMapFallbackWarning)
        step = shardplan.train_step(placement, engine.lm_loss, model, optimizer, backend="shard_map")
        placed = step.place(batches[0])
        compiled = step.lower(model, optimizer, batches[0]).compile()
        losses = [float(step(model, optimizer, b)) for b in batches]
    reference.assert_trains_alike(losses, reference.params_of(model), ref_losses, ref_params)
    record = step.fn.record(placed)
    assert record.fallbacks == []
    got: dict = {}
    for op in collectives.with_axes(collectives.parse(compiled.as_text()), placement.mesh_shape):
        got[(op.kind, op.axes)] = got.get((op.kind, op.axes), 0) + op.bytes_per_step
    want: dict = {}
    for c in record.issued:
        want[(c.kind, c.axes)] = want.get((c.kind, c.axes), 0) + c.bytes
    assert got == want
    assert not any(c.kind == "all-gather" and c.op == "ragged_dot_general" for c in record.issued)


def _one_device_greedy(factory):
    """Unsharded, cache-free, unpadded: plain NNX on one device, each sequence alone."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = factory(0)
    state, gm = jax.device_put(nnx.state(model), jax.devices()[0]), nnx.graphdef(model)
    forward = jax.jit(lambda st, seq: nnx.merge(gm, st)(seq)[0])

    def check(prompt, generated):
        logits = forward(state, jnp.asarray([prompt + generated], jnp.int32))[0]
        return [int(t) for t in jnp.argmax(logits[len(prompt) - 1:], axis=-1)][:len(generated)] == generated

    return check


@pytest.mark.parametrize("mode", ["plain", "cache"])
def test_generation_with_experts_split_matches_one_device(mode):
    """Greedy decoding of the MoE under the expert-parallel plan (experts on their slices, the
    batch over data x expert), with the KV cache (the model's init_cache convention) and without
    (an adapter that drops the load-balancing loss), equals one device token for token."""
    from shardplan import GenerationAdapter, GenerationConfig, Generator

    check = _one_device_greedy(models.moe_tiny)
    model, _, placement = shardplan.init_sharded(shardplan.load(PLANS / "moe_ep.splan"), lambda: models.moe_tiny(0),
                                                 None)
    assert model.blocks[0].moe.w_in[...].sharding.spec[0] == "expert"
    adapter = GenerationAdapter(forward=lambda m, tokens: m(tokens)[0]) if mode == "plain" else None
    gen = Generator(placement, model, GenerationConfig(max_len=32, buckets=(8, 16), max_new_tokens=8), adapter=adapter)
    assert gen.mode == mode
    for i, length in enumerate((3, 11)):
        prompts = [[int(t) for t in np.random.default_rng(i * 8 + r).integers(1, 64, size=length)] for r in range(8)]
        out = gen.generate(prompts)
        for p, toks in zip(prompts, out.tokens):
            assert len(toks) == 8 and check(p, toks), (mode, length, p, toks)


def test_quick_moe_benchmark_measures_side_by_side_and_reports_each_target_honestly():
    """benchmarks/moe.py's quick run: the step on both backends and under data parallel, timed in
    one run; fast vs exact rows whose errors are the two modes' figures and whose checks say "yes"
    exactly where the error is within the target (fast mode misses the dispatch: it is reported)."""
    from benchmarks import moe

    res = moe.run(quick=True)
    (step,) = res["steps"]
    assert step["plan"] == "moe_ep.splan" and step["shard_map_fallbacks"] == 0
    assert all(step[k] > 0 for k in ("auto_ms", "shard_map_ms", "dp_ms"))
    assert step["shard_map_vs_auto"] == step["shard_map_ms"] / step["auto_ms"]
    (row,) = res["fast_vs_exact"]
    assert row["comm"]["all-to-all"]["exact"] > 0  # XLA's program dispatches by all-to-all over expert
    checks = {c["measurement"]: c for c in moe.checks(res)}
    for kind, c in row["comm"].items():
        assert c["error"] == abs(c["fast"] - c["exact"]) / c["exact"]
        check = checks[f"fast vs exact moe_ep.splan x moe_tiny: {kind} bytes error"]
        assert (check["met"] == "yes") == (c["error"] <= 0.10) and not check["timing"]
    assert (checks["fast vs exact moe_ep.splan x moe_tiny: peak memory error"]["met"] == "yes") == (
        row["peak_error"] <= 0.15)
    assert any(line.startswith("moe_ep.splan") for line in moe.report(res))
    # Every deterministic target is met, except those known unmet (issue 31, the MoE engine work; issue
    # 44, the engine's accuracy): each of those may not get worse than measured (2026-12-03), and the
    # test shows as xfail while any is left.
    missed = {c["measurement"]: c for c in checks.values() if not c["timing"] and c["met"] != "yes"}
    assert set(missed) <= set(MOE_KNOWN_MISSES), sorted(set(missed) - set(MOE_KNOWN_MISSES))
    errors = {f"fast vs exact moe_ep.splan x moe_tiny: {k} bytes error": c["error"] for k, c in row["comm"].items()}
    errors["fast vs exact moe_ep.splan x moe_tiny: FLOPs error"] = row["flops_error"]
    for name, bound in MOE_KNOWN_MISSES.items():
        assert errors[name] <= bound, (name, errors[name], bound)
    if missed:
        pytest.xfail(f"issues 31 and 44: targets not met yet: {', '.join(sorted(missed))}")


# Measured on 2026-12-03 (quick mode): all-gather 63.6%, all-to-all 750%, FLOPs 3.00%; bounds a little above.
MOE_KNOWN_MISSES = {
    "fast vs exact moe_ep.splan x moe_tiny: all-gather bytes error": 0.70,
    "fast vs exact moe_ep.splan x moe_tiny: all-to-all bytes error": 8.0,
    "fast vs exact moe_ep.splan x moe_tiny: FLOPs error": 0.035,
}


def test_exact_mode_of_the_shard_map_backend_compiles_the_step_that_trains():
    """`check --step --compile --backend shard_map` compiles the program training runs: the plan's
    logical-axis constraints traced over global values, so its all-to-alls are there (it once traced
    them per device, where they do nothing, and reported gathers instead)."""
    from tests.test_shard_map import compiled_vs_predicted

    got, _, _ = compiled_vs_predicted("moe_ep.splan", "moe_tiny", example.moe_lm_loss)
    cost = shardplan.api.analyze(PLANS / "moe_ep.splan", model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny",
                                 step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
                                 batch=["tokens=int32[16,16],labels=int32[16,16]"], mode="exact", devices=8,
                                 backend="shard_map")
    assert sum(c.bytes for c in cost.communication if c.kind == "all-to-all") == got[("all-to-all", ("expert",))][1]
    assert sum(c.bytes for c in cost.communication) == sum(b for _, b in got.values())


@pytest.mark.parametrize("target", [
    "cpu",
    pytest.param("tpu-v5e:2x4", marks=pytest.mark.skipif(not HAS_TPU, reason="needs XLA:TPU: 'shardplan[tpu]'")),
    pytest.param("h100:8", marks=pytest.mark.skipif(not HAS_GPU, reason="needs XLA:GPU: 'shardplan[gpu]'")),
])
def test_fast_mode_counts_the_shard_map_backends_grouped_matmuls_as_each_compiler_runs_them(target):
    """The shard_map backend runs each grouped matmul on its device's own experts, over the whole
    sorted rows: XLA:TPU's grouped kernel takes each row through its expert's weights once, XLA:GPU
    and XLA:CPU (jax's dense decomposition) every row through every local expert, and each runs the
    weight gradients densely. Fast mode had counted the auto backend's (every expert on every
    device): moe_tiny_dropless under moe_ep at 16 x 32 tokens +69.8% of XLA:TPU v5e's FLOPs,
    +223% of XLA:GPU's, -21.9% of XLA:CPU's; now -5.4%, -4.6%, -6.4%."""
    kw = dict(model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny_dropless",
              step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
              batch=["tokens=int32[16,32],labels=int32[16,32]"], devices=8, backend="shard_map", target=target)
    fast, exact = (shardplan.api.analyze(PLANS / "moe_ep.splan", mode=m, **kw) for m in ("fast", "exact"))
    assert fast.flops == pytest.approx(exact.flops, rel=0.08)


@pytest.mark.skipif(not HAS_TPU, reason="needs XLA:TPU: 'shardplan[tpu]'")
def test_a_dropless_layers_lookups_in_sort_order_are_summed_where_they_are_made_on_xla_tpu():
    """tests/fixtures/engine_models.py's sorted_experts (its own names, top-1) under experts_ep on
    the auto backend, compiled offline for 8 v5e chips: XLA:TPU all-reduces each lookup of the
    batch-split tokens by the global sort's whole order (the sorted tokens forward, the combine's
    cotangent backward) and gathers the experts' weights, nothing else. Fast mode had scattered the
    lookups onto the batch rows and gathered them again (387 KiB against 322); now every kind is
    the compiler's."""
    from tests.helpers import FIXTURES

    kw = dict(model=f"{FIXTURES / 'engine_models.py'}:sorted_experts", step=f"{FIXTURES / 'engine_models.py'}:lm_loss",
              batch=["tokens=int32[8,16],labels=int32[8,16]"], devices=8, target="tpu-v5e:2x4")
    fast, exact = (shardplan.api.analyze(FIXTURES / "experts_ep.splan", mode=m, **kw) for m in ("fast", "exact"))
    f, e = fast.bytes_by_kind(), exact.bytes_by_kind()
    assert {k for k in f if f[k]} == {k for k in e if e[k]} == {"all-reduce", "all-gather"}
    for kind in ("all-reduce", "all-gather"):
        assert f[kind] == pytest.approx(e[kind], rel=0.01), (kind, f, e)


@pytest.mark.skipif(not HAS_GPU, reason="needs XLA:GPU: 'shardplan[gpu]'")
def test_fast_mode_holds_the_rows_xla_gpu_masks_for_its_dense_grouped_matmuls():
    """XLA:GPU rewrites each grouped matmul into dense ones over the rows masked once per group, and
    keeps that (groups x rows x width) copy from the forward pass to the weight gradient that reads
    it again (its buffer assignment: f32[8,1536,256] and f32[8,1536,128] copies live from the
    forward pass into the backward, moe_small dropless at 16 x 48 tokens). Fast mode told an H100
    target holds them too: moe_tiny_dropless under moe_ep at 16 x 32 tokens on the auto backend,
    fast / compiled peak 2.94 / 7.98 MiB (-63%) before, within 30% now."""
    kw = dict(model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny_dropless",
              step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
              batch=["tokens=int32[16,32],labels=int32[16,32]"], devices=8, target="h100:8")
    fast, exact = (shardplan.api.analyze(PLANS / "moe_ep.splan", mode=m, **kw) for m in ("fast", "exact"))
    assert fast.memory.peak == pytest.approx(exact.memory.peak, rel=0.3)
    # the shard_map backend runs its own grouped matmuls, on each device's experts: not these copies
    sm = shardplan.api.analyze(PLANS / "moe_ep.splan", mode="fast", backend="shard_map", **kw)
    assert sm.memory.peak < fast.memory.peak


@pytest.mark.skipif(not HAS_TPU, reason="needs XLA:TPU: pip install 'shardplan[tpu]'")
def test_xla_tpu_runs_a_grouped_matmuls_weight_gradient_densely_and_fast_mode_says_so():
    """XLA:TPU's own cost analysis of jax.lax.ragged_dot, compiled offline for one v5e chip, 32
    groups of a 4,096 x 256 by 256 x 128 product: the forward counts the useful FLOPs (each row once),
    the weights' gradient every row through each of the 32 groups. Fast mode counts it so and says
    where, on both backends; with one expert per device (moe_ep) there is nothing dense to say."""
    import jax
    import jax.numpy as jnp

    from shardplan.core import targets
    from shardplan.runtime import exact

    dev = exact._topology_devices(targets.parse("tpu-v5e:2x4"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    x = jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((32, 256, 128), jnp.bfloat16, sharding=sh)
    s = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=sh)
    useful = 2 * 4096 * 256 * 128

    def flops(fn):
        ca = jax.jit(fn).lower(x, w, s).compile().cost_analysis()
        return (ca[0] if isinstance(ca, list) else ca)["flops"]

    assert flops(jax.lax.ragged_dot) == useful
    grad = flops(lambda x, w, s: jax.grad(lambda w: jnp.sum(jax.lax.ragged_dot(x, w, s).astype(jnp.float32)))(w))
    assert grad >= 32 * useful

    kw = dict(model=f"{PLANS.parent / 'examples' / 'models.py'}:moe_tiny_dropless",
              step=f"{PLANS.parent / 'examples' / 'train.py'}:moe_lm_loss",
              batch=["tokens=int32[16,32],labels=int32[16,32]"], devices=8, target="tpu-v5e:2x4")
    for backend, mesh, dense in (("auto", None, True), ("shard_map", None, False),
                                 ("shard_map", {"data": 4, "expert": 2}, True)):
        cost = shardplan.api.analyze(PLANS / "moe_ep.splan", mode="fast", backend=backend, mesh=mesh, **kw)
        notes = [n for n in cost.notes if n.code == "grouped-dense"]
        assert bool(notes) == dense, (backend, mesh, cost.notes)
        if dense:
            assert "weight gradients" in notes[0].text and notes[0].source.endswith("models.py:620")
