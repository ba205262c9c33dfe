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
