"""Small shared helpers and paths for tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import shardplan
from shardplan.errors import Diagnostic

ROOT = Path(__file__).resolve().parent.parent

# XLA flags the suite compiles with (tests/conftest.py says why) and that the benchmarks' runs drop.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def compiler_defaults_env() -> dict[str, str]:
    """This process's environment with XLA's default compile settings, for what reads a compiled
    step's kernel count (suggest's benchmark times the compiled step on a chip's preset, kernel
    launches included): the program users get."""
    import os

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE]
    return {**os.environ, "XLA_FLAGS": " ".join(flags)}
PLANS = ROOT / "plans"
FIXTURES = ROOT / "tests" / "fixtures"


def diags_of(fn, *args, **kwargs) -> tuple[Diagnostic, ...]:
    with pytest.raises(shardplan.ShardPlanError) as info:
        fn(*args, **kwargs)
    return info.value.diagnostics


def only(diags, code: str) -> Diagnostic:
    found = [d for d in diags if d.code == code]
    assert len(found) == 1, [d.render() for d in diags]
    return found[0]


# The example model each shipped plan is written for (examples/models.py factories). Every plan in
# plans/ must be here: tests/test_cli.py checks each against its model, tests/test_train_plans.py
# trains each with examples/train.py.
PLAN_MODELS = {
    "dp.splan": "gpt_tiny",
    "fsdp.splan": "gpt_tiny",
    "fsdp_any_rank.splan": "llama_tiny_scan",
    "gpt_2d.splan": "gpt_tiny",
    "gpt_logical.splan": "gpt_tiny_annotated",
    "gpt_tp.splan": "gpt_tiny",
    "llama_pp.splan": "llama_deep_scan",
    "llama_pp_circular.splan": "llama_deep_scan",
    "llama_scan_2d.splan": "llama_tiny_scan",
    "llama_sp.splan": "llama_tiny",
    "llama_tp.splan": "llama_tiny",
    "moe_ep.splan": "moe_tiny",
    "moe_ep_fsdp.splan": "moe_tiny",
    "moe_ep_tp.splan": "moe_tiny_shared",
    "typed_tp.splan": "typed_tiny",
}


def plan_line(plan: str, starts: str) -> int:
    """The line number in plans/``plan`` of the first line starting with ``starts`` (headers grow)."""
    lines = (PLANS / plan).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(starts))


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a target compiler's package: the test extra brings libtpu)."""
    try:  # a submodule's spec imports its parent, which may be missing
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


HAS_TPU = installed("libtpu")  # XLA:TPU, offline
HAS_GPU = installed("jax_plugins.xla_cuda12")  # XLA:GPU, offline ('shardplan[gpu]')


def once_per_run(name: str, make):
    """``make()``'s result, made once per test run and shared by every xdist worker (pickled in the
    run's folder, tests/conftest.py, under a lock per name), where a module-scoped fixture is made
    again in each worker that runs one of its tests."""
    import fcntl
    import pickle

    folder = Path(os.environ["SHARDPLAN_TEST_RUN"]) / "once"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.pickle"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value
