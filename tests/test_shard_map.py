"""The shard_map backend: equivalence with auto and 1 device, emitted modules, and the
collectives each plan's compiled step really issues."""

import functools
import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples import models
import shardplan
from examples import train as example
from tests import reference
from tests.helpers import PLANS, ROOT
from shardplan.core import hlo as collectives
from shardplan.core import lowering
from shardplan.tools import emit

PLAN_MODELS = {"dp.splan": "gpt_tiny", "fsdp.splan": "gpt_tiny", "gpt_tp.splan": "gpt_tiny",
               "gpt_2d.splan": "gpt_tiny", "gpt_logical.splan": "gpt_tiny_annotated"}
# As in test_apply: float32 round-off differs with the reduction order; AdamW eps=1e-5.
# clip_by_global_norm runs outside shard_map on global arrays: it must see the global norm.
LOSS_RTOL = reference.LOSS_RTOL


def tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-5))


def plain_tx():
    """tx() without the global-norm clip, whose all-reduces run outside shard_map (not in the
    record): the optimizer of the steps whose compiled collectives are compared with the record,
    so the step a test trains is the program it compares (one compile, the second from the cache).
    The clip under shard_map is the emitted modules' tests' (they train with tx())."""
    return optax.adamw(1e-2, eps=1e-5)


def batches(n=5):
    rng = np.random.default_rng(3)
    return [example.synthetic_batch(rng, 64, 16, 16) for _ in range(n)]


def run(plan_name, backend, devices=None):
    plan = shardplan.load(PLANS / plan_name)
    if devices is not None:
        plan = shardplan.with_mesh(plan, {a: 1 for a in plan.axis_names})
    mesh = shardplan.make_mesh(plan, devices=devices)
    model, optimizer, placement = shardplan.init_sharded(plan, getattr(models, PLAN_MODELS[plan_name]), tx(),
                                                         mesh=mesh)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    if devices is None:
        shardplan.verify(placement, model, optimizer)
    params = {leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(model)}
    return losses, params


def assert_same(a, b):
    assert a[1].keys() == b[1].keys()
    reference.assert_trains_alike(a[0], a[1], b[0], b[1])


# Every plan with a model of each family (the Llama: grouped-query attention, rotary embeddings,
# SwiGLU; scanned under nnx.remat for the stacked plans).
PLAN_PAIRS = [("dp.splan", "gpt_tiny"), ("fsdp.splan", "gpt_tiny"), ("gpt_tp.splan", "gpt_tiny"),
              ("gpt_2d.splan", "gpt_tiny"), ("dp.splan", "llama_tiny"), ("fsdp.splan", "llama_tiny"),
              ("llama_tp.splan", "llama_tiny"), ("llama_sp.splan", "llama_tiny"),
              ("llama_scan_2d.splan", "llama_tiny_scan"), ("fsdp_any_rank.splan", "llama_tiny_scan")]


def run_model(plan_name, model_name, backend, devices=None, loss=example.lm_loss, data=None, opt=plain_tx):
    plan = shardplan.load(PLANS / plan_name)
    if devices is not None:
        plan = shardplan.with_mesh(plan, {a: 1 for a in plan.axis_names})
    mesh = shardplan.make_mesh(plan, devices=devices)
    model, optimizer, placement = shardplan.init_sharded(plan, getattr(models, model_name), opt(), mesh=mesh)
    step = shardplan.train_step(placement, loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in (data or batches())]
    return losses, reference.params_of(model)


def one_device(model_name, loss=example.lm_loss, data=None, opt=plain_tx):
    """Plain Flax NNX + optax on the default device (tests/reference.py): no shardplan in it."""
    return reference.train(getattr(models, model_name), opt(), loss, data or batches(), key=opt.__name__)


@pytest.mark.parametrize("plan_name,model_name", PLAN_PAIRS)
def test_shard_map_matches_auto_and_one_device(plan_name, model_name):
    # auto == 1 device for every plan is test_apply's; both equal to one plain-NNX device is the same claim
    sm = run_model(plan_name, model_name, "shard_map")
    assert_same(sm, one_device(model_name))
    assert sm[0][-1] < sm[0][0]


def masked_lm_loss(model, batch):
    """Cross-entropy over real tokens only, divided by the global count of real tokens."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["labels"])
    mask = batch["mask"].astype(ce.dtype)
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def padded_batches(n=5):
    """Padding spread unevenly: the first rows (device 0's slice) are mostly padding."""
    out = []
    for b in batches(n):
        rows, t = b["tokens"].shape
        keep = np.maximum(t - np.arange(rows)[::-1] * 2, 1)[:, None]  # 1..16 real tokens per row
        mask = (np.arange(t)[None, :] < keep).astype(np.int32)
        out.append({**b, "mask": mask})
    return out


@pytest.mark.parametrize("plan_name,model_name", [("gpt_2d.splan", "gpt_tiny"), ("llama_tp.splan", "llama_tiny")])
def test_padding_masked_loss_is_the_global_loss(plan_name, model_name):
    data = padded_batches()
    counts = [int(b["mask"].reshape(8, -1).sum()) for b in data[:1]]  # per-device real tokens differ
    assert len(set(counts)) == 1 and len({int(r.sum()) for r in data[0]["mask"].reshape(8, -1, 16)}) > 1
    # with the clip: uneven padding makes Adam's first steps sensitive to float32 round-off
    sm = run_model(plan_name, model_name, "shard_map", loss=masked_lm_loss, data=data, opt=tx)
    assert_same(sm, one_device(model_name, loss=masked_lm_loss, data=data, opt=tx))


def _emitted(plan_name, backend, tmp_path):
    plan = shardplan.load(PLANS / plan_name)
    factory = getattr(models, PLAN_MODELS[plan_name])
    with nnx.use_eager_sharding(False):
        m, o = nnx.eval_shape(lambda: (lambda m: (m, nnx.Optimizer(m, tx(), wrt=nnx.Param)))(factory()))
    params = shardplan.resolve(plan, m, devices=8)
    opt = shardplan.resolve(plan, o, params=m, devices=8)
    low = lowering.lower(plan, params, shardplan.resolve_batch(plan, batches(1)[0], devices=8))
    path = tmp_path / f"step_{backend}.py"
    path.write_text(emit.emit(plan, params, opt, low, backend))
    spec = importlib.util.spec_from_file_location(f"emitted_{backend}_{plan_name[:-6]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importlib's recipe without registering it in sys.modules: loads too
    assert spec.name not in sys.modules
    return module, path


# The plans whose partitioned code differs most (FSDP gathers, a 2-D split, logical constraints); dp and
# tensor parallel are the runtime backend's tests above (the suite's time: each case compiles twice).
@pytest.mark.parametrize("plan_name", ["fsdp.splan", "gpt_2d.splan", "gpt_logical.splan"])
def test_emitted_shard_map_module_runs_and_matches(plan_name, tmp_path):
    module, path = _emitted(plan_name, "shard_map", tmp_path)
    imports = {line.split()[1].split(".")[0] for line in path.read_text().splitlines()
               if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "re", "math", "collections", "dataclasses", "types", "typing", "numpy", "jax",
                       "flax", "optax"}
    assert_same(run_emitted(module, plan_name), run(plan_name, "shard_map"))


def test_emitted_module_is_exact_for_a_padding_masked_loss(tmp_path):
    """The emitted make_train_step partitions the step as the runtime backend does: a loss divided
    by the global count of real tokens, padding uneven over devices, equals 1 device."""
    module, _ = _emitted("gpt_2d.splan", "shard_map", tmp_path)
    with nnx.use_eager_sharding(False):
        model = models.gpt_tiny()
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    mesh = module.make_mesh()
    module.place(model, optimizer, mesh)
    step = module.make_train_step(model, optimizer, masked_lm_loss, mesh)
    losses = [float(step(model, optimizer, b)) for b in padded_batches()]
    got = losses, reference.params_of(model)
    assert_same(got, one_device("gpt_tiny", loss=masked_lm_loss, data=padded_batches(), opt=tx))
    (record,) = step.records.values()
    assert record.issued and not record.fallbacks


def run_emitted(module, plan_name):
    """5 steps with an emitted module, on a plain (unplaced) model: its own place() places it."""
    with nnx.use_eager_sharding(False):
        model = getattr(models, PLAN_MODELS[plan_name])()
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    mesh = module.make_mesh()
    module.place(model, optimizer, mesh)
    step = module.make_train_step(model, optimizer, example.lm_loss, mesh)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    return losses, {leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(model)}


def test_emitted_auto_module_runs_and_matches(tmp_path):
    module, _ = _emitted("gpt_tp.splan", "auto", tmp_path)
    assert_same(run_emitted(module, "gpt_tp.splan"), run("gpt_tp.splan", "auto"))


@functools.cache
def compiled_vs_predicted(plan_name, model_name, loss=example.lm_loss):
    """Per (kind, axes): (count, bytes) of the compiled shard_map step's collectives and of the
    partitioner's record, and the record."""
    plan = shardplan.load(PLANS / plan_name)
    model, optimizer, placement = shardplan.init_sharded(plan, getattr(models, model_name), plain_tx())
    step = shardplan.train_step(placement, loss, model, optimizer, backend="shard_map")
    b = batches(1)[0]
    compiled = step.lower(model, optimizer, b).compile()
    got: dict = {}
    for op in collectives.with_axes(collectives.parse(compiled.as_text()), placement.mesh_shape):
        key = (op.kind, op.axes)
        got[key] = (got.get(key, (0, 0))[0] + op.runs, got.get(key, (0, 0))[1] + op.bytes_per_step)
    record = step.fn.record(step.place(b))
    want: dict = {}
    for c in record.issued:
        key = (c.kind, c.axes)
        want[key] = (want.get(key, (0, 0))[0] + c.count, want.get(key, (0, 0))[1] + c.bytes)
    return got, want, record


@pytest.mark.parametrize("plan_name,model_name", PLAN_PAIRS)
def test_compiled_collectives_are_the_predicted_ones(plan_name, model_name):
    """Kind, mesh axes, count and bytes of every collective in the compiled shard_map step (read
    from XLA's optimized HLO) equal what the partitioner issued, and nothing fell back."""
    got, want, record = compiled_vs_predicted(plan_name, model_name)
    assert got == want
    assert record.fallbacks == []


@pytest.mark.parametrize("plan_name,model_name", [("gpt_tp.splan", "gpt_tiny"), ("llama_tp.splan", "llama_tiny")])
def test_tensor_parallel_reduces_activations_and_gathers_no_weight(plan_name, model_name):
    got, _, record = compiled_vs_predicted(plan_name, model_name)
    assert not any(kind == "all-gather" for kind, _ in got)
    # Row-parallel matmuls (attention output, MLP down): the pending sum over `model` of their
    # output, the residual stream [16/4, 16, d_model] per device, all-reduced where the model's
    # residual add reads it, at least once per layer and kind.
    d_model = getattr(models, model_name)().cfg.d_model
    residual = [c for c in record.issued if c.kind == "all-reduce" and c.axes == ("model",)
                and "models.py" in c.source and c.bytes == 4 * 16 * d_model * 4]
    assert len(residual) >= 2 * 2, record.issued


def test_fsdp_gathers_weights_and_reduce_scatters_gradients():
    got, _, record = compiled_vs_predicted("fsdp.splan", "gpt_tiny")
    gathers = [c for c in record.issued if c.kind == "all-gather"]
    assert gathers and all(c.axes == ("data",) for c in gathers)
    assert got[("reduce-scatter", ("data",))][0] >= 1 and ("all-gather", ("model",)) not in got


def test_op_with_no_local_rule_falls_back_and_is_reported():
    """top_k over the batch: operands gathered, the op run whole, listed with its source line."""
    def loss(model, batch):
        y = model(batch["x"]).sum(-1)
        return jax.lax.top_k(y, 4)[0].sum()

    plan = shardplan.loads("mesh data = *\nbatch (data, _)\ndefault replicated")
    model, optimizer, placement = shardplan.init_sharded(plan, models.mlp_small, tx())
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    step = shardplan.train_step(placement, loss, model, optimizer, backend="shard_map")
    losses = [float(step(model, optimizer, {"x": x})) for _ in range(3)]
    record = step.fn.record(step.place({"x": x}))
    assert [f.op for f in record.fallbacks] == ["top_k"] and "test_shard_map.py" in record.fallbacks[0].source
    one, _ = reference.train(models.mlp_small, tx(), loss, [{"x": x}] * 3)  # plain NNX on one device
    np.testing.assert_allclose(losses, one, rtol=LOSS_RTOL)


def test_a_step_with_a_cond_and_a_while_loop_runs_them_locally_and_trains_as_one_device():
    """A loss with a data-dependent ``lax.cond`` and a ``lax.while_loop`` of run-time trips
    (tests/fixtures/fast_models.py): the shard_map backend runs both on local blocks (no fallback)
    and trains equal to plain NNX on one device, with both branches taken; fast mode models both
    (nothing "not modelled" in its notes, the loop named as costed for one trip)."""
    from tests.fixtures.fast_models import cond_while_loss

    plan_text = ('mesh data = 4, model = 2\nbatch (data, _)\nparam "layers/0/kernel" (_, model)\n'
                 'param "layers/1/kernel" (model, _)\ndefault replicated\n')
    plan = shardplan.loads(plan_text)
    model, optimizer, placement = shardplan.init_sharded(plan, models.mlp_small, tx())
    rng = np.random.default_rng(0)
    data = [{"x": (rng.normal(size=(16, 64)) + shift).astype(np.float32)} for shift in (3.0, -3.0, 3.0)]
    step = shardplan.train_step(placement, cond_while_loss, model, optimizer, backend="shard_map")
    losses = [float(step(model, optimizer, b)) for b in data]
    assert step.fn.record(step.place(data[0])).fallbacks == []
    one, _ = reference.train(models.mlp_small, tx(), cond_while_loss, data)  # plain NNX on one device
    np.testing.assert_allclose(losses, one, rtol=LOSS_RTOL)
    fast = shardplan.api.analyze(plan, mode="fast", model=f"{ROOT / 'examples' / 'models.py'}:mlp_small",
                                 step=f"{ROOT / 'tests' / 'fixtures' / 'fast_models.py'}:cond_while_loss",
                                 batch=["x=float32[16,64]"])
    assert not any(n.code == "fast-not-modelled" for n in fast.notes), fast.notes
    assert any(n.code == "fast-loop-trips" and "fast_models.py" in n.text for n in fast.notes), fast.notes


def test_lowering_picks_collectives_by_axis_role():
    plan = shardplan.load(PLANS / "gpt_2d.splan")
    with nnx.use_eager_sharding(False):
        m = nnx.eval_shape(models.gpt_tiny)
    params = shardplan.resolve(plan, m, devices=8)
    low = lowering.lower(plan, params, shardplan.resolve_batch(plan, batches(1)[0], devices=8))
    by = {p.path: p for p in low.params}
    q = by["blocks/0/attn/query/kernel"]  # (data, model)
    assert [(c.kind, c.axes, c.dim) for c in q.gather] == [("all_gather", ("data",), 0), ("all_gather", ("model",), 1)]
    assert [(c.kind, c.axes, c.dim) for c in q.reduce] == [("slice", ("model",), 1), ("psum_scatter", ("data",), 0)]
    ln = by["blocks/0/ln1/scale"]  # replicated: one all-reduce (psum) over the batch axis
    assert ln.gather == () and [(c.kind, c.axes) for c in ln.reduce] == [("psum", ("data",))]


# -- bad input ----------------------------------------------------------------------------

def _placed(plan_text_or_name="dp.splan"):
    plan = shardplan.load(PLANS / plan_text_or_name) if plan_text_or_name.endswith(".splan") else \
        shardplan.loads(plan_text_or_name)
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adam(1e-3))
    return model, optimizer, placement


def test_loss_not_scalar():
    model, optimizer, placement = _placed()
    step = shardplan.train_step(placement, lambda m, b: m(b["tokens"]), model, optimizer, backend="shard_map")
    with pytest.raises(shardplan.PlanApplyError, match="not a float scalar"):
        step(model, optimizer, batches(1)[0])


def test_batch_not_dividing_over_batch_axes():
    model, optimizer, placement = _placed()
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend="shard_map")
    bad = {k: v[:12] for k, v in batches(1)[0].items()}
    with pytest.raises(shardplan.PlanCheckError) as info:
        step(model, optimizer, bad)
    assert info.value.diagnostics[0].code == "indivisible"


def test_input_split_on_a_non_batch_dim_is_partitioned():
    """Tokens split over batch and sequence: the partitioned step runs and equals 1 device."""
    model, optimizer, placement = _placed('mesh data = 4, seq = 2\nbatch (data, seq)\ndefault replicated')
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend="shard_map")
    losses = [float(step(model, optimizer, b)) for b in batches(3)]
    one, _ = reference.train(models.gpt_tiny, optax.adam(1e-3), example.lm_loss, batches(3))  # plain NNX
    np.testing.assert_allclose(losses, one, rtol=LOSS_RTOL)


def test_model_with_non_param_state_cannot_be_lowered():
    class WithStats(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(self.lin(x))

    plan = shardplan.loads("mesh data = *\nbatch (data)\ndefault replicated")
    model, optimizer, placement = shardplan.init_sharded(plan, WithStats, optax.adam(1e-3))
    with pytest.raises(shardplan.PlanApplyError) as info:
        shardplan.train_step(placement, lambda m, b: m(b["x"]).mean(), model, optimizer, backend="shard_map")
    assert "non-Param state" in str(info.value) and info.value.diagnostics[0].path.startswith("bn/")


def test_lower_refuses_what_the_backend_refuses(tmp_path):
    """`shardplan lower` of a model with RNG streams: the same cannot-lower error as the runtime
    backend, not a module that then fails with a uint32 gradient TypeError."""
    model = tmp_path / "with_rngs.py"
    model.write_text(
        "from flax import nnx\n"
        "class M(nnx.Module):\n"
        "    def __init__(self):\n"
        "        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))\n"
        "        self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1))\n"
        "def make():\n"
        "    return M()\n"
    )
    r = subprocess.run([sys.executable, "-m", "shardplan", "lower", str(PLANS / "dp.splan"), "--model",
                        f"{model}:make", "--simulate-devices", "8", "-o", str(tmp_path / "step.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "error[cannot-lower]" in r.stderr and "non-Param state" in r.stderr
    assert "drop/rngs" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "step.py").exists()


def test_backend_line_in_plan_selects_shard_map():
    plan = shardplan.loads("mesh data = *\nbatch (data, _)\ndefault replicated\nbackend shard_map")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adam(1e-3))
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer)
    assert step.backend == "shard_map"
    assert np.isfinite(float(step(model, optimizer, batches(1)[0])))


def test_cli_lower_writes_a_module_and_reports(tmp_path):
    out = tmp_path / "step.py"
    r = subprocess.run([sys.executable, "-m", "shardplan", "lower", str(PLANS / "fsdp.splan"), "--model",
                        f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", "--simulate-devices", "8", "-o", str(out),
                        "--batch", "tokens=16x16:int32", "--batch", "labels=16x16:int32", "--report"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "jax.lax.psum_scatter(g['blocks/0/mlp/up/kernel'], 'data', scatter_dimension=0, tiled=True)" in text
    assert "shard_map" in r.stdout and "reduce-scatter" in r.stdout and "all-gather" in r.stdout
    assert "predicted from the plan" in r.stdout
    assert "shard_map (partitioned step), issued by its per-device code: all-reduce 6 / 644 B, all-gather 16" in r.stdout
    assert "no op fell back to gathering its operands" in r.stdout


# -- a KV cache built inside the step (issue 29) -----------------------------------------------
from tests.fixtures import cache_models  # noqa: E402

CACHE_PLANS = {"megatron_tp": cache_models.TP_PLAN, "fsdp": cache_models.FSDP_PLAN}
CACHE_STEPS = 3


cache_tx = plain_tx


def cache_params(model):
    return {leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(model)}


@functools.cache
def cache_one_device():
    """The reference: plain Flax NNX and optax on one device, no shardplan."""
    with jax.default_device(jax.devices()[0]):
        model = cache_models.cache_lm()
        optimizer = nnx.Optimizer(model, cache_tx(), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(example.lm_loss)(model, batch)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, b)) for b in batches(CACHE_STEPS)]
    return losses, cache_params(model)


def step_cost(step, model, optimizer, batch):
    """(FLOPs, peak bytes) per device of the compiled step, read as exact mode reads them."""
    compiled = step.lower(model, optimizer, batch).compile()
    mem = compiled.memory_analysis()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return float(costs["flops"]), int(peak), compiled


@pytest.mark.parametrize("plan_key", sorted(CACHE_PLANS))
def test_kv_cache_made_in_the_step_stays_split(plan_key):
    """A cache made with jnp.zeros and written with dynamic_update_slice at a time position is
    split like the K/V written into it: no fallback (strict=True would raise), training equals
    plain 1-device NNX + optax, FLOPs and peak within 10% of the auto step, and the compiled
    step's collectives are the record's (before: 4 fallbacks, FLOPs 1.97x / 1.74x and peak
    2.2x / 2.5x the auto step's under Megatron TP / FSDP)."""
    plan = shardplan.loads(CACHE_PLANS[plan_key])
    model, optimizer, placement = shardplan.init_sharded(plan, cache_models.cache_lm, cache_tx())
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend="shard_map", strict=True)
    losses = [float(step(model, optimizer, b)) for b in batches(CACHE_STEPS)]
    assert_same((losses, cache_params(model)), cache_one_device())
    b = batches(1)[0]
    record = step.fn.record(step.place(b))
    assert record.fallbacks == [] and record.issued
    flops, peak, compiled = step_cost(step, model, optimizer, b)
    auto = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend="auto")
    auto_flops, auto_peak, _ = step_cost(auto, model, optimizer, b)
    assert abs(flops / auto_flops - 1) < 0.10 and abs(peak / auto_peak - 1) < 0.10, (flops, auto_flops, peak, auto_peak)
    got: dict = {}
    for op in collectives.with_axes(collectives.parse(compiled.as_text()), placement.mesh_shape):
        n, nbytes = got.get((op.kind, op.axes), (0, 0))
        got[(op.kind, op.axes)] = (n + op.runs, nbytes + op.bytes_per_step)
    want: dict = {}
    for c in record.issued:
        n, nbytes = want.get((c.kind, c.axes), (0, 0))
        want[(c.kind, c.axes)] = (n + c.count, nbytes + c.bytes)
    assert got == want


def _top_k_over_batch(model, batch):
    y = model(batch["x"]).sum(-1)
    return jax.lax.top_k(y, 4)[0].sum()  # the line the warning names


def _top_k_step(strict=False):
    plan = shardplan.loads("mesh data = *\nbatch (data, _)\ndefault replicated")
    model, optimizer, placement = shardplan.init_sharded(plan, models.mlp_small, tx())
    step = shardplan.train_step(placement, _top_k_over_batch, model, optimizer, backend="shard_map", strict=strict)
    return model, optimizer, step, {"x": np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)}


def test_fallback_warns_once_naming_op_line_and_bytes():
    model, optimizer, step, batch = _top_k_step()
    line = _top_k_over_batch.__code__.co_firstlineno + 2
    with pytest.warns(shardplan.ShardMapFallbackWarning) as caught:
        for _ in range(3):
            step(model, optimizer, batch)
    assert len(caught) == 1 and caught[0].filename == __file__  # said at the user's call, once
    text = str(caught[0].message)
    assert f"top_k at {__file__}:{line}" in text and "64 B made whole per device per step" in text


def test_strict_makes_a_fallback_an_error_before_the_step_runs():
    model, optimizer, step, batch = _top_k_step(strict=True)
    before = cache_params(model)
    with pytest.raises(shardplan.PlanApplyError) as info:
        step(model, optimizer, batch)
    (d,) = info.value.diagnostics
    line = _top_k_over_batch.__code__.co_firstlineno + 2
    assert d.code == "cannot-lower" and "top_k" in d.message and d.path == f"{__file__}:{line}"
    after = cache_params(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing ran
