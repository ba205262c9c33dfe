"""Hostile input: every case ends in a located ShardPlanError (or a clean exit), within a bound,
with no traceback and no process left behind."""

import json
import os
import signal
import subprocess
import sys
import time

import optax
import pytest
from flax import nnx

import shardplan
from shardplan.core import cost, optimizers
from shardplan.runtime import tree
from tests.helpers import PLANS


def cli(*args, timeout=60):
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shardplan", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t < 20
    return r


def test_thousands_of_distinct_rules_compile_and_match():
    rules = "\n".join(f'param "blocks/\\d+/expert_{i}/(up|gate)/kernel" replicated' for i in range(6000))
    plan = shardplan.loads("mesh data = *\n" + rules + "\ndefault replicated")
    leaves = [shardplan.Leaf(f"blocks/3/expert_{i}/up/kernel", (8, 8), "float32", 4) for i in (0, 4321, 5999)]
    res = shardplan.resolve_leaves(plan, {"data": 8}, leaves)
    assert [d.origin for d in res.decisions] == ["<string>:2", "<string>:4323", "<string>:6001"]


def test_an_extends_chain_too_deep_is_not_called_a_cycle(tmp_path):
    for i in range(40):
        (tmp_path / f"p{i}.splan").write_text(f'extends "p{i + 1}.splan"\n')
    (tmp_path / "p40.splan").write_text("mesh data = *\ndefault replicated\n")
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.load(tmp_path / "p0.splan")
    assert {d.code for d in info.value.diagnostics} == {"extends-too-deep"}


@pytest.mark.parametrize("target", ["dev.splan", "fifo.splan"])
def test_extends_of_a_device_or_a_fifo_is_refused_without_reading(tmp_path, target):
    if target == "fifo.splan":
        os.mkfifo(tmp_path / "fifo.splan")
    else:
        os.symlink("/dev/zero", tmp_path / "dev.splan")
    (tmp_path / "p.splan").write_text(f'extends "{target}"\nmesh data = *\n')
    with pytest.raises(shardplan.PlanCheckError, match="not a regular file") as info:
        shardplan.load(tmp_path / "p.splan")
    d = info.value.diagnostics[0]
    assert d.code == "cannot-read" and (d.span.line, d.span.column) == (1, 1)


def test_a_utf8_bom_is_not_a_syntax_error(tmp_path):
    (tmp_path / "p.splan").write_bytes("\ufeffmesh data = *\ndefault replicated\n".encode())
    assert shardplan.load(tmp_path / "p.splan").mesh[0].name == "data"


def test_a_huge_one_line_regex_prints_a_bounded_excerpt():
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.loads('mesh data = *\nparam "' + "a" * 2_000_000 + '(" replicated\n')  # the CLI case: 10 MB
    text = str(info.value)
    assert len(text) < 2000 and "..." in text and text.count("^") < 100


def test_tabs_and_control_characters_keep_the_caret_under_the_mistake():
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.loads('mesh data = *\n\tparam "\x01x" (modle)\n')
    line, caret = info.value.diagnostics[0].render().split("\n")[1:3]
    assert "\\x01" in line and "\t" not in line
    assert line[caret.index("^"):caret.index("^") + 5] == "modle"


@pytest.mark.parametrize("value", ["1e400", "nan", "-5GB", "inf"])
def test_sizes_that_are_not_finite_are_usage_errors(value):
    r = cli("check", PLANS / "dp.splan", "--device-memory", value)
    assert r.returncode == 2 and "--device-memory" in r.stderr


@pytest.mark.parametrize("args", [["--devices", "-8"], ["--devices", "0"], ["--mesh", "data=0"],
                                  ["--mesh", "data=*,model=*"]])
def test_impossible_meshes_are_errors_not_exit_0(args):
    r = cli("check", PLANS / "dp.splan", *args)
    assert r.returncode in (1, 2) and r.stderr


def test_json_output_carries_the_errors():
    r = cli("check", PLANS / "dp.splan", "--mesh", "data=0", "--format", "json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and doc["ok"] is False and doc["diagnostics"][0]["code"] == "axis-size"  # a bad flag


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_rank(sig):
    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", "launch", "-n", "2", "--devices-per-process", "1",
                             "--", sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "ranks did not start"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + sig and f"interrupted by {signal.Signals(sig).name}" in proc.stderr.read()
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_rich_markup_in_plan_names_and_paths_is_shown_as_written(tmp_path):
    p = tmp_path / "p.splan"
    p.write_text('plan "[bold red]mine[/]"\nmesh data = *\nparam "[x]" replicated\ndefault replicated\n')
    r = cli("check", p, "--shapes", _shapes(tmp_path, "[weird]/kernel"), "--devices", 8, "--optimizer", "sgd")
    assert r.returncode == 0, r.stderr
    assert "[bold red]mine[/]" in r.stdout and "[weird]/kernel" in r.stdout


def _shapes(tmp_path, path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"format": "shardplan-shapes/1",
                             "params": [{"path": path, "shape": [8, 8], "dtype": "float32"}]}))
    return f


class _WithState(nnx.Module):
    """Params beside BatchNorm statistics and RNG streams: only params are trained."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.rngs = rngs


def test_state_that_is_not_a_param_gets_no_optimizer_state_and_is_counted_apart():
    plan = shardplan.loads('mesh data = *\nparam ".*/kernel" (_, data)\ndefault replicated\n')
    model = nnx.eval_shape(lambda: _WithState(nnx.Rngs(0, dropout=1)))
    real_opt = nnx.eval_shape(lambda: nnx.Optimizer(_WithState(nnx.Rngs(0, dropout=1)), optax.adam(1e-3),
                                                    wrt=nnx.Param))
    params, _ = tree.flatten(model)
    derived = optimizers.optimizer_leaves(params, "adam")
    real = tree.flatten(real_opt)[0]
    assert sorted(x.path for x in derived) == sorted(x.path for x in real)  # ground truth: nnx.Optimizer
    res = shardplan.resolve_leaves(plan, {"data": 8}, params, derived)
    by = res.by_path()
    assert by["bn/mean"].role == "state" and by["bn/mean"].origin == "batch_stat, not a param"
    assert by["rngs/dropout/key"].role == "state" and by["rngs/dropout/count"].spec == shardplan.Spec(())
    s = cost.summary(res)
    assert s["n_params"] == 4 and s["n_state"] == 8
    assert s["total_bytes_per_device"] == res.bytes_per_device()


def test_repeated_warnings_are_grouped_and_axis_rules_that_cannot_apply_warn_at_their_line():
    plan = shardplan.loads("mesh data = *\naxis embed -> data\naxis heads -> data\ndefault replicated\n", "p.splan")
    leaves = [shardplan.Leaf(f"blocks/{i}/w", (8, 8), "float32", 4, ("embed", "mlp")) for i in range(37)]
    warnings = shardplan.resolve_leaves(plan, {"data": 8}, leaves).warnings
    by = {w.code: w for w in warnings}
    assert sorted(by) == ["unmapped-logical-axis", "unused-axis-rule"] and len(warnings) == 2
    grouped, unused = by["unmapped-logical-axis"], by["unused-axis-rule"]
    assert "37 arrays" in grouped.message and grouped.path == "blocks/0/w (+36 more)"
    assert str(unused.span) == "p.splan:3:1" and "'heads'" in unused.message
    bare = [shardplan.Leaf("w", (8, 8, 8), "float32", 4, ("embed",))]
    codes = [w.code for w in shardplan.resolve_leaves(plan, {"data": 8}, bare).warnings]
    assert sorted(codes) == ["annotation-rank", "unused-axis-rule"]
