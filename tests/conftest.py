"""8 simulated CPU devices, set before jax is imported."""

import os as _os

from shardplan.runtime.devices import simulate

# Compile for speed of compiling, not of the code (the suite's programs run for microseconds;
# compiling is most of the suite's time): LLVM's optimisation level 0 and XLA:CPU's classic
# elemental emitters instead of its MLIR fusion emitters (together a step compiles in 0.3x the
# time). XLA's HLO passes up to the SPMD partitioner are the same; measured on four plans'
# exact-mode steps against the default flags: every collective's bytes equal, peak within 0.05%,
# FLOPs within 0.1%, memory traffic within 0.4%, losses equal to 6 digits; but the program has
# more kernels (unfused loops), so what reads a compiled step's kernel count (suggest's
# confirmation by the compiled step's time) runs with XLA's defaults: tests/helpers.compiler_defaults_env().
# Subprocesses inherit the flags; simulate() keeps the rest.
from tests.helpers import FAST_COMPILE as _FAST_COMPILE  # noqa: E402

_flags = _os.environ.get("XLA_FLAGS", "")
for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
_os.environ["XLA_FLAGS"] = _flags
simulate(8)

# The shardplan command honours COLUMNS when piped (and prints 160 wide without it); this process
# may hand its children COLUMNS=80 (set below Python's os.environ): the suite's tables are read
# at the width a pipe gets. Tests of narrow output set COLUMNS themselves.
_os.environ["COLUMNS"] = "160"

# The folders of this run, under one temporary folder that the process which made it (the
# controller, or a lone pytest) removes when the run ends, so a run leaves nothing in /tmp:
# - the shapes cache: a fresh folder, never the user's (subprocesses inherit it);
# - one persistent XLA compilation cache, empty at its start (never a cache of the developer's own)
#   and shared by the xdist workers and every subprocess: tests that compile the same program (the
#   same model, plan and step in another test, a CLI run of it) load it instead of compiling it
#   again. A cache hit still reports a backend compile (jax.monitoring wraps the lookup), so
#   compile counts hold;
# - the plain-NNX one-device reference runs (tests/reference.py), made once per run for all workers.
# Workers, loading this file again, inherit the folder from the controller's environment.
import shutil as _shutil  # noqa: E402
import tempfile as _tempfile  # noqa: E402

_MADE_HERE = "SHARDPLAN_TEST_RUN" not in _os.environ
if _MADE_HERE:
    _run = _tempfile.mkdtemp(prefix="shardplan-test-")
    _os.environ["SHARDPLAN_TEST_RUN"] = _run
    _os.environ.setdefault("SHARDPLAN_CACHE_DIR", _os.path.join(_run, "shapes"))
    _os.environ["JAX_COMPILATION_CACHE_DIR"] = _os.path.join(_run, "xla")
    _os.environ["SHARDPLAN_REF_DIR"] = _os.path.join(_run, "ref")
    _os.makedirs(_os.environ["SHARDPLAN_REF_DIR"])
    _os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if _MADE_HERE:
        _shutil.rmtree(_os.environ["SHARDPLAN_TEST_RUN"], ignore_errors=True)
