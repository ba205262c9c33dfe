"""Activations in the plan: Flax logical constraints driven by `axis` rules, `act` rules by module
path, models that name mesh axes themselves, and sequence parallelism for the Llama."""

import collections
import warnings

import jax
import numpy as np
import optax
import pytest

import shardplan
from examples import models
from shardplan import api
from shardplan.core import hlo
from tests.fixtures import act_models as am
from tests.helpers import FIXTURES, PLANS, ROOT

ACT = FIXTURES / "act_models.py"
DP = 'plan "dp"\nmesh data = 4, model = 2\nbatch (data, _)\ndefault replicated\n'
TP = DP.replace(
    "default", 'param "up/kernel" (_, model)\nparam "up/bias" (model)\nparam "down/kernel" (model, _)\ndefault'
)
LOGICAL = TP + "axis batch -> data\naxis hidden -> model\naxis features -> model\n"
BY_PATH = TP + 'act "down" (data, model)\n'
XY = {"x": ((16, 16), "float32"), "y": ((16, 16), "float32")}


def compiled_ops(plan, factory, loss, batch, backend=None, state=False):
    """The compiled step's collectives and the step (with ``state``: also its model and optimizer)."""
    model, opt, placement = shardplan.init_sharded(plan, factory, optax.sgd(0.1))
    step = shardplan.train_step(placement, loss, model, opt, backend=backend)
    text = step.lower(model, opt, batch).compile().as_text()
    ops = hlo.with_axes(hlo.parse(text, 8), placement.mesh_shape)
    return (ops, step, model, opt) if state else (ops, step)


def losses(plan, factory, loss, batch, steps, backend=None, tx=None):
    model, opt, placement = shardplan.init_sharded(plan, factory, tx or optax.sgd(0.1))
    step = shardplan.train_step(placement, loss, model, opt, backend=backend)
    return [float(step(model, opt, batch)) for _ in range(steps)], model


def one_device(factory, loss, batch, steps, tx=None, axes=None):
    """The reference: one device (under a 1 x 1 mesh with ``axes`` for a model that names them)."""
    from flax import nnx

    if axes is not None:
        mesh = jax.make_mesh(
            (1,) * len(axes), axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes), devices=jax.devices()[:1]
        )
        with jax.set_mesh(mesh):
            return one_device(factory, loss, batch, steps, tx)
    model = factory()
    opt = nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        opt.update(model, grads)
        return value

    dev = jax.devices()[0]
    batch = jax.device_put(batch, dev)
    return [float(step(model, opt, batch)) for _ in range(steps)], model


def by_axes(ops, kind):
    out = collections.Counter()
    for o in ops:
        if o.kind == kind:
            out[",".join(o.axes)] += o.bytes_per_step
    return dict(out)


@pytest.mark.parametrize("text", [LOGICAL, BY_PATH], ids=["logical-name", "act-rule"])
def test_a_constraint_changes_the_compiled_step_as_predicted_and_keeps_the_numbers(text, tmp_path):
    """Under tensor parallelism the MLP's output is a partial sum over `model`, all-reduced. A
    constraint that splits it over `model` too (by logical name through the plan's axis rules, or
    by module path) leaves each device a block that the loss needs whole: one more all-gather
    over `model` of the output per device, as fast mode predicts, and the compiled step has."""
    base = shardplan.loads(TP, "tp.splan")
    plan = shardplan.loads(text, "p.splan")
    before, _ = compiled_ops(base, am.logical, am.loss, am.batch())
    after, step = compiled_ops(plan, am.logical, am.loss, am.batch())

    def gathered(ops):  # all-gathers over `model` alone: their results' bytes
        return sum(o.bytes_per_step for o in ops if o.kind == "all-gather" and o.axes == ("model",))

    out = 16 // 4 * 16 * 4  # the MLP's output per device: batch 16 / data 4, 16 features, f32
    bias = 16 * 4  # the down bias's gradient, split like the output's features, gathered whole
    assert gathered(before) == 0 and gathered(after) == out + bias
    paths = {}
    for name, t in (("tp", TP), ("p", text)):
        paths[name] = tmp_path / f"{name}.splan"
        paths[name].write_text(t)
    fast = {
        name: api.analyze(p, model=f"{ACT}:logical", step=f"{ACT}:loss", batch=XY, optimizer="sgd", mode="fast")
        for name, p in paths.items()
    }

    # Every all-gather the compiled steps have, fast mode predicts: the output's over `model`, and
    # the down bias's gradient (split like the constrained output's features) gathered whole.
    def all_gathers(cost):
        return sum(cost.bytes_by_axes()["all-gather"].values())

    assert all_gathers(fast["tp"]) == sum(o.bytes_per_step for o in before if o.kind == "all-gather") == 0
    assert all_gathers(fast["p"]) == sum(o.bytes_per_step for o in after if o.kind == "all-gather") > out
    # what `check --step` says they add
    assert ("all-gather", "model", all_gathers(fast["p"])) in fast["p"].constraint_delta
    (c,) = [c for c in fast["p"].constrained if c.shape == (16, 16)]
    assert c.spec == "(data, model)" and c.bytes == 16 * 16 * 4 // 8
    assert ("act rule p.splan:8" in c.what) == (text == BY_PATH)
    if text == BY_PATH:
        assert step.activations.applied == {"down": 1}
    # The numbers: 5 steps equal one device, on both backends (shard_map's partitioner reshards
    # the constrained value to the same layout).
    want, _ = one_device(am.logical, am.loss, am.batch(), 5)
    for backend in ("auto", "shard_map"):
        got, _ = losses(plan, am.logical, am.loss, am.batch(), 5, backend=backend)
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_sequence_parallel_plan_turns_tp_activation_all_reduces_into_reduce_scatter_and_all_gather():
    """Under llama_tp the compiled step all-reduces the residual stream over `model`; under
    llama_sp (the same weights, the residual stream split over the sequence) those become
    reduce-scatters (XLA:CPU: all-reduces every device only slices) and all-gathers."""
    tokens = np.random.default_rng(0).integers(0, 256, size=(8, 32)).astype(np.int32)
    batch = {"tokens": tokens, "labels": np.roll(tokens, -1, axis=1)}
    act = "f32[2,32,256]"  # the residual stream per device: batch 8 / data 4, whole sequence, d_model

    def model_ops(plan_file):
        ops, *trained = compiled_ops(shardplan.load(PLANS / plan_file), am.llama_wide, am.lm_loss, batch, state=True)
        out = collections.Counter()
        for o in ops:
            if o.axes == ("model",) and o.shapes == (act,):
                out["reduce-scatter" if o.as_reduce_scatter else o.kind] += 1
        return out, trained

    (tp, _), (sp, (sp_step, model, opt)) = model_ops("llama_tp.splan"), model_ops("llama_sp.splan")
    assert tp["all-reduce"] >= 8 and tp["all-gather"] == 0 and tp["reduce-scatter"] == 0
    assert sp["all-reduce"] == 0 and sp["reduce-scatter"] >= 4 and sp["all-gather"] >= 4
    # The shard_map backend follows the same constraints: its compiled step reduce-scatters the
    # row-parallel outputs onto the sequence split (psum_scatter) instead of all-reducing them.
    ops, _ = compiled_ops(
        shardplan.load(PLANS / "llama_sp.splan"), am.llama_wide, am.lm_loss, batch, backend="shard_map"
    )
    sm = collections.Counter((o.kind, o.shapes[0]) for o in ops if o.axes == ("model",))
    assert sm["reduce-scatter", "f32[2,16,256]"] >= 4 and sm["all-gather", act] >= 4
    assert sm["all-reduce", act] == 0
    # ... and gathers the activation, not the column-parallel weights, where the sequence split ends.
    assert not any(kind == "all-gather" and shape != act for kind, shape in sm)
    # And the numbers: the step compiled above (auto backend), 5 SGD steps, equal one device.
    got = [float(sp_step(model, opt, batch)) for _ in range(5)]
    want, _ = one_device(am.llama_wide, am.lm_loss, batch, 5)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_sequence_parallel_saves_the_activation_memory_fast_mode_predicts():
    """With layers under nnx.remat the residual stream is what a step keeps for the backward
    pass: splitting it over the sequence shrinks XLA's temporaries, by what fast mode says."""
    kw = dict(
        model=f"{ACT}:llama_wide_scan",
        step=f"{ACT}:lm_loss",
        optimizer="adamw",
        devices=8,
        batch={"tokens": ((8, 256), "int32"), "labels": ((8, 256), "int32")},
    )
    cost = {
        (plan, mode): api.analyze(PLANS / plan, mode=mode, **kw)
        for plan in ("llama_tp.splan", "llama_sp.splan")
        for mode in ("exact", "fast")
    }
    temps = {k: c.memory.temporaries for k, c in cost.items()}
    saved_exact = temps["llama_tp.splan", "exact"] - temps["llama_sp.splan", "exact"]
    saved_fast = temps["llama_tp.splan", "fast"] - temps["llama_sp.splan", "fast"]
    assert saved_exact > 0.15 * temps["llama_tp.splan", "exact"]  # a real saving, not noise
    assert abs(saved_fast - saved_exact) <= 0.15 * saved_exact
    for plan in ("llama_tp.splan", "llama_sp.splan"):
        exact, fast = cost[plan, "exact"].memory, cost[plan, "fast"].memory
        assert abs(fast.temporaries - exact.temporaries) <= 0.15 * exact.temporaries
        assert abs(fast.peak - exact.peak) <= 0.15 * exact.peak
    # README.md quotes these temporaries (compiled, MB): the figures are this run's.
    from tests.test_readme_figures import readme_sp_temporaries

    quoted = readme_sp_temporaries()
    measured = tuple(round(temps[p, "exact"] / 1e6, 1) for p in ("llama_tp.splan", "llama_sp.splan"))
    assert quoted == measured, (quoted, measured)
    sp = cost["llama_sp.splan", "fast"]
    assert sp.constrained  # check --step lists the constrained activations, and what they change
    # (the plan less its constraints is llama_tp): each kind over `model` moves the way XLA's
    # programs move from llama_tp to llama_sp. The activations' all-reduces become reduce-scatters
    # and gathers; the weight gradients, now summed over the sequence's split too, are all-reduced
    # over `model` as well (XLA:CPU one axis after the other): more all-reduce over `model`, not less.
    delta = {(kind, axes): n for kind, axes, n in sp.constraint_delta}

    def over_model(c, kind):
        return sum(r.bytes for r in c.communication if r.kind == kind and r.axes == ("model",))

    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        moved = over_model(cost["llama_sp.splan", "exact"], kind) - over_model(cost["llama_tp.splan", "exact"], kind)
        assert moved > 0 and delta[(kind, "model")] > 0, (kind, moved, delta)


def test_a_model_that_names_mesh_axes_runs_under_the_plans_mesh_on_both_backends():
    """`with_sharding_constraint(x, P("data", "model"))` in model code: shardplan provides the mesh
    context (no jax.set_mesh in user code), on both backends."""
    plan = shardplan.loads(DP, "dp.splan")
    want, _ = one_device(am.mesh_named, am.loss, am.batch(), 3, axes=("data", "model"))
    for backend in ("auto", "shard_map"):
        got, _ = losses(plan, am.mesh_named, am.loss, am.batch(), 3, backend=backend)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    # The same model written for other axis names: one diagnostic naming both.
    with pytest.raises(shardplan.ShardPlanError) as info:
        losses(plan, am.mesh_named_fsdp, am.loss, am.batch(), 1)
    (d,) = info.value.diagnostics
    assert d.code == "model-axis" and "'fsdp'" in d.message and "(data, model)" in d.message
    assert "act_models.py:" in d.message and "mesh fsdp" in d.hint


def test_logical_names_no_axis_rule_maps_are_reported():
    plan = shardplan.loads(DP + "axis hidden -> model\n", "p.splan")  # 'batch' has no rule
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses(plan, am.logical, am.loss, am.batch(), 1)
    assert any("'batch'" in str(w.message) and "no axis rule maps" in str(w.message) for w in seen)


def test_act_rules_are_checked_against_the_model(tmp_path):
    p = tmp_path / "p.splan"
    p.write_text(DP + 'act "up" (data, model)\nact "ffn" (data, _)\n')
    warned = [w for w in api.check(p, model=f"{ACT}:logical", devices=8).warnings if w.code == "unused-rule"]
    assert [(w.span.line, '"ffn"' in w.message) for w in warned] == [(6, True)]
    bad = shardplan.loads(DP + 'act "up" (data, model, _)\n', "bad.splan")
    with pytest.raises(shardplan.ShardPlanError) as info:
        losses(bad, am.logical, am.loss, am.batch(), 1)
    (d,) = info.value.diagnostics
    assert d.code == "act-rank" and "'up'" in d.message and d.span.line == 5


def test_the_plan_splits_the_cache_of_a_model_with_k_v_projections_over_heads(tmp_path):
    """The Llama's projections are named k/v: the layout comes from the plan's cache statement,
    and generation equals the unsharded model token for token."""
    from jax.sharding import PartitionSpec as P

    from shardplan.runtime.generate import GenerationConfig, Generator

    p = tmp_path / "served.splan"
    p.write_text(f'extends "{PLANS / "llama_tp.splan"}"\ncache (data, _, model, _)\n')
    model, _, placement = shardplan.init_sharded(shardplan.load(p), lambda: models.llama_tiny_cached(0), None)
    gen = Generator(placement, model, GenerationConfig(max_len=32, buckets=(8,), max_new_tokens=6))
    assert gen.cache_spec == P("data", None, "model") and "cache statement" in gen.cache_origin
    ref = models.llama_tiny(0)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 64, size=5)] for i in range(8)]
    generated = gen.generate(prompts).tokens
    assert all(len(toks) == 6 for toks in generated)
    # Greedy is teacher-forced on one device: each generated token is the unsharded model's argmax
    # after the prompt and the tokens before it (the model is causal: one call on all 8 sequences).
    logits = np.asarray(ref(np.asarray([p + t for p, t in zip(prompts, generated)], np.int32)))
    for i, (prompt, toks) in enumerate(zip(prompts, generated)):
        assert toks == [int(t) for t in np.argmax(logits[i, len(prompt) - 1 : -1], axis=-1)]


def test_axis_rules_for_activations_are_checked_against_the_model(tmp_path):
    """The Llama has no annotated params; its residual stream is constrained with logical names.
    Without --step, a name written in the model's source counts as used; a misspelt one warns."""
    model = f"{ROOT / 'examples' / 'models.py'}:llama_tiny"
    clean = api.check(PLANS / "llama_sp.splan", model=model, devices=8)
    assert [w for w in clean.warnings if w.code == "unused-axis-rule"] == []
    typo = tmp_path / "typo.splan"
    typo.write_text(f'extends "{PLANS / "llama_sp.splan"}"\naxis activation_lenght -> model\n')
    warned = [w for w in api.check(typo, model=model, devices=8).warnings if w.code == "unused-axis-rule"]
    assert [(w.span.line, "'activation_lenght'" in w.message) for w in warned] == [(2, True)]
