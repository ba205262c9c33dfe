"""Simulated CPU devices. Imports nothing from jax: it must run before jax is imported."""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count"


def simulate(n: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """Ask XLA for ``n`` CPU devices: sets XLA_FLAGS (replacing an earlier device count) and
    JAX_PLATFORMS=cpu in ``env`` (default: this process's environment, which then must not
    have imported jax yet). Returns the environment.

    Raises:
        RuntimeError: ``env`` is this process's and jax is already imported.
    """
    target = os.environ if env is None else env
    if env is None and "jax" in sys.modules:
        raise RuntimeError("simulated devices must be set before jax is imported")
    flags = [f for f in target.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]
    target["XLA_FLAGS"] = " ".join(flags + [f"{FLAG}={n}"])
    target.setdefault("JAX_PLATFORMS", "cpu")
    return dict(target)
