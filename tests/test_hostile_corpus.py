"""The hostile-input corpus: each case runs the installed `shardplan` command on something a
careless or hostile user (or file) could supply and asserts the contract: the documented exit
code, a location in the message, the diagnostic's code, no traceback, at most 20 s and a
bounded peak memory. Cases are data: a setup that writes files and returns the arguments."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optax
import pytest

import shardplan
from examples import models
from shardplan import checkpoint
from tests.helpers import PLANS, ROOT

_SCRIPT = Path(sys.executable).parent / "shardplan"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "shardplan"]
MAX_SECONDS = 20
MAX_RSS_KIB = 3 * 2**20  # 3 GiB: a jax import is ~0.5 GiB; /dev/zero read whole would be unbounded
MODEL = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"
SHAPES_FORMAT = "shardplan-shapes/1"


@dataclass(frozen=True)
class Ran:
    rc: int
    out: str
    err: str
    seconds: float
    max_rss_kib: int


def run_cli(args: list[str], cwd: Path, timeout: float = 60) -> Ran:
    """Run the CLI and measure its own peak memory (wait4's rusage is the child's alone)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(CLI + [str(a) for a in args], stdout=out, stderr=err, cwd=cwd,
                                env={**os.environ, "COLUMNS": "200"})
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return Ran(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                   seconds, usage.ru_maxrss)


def shapes(tmp: Path, params, name="s.json", **extra) -> Path:
    f = tmp / name
    f.write_text(json.dumps({"format": SHAPES_FORMAT, "params": params, **extra}))
    return f


def leaf(path="w", shape=(8, 8), dtype="float32", **kw) -> dict:
    return {"path": path, "shape": list(shape) if isinstance(shape, tuple) else shape, "dtype": dtype, **kw}


def plan(tmp: Path, text: str, name="p.splan") -> Path:
    f = tmp / name
    f.write_text(text)
    return f


DP = str(PLANS / "dp.splan")
OK_SHAPES = [leaf("blocks/0/w", (16, 16)), leaf("embed", (64, 16))]


def check_shapes(tmp, params, *flags, plan_path=DP):
    return ["check", plan_path, "--shapes", shapes(tmp, params), "--devices", "8", *flags]


# -- the corpus: name -> (setup(tmp) -> args, exit code, texts stderr must hold) ------------------
def _many_rules(tmp):
    rules = "\n".join(f'param "blocks/\\d+/expert_{i}/w" replicated' for i in range(6000))
    return check_shapes(tmp, OK_SHAPES, plan_path=plan(tmp, "mesh data = *\n" + rules + "\ndefault replicated\n"))


def _deep_extends(tmp):
    for i in range(40):
        plan(tmp, f'extends "p{i + 1}.splan"\n', f"p{i}.splan")
    plan(tmp, "mesh data = *\ndefault replicated\n", "p40.splan")
    return ["check", tmp / "p0.splan"]


def _fifo(tmp):
    os.mkfifo(tmp / "base.splan")
    return ["check", plan(tmp, 'extends "base.splan"\nmesh data = *\n')]


def _dev_zero_link(tmp):
    os.symlink("/dev/zero", tmp / "zero.splan")
    return ["check", plan(tmp, 'extends "zero.splan"\nmesh data = *\n')]


def _secret(tmp):
    (tmp / ".env").write_text("AWS_SECRET_ACCESS_KEY=hunter2hunter2\n")
    return ["check", plan(tmp, 'extends ".env"\nmesh data = *\n')]


def _secret_named_splan(tmp):
    (tmp / "leak.splan").write_text("AWS_SECRET_ACCESS_KEY=" + "x" * 400 + "\n")
    return ["check", plan(tmp, 'extends "leak.splan"\nmesh data = *\n')]


def _huge_regex(tmp):
    return ["check", plan(tmp, 'mesh data = *\nparam "' + "a" * 10_000_000 + '(" replicated\n')]


def _huge_file(tmp):
    f = tmp / "huge.splan"
    with open(f, "wb") as fh:
        fh.truncate(20 * 2**20)  # sparse: 20 MiB of NULs, more than a plan may be
    return ["check", f]


def _markup(tmp):
    p = plan(tmp, 'plan "[bold red]mine[/]"\nmesh data = *\nparam "[x]" replicated\ndefault replicated\n')
    return ["check", p, "--shapes", shapes(tmp, [leaf("[weird]/kernel")]), "--devices", "8", "--optimizer", "sgd"]


def _axis_rules_unannotated(tmp):
    p = plan(tmp, "mesh data = *\naxis embed -> data\ndefault replicated\n")
    return check_shapes(tmp, OK_SHAPES, "--strict", plan_path=p)


def _short_annotation(tmp):
    p = plan(tmp, "mesh data = *\naxis embed -> data\ndefault replicated\n")
    return check_shapes(tmp, [leaf("w", (8, 8, 8), names=["embed"])], "--strict", plan_path=p)


def _unmapped_names_grouped(tmp):
    p = plan(tmp, "mesh data = *\naxis embed -> data\ndefault replicated\n")
    params = [leaf(f"blocks/{i}/w", (8, 8), names=["embed", "mlp"]) for i in range(37)]
    return check_shapes(tmp, params, plan_path=p)


def _size_one_axis(tmp):
    p = plan(tmp, "mesh data = *, model = 1\nparam \"w\" (model, _)\ndefault replicated\n")
    return check_shapes(tmp, [leaf("w", (65536, 65536))], "--optimizer", "sgd", plan_path=p)


def _ckpt(name):
    def setup(tmp):
        return ["ckpt", "info", tmp / name]
    return setup


CASES: dict[str, tuple] = {
    # plans (the cases the issue names first)
    "6000 distinct rules": (_many_rules, 0, []),
    "extends chain 40 deep": (_deep_extends, 1, ["p32.splan:1:1", "extends-too-deep"]),
    "extends a FIFO": (_fifo, 1, ["p.splan:1:1", "not a regular file"]),
    "extends /dev/zero (via a .splan link)": (_dev_zero_link, 1, ["p.splan:1:1", "not a regular file"]),
    "extends /dev/zero": (lambda t: ["check", plan(t, 'extends "/dev/zero"\nmesh data = *\n')], 1,
                          ["p.splan:1:1", "bad-extends"]),
    "extends a .env secret": (_secret, 1, ["p.splan:1:1", "bad-extends"]),
    "extends a non-plan .splan": (_secret_named_splan, 1, ["leak.splan:1:", "syntax"]),
    "UTF-8 BOM": (lambda t: ["check", plan(t, "\ufeffmesh data = 8\ndefault replicated\n")], 0, []),
    "invalid UTF-8": (lambda t: ["check", (t / "u.splan", (t / "u.splan").write_bytes(b"mesh data = *\n\xff\n"))[0]],
                      1, ["u.splan:2:1", "not UTF-8"]),
    "10 MB one-line regex": (_huge_regex, 1, ["p.splan:2:", "unsupported-regex", "at most 10,000"]),
    "tabs and control characters": (lambda t: ["check", plan(t, 'mesh data = *\n\tparam "\x01x" (modle)\n')], 1,
                                    ["p.splan:2:", "unknown-axis", "\\x01"]),
    "NUL bytes": (lambda t: ["check", plan(t, "mesh data = *\n\x00\x00param\n")], 1, ["p.splan:2:1", "syntax"]),
    "catastrophic regex is linear in RE2": (lambda t: check_shapes(
        t, [leaf("a" * 5000 + "!", (8,))], plan_path=plan(t, 'mesh data = *\nparam "(a+)+$" replicated\n'
                                                          'default replicated\n')), 0, []),
    "regex groups nested 500 deep": (lambda t: ["check", plan(t, 'mesh data = *\nparam "' + "(" * 500 + "w"
                                                    + ")" * 500 + '" replicated\n')], 1,
                                     ["p.splan:2:8", "unsupported-regex", "500 levels"]),
    "mesh size ² in the plan": (lambda t: ["check", plan(t, "mesh data = ²\n")], 1, ["p.splan:1:13", "syntax"]),
    "a misspelt keyword": (lambda t: ["check", plan(t, 'mesh data = *\nparams "w" (data)\n')], 1,
                           ["p.splan:2:1", "did you mean 'param'"]),
    "a missing ')' at the end of a line": (lambda t: ["check", plan(t, 'mesh data = *\nparam "w" (data, _\n'
                                                                      'param "v" (data)\n')], 1,
                                           ["p.splan:2:19", "line 2 ends before its statement is complete"]),
    "spec nested 20000 deep": (lambda t: ["check", plan(t, 'mesh data = *\nparam "x" ' + "(" * 20000 + "\n")], 1,
                               ["p.splan:2:", "syntax"]),
    "plan is a directory": (lambda t: ["check", t], 1, ["not a regular file"]),
    "plan does not exist": (lambda t: ["check", t / "nope.splan"], 1, ["nope.splan", "cannot-read"]),
    "plan of 20 MiB": (_huge_file, 1, ["huge.splan", "a plan is at most"]),
    "mesh size 0 in the plan": (lambda t: ["check", plan(t, "mesh data = 0\n")], 1, ["p.splan:1:6", "axis-size"]),
    "two * sizes in the plan": (lambda t: ["check", plan(t, "mesh data = *, model = *\n")], 1,
                                ["p.splan:1:", "two-inferred-sizes"]),
    "mesh size 10**11": (lambda t: ["check", plan(t, "mesh data = 100000000000\n")], 1, ["p.splan:1:6", "axis-size"]),
    "rich markup in names and paths": (_markup, 0, []),
    "axis rules on an unannotated model": (_axis_rules_unannotated, 1, ["p.splan:2:1", "unused-axis-rule"]),
    "annotation shorter than the rank": (_short_annotation, 1, ["w", "annotation-rank"]),
    "37 params, one unmapped name: one warning": (_unmapped_names_grouped, 0, ["(+36 more)", "37 arrays"]),
    "16 GiB over an axis of size 1": (_size_one_axis, 0, ["large-replicated", "16.00 GiB"]),
    # flags
    "--devices -8": (lambda t: ["check", DP, "--devices", "-8"], 2, ["--devices"]),
    "--devices 0": (lambda t: ["check", DP, "--devices", "0"], 2, ["--devices"]),
    "--devices 10**20": (lambda t: ["check", DP, "--devices", str(10**20)], 2, ["--devices", "mesh-devices"]),
    "--devices nan": (lambda t: ["check", DP, "--devices", "nan"], 2, ["--devices"]),
    "--mesh data=0": (lambda t: ["check", DP, "--mesh", "data=0"], 2, ["--mesh data", "axis-size"]),
    "--mesh data=*,model=*": (lambda t: ["check", DP, "--mesh", "data=*,model=*"], 2, ["--mesh", "two-inferred"]),
    "--mesh data": (lambda t: ["check", DP, "--mesh", "data"], 2, ["--mesh", "bad-mesh-arg"]),
    "--mesh data=1e3": (lambda t: ["check", DP, "--mesh", "data=1e3"], 2, ["--mesh", "bad-mesh-arg"]),
    "--mesh data=10**23": (lambda t: ["check", DP, "--mesh", "data=" + "9" * 23], 2, ["--mesh", "axis-size"]),
    "--mesh data=abc": (lambda t: ["check", DP, "--mesh", "data=abc"], 2, ["--mesh", "bad-mesh-arg"]),
    "--mesh data=² (a superscript digit)": (lambda t: ["check", DP, "--mesh", "data=²"], 2, ["--mesh", "bad-mesh-arg"]),
    "--mesh data=٣ (an Arabic-Indic digit)": (lambda t: ["check", DP, "--mesh", "data=٣"], 2, ["--mesh"]),
    "--mesh that does not fit --devices": (lambda t: ["check", DP, "--mesh", "data=4,model=2", "--devices", "16"],
                                           2, ["--mesh:", "mesh-devices", "uses 8 devices; 16"]),
    "--devices ８ (a full-width digit)": (lambda t: ["check", DP, "--devices", "８"], 2, ["--devices"]),
    "--device-memory 80 (no unit)": (lambda t: ["check", DP, "--device-memory", "80"], 2,
                                     ["--device-memory", "no unit", "80GB"]),
    "--max-replicated-fraction nan": (lambda t: ["check", DP, "--max-replicated-fraction", "nan"], 2,
                                      ["--max-replicated-fraction"]),
    "--device-memory nan": (lambda t: ["check", DP, "--device-memory", "nan"], 2, ["--device-memory"]),
    "--device-memory inf": (lambda t: ["check", DP, "--device-memory", "inf"], 2, ["--device-memory"]),
    "--device-memory -5GB": (lambda t: ["check", DP, "--device-memory", "-5GB"], 2, ["--device-memory"]),
    "--device-memory 0": (lambda t: ["check", DP, "--device-memory", "0"], 2, ["--device-memory"]),
    "--device-memory 1e400": (lambda t: ["check", DP, "--device-memory", "1e400"], 2, ["--device-memory"]),
    "--replicated-threshold nan": (lambda t: ["check", DP, "--replicated-threshold", "nan"], 2,
                                   ["--replicated-threshold"]),
    "--replicated-threshold 0 warns about everything": (lambda t: check_shapes(
        t, OK_SHAPES, "--replicated-threshold", "0B", "--strict"), 1, ["large-replicated"]),
    "--batch without --step": (lambda t: ["check", DP, "--batch", "tokens=int32[8,8]"], 2, ["--step"]),
    "--step with --shapes": (lambda t: check_shapes(t, OK_SHAPES, "--step", "x.py:f", "--batch", "x=f32[1]"), 2,
                             ["--step"]),
    "--chip unknown": (lambda t: ["check", DP, "--chip", "tpu-v9"], 2, ["--chip"]),
    "--model no such file": (lambda t: ["check", DP, "--model", t / "nope.py:f", "--devices", "8"], 2,
                             ["--model", "bad-model-arg"]),
    "--model factory misspelt": (lambda t: ["check", DP, "--model", f"{ROOT / 'examples' / 'models.py'}:gpt_tinny"], 2,
                                 ["--model", "bad-model-arg", "did you mean 'gpt_tiny'?"]),
    "--model file misspelt": (lambda t: ["check", DP, "--model", f"{ROOT / 'examples' / 'modls.py'}:gpt_tiny"], 2,
                              ["--model", "no such file", "did you mean 'models.py'?"]),
    "--step function misspelt": (lambda t: ["check", DP, "--model", MODEL, "--step",
                                            f"{ROOT / 'examples' / 'train.py'}:lm_los", "--batch", "x=int32[8]"], 2,
                                 ["--step", "did you mean 'lm_loss'?"]),
    "--batch dtype misspelt": (lambda t: ["check", DP, "--model", MODEL, "--step",
                                          f"{ROOT / 'examples' / 'train.py'}:lm_loss", "--batch", "x=int23[8]"], 2,
                               ["--batch", "unknown dtype 'int23'", "did you mean 'int32'?"]),
    "--model module missing": (lambda t: ["check", DP, "--model", "no_such_pkg.models:f"], 2,
                               ["--model", "no module 'no_such_pkg.models'"]),
    "--model not FILE:FACTORY": (lambda t: ["check", DP, "--model", "nofactory", "--devices", "8"], 2,
                                 ["--model", "bad-model-arg"]),
    "--model FILE.py without :FACTORY": (lambda t: ["check", DP, "--model", ROOT / "examples" / "models.py"], 2,
                                         ["--model", "bad-model-arg", "FILE.py:FACTORY"]),
    "--model factory raises": (lambda t: ["check", DP, "--model", (t / "m.py", (t / "m.py").write_text(
        "def f():\n    return 1 // 0\n"))[0].__str__() + ":f", "--devices", "8"], 1,
                               ["--model", "model-build", "m.py:2", "ZeroDivisionError"]),
    "--model factory takes arguments": (lambda t: ["check", DP, "--model", (t / "m.py", (t / "m.py").write_text(
        "def f(cfg):\n    pass\n"))[0].__str__() + ":f", "--devices", "8"], 1,
                                        ["--model", "takes arguments (cfg)"]),
    "--model import fails": (lambda t: ["check", DP, "--model", (t / "m.py", (t / "m.py").write_text(
        "import no_such_module_xyz\n\n\ndef f():\n    pass\n"))[0].__str__() + ":f", "--devices", "8"], 1,
                             ["--model", "model-import"]),
    "--model factory returns None": (lambda t: ["check", DP, "--model", (t / "m.py", (t / "m.py").write_text(
        "def f():\n    pass\n"))[0].__str__() + ":f", "--devices", "8", "--strict"], 1,
                                     ["--model", "returned NoneType"]),
    "--format json with errors": (lambda t: ["check", DP, "--mesh", "data=0", "--format", "json"], 2, ["axis-size"]),
    "--vs without a model": (lambda t: ["check", DP, "--vs", DP], 2, ["--vs"]),
    # shapes files
    "shapes: float dim": (lambda t: check_shapes(t, [leaf(shape=[8.7, 8])]), 1, ["params[0].shape[0]", "bad-shapes"]),
    "shapes: string dim": (lambda t: check_shapes(t, [leaf(shape=["8", 8])]), 1, ["params[0].shape[0]"]),
    "shapes: bool dim": (lambda t: check_shapes(t, [leaf(shape=[True, 8])]), 1, ["params[0].shape[0]"]),
    "shapes: negative dim": (lambda t: check_shapes(t, [leaf(shape=[-8, 8])]), 1, ["params[0].shape[0]"]),
    "shapes: 2**70 elements": (lambda t: check_shapes(t, [leaf(shape=[2**40, 2**30])]), 1, ["params[0].shape"]),
    "shapes: Infinity": (lambda t: ["check", DP, "--devices", "8", "--shapes", (t / "s.json", (t / "s.json").write_text(
        '{"format": "shardplan-shapes/1", "params": [{"path": "w", "shape": [Infinity], "dtype": "float32"}]}'))[0]],
                         1, ["s.json", "Infinity"]),
    "shapes: non-string names": (lambda t: check_shapes(t, [leaf(names=[3, None])]), 1, ["params[0].names"]),
    "shapes: more names than dims": (lambda t: check_shapes(t, [leaf(names=["a", "b", "c"])]), 1,
                                     ["params[0].names"]),
    "shapes: non-string path": (lambda t: check_shapes(t, [leaf(path=7)]), 1, ["params[0].path"]),
    "shapes: duplicate path": (lambda t: check_shapes(t, [leaf(), leaf()]), 1, ["params[1].path", "twice"]),
    "shapes: unknown dtype": (lambda t: check_shapes(t, [leaf(dtype="float128")]), 1, ["params[0].dtype"]),
    "shapes: params not a list": (lambda t: check_shapes(t, {"w": 1}), 1, ["params", "bad-shapes"]),
    "shapes: not JSON": (lambda t: ["check", DP, "--devices", "8", "--shapes", (t / "s.json", (t / "s.json").write_text(
        '{"format": ['))[0]], 1, ["s.json:1:", "not JSON"]),
    "shapes: 100000-deep JSON": (lambda t: ["check", DP, "--devices", "8", "--shapes",
                                            (t / "s.json", (t / "s.json").write_text("[" * 100000))[0]], 1,
                                 ["s.json", "bad-shapes"]),
    "shapes: invalid UTF-8": (lambda t: ["check", DP, "--devices", "8", "--shapes", (t / "s.json", (
        t / "s.json").write_bytes(b'{"format": "x",\n "p": "\xff"}'))[0]], 1, ["s.json:2:8", "not UTF-8"]),
    "shapes: /dev/zero": (lambda t: ["check", DP, "--devices", "8", "--shapes", "/dev/zero"], 1,
                          ["/dev/zero", "not a regular file"]),
    "shapes: a list at the top": (lambda t: ["check", DP, "--devices", "8", "--shapes", (t / "s.json", (
        t / "s.json").write_text("[1, 2]"))[0]], 1, ["s.json", "not a shapes file"]),
    "shapes: --optimizer recorded without a record": (lambda t: check_shapes(t, OK_SHAPES, "--optimizer", "recorded"),
                                                      2, ["--optimizer", "no optimizer state is recorded"]),
    # checkpoints (the directories are made by the `corrupted` fixture)
    "ckpt: a junk step folder": (_ckpt("junkstep"), 1, ["junkstep/7", "foreign-checkpoint"]),
    "ckpt: truncated step metadata": (_ckpt("truncmeta"), 1, ["_CHECKPOINT_METADATA", "corrupt-checkpoint"]),
    "ckpt: broken meta JSON": (_ckpt("badmeta"), 1, ["meta/metadata", "corrupt-checkpoint"]),
    "ckpt: meta of another tool": (_ckpt("foreignmeta"), 1, ["meta/metadata", "foreign-checkpoint"]),
    "ckpt: no meta item": (_ckpt("nometa"), 1, ["nometa/1", "foreign-checkpoint"]),
    "ckpt: broken tree metadata": (_ckpt("treemeta"), 1, ["model/_METADATA", "corrupt-checkpoint"]),
    "ckpt: array data deleted": (_ckpt("nodata"), 1, ["nodata/1/model", "corrupt-checkpoint"]),
    "ckpt: another tool's Orbax checkpoint": (_ckpt("orbax"), 1, ["orbax/5", "foreign-checkpoint"]),
    "ckpt: only numbered folders": (_ckpt("numbers"), 1, ["numbers/3", "foreign-checkpoint"]),
    "ckpt: a file": (lambda t: ["ckpt", "info", plan(t, "x")], 1, ["p.splan", "not-a-checkpoint"]),
    "ckpt: missing": (lambda t: ["ckpt", "info", t / "none"], 1, ["none", "not-a-checkpoint"]),
    "ckpt: --step that is corrupt": (lambda t: ["ckpt", "info", t / "badmeta", "--step", "1"], 1,
                                     ["corrupt-checkpoint"]),
    # launch
    "launch -n 0": (lambda t: ["launch", "-n", "0", "--", "true"], 2, ["-n"]),
    "launch --failure-grace nan": (lambda t: ["launch", "--failure-grace", "nan", "--", "true"], 2,
                                   ["--failure-grace"]),
    "launch --failure-grace inf": (lambda t: ["launch", "--failure-grace", "inf", "--", "true"], 2,
                                   ["--failure-grace"]),
    "launch --timeout -1": (lambda t: ["launch", "--timeout", "-1", "--", "true"], 2, ["--timeout"]),
    "launch --timeout 1e999": (lambda t: ["launch", "--timeout", "1e999", "--", "true"], 2, ["--timeout"]),
    "launch --timeout 0": (lambda t: ["launch", "--timeout", "0", "--", "true"], 2, ["--timeout 0"]),
    "launch -n ²": (lambda t: ["launch", "-n", "²", "--", "true"], 2, ["-n"]),
    "launch without a command": (lambda t: ["launch", "-n", "2"], 2, ["give the command"]),
    "launch of a missing program": (lambda t: ["launch", "-n", "1", "--", t / "no-such-program"], 2,
                                    ["cannot-launch"]),
}


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory) -> Path:
    """A real shardplan checkpoint (gpt_tiny, dp, step 1), copied and damaged one way per folder."""
    root = tmp_path_factory.mktemp("ckpts")
    plan_ = shardplan.load(PLANS / "dp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan_, models.gpt_tiny, optax.adamw(1e-3))
    ck = checkpoint.Checkpointer(root / "base", placement)
    ck.save(1, model, optimizer)
    ck.wait()
    ck.close()

    def copy(name: str) -> Path:
        shutil.copytree(root / "base", root / name)
        return root / name / "1"

    (copy("junkstep").parent / "7").mkdir()
    f = copy("truncmeta") / "_CHECKPOINT_METADATA"
    f.write_text(f.read_text()[:10])
    (copy("badmeta") / "meta" / "metadata").write_text("{not json")
    (copy("foreignmeta") / "meta" / "metadata").write_text('{"hello": 1}')
    shutil.rmtree(copy("nometa") / "meta")
    (copy("treemeta") / "model" / "_METADATA").write_text("garbage")
    step = copy("nodata")
    (step / "model" / "manifest.ocdbt").unlink()
    for n in (3, 4):
        (root / "numbers" / str(n)).mkdir(parents=True)
    import orbax.checkpoint as ocp

    m = ocp.CheckpointManager(root / "orbax")
    m.save(5, args=ocp.args.StandardSave({"w": np.ones(3)}))
    m.wait_until_finished()
    m.close()
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input(name, tmp_path, corrupted):
    setup, rc, must = CASES[name]
    cwd = corrupted if name.startswith("ckpt") else tmp_path
    args = setup(cwd if name.startswith("ckpt") else tmp_path)
    ran = run_cli(args, cwd)
    both = ran.out + ran.err
    assert "Traceback" not in both, both[-3000:]
    assert ran.rc == rc, (ran.rc, both[-3000:])
    for text in must:
        assert text in both, (text, both[-3000:])
    assert ran.seconds <= MAX_SECONDS, ran.seconds
    assert ran.max_rss_kib <= MAX_RSS_KIB, ran.max_rss_kib
    assert len(ran.err) < 20_000, "output is bounded"
    if "secret" in name:
        assert "hunter2" not in both and "x" * 150 not in both
    if rc == 1 and name != "--replicated-threshold 0 warns about everything" and "--strict" not in map(str, args):
        assert "error[" in ran.err
    if "json" in name:
        doc = json.loads(ran.out)
        assert doc["ok"] is False and doc["diagnostics"][0]["code"] == "axis-size"


def test_the_corpus_is_at_least_twice_the_named_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("args", [
    ["check", str(DP), "--model", f"{ROOT / 'examples' / 'models.py'}:gpt_tinny", "--devices", "8"],
    ["check", str(DP), "--model", MODEL, "--step", f"{ROOT / 'examples' / 'train.py'}:lm_loss", "--batch", "x=int23[8]"],
    ["check", str(DP), "--model", MODEL, "--step", f"{ROOT / 'examples' / 'train.py'}:lm_loss", "--batch", "x=int32[8]",
     "--chip", "h100", "--link", "nolink=1"],
])
def test_usage_errors_are_found_before_jax_is_imported(args):
    """A mistyped flag is reported without loading jax or the model (about a second, not 10+)."""
    code = f"import sys; from shardplan.tools import cli; rc = cli.main({args!r}); print(rc, 'jax' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split()[-2:] == ["2", "False"], (r.stdout[-500:], r.stderr[-2000:])
