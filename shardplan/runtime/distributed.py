"""Multi-process runs: ``jax.distributed`` set up from the launcher's environment.

``shardplan launch`` starts each rank with SHARDPLAN_COORDINATOR, SHARDPLAN_NUM_PROCESSES
and SHARDPLAN_PROCESS_ID set; a training script calls :func:`initialize` first thing
(before any jax computation). On CPU the collectives go through gloo.
"""

from __future__ import annotations

import os

from shardplan.errors import as_error, error

ENV_COORDINATOR = "SHARDPLAN_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDPLAN_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDPLAN_PROCESS_ID"
ENV_TIMEOUT = "SHARDPLAN_TIMEOUT"


def launched() -> bool:
    """True inside a rank started by ``shardplan launch``."""
    return ENV_COORDINATOR in os.environ


def initialize(timeout_s: int | None = None) -> bool:
    """Join the job the launcher started (no-op outside one). Returns whether it joined.

    ``timeout_s`` bounds joining and sets the heartbeat timeout after which a silent
    rank counts as dead (default: SHARDPLAN_TIMEOUT, else 60 s).
    """
    if not launched():
        return False
    import jax

    timeout = int(timeout_s or os.environ.get(ENV_TIMEOUT) or 60)
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ[ENV_COORDINATOR],
        int(os.environ[ENV_NUM_PROCESSES]),
        int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )
    return True


def process_slice(global_batch: int) -> slice:
    """The rows of a global batch that this process feeds (contiguous, by process index)."""
    import jax

    n, i = jax.process_count(), jax.process_index()
    if global_batch % n:
        raise as_error(
            [
                error(
                    "indivisible",
                    f"a global batch of {global_batch} does not divide over {n} processes",
                    f"use a batch size that is a multiple of {n}",
                    path="batch",
                )
            ]
        )
    per = global_batch // n
    return slice(i * per, (i + 1) * per)
