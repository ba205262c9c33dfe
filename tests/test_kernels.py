"""Custom kernels and hand-placed regions in fast mode: a Pallas kernel's memory traffic against a
hand count of its block copies and its FLOPs against its body; a jax.shard_map region against the
compiled step (exact mode); flash attention against the naive attention's stored scores."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

import shardplan
from shardplan.runtime.kernels import pallas_cost
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "manual_models.py"
MiB = 2**20


def eqns_named(name, f, *args):
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == name:
                out.append(e)
                continue
            for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
                sub = e.params.get(key)
                if sub is not None:
                    walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return out


def pallas_eqns(f, *args):
    return eqns_named("pallas_call", f, *args)


def matmul(tpu: bool):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...])

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((256, 512), jnp.float32),
        grid=(2, 2),
        in_specs=[pl.BlockSpec((128, 384), lambda i, j: (i, 0)), pl.BlockSpec((384, 256), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((128, 256), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")) if tpu else None,
    )


@pytest.mark.parametrize("tpu", [True, False])
def test_a_kernels_flops_are_its_body_times_its_grid_and_its_traffic_its_block_copies(tpu):
    x, y = jax.ShapeDtypeStruct((256, 384), jnp.float32), jax.ShapeDtypeStruct((384, 512), jnp.float32)
    (eqn,) = pallas_eqns(matmul(tpu), x, y)
    cost = pallas_cost(eqn)
    assert cost.flops == 2 * 256 * 512 * 384
    x_block, y_block = 128 * 384 * 4, 384 * 256 * 4
    # Grid (i, j), j fastest. TPU's pipeline keeps x's block while only j moves (2 copies) and
    # fetches y's at every step (4); elsewhere each of the 4 programs loads both blocks.
    assert cost.read == (2 * x_block + 4 * y_block if tpu else 4 * x_block + 4 * y_block)
    assert cost.written == 256 * 512 * 4


def test_flash_attention_rereads_keys_once_per_query_block_and_skips_blocks_above_the_diagonal():
    q = jax.ShapeDtypeStruct((2, 4, 512, 128), jnp.bfloat16)  # (batch, heads, time, dim), 1 MiB
    (full,) = pallas_eqns(lambda q, k, v: flash_attention(q, k, v), q, q, q)
    (causal,) = pallas_eqns(lambda q, k, v: flash_attention(q, k, v, causal=True), q, q, q)
    # Blocks of 128 rows: 4 query blocks, each reading all 4 key and value blocks.
    assert pallas_cost(full).read == 1 * MiB + 4 * (1 + 1) * MiB
    # Causal: query block i reads key blocks 0..i; a block index that does not change from one
    # step to the next is not copied again (block 0 stays from the end of query block 0 into
    # query block 1): per (batch, head) 1 + 1 + 3 + 4 = 9 of the 16 copies of 32 KiB.
    assert pallas_cost(causal).read == 1 * MiB + 2 * 9 * 8 * 32 * 1024
    assert pallas_cost(full).written == 1 * MiB  # the output (not differentiated: no residuals)
    # The forward kernel's own cost estimate: both matmuls over every (query, key) pair, and the softmax.
    assert pallas_cost(full).flops == pytest.approx(2 * 2 * (2 * 4 * 512 * 512 * 128), rel=0.02)


def analyze(model, mode, plan=None, step=None, batch=("tokens=int32[16,32],labels=int32[16,32]",)):
    return shardplan.api.analyze(
        plan, model=model, step=step or f"{FIXTURES}:loss", batch=list(batch), mode=mode, devices=8
    )


TP = """plan "manual"
mesh data = 4, model = 2
batch (data, _)
param "up" (_, model)
param "down" (model, _)
default replicated
"""


def by_kind(cost):
    out = {}
    for c in cost.communication:
        out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + c.bytes
    return out


@pytest.mark.parametrize("model", ["manual_mlp", "partial_mlp"])
def test_a_shard_map_region_costs_what_the_compiled_step_does(tmp_path, model):
    plan = tmp_path / "tp.splan"
    plan.write_text(TP)
    fast = analyze(f"{FIXTURES}:{model}", "fast", plan)
    exact = analyze(f"{FIXTURES}:{model}", "exact", plan)
    fast_comm, exact_comm = by_kind(fast), by_kind(exact)
    assert set(fast_comm) == set(exact_comm) == {("all-reduce", ("data",)), ("all-reduce", ("model",))}
    for k, n in exact_comm.items():
        assert fast_comm[k] == pytest.approx(n, rel=0.10), k  # the user's psum over model, the gradients' over data
    assert fast.flops == pytest.approx(exact.flops, rel=0.02)
    # The same MLP left to GSPMD compiles to the same collectives.
    assert by_kind(analyze(f"{FIXTURES}:auto_mlp", "exact", plan)) == exact_comm


FLASH = f"""
from flax import nnx
import sys
sys.path.insert(0, {str(ROOT)!r})
from examples.models import Llama, LlamaConfig

def build(attention):
    return Llama(LlamaConfig(vocab=128, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=1, max_len=512,
                             attention=attention, attention_blocks=(128, 128, 128)), nnx.Rngs(0))

def flash():
    return build("flash")

def flash_unwrapped():  # the kernel called on the batch-split activations, no shard_map
    return Llama(LlamaConfig(vocab=128, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=1, max_len=512,
                             attention="flash", attention_axes=(), attention_blocks=(128, 128, 128)), nnx.Rngs(0))

def naive():
    return build("naive")
"""


def test_flash_attention_moves_less_than_the_stored_scores_of_naive_attention(tmp_path):
    models = flash_models(tmp_path)
    kw = dict(step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", batch=("tokens=int32[8,512],labels=int32[8,512]",))
    naive = analyze(f"{models}:naive", "fast", ROOT / "plans" / "dp.splan", **kw)
    flash = analyze(f"{models}:flash", "fast", ROOT / "plans" / "dp.splan", **kw)
    # Naive attention stores each device's f32 scores (1 sequence x 4 heads x 512 x 512) at least
    # once forward and once backward; the kernel keeps them on chip.
    scores = 1 * 4 * 512 * 512 * 4
    assert naive.hbm_bytes - flash.hbm_bytes >= 2 * scores
    assert by_kind(flash) == by_kind(naive)  # the kernel runs per device: no collective added
    assert not any(n.code == "kernel-outside-shard-map" for n in flash.notes)


def flash_models(tmp_path):
    models = tmp_path / "flash_models.py"
    models.write_text(FLASH)
    return models


def test_a_kernel_outside_shard_map_gathers_its_operands_and_says_so(tmp_path):
    models = flash_models(tmp_path)
    kw = dict(step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", batch=("tokens=int32[8,512],labels=int32[8,512]",))
    wrapped = analyze(f"{models}:flash", "fast", ROOT / "plans" / "dp.splan", **kw)
    bare = analyze(f"{models}:flash_unwrapped", "fast", ROOT / "plans" / "dp.splan", **kw)
    # q, k and v (8 x 512 x 4 heads x 32, f32), split over data=8, gathered whole for the kernel.
    gathered = sum(c.bytes for c in bare.communication if c.kind == "all-gather" and "kernel" in c.op)
    assert gathered >= 3 * 8 * 512 * 4 * 32 * 4
    assert not any(c.kind == "all-gather" for c in wrapped.communication)
    assert any(n.code == "kernel-outside-shard-map" and "wrap the kernel in jax.shard_map" in n.text for n in bare.notes)
    assert bare.flops > 4 * wrapped.flops  # every device runs the whole batch's attention


def test_propagation_auto_lays_a_kernels_step_out_by_fast_modes_own_propagation_and_says_why(tmp_path):
    """Shardy's import cannot read a step that calls a Pallas kernel on CPU: ``propagation="auto"``
    costs it on fast mode's own propagation (the same figures) and the notes say why; a step
    without one it lays out by Shardy's propagation, as ``xla`` does."""
    models = flash_models(tmp_path)
    kw = dict(model=f"{models}:flash", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", mode="fast", devices=8,
              batch=["tokens=int32[8,512],labels=int32[8,512]"])
    with pytest.raises(shardplan.ShardPlanError, match="Shardy's propagation could not run"):
        shardplan.api.analyze(ROOT / "plans" / "dp.splan", propagation="xla", **kw)
    auto = shardplan.api.analyze(ROOT / "plans" / "dp.splan", propagation="auto", **kw)
    own = shardplan.api.analyze(ROOT / "plans" / "dp.splan", propagation="shardplan", **kw)
    assert auto.propagation == "shardplan" and by_kind(auto) == by_kind(own) and auto.memory == own.memory
    assert any(n.code == "fast-how" and "Shardy's propagation could not run over the step" in n.text for n in auto.notes)
    kw["model"] = f"{models}:naive"
    auto, xla = (shardplan.api.analyze(ROOT / "plans" / "llama_tp.splan", propagation=p, **kw) for p in ("auto", "xla"))
    assert auto.propagation == "xla" and by_kind(auto) == by_kind(xla) and auto.memory == xla.memory


def test_scan_operand_groups_are_read_from_either_jax_form():
    """Up to jax 0.10 a scan names its constants and carries by count; jax 0.11 groups its operands
    (consts, carry, xs) in a flat tree, ``ft_in``. Both give the same split."""
    from types import SimpleNamespace

    from shardplan.runtime.sharding import scan_counts

    w = jnp.ones(3)
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x * w, c.sum()), c, xs))(jnp.ones(3),
                                                                                                  jnp.ones((5, 3)))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(eqn) == (1, 1)

    class Groups:  # jax 0.11's flat tree of the operands, three groups
        def update(self, leaves):
            return SimpleNamespace(unpack=lambda: (leaves[:1], leaves[1:2], leaves[2:]))

    newer = SimpleNamespace(params={"ft_in": Groups(), "length": 5}, invars=eqn.invars)
    assert scan_counts(newer) == scan_counts(eqn)


CUDNN = f'''
from flax import nnx
import sys
sys.path.insert(0, {str(ROOT)!r})
from examples.models import Llama, LlamaConfig

def build(attention):
    return Llama(LlamaConfig(vocab=128, d_model=256, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=1, max_len=512,
                             attention=attention, dtype="bfloat16"), nnx.Rngs(0))

def cudnn():
    return build("cudnn")

def naive():
    return build("naive")
'''


def test_cudnn_attention_forward_flops_are_the_attention_xla_compiles():
    """Without a GPU, fast mode traces jax.nn.dot_product_attention(implementation="cudnn") as on one;
    its forward kernel's FLOPs are those of jax's own XLA attention compiled here (not masked)."""
    from shardplan.runtime.kernels import cudnn_traceable, fused_attention_cost

    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    with cudnn_traceable():
        (eqn,) = eqns_named("dot_product_attention_fwd_wrapper",
                            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), q, q, q)
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")).lower(q, q, q)
    costs = xla.compile().cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    cost = fused_attention_cost(eqn)
    assert cost.flops == pytest.approx(costs["flops"], rel=0.03)
    # q, k and v read once; the output written (not differentiated: no softmax statistics kept).
    assert cost.read == 3 * 2 * 256 * 4 * 128 * 2 and cost.written == 2 * 256 * 4 * 128 * 2


def test_cudnn_attention_traces_without_starting_a_backend(monkeypatch):
    """Tracing cuDNN attention on a machine without a GPU asks no backend: jax's compute-capability
    checks start every installed one (XLA:TPU's start-up warnings, the CUDA plugin's traceback when
    shardplan[gpu] is installed without a GPU), printed on the user's terminal by a fast `check`.
    Answered as for an H100 inside the trace (head dims up to 256 allowed), jax's own after it."""
    from jax._src import xla_bridge
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from shardplan.runtime.kernels import cudnn_traceable

    if fa.check_cudnn_version.__module__ == fa.__name__:
        try:
            present = fa.check_cudnn_version() > 0
        except Exception:
            present = False
        if present:
            pytest.skip("cuDNN is installed here: jax's own checks stand")

    def no_backend(*a, **k):
        raise AssertionError("a backend was asked for while tracing")

    monkeypatch.setattr(xla_bridge, "get_backend", no_backend)
    q = jax.ShapeDtypeStruct((2, 256, 4, 256), jnp.bfloat16)  # head dim 256: Hopper only
    with cudnn_traceable():
        (eqn,) = eqns_named("dot_product_attention_fwd_wrapper",
                            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), q, q, q)
    assert eqn.outvars[0].aval.shape == (2, 256, 4, 256)
    assert fa.check_compute_capability.__module__ == fa.__name__  # undone after the trace


def test_cudnn_attention_keeps_the_heads_split_and_moves_less_than_naive_attention(tmp_path):
    models = tmp_path / "cudnn_models.py"
    models.write_text(CUDNN)
    kw = dict(step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", batch=("tokens=int32[8,512],labels=int32[8,512]",))
    for plan in ("dp.splan", "llama_tp.splan"):  # batch split; heads split over model
        naive = analyze(f"{models}:naive", "fast", ROOT / "plans" / plan, **kw)
        cudnn = analyze(f"{models}:cudnn", "fast", ROOT / "plans" / plan, **kw)
        assert by_kind(cudnn) == by_kind(naive), plan  # attention runs where its heads are: nothing gathered
        assert not any(n.code == "fast-not-modelled" for n in cudnn.notes)
        # Naive attention stores each device's f32 scores (1 sequence x 4 heads, or 2 under tp, x 512 x 512)
        # forward and backward; the kernel keeps them on chip.
        assert naive.hbm_bytes - cudnn.hbm_bytes >= 2 * (1 * 2 * 512 * 512 * 4)


def test_a_gpu_kernels_key_loop_runs_as_often_as_its_program_ids_say():
    """jax's Pallas GPU (Triton) flash attention loops over key blocks with a fori_loop whose bound
    it computes from its program id (causal: query block i reads key blocks 0..i). Non-causal, its
    FLOPs are those of jax's XLA attention compiled here; causal, 4 query blocks of 128 read
    1 + 2 + 3 + 4 of the 16 key blocks."""
    from jax.experimental.pallas.ops.gpu.attention import mha

    q = jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16)
    (full,) = pallas_eqns(lambda q, k, v: mha(q, k, v, segment_ids=None, causal=False), q, q, q)
    (causal,) = pallas_eqns(lambda q, k, v: mha(q, k, v, segment_ids=None, causal=True), q, q, q)
    costs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")).lower(
        q, q, q).compile().cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    assert pallas_cost(full).flops == pytest.approx(costs["flops"], rel=0.05)
    assert pallas_cost(causal).flops == pytest.approx(pallas_cost(full).flops * 10 / 16, rel=0.02)
    assert not pallas_cost(causal).notes  # every loop's trip count was evaluated


def test_a_causal_kernels_skipped_blocks_are_not_counted_as_work():
    """jax's TPU flash-attention backward kernels run their body under ``pl.when`` on the program
    ids (a key block above the diagonal is skipped): causal, 10 of the 16 (query, key) block pairs
    run. The forward kernel brings its author's cost estimate (every pair), which is kept."""
    q = jax.ShapeDtypeStruct((2, 4, 512, 128), jnp.bfloat16)

    def kernels(causal):
        def loss(q, k, v):
            return flash_attention(q, k, v, causal=causal).astype(jnp.float32).sum()

        return [pallas_cost(e).flops for e in pallas_eqns(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)]

    (fwd_full, *bwd_full), (fwd_causal, *bwd_causal) = kernels(False), kernels(True)
    assert len(bwd_full) == 2 and fwd_causal == pytest.approx(fwd_full, rel=0.01)
    for full, causal in zip(bwd_full, bwd_causal, strict=True):
        assert causal == pytest.approx(full * 10 / 16, rel=0.02)


def test_a_grid_given_as_numpy_integers_is_walked_whole():
    """Pallas takes numpy integers in a grid as sizes passed at run time; here they are literals."""
    import numpy as np

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    spec = pl.BlockSpec((128, 128), lambda i, j: (i, j))
    costs = [pallas_cost(pallas_eqns(pl.pallas_call(kernel, out_shape=x, grid=grid, in_specs=[spec], out_specs=spec,
                                                    compiler_params=pltpu.CompilerParams()), x)[0])
             for grid in ((2, 4), (np.int64(2), np.int64(4)))]
    assert costs[0] == costs[1]
    assert costs[1].read == costs[1].written == 8 * 128 * 128 * 4 and costs[1].flops == 256 * 512


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_exact_mode_refuses_a_custom_kernel_with_a_located_error(tmp_path, kernel):
    models = tmp_path / "kernel_models.py"
    models.write_text(FLASH if kernel == "flash" else CUDNN)
    with pytest.raises(shardplan.ShardPlanError) as info:
        analyze(f"{models}:{kernel}", "exact", ROOT / "plans" / "dp.splan",
                step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", batch=("tokens=int32[8,512],labels=int32[8,512]",))
    d = info.value.diagnostics[0]
    assert d.code == "kernel-not-compilable" and d.path == "--compile" and "fast mode" in d.hint
    assert "Traceback" not in d.message
