"""8 simulated CPU devices, set before jax is imported."""

import os as _os

from shardplan.runtime.devices import simulate

# Compile for speed of compiling, not of the code (the suite's programs run for microseconds):
# LLVM's optimisation level 1 (0 changes float rounding enough to fail 1e-5 tolerances, and a
# truncated checkpoint chunk then reads without error; 1 passes every test). XLA's HLO passes
# (the SPMD partitioner, buffer assignment: the collectives, memory_analysis and cost_analysis
# the tests read) are the same at any level. Subprocesses inherit it; simulate() keeps the rest.
if "--xla_backend_optimization_level" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=1").strip()
simulate(8)

# The shardplan command honours COLUMNS when piped (and prints 160 wide without it); this process
# may hand its children COLUMNS=80 (set below Python's os.environ): the suite's tables are read
# at the width a pipe gets. Tests of narrow output set COLUMNS themselves.
_os.environ["COLUMNS"] = "160"

# The shapes cache of this run: a fresh folder, never the user's (subprocesses inherit it).
import tempfile as _tempfile  # noqa: E402

_os.environ.setdefault("SHARDPLAN_CACHE_DIR", _tempfile.mkdtemp(prefix="shardplan-shapes-"))

# One persistent XLA compilation cache per test run, empty at its start (never a cache of the
# developer's own) and shared by the xdist workers and every subprocess: tests that compile the
# same program (the same model, plan and step in another test, a CLI run of it) load it instead
# of compiling it again. A cache hit still reports a backend compile (jax.monitoring wraps the
# lookup), so compile counts hold. The controller makes it; workers, loading this file again,
# inherit it.
if "SHARDPLAN_TEST_RUN" not in _os.environ:
    _os.environ["SHARDPLAN_TEST_RUN"] = "1"
    _os.environ["JAX_COMPILATION_CACHE_DIR"] = _tempfile.mkdtemp(prefix="shardplan-xla-")
    # The plain-NNX one-device reference runs (tests/reference.py), made once per run for all workers.
    _os.environ["SHARDPLAN_REF_DIR"] = _tempfile.mkdtemp(prefix="shardplan-ref-")
    _os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
