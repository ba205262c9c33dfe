"""A non-editable install ships the grammar: the wheel works from another directory."""

import json
import os
import subprocess
import sys
import zipfile

from tests.helpers import PLANS, ROOT


def test_wheel_ships_grammar_and_checks_from_elsewhere(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, timeout=600, capture_output=True)
    (wheel,) = wheels.glob("shardplan-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "shardplan/grammar/splan.lark" in names
    assert {f"shardplan/tools/templates/{t}" for t in ("header.py.tmpl", "common.py.tmpl", "step_auto.py.tmpl",
                                                      "step_shard_map.py.tmpl")} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import shardplan, shardplan.lang.parser as p, json; "
            "print(json.dumps([shardplan.__file__, p._grammar_text()[:20]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    where, grammar = json.loads(out.stdout)
    assert where.startswith(str(site)) and grammar.startswith("// The .splan")
    r = subprocess.run([sys.executable, "-m", "shardplan", "check", str(PLANS / "gpt_tp.splan"), "--model",
                        f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", "--devices", "8"],
                       cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
