"""The shapes cache: the second check of a model skips nnx.eval_shape, and any change the shapes
could depend on (the model's file, a sibling module, a library version) is a miss, never stale."""

import subprocess
import sys
import pytest

from shardplan import api
from shardplan.core import shapecache
from shardplan.runtime import model as model_mod
from tests.helpers import PLANS

MODEL = """
from flax import nnx
import helper


class M(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(helper.WIDTH, 16, rngs=nnx.Rngs(0))


def make():
    return M()
"""


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(shapecache.ENV_DIR, str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "mymodel.py").write_text(MODEL)
    (tmp_path / "m" / "helper.py").write_text("WIDTH = 8\n")
    return tmp_path / "m"


def builds(monkeypatch) -> list:
    calls = []
    real = model_mod.abstract_model
    monkeypatch.setattr(model_mod, "abstract_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def fresh():
    """Forget imported model modules (each CLI run is a new process; this test is one process)."""
    for name in [m for m in sys.modules if m.startswith("_shardplan_model_") or m == "helper"]:
        sys.modules.pop(name)


def widths(spec):
    fresh()
    return {leaf.path: leaf.shape for leaf in api.model_leaves(model=spec, optimizer="none")[0]}


def test_a_second_check_reads_the_cache_and_every_dependency_invalidates_it(model_dir, monkeypatch):
    calls = builds(monkeypatch)
    spec = f"{model_dir / 'mymodel.py'}:make"
    first = widths(spec)
    assert calls == [1] and first["a/kernel"] == (8, 16)
    assert widths(spec) == first and calls == [1]  # a hit: nothing built
    (model_dir / "helper.py").write_text("WIDTH = 12\n")  # a sibling module the model imports
    assert widths(spec)["a/kernel"] == (12, 16) and calls == [1, 1]
    (model_dir / "mymodel.py").write_text(MODEL.replace("16, rngs", "24, rngs"))  # the model itself
    assert widths(spec)["a/kernel"] == (12, 24) and calls == [1, 1, 1]
    monkeypatch.setattr(shapecache, "_versions", lambda: "flax 99.0")  # another library version
    assert widths(spec)["a/kernel"] == (12, 24) and calls == [1, 1, 1, 1]
    assert api.model_leaves(model=spec, optimizer="none", cache=False) and calls == [1, 1, 1, 1, 1]  # bypass


def test_a_damaged_entry_is_a_miss(model_dir, monkeypatch):
    calls = builds(monkeypatch)
    spec = f"{model_dir / 'mymodel.py'}:make"
    widths(spec)
    for entry in shapecache.cache_dir().glob("*.json"):
        entry.write_text("{broken")
    assert widths(spec)["a/kernel"] == (8, 16) and calls == [1, 1]


def test_recheck_through_the_cache_is_fast_and_imports_no_jax(model_dir, tmp_path):
    spec = f"{model_dir / 'mymodel.py'}:make"
    cmd = [sys.executable, "-m", "shardplan", "check", str(PLANS / "dp.splan"), "--model", spec, "--devices", "8"]
    env = {**__import__("os").environ, shapecache.ENV_DIR: str(tmp_path / "cache")}
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env).returncode == 0
    probe = ("import runpy, sys; sys.argv = %r; "
             "rc = 0\ntry:\n    runpy.run_module('shardplan', run_name='__main__')\nexcept SystemExit as e:\n    rc = e.code\n"
             "print('JAX' if 'jax' in sys.modules else 'NOJAX')" % (cmd[2:],))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.strip().endswith("NOJAX"), r.stdout[-500:] + r.stderr[-1000:]
    r = subprocess.run([sys.executable, "-m", "shardplan", "cache", "clear"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert "removed 1 cached model shapes" in r.stdout
