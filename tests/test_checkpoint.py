"""Orbax checkpoints under plans: resume, reshard onto other plans and meshes, crash safety."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from examples import models
import shardplan
from tests.helpers import PLANS, ROOT
from shardplan import checkpoint

TRAIN = ROOT / "examples" / "train.py"


def train(*args, timeout=300):
    r = subprocess.run([sys.executable, str(TRAIN), "--no-show", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def values(tree) -> dict:
    return {leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(tree)}


def restore(directory, plan, factory=models.gpt_tiny, devices=None, with_opt=True):
    mesh = shardplan.make_mesh(plan, devices=devices)
    # the saved optimizer's state where it is restored; a stateless one where only the model is
    tx = optax.adamw(3e-3) if with_opt else optax.sgd(3e-3)
    model, optimizer, placement = shardplan.init_sharded(plan, lambda: factory(7), tx, mesh=mesh)
    ckpt = checkpoint.Checkpointer(directory, placement)
    step = ckpt.restore(model, optimizer if with_opt else None)
    return step, model, optimizer, placement


def test_resume_equals_straight_run(tmp_path):
    """6 steps straight, saving at 3 and 6; step 3's checkpoint restored in a new process, 3 more
    == the straight run's last 3 and its step-6 state (float32 on CPU: equal)."""
    from examples import train as example

    common = ["--plan", PLANS / "gpt_tp.splan", "--steps"]
    straight_run = [*common, 6, "--checkpoint-dir", tmp_path / "a", "--save-every", 3, "--metrics", tmp_path / "a.json"]
    # straight through in this process; the resumed run below in a new one
    assert example.main([*map(str, straight_run), "--no-show", "--simulate-devices", "0"]) == 0
    assert checkpoint.open_readonly(tmp_path / "a").all_steps() == [3, 6]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "6")
    train(*common, 3, "--checkpoint-dir", tmp_path / "b", "--resume", "--metrics", tmp_path / "b2.json")
    straight = json.loads((tmp_path / "a.json").read_text())["losses"]
    second = json.loads((tmp_path / "b2.json").read_text())
    assert second["start"] == 3
    np.testing.assert_array_equal(second["losses"], straight[3:])
    plan = shardplan.load(PLANS / "gpt_tp.splan")
    sa, ma, oa, _ = restore(tmp_path / "a", plan)
    sb, mb, ob, _ = restore(tmp_path / "b", plan)
    assert sa == sb == 6
    for tree_a, tree_b in ((ma, mb), (oa, ob)):
        va, vb = values(tree_a), values(tree_b)
        assert va.keys() == vb.keys()
        for path in va:
            np.testing.assert_array_equal(va[path], vb[path], err_msg=path)


@pytest.fixture(scope="module")
def dp_checkpoint(tmp_path_factory):
    """A checkpoint saved under data=8 (plans/dp.splan), with the values it holds."""
    d = tmp_path_factory.mktemp("dp_ckpt")
    plan = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(3e-3))
    step = shardplan.train_step(placement, lambda m, b: (m(b["x"]) ** 2).mean(), model, optimizer)
    step(model, optimizer, {"x": np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 64})
    ckpt = checkpoint.Checkpointer(d, placement)
    ckpt.save(1, model, optimizer)
    ckpt.wait()
    return d, values(model), values(optimizer)


@pytest.mark.parametrize("plan_name,mesh", [("gpt_tp.splan", {"data": 2, "model": 4}), ("fsdp.splan", None),
                                            ("gpt_2d.splan", None)])
def test_restore_onto_another_plan_and_mesh(dp_checkpoint, plan_name, mesh):
    d, model_values, opt_values = dp_checkpoint
    plan = shardplan.load(PLANS / plan_name, mesh=mesh)
    step, model, optimizer, placement = restore(d, plan)
    assert step == 1
    shardplan.verify(placement, model, optimizer)  # every leaf has the *new* plan's sharding
    if mesh:
        assert placement.mesh_shape == mesh
    for want, tree in ((model_values, model), (opt_values, optimizer)):
        got = values(tree)
        for path, v in want.items():
            np.testing.assert_array_equal(got[path], v, err_msg=path)


def test_saved_under_tp_restores_on_one_device(tmp_path):
    plan = shardplan.load(PLANS / "gpt_tp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(3e-3))
    ckpt = checkpoint.Checkpointer(tmp_path, placement)
    ckpt.save(5, model, optimizer)
    ckpt.wait()
    one = shardplan.with_mesh(plan, {"data": 1, "model": 1})
    step, m1, o1, p1 = restore(tmp_path, one, devices=jax.devices()[:1])
    assert step == 5 and p1.mesh.devices.size == 1
    assert all(leaf.sharding.num_devices == 1 for leaf in shardplan.live_leaves(m1))
    for path, v in values(model).items():
        np.testing.assert_array_equal(values(m1)[path], v, err_msg=path)


def test_model_only_restore_for_inference(dp_checkpoint):
    d, model_values, _ = dp_checkpoint
    plan = shardplan.load(PLANS / "gpt_tp.splan")
    mesh = shardplan.make_mesh(plan)
    model, _, placement = shardplan.init_sharded(plan, lambda: models.gpt_tiny(9), None, mesh=mesh)
    checkpoint.Checkpointer(d, placement).restore(model)
    for path, v in model_values.items():
        np.testing.assert_array_equal(values(model)[path], v, err_msg=path)
    shardplan.verify(placement, model)


CRASHER = r'''
import os, sys, signal, glob
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"  # the suite's compile flags kept
sys.path.insert(0, sys.argv[2])
import optax, models, shardplan
from flax import nnx
from shardplan import checkpoint
plan = shardplan.load(sys.argv[3])
cfg = models.GPTConfig(vocab=4096, d_model=256, n_heads=8, d_ff=1024, n_layers=4, max_len=64)
model, optimizer, placement = shardplan.init_sharded(plan, lambda: models.GPT(cfg, nnx.Rngs(0)), optax.adam(1e-3))
ckpt = checkpoint.Checkpointer(sys.argv[1], placement)
ckpt.save(1, model, optimizer)
ckpt.wait()
ckpt.save(2, model, optimizer)  # async: returns while the files are being written
print("PENDING", glob.glob(os.path.join(sys.argv[1], "2.*")), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_sigkill_during_async_save_leaves_last_complete_step(tmp_path):
    d = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-c", CRASHER, str(d), str(ROOT / "examples"), str(PLANS / "fsdp.splan")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL
    pending = [line for line in r.stdout.splitlines() if line.startswith("PENDING")]
    assert pending and "2.orbax-checkpoint-tmp" in pending[0], r.stdout  # killed mid-save
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in os.listdir(d))

    plan = shardplan.load(PLANS / "fsdp.splan")
    cfg = models.GPTConfig(vocab=4096, d_model=256, n_heads=8, d_ff=1024, n_layers=4, max_len=64)
    model, optimizer, placement = shardplan.init_sharded(plan, lambda: models.GPT(cfg, nnx.Rngs(1)), optax.adam(1e-3))
    ckpt = checkpoint.Checkpointer(d, placement)
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1  # the incomplete step is never reported
    assert ckpt.restore(model, optimizer) == 1
    with pytest.raises(shardplan.PlanApplyError, match="step 2 is not in"):
        ckpt.restore(model, optimizer, step=2)
    info = subprocess.run([sys.executable, "-m", "shardplan", "ckpt", "info", str(d)], capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "complete steps 1\n" in info.stdout
    ckpt.save(2, model, optimizer)  # the next save of that step succeeds
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    assert not any(".orbax-checkpoint-tmp" in name for name in os.listdir(d))


def test_async_save_does_not_block_training(tmp_path):
    plan = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adam(1e-3))
    ckpt = checkpoint.Checkpointer(tmp_path, placement, max_to_keep=2)
    for s in (1, 2, 3):
        ckpt.save(s, model, optimizer)
    ckpt.wait()
    assert ckpt.steps() == [2, 3]  # max_to_keep
    meta = ckpt.info(3).meta
    assert meta["plan_name"] == "dp" and meta["mesh"] == {"data": 8} and "default replicated" in meta["plan_text"]


def test_a_plan_with_extends_is_rebuilt_from_its_checkpoint(tmp_path):
    """Every file of the plan is stored: the plan comes back from the checkpoint alone, after
    the files on disk are gone, with each rule where it was written."""
    src = tmp_path / "plans"
    (src / "base").mkdir(parents=True)
    (src / "base" / "common.splan").write_text('mesh data = *, model = 2\nbatch (data, _)\n'
                                               'param "embed/embedding" (model, _)\ndefault replicated\n')
    (src / "top.splan").write_text('plan "top"\nextends "base/common.splan"\n'
                                   'param "blocks/\\d+/mlp/(up|gate)/kernel" (_, model)\n')
    plan = shardplan.load(src / "top.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adam(1e-3))
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", placement)
    ckpt.save(1, model, optimizer)
    ckpt.wait()
    ckpt.close()
    meta = ckpt.info(1).meta
    assert [f for f, _ in meta["plan_sources"]] == [str(src / "top.splan"), str(src / "base" / "common.splan")]
    import shutil

    shutil.rmtree(src)
    back = shardplan.stored_plan(tmp_path / "ckpt")
    assert back.name == "top" and back.files == plan.files
    assert [(r.pattern, r.spec, r.origin) for r in back.params] == [(r.pattern, r.spec, r.origin) for r in plan.params]
    assert back.default == plan.default and back.batch == plan.batch
    assert back.mesh_shape() == {"data": 4, "model": 2}  # the mesh it was saved on
    again = shardplan.resolve_model(back, model, optimizer)[0]
    assert [(d.path, d.spec) for d in again.decisions] == [(d.path, d.spec) for d in placement.params.decisions]


# -- bad input ----------------------------------------------------------------------------

def test_tree_that_differs_names_the_paths(dp_checkpoint):
    d, _, _ = dp_checkpoint
    plan = shardplan.load(PLANS / "dp.splan")
    deeper = lambda: models.GPT(models.GPTConfig(n_layers=3), nnx.Rngs(0))  # noqa: E731
    with pytest.raises(shardplan.PlanApplyError) as info:
        restore(d, plan, factory=lambda seed: deeper(), with_opt=False)
    paths = {x.path for x in info.value.diagnostics}
    assert "model/blocks/2/attn/query/kernel" in paths and "missing from the checkpoint" in str(info.value)
    wider = lambda seed: models.GPT(models.GPTConfig(d_ff=128), nnx.Rngs(0))  # noqa: E731
    with pytest.raises(shardplan.PlanApplyError) as info:
        restore(d, plan, factory=wider, with_opt=False)
    d0 = next(x for x in info.value.diagnostics if x.path == "model/blocks/0/mlp/up/kernel")
    assert "checkpoint has float32[32, 64], the model has float32[32, 128]" in d0.message
    shallow = lambda seed: models.GPT(models.GPTConfig(n_layers=1), nnx.Rngs(0))  # noqa: E731
    with pytest.raises(shardplan.PlanApplyError) as info:
        restore(d, plan, factory=shallow, with_opt=False)
    assert any("in the checkpoint but not in the model" in x.message for x in info.value.diagnostics)
    half = lambda seed: models.GPT(models.GPTConfig(dtype="bfloat16"), nnx.Rngs(0))  # noqa: E731
    with pytest.raises(shardplan.PlanApplyError, match="checkpoint has float32"):
        restore(d, plan, factory=half, with_opt=False)


def test_step_that_does_not_exist(dp_checkpoint):
    d, _, _ = dp_checkpoint
    plan = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(3e-3))
    with pytest.raises(shardplan.PlanApplyError) as info:
        checkpoint.Checkpointer(d, placement).restore(model, optimizer, step=99)
    assert "step 99 is not in" in str(info.value) and "complete steps: 1" in info.value.diagnostics[0].hint


def test_directory_that_is_not_a_checkpoint(tmp_path):
    plan = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(3e-3))
    with pytest.raises(shardplan.PlanApplyError, match="not a shardplan checkpoint directory: it does not exist"):
        checkpoint.Checkpointer(tmp_path / "missing", placement, create=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(shardplan.PlanApplyError, match="holds no complete step"):
        checkpoint.Checkpointer(tmp_path / "junk", placement).restore(model, optimizer)
    r = subprocess.run([sys.executable, "-m", "shardplan", "ckpt", "info", str(tmp_path / "junk")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "error[not-a-checkpoint]" in r.stderr and "Traceback" not in r.stderr


def test_restore_names_a_corrupt_or_foreign_latest_step_and_the_readable_ones(dp_checkpoint, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(dp_checkpoint[0], d)
    plan = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(3e-3))
    (d / "9").mkdir()  # a stray numbered folder: the "latest" step
    with pytest.raises(shardplan.PlanApplyError) as info:
        checkpoint.Checkpointer(d, placement).restore(model, optimizer)
    diag = info.value.diagnostics[0]
    assert diag.code == "foreign-checkpoint" and diag.path == str(d / "9") and "readable steps: 1" in diag.hint
    assert checkpoint.Checkpointer(d, placement).restore(model, optimizer, step=1) == 1
    shutil.rmtree(d / "9")
    # Damaged array data: every OCDBT data file of the step's model item. Orbax's merge writes the
    # root's b-tree (and, as it decides, copies of values) under 1/model/d/ beside the per-process
    # files, so damaging only ocdbt.process_0/d/ can leave every array readable.
    chunks = [f for f in (d / "1" / "model").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert len(chunks) >= 2
    for chunk in chunks:
        chunk.write_bytes(chunk.read_bytes()[:16])
    with pytest.raises(shardplan.PlanApplyError) as info:
        checkpoint.Checkpointer(d, placement).restore(model, optimizer)
    assert info.value.diagnostics[0].code == "corrupt-checkpoint" and "reading its arrays failed" in str(info.value)


def test_a_restore_that_fails_for_another_reason_is_not_called_corrupt(tmp_path):
    from shardplan.runtime.checkpoint import _restore_error

    def chained(outer, inner):
        try:
            try:
                raise inner
            except Exception as e:
                raise outer from e
        except Exception as e:
            return e

    oom = _restore_error(3, tmp_path, chained(RuntimeError("restore failed"), RuntimeError("RESOURCE_EXHAUSTED: oom")))
    assert oom.diagnostics[0].code == "restore-failed" and "delete" not in oom.diagnostics[0].hint
    bad = _restore_error(3, tmp_path, chained(RuntimeError("restore failed"), ValueError("DATA_LOSS: bad chunk")))
    assert bad.diagnostics[0].code == "corrupt-checkpoint"
