"""Compile targets (shardplan.core.targets): names as TPU and GPU users write them, the GPU
descriptions the compiler gets, and every mistake located before anything is compiled. The
compiles themselves (XLA:TPU, XLA:GPU offline) are in tests/test_target_compile.py."""

import subprocess
import sys

import pytest

import shardplan
from shardplan.core import chips, targets
from tests.helpers import PLANS, ROOT

MODEL = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"
STEP = f"{ROOT / 'examples' / 'train.py'}:lm_loss"
BATCH = "tokens=int32[16,16],labels=int32[16,16]"


@pytest.mark.parametrize("text, platform, chip, devices, topology", [
    ("cpu", "cpu", None, None, ""),
    ("tpu-v5p:2x2x2", "tpu", "tpu-v5p", 8, "v5p:2x2x2"),
    ("TPU-v5e:2x4", "tpu", "tpu-v5e", 8, "v5e:2x4"),
    ("tpu-v6e:16x16", "tpu", "tpu-v6e", 256, "v6e:16x16"),
    ("h100:8", "cuda", "h100", 8, "1x1x8"),
    ("h100:64", "cuda", "h100", 64, "1x8x8"),
    ("h200:2x4", "cuda", "h200", 8, "1x2x4"),
    ("a100-80gb:4", "cuda", "a100-80gb", 4, "1x1x4"),
    ("b200:16", "cuda", "b200", 16, "1x2x8"),
])
def test_targets_parse_as_tpu_and_gpu_users_name_them(text, platform, chip, devices, topology):
    t = targets.parse(text)
    assert (t.platform, t.chip, t.devices, t.topology) == (platform, chip, devices, topology)
    assert t.chip is None or t.chip in chips.CHIPS  # every target's chip has datasheet figures


@pytest.mark.parametrize("text, says", [
    ("h10:8", "did you mean 'h100'?"),
    ("tpu-v5:2x2x2", "did you mean"),
    ("h100", "needs its size"),
    ("tpu-v5p:2x0x2", "needs its size"),
    ("h100:12", "do not fill hosts of 8"),
    ("tpu-v5p:8", "must have 2 (v5e, v6e) or 3 (v5p) dims"),
    ("h100:1x2x8", "a count or hosts x GPUs per host"),
])
def test_a_bad_target_is_a_located_error_with_a_fix(text, says):
    with pytest.raises(shardplan.ShardPlanError) as info:
        targets.parse(text)
    d = info.value.diagnostics[0]
    assert d.code == "bad-target" and d.path == "--target" and says in d.message + " " + d.hint, (d.message, d.hint)


@pytest.mark.parametrize("chip", sorted(targets.GPUS))
def test_the_gpu_description_is_the_datasheets(chip):
    """What XLA:GPU is told agrees with the chip registry the time estimate uses (one set of facts)."""
    text = targets.gpu_target_config(chip)
    spec, figures = targets.GPUS[chip], chips.lookup(chip)
    assert f"device_memory_size: {int(figures.hbm_bytes)}" in text
    assert f"memory_bandwidth: {int(figures.hbm_bandwidth)}" in text
    assert f"core_count: {spec.sms}" in text and f"major: {spec.compute_capability[0]}" in text
    assert text.count("{") == text.count("}") and 'platform_name: "CUDA"' in text


def test_chip_and_target_must_agree():
    targets.agree(targets.parse("h100:8"), "h100")
    targets.agree(targets.parse("cpu"), "tpu-v5p")  # XLA:CPU names no chip: any estimate
    with pytest.raises(shardplan.ShardPlanError, match="name different chips"):
        targets.agree(targets.parse("tpu-v5p:2x2x2"), "h100")


@pytest.mark.parametrize("chip, chips_, shape", [
    # every name below compiled for, or was refused by, jax's topology API with libtpu 0.0.42.1
    # (2026-12-07): v5e:1x2, v5e:2x3, v5p:1x2x2 and v5p:1x1x2 refused
    ("tpu-v5e", 4, "2x2"), ("tpu-v5e", 8, "2x4"), ("tpu-v5e", 12, "2x6"), ("tpu-v6e", 16, "4x4"),
    ("tpu-v6e", 256, "16x16"), ("tpu-v5p", 4, "2x2x1"), ("tpu-v5p", 8, "2x2x2"), ("tpu-v5p", 12, "2x2x3"),
    ("tpu-v5p", 16, "2x2x4"), ("tpu-v5p", 32, "2x4x4"), ("tpu-v5p", 2048, "8x16x16"),
    ("tpu-v5e", 2, None), ("tpu-v5p", 7, None), ("tpu-v5e", 512, None),
])
def test_a_tpu_slice_of_n_chips_is_named_as_its_topology_api_takes_it(chip, chips_, shape):
    assert targets.tpu_slice(chip, chips_) == shape


def test_suggest_confirms_with_the_chips_own_compiler_where_it_is_installed(monkeypatch):
    """``suggest --chip C`` without ``--target``: a GPU's compiler for that many of C, or XLA:CPU with
    a reason the user can act on (the ``pip install`` line; GPUs that do not fill hosts; a TPU's
    program named only by ``--target``)."""
    monkeypatch.setattr(targets, "installed", lambda target: True)
    assert targets.for_chip("h100", 8) == (targets.parse("h100:8"), "")
    assert targets.for_chip("h100", 64, 8)[0] == targets.parse("h100:8x8")
    assert targets.for_chip("b200", 16, 4)[0] == targets.parse("b200:4x4")
    assert targets.for_chip("tpu-v5p", 64)[0] == targets.parse("tpu-v5p:4x4x4")
    assert targets.for_chip("h100", 12) == (None, "12 h100 GPUs do not fill hosts of 8")
    assert targets.for_chip("tpu-v5e", 6) == (None, "no tpu-v5e slice has 6 chips")
    monkeypatch.setattr(targets, "installed", lambda target: target.platform != "cuda")
    aim, why = targets.for_chip("h100", 8)
    assert aim is None and why == f"XLA:GPU is not installed here: {targets.INSTALL['cuda']}"
    # suggest's default leaves a TPU's program out (its windowed einsums' rings timed serially)
    aim, why = targets.for_chip("tpu-v5p", 8, tpus=False)
    assert aim is None and "--target tpu-v5p:2x2x2" in why


def cli(*args):
    return subprocess.run([sys.executable, "-m", "shardplan", "check", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("extra, says", [
    (["--compile", "--target", "h10:8"], "did you mean 'h100'?"),
    (["--target", "h10:8"], "did you mean 'h100'?"),  # fast mode told a target names it right too
    (["--compile", "--target", "tpu-v5p:2x2x2", "--chip", "h100"], "name different chips"),
])
def test_target_mistakes_on_the_command_line_exit_2_before_compiling(extra, says):
    r = cli(PLANS / "dp.splan", "--model", MODEL, "--devices", 8, "--step", STEP, "--batch", BATCH, *extra)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_mesh_that_is_not_the_targets_size_is_refused(mode):
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.api.analyze(PLANS / "dp.splan", model=MODEL, step=STEP, batch=[BATCH], mode=mode, devices=4,
                              target="h100:8")
    assert info.value.diagnostics[0].code == "bad-target" and "has 4 devices" in str(info.value)


def test_a_compiler_fast_mode_has_no_rules_for_is_a_located_error():
    coster = shardplan.api.step_coster(MODEL, STEP, [BATCH])
    with pytest.raises(shardplan.ShardPlanError) as info:
        coster.cost(PLANS / "dp.splan", devices=8, compiler="rocm")
    (d,) = info.value.diagnostics
    assert d.code == "bad-argument" and d.path == "compiler" and "cpu, tpu, cuda" in d.hint
