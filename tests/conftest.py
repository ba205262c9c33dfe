"""8 simulated CPU devices, set before jax is imported."""

from shardplan.runtime.devices import simulate

simulate(8)

# The shapes cache of this run: a fresh folder, never the user's (subprocesses inherit it).
import os as _os  # noqa: E402
import tempfile as _tempfile  # noqa: E402

_os.environ.setdefault("SHARDPLAN_CACHE_DIR", _tempfile.mkdtemp(prefix="shardplan-shapes-"))
