"""The shardplan CLI: check output, exit codes, JSON, and diagnostics without tracebacks."""

import json
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES, PLAN_MODELS, PLANS, ROOT

MODEL = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shardplan", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def test_every_shipped_plan_names_its_model():
    assert sorted(p.name for p in PLANS.glob("*.splan")) == sorted(PLAN_MODELS)


@pytest.mark.parametrize("plan", sorted(PLAN_MODELS))
def test_every_plan_checks_against_its_model(plan):
    factory = PLAN_MODELS[plan]
    r = run("check", PLANS / plan, "--model", f"{ROOT / 'examples' / 'models.py'}:{factory}", "--devices", 8,
            "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "per device: params" in r.stdout


def test_check_text_table_groups_layers():
    r = run("check", FIXTURES / "gpt_tp.splan", "--model", MODEL, "--devices", 8)
    assert r.returncode == 0
    assert "blocks/*/attn/out/kernel  x2" in r.stdout
    assert "gpt_tp.splan:7" in r.stdout and "(32, 16)" in r.stdout


def test_check_json():
    r = run("check", PLANS / "gpt_2d.splan", "--model", MODEL, "--devices", 8, "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["mesh"] == {"data": 4, "model": 2}
    leaf = next(x for x in doc["leaves"] if x["path"] == "blocks/0/attn/query/kernel")
    assert leaf["partition_spec"] == [["data"], ["model"]] and leaf["shard_shape"] == [8, 16]
    assert doc["summary"]["param_bytes_per_device"] == sum(
        x["bytes_per_device"] for x in doc["leaves"] if x["role"] == "param")


def test_broken_plan_prints_located_diagnostics_and_exits_1(tmp_path):
    bad = tmp_path / "bad.splan"
    bad.write_text('mesh data = *, model = 2\nparam "blocks/\\d+/mlp/up/kernel" (_, modle)\n')
    r = run("check", bad, "--model", MODEL, "--devices", 8)
    assert r.returncode == 1
    assert f"{bad}:2:38: error[unknown-axis]: unknown mesh axis 'modle'" in r.stderr
    assert "did you mean 'model'?" in r.stderr and "Traceback" not in r.stderr


def test_model_errors_exit_1(tmp_path):
    bad = tmp_path / "bad.splan"
    bad.write_text('mesh data = *, model = 3\nparam ".*/kernel" (_, model)\n')
    r = run("check", bad, "--model", MODEL, "--devices", 9)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "error[indivisible]" in r.stderr and "error[unmatched-param]" in r.stderr


def test_strict_turns_warnings_into_failure(tmp_path):
    p = tmp_path / "w.splan"
    p.write_text('mesh data = *\nparam "nothing/matches" (data)\ndefault replicated\n')
    assert run("check", p, "--model", MODEL, "--devices", 8).returncode == 0
    r = run("check", p, "--model", MODEL, "--devices", 8, "--strict")
    assert r.returncode == 1 and "warning[unused-rule]" in r.stderr


def test_usage_errors_exit_2():
    assert run("check").returncode == 2
    assert run("check", PLANS / "dp.splan", "--device-memory", "lots").returncode == 2


def test_device_memory_budget():
    r = run("check", PLANS / "dp.splan", "--model", MODEL, "--devices", 8, "--device-memory", "1KB")
    assert r.returncode == 1 and "does not fit" in r.stdout


def test_shapes_json_roundtrip(tmp_path):
    code = ("import sys; sys.path.insert(0, %r); import models, shardplan; from shardplan.runtime.model import "
            "abstract_model; shardplan.dump_shapes(abstract_model(models.gpt_tiny), %r)"
            % (str(ROOT / "examples"), str(tmp_path / "s.json")))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    a = json.loads(run("check", PLANS / "gpt_tp.splan", "--shapes", tmp_path / "s.json", "--mesh",
                       "data=4,model=2", "--format", "json").stdout)
    b = json.loads(run("check", PLANS / "gpt_tp.splan", "--model", MODEL, "--mesh", "data=4,model=2",
                       "--format", "json").stdout)
    assert a["leaves"] == b["leaves"]


def test_bad_shapes_file(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('{"format": "other"}')
    r = run("check", PLANS / "dp.splan", "--shapes", p, "--devices", 8)
    assert r.returncode == 1 and "error[bad-shapes]" in r.stderr


def test_bad_model_argument():
    r = run("check", PLANS / "dp.splan", "--model", f"{ROOT / 'examples' / 'models.py'}:nope", "--devices", 8)
    assert r.returncode == 2 and "defines no 'nope'" in r.stderr  # a malformed flag: a usage error
    assert "gpt_tiny" in r.stderr  # the factories it does define


def test_plan_only_check():
    r = run("check", PLANS / "gpt_tp.splan", "--devices", 8)
    assert r.returncode == 0 and "ok" in r.stdout
    r = run("check", PLANS / "gpt_tp.splan", "--mesh", "data=4,model=4", "--devices", 8)
    assert r.returncode == 2 and "--mesh: error[mesh-devices]" in r.stderr  # two flags that contradict
    assert "needs 16 devices; 8 are available" in r.stderr
