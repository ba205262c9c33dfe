"""The auto backend on 8 simulated CPU devices: placement, training equivalence, HLO
identity with hand-written shardings, sharded init, live view and bad input."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from benchmarks.run import PINNED, pinned_residual
from examples import models
from examples import train as example
from tests import reference
from tests.helpers import PLANS, only

# (plan, factory) pairs: each plan with the example models it is written for.
CASES = [
    ("dp.splan", "gpt_tiny"), ("dp.splan", "mlp_small"),
    ("fsdp.splan", "gpt_tiny"), ("fsdp.splan", "mlp_small"),
    ("gpt_tp.splan", "gpt_tiny"), ("gpt_2d.splan", "gpt_tiny"),
    ("gpt_logical.splan", "gpt_tiny_annotated"),
]
# Reductions run in another order on 8 devices than on 1, so results agree to float32
# round-off, not bit for bit. Adam's update m / (sqrt(v) + eps) turns round-off in a
# near-zero gradient into an lr-sized step when eps is tiny, so the equivalence runs use
# AdamW with eps=1e-5 (still with mirrored mu/nu state). Tolerances: losses rtol 1e-5;
# params (about 0.05 in size) rtol 1e-4 + atol 5e-6 after 5 steps at lr 1e-2.
EQUIV_TX = optax.adamw(1e-2, eps=1e-5)


def _setup(plan_name, factory, devices=None, tx=None):
    plan = shardplan.load(PLANS / plan_name)
    if devices is not None:
        plan = shardplan.with_mesh(plan, {a: 1 for a in plan.axis_names})
    mesh = shardplan.make_mesh(plan, devices=devices)
    return shardplan.init_sharded(plan, getattr(models, factory), tx or optax.adamw(1e-2), mesh=mesh)


def _batches(factory, model, n):
    rng = np.random.default_rng(1)
    if factory.startswith("mlp"):
        return [example.synthetic_regression(rng, 16, 64, 16) for _ in range(n)], example.mse_loss
    return [example.synthetic_batch(rng, 64, 16, 16) for _ in range(n)], example.lm_loss


@pytest.mark.parametrize("plan_name,factory", CASES)
def test_every_leaf_has_the_plans_sharding(plan_name, factory):
    model, optimizer, placement = _setup(plan_name, factory)
    for tree, res in ((model, placement.params), (optimizer, placement.opt)):
        live = {leaf.path: leaf for leaf in shardplan.live_leaves(tree)}
        assert live.keys() == res.by_path().keys()
        for d in res.decisions:
            leaf = live[d.path]
            assert leaf.sharding == NamedSharding(placement.mesh, shardplan.pspec(d.spec)), d.path
            # Every device holds exactly the shard the spec implies.
            assert leaf.shard_shapes == ((d.shard_shape, 8),), d.path
    shardplan.verify(placement, model, optimizer)


@pytest.mark.parametrize("plan_name,factory", CASES)
def test_five_steps_match_one_device(plan_name, factory):
    # The reference is plain NNX + optax on one device (tests/reference.py): no shardplan in it.
    model, optimizer, placement = _setup(plan_name, factory, tx=EQUIV_TX)
    batches, loss_fn = _batches(factory, model, 5)
    step = shardplan.train_step(placement, loss_fn, model, optimizer)
    l8 = [float(step(model, optimizer, b)) for b in batches]
    shardplan.verify(placement, model, optimizer)  # the step keeps the plan's placement
    p8 = reference.params_of(model)
    l1, p1 = reference.train(getattr(models, factory), EQUIV_TX, loss_fn, batches, key="EQUIV_TX")
    assert p8.keys() == p1.keys()
    reference.assert_trains_alike(l8, p8, l1, p1)
    assert l8[-1] < l8[0]


def _normalise(hlo: str) -> str:
    """Drop what names the Python source (module name, op metadata, the source-location
    tables at the top); keep every instruction, sharding and collective."""
    hlo = re.sub(r"^HloModule \S+", "HloModule m", hlo)
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    out, skipping = [], False
    for line in hlo.split("\n"):
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
        elif skipping and line:
            continue
        else:
            skipping = False
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("plan_name", ["fsdp.splan", "gpt_tp.splan", "gpt_2d.splan"])
def test_compiled_step_equals_hand_written_shardings(plan_name):
    model, optimizer, placement = _setup(plan_name, "gpt_tiny")
    batches, loss_fn = _batches("gpt_tiny", model, 1)
    step = shardplan.train_step(placement, loss_fn, model, optimizer)
    ours = step.lower(model, optimizer, batches[0]).compile().as_text()

    # By hand: NamedShardings written out per param path, device_put, one jax.jit of the plain NNX
    # step (nothing of shardplan's: a fault in its step shows as a different program).
    mesh = placement.mesh
    hand = {
        "dp.splan": lambda path: P(),
        "fsdp.splan": lambda path: P("data") if path.endswith(("kernel", "embedding")) else P(),
        "gpt_tp.splan": lambda path: (P("model") if re.search(r"(^embed/embedding|out/kernel|down/kernel)$", path)
                                      else P(None, "model")
                                      if re.search(r"(query|key|value|up|gate|head)/kernel$", path)
                                      else P()),
        "gpt_2d.splan": lambda path: (P("model", "data") if path == "embed/embedding"
                                      else P("data") if path == "pos_embed/embedding"
                                      else P("model", "data") if re.search(r"(out|down)/kernel$", path)
                                      else P("data", "model") if path.endswith("kernel") else P()),
    }[plan_name]

    def shardings(tree):
        def spec(kp, x):
            path = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in kp)
            mirrored = re.sub(r"^opt_state/0/(mu|nu)/", "", path)
            return NamedSharding(mesh, hand(mirrored) if x.ndim else P())
        return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    sm, so = nnx.state(model), nnx.state(optimizer)
    sh_m, sh_o = shardings(sm), shardings(so)
    gm, go = nnx.graphdef(model), nnx.graphdef(optimizer)
    if plan_name in PINNED:  # the plan pins the embedding's output: by hand, a sharding constraint
        loss_fn = pinned_residual(loss_fn, mesh)
    def pure_step(sm, so, batch):
        model, optimizer = nnx.merge(gm, sm), nnx.merge(go, so)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), loss

    fn = jax.jit(pure_step, out_shardings=(sh_m, sh_o, NamedSharding(mesh, P())),
                 donate_argnums=(0, 1))
    batch = jax.device_put(batches[0], NamedSharding(mesh, P("data")))
    theirs = fn.lower(jax.device_put(sm, sh_m), jax.device_put(so, sh_o), batch).compile().as_text()
    assert _normalise(ours) == _normalise(theirs)


def test_sharded_init_never_materialises_a_full_array():
    plan = shardplan.load(PLANS / "fsdp.splan")
    mesh = shardplan.make_mesh(plan)
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_small, optax.adam(1e-3), mesh=mesh)
    # Every live shard is exactly its planned shard.
    for tree, res in ((model, placement.params), (optimizer, placement.opt)):
        planned = res.by_path()
        for leaf in shardplan.live_leaves(tree):
            assert leaf.shard_shapes == ((planned[leaf.path].shard_shape, 8),)
    # The init computation itself (per device): its outputs are exactly the planned shards,
    # no value in the optimized program has the full shape of an array the plan shards,
    # and output + temporaries stay below what one device would need for the whole state.
    with nnx.use_eager_sharding(False):
        def build():
            m = models.gpt_small()
            return nnx.state(m), nnx.state(nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param))
        compiled = jax.jit(build, out_shardings=(placement.model_shardings(), placement.opt_shardings())
                           ).lower().compile()
    mem = compiled.memory_analysis()
    planned_bytes = placement.params.bytes_per_device() + placement.opt.bytes_per_device()
    n_outputs = len(placement.params.decisions) + len(placement.opt.decisions)
    # XLA counts the output tuple's pointer table too: 8 bytes per output buffer.
    assert mem.output_size_in_bytes == planned_bytes + 8 * n_outputs
    sharded = [d for d in placement.params.decisions if not d.spec.is_replicated]
    shard_shapes = {d.shard_shape for d in placement.params.decisions}
    full_shapes = {d.shape for d in sharded} - shard_shapes
    hlo_shapes = {tuple(int(x) for x in dims.split(",")) for dims in re.findall(r"= [fsu]32\[([0-9,]+)\]",
                                                                              compiled.as_text())}
    assert full_shapes and not (full_shapes & hlo_shapes)
    whole_state = sum(d.nbytes for d in placement.params.decisions + placement.opt.decisions)
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < whole_state / 2


def test_user_nnx_jit_step_on_placed_state():
    model, optimizer, placement = _setup("gpt_tp.splan", "gpt_tiny")
    batch = placement.shard_batch(_batches("gpt_tiny", model, 1)[0][0])

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(example.lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    l0 = float(step(model, optimizer, batch))
    assert float(step(model, optimizer, batch)) < l0
    assert model.blocks[0].attn.query.kernel[...].sharding.spec == P(None, "model")


def test_explicit_axis_types():
    plan = shardplan.load(PLANS / "dp.splan")
    mesh = shardplan.make_mesh(plan, axis_types="explicit")
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    # Explicit mode types every array by its sharding; the MLP's matmuls need no
    # annotations (nnx.Embed's gather would need an out_sharding in explicit mode).
    model, optimizer, placement = shardplan.init_sharded(plan, models.mlp_small, optax.adam(1e-2), mesh=mesh)
    batches, loss_fn = _batches("mlp_small", model, 3)
    step = shardplan.train_step(placement, loss_fn, model, optimizer)
    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, b)) for b in batches]
    assert losses[-1] < losses[0]
    shardplan.verify(placement, model, optimizer)


def test_shard_model_in_place():
    plan = shardplan.load(PLANS / "gpt_2d.splan")
    model = models.gpt_tiny()
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    before = np.asarray(model.head.kernel[...])
    placement = shardplan.shard_model(plan, model, optimizer)
    assert model.head.kernel[...].sharding.spec == P("data", "model")
    assert optimizer.opt_state[0].mu["head"]["kernel"][...].sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(model.head.kernel[...]), before)
    shardplan.verify(placement, model, optimizer)


def test_verify_names_each_leaf_that_differs():
    model, optimizer, placement = _setup("gpt_tp.splan", "gpt_tiny")
    model.head.kernel.set_value(jax.device_put(model.head.kernel[...], NamedSharding(placement.mesh, P())))
    model.embed.embedding.set_value(jax.device_put(model.embed.embedding[...], NamedSharding(placement.mesh, P())))
    with pytest.raises(shardplan.PlanApplyError) as info:
        shardplan.verify(placement, model, optimizer)
    paths = sorted(d.path for d in info.value.diagnostics)
    assert paths == ["embed/embedding", "head/kernel"]
    assert "the plan says P(None, 'model')" in str(info.value)


def test_show_prints_shards_and_visualization(capsys):
    model, optimizer, placement = _setup("gpt_tp.splan", "gpt_tiny")
    from rich.console import Console

    shardplan.show(model, console=Console(width=200), max_visualize=1)
    out = capsys.readouterr().out
    assert "blocks/*/attn/query/kernel  x2" in out
    assert "(32, 16) x8" in out  # query kernel: (32, 32) split over model=2
    assert "CPU 0,2,4,6" in out  # visualize_array_sharding's device map


# -- bad input ----------------------------------------------------------------------------

def test_mesh_needing_more_devices_than_exist():
    plan = shardplan.loads("mesh data = 4, model = 4\ndefault replicated")
    # A plan that does not fit the devices is a check error, wherever it is found.
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.make_mesh(plan)
    assert "needs 16 devices; 8 are available" in str(info.value)


def test_batch_that_does_not_divide():
    model, optimizer, placement = _setup("dp.splan", "gpt_tiny")
    batch = {"tokens": np.zeros((12, 16), np.int32), "labels": np.zeros((12, 16), np.int32)}
    with pytest.raises(shardplan.PlanCheckError) as info:
        placement.shard_batch(batch)
    d = info.value.diagnostics[0]
    assert d.code == "indivisible" and d.path in ("labels", "tokens") and "data=8" in d.message


def test_state_that_is_not_a_model():
    plan = shardplan.load(PLANS / "dp.splan")
    with pytest.raises(shardplan.PlanApplyError) as info:
        shardplan.shard_model(plan, "my_model")
    assert "not an NNX Module" in str(info.value)
    with pytest.raises(shardplan.PlanApplyError) as info:
        shardplan.shard_model(plan, {"w": object()})
    assert only(info.value.diagnostics, "not-an-array").path == "w"


def test_plan_leaving_a_param_unmatched():
    plan = shardplan.loads('mesh data = *\nparam ".*/kernel" (data)')
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.init_sharded(plan, models.gpt_tiny, optax.adam(1e-3))
    assert {d.code for d in info.value.errors} == {"unmatched-param"}
    assert any(d.path == "embed/embedding" for d in info.value.errors)


def test_loss_that_is_not_a_scalar():
    model, optimizer, placement = _setup("dp.splan", "gpt_tiny")
    step = shardplan.train_step(placement, lambda m, b: m(b["tokens"]).mean(axis=0), model, optimizer)
    with pytest.raises(shardplan.PlanApplyError) as info:
        step(model, optimizer, _batches("gpt_tiny", model, 1)[0][0])
    assert "not a float scalar" in str(info.value)


def test_cli_show_builds_sharded_and_verifies():
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run([sys.executable, "-m", "shardplan", "show", str(PLANS / "gpt_2d.splan"), "--model",
                        f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", "--simulate-devices", "8", "--batch",
                        "tokens=16x16:int32", "--visualize", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "P('data', 'model')" in r.stdout and "(8, 16) x8" in r.stdout  # query kernel shards
    assert "CPU 0,1" in r.stdout  # the batch's device map
    assert "every array lives where the plan says" in r.stdout
