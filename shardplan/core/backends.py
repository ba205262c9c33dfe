"""The registry of backends: the one place that names them.

The plan checker (``backend`` statements), the command line's choices, the source emitter
and ``shardplan.runtime.backends`` all read this table. Adding a backend is one module
under ``shardplan/runtime/backends/`` and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.errors import as_error, error


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # the runtime module with ``build(placement, loss_fn, model, optimizer)``
    # "module:function": its step cost in fast mode, fn(tracer, plan, mesh, delta=..., compiler=...) (runtime.tracing)
    fast_cost: str
    template: str  # the step template under shardplan/tools/templates/ for ``shardplan lower``
    doc: str


BACKENDS: dict[str, BackendInfo] = {
    b.name: b
    for b in (
        BackendInfo(
            "auto",
            "shardplan.runtime.backends.auto",
            "shardplan.runtime.fast:step_cost",
            "step_auto.py.tmpl",
            "NamedSharding + device_put, one jax.jit step; XLA inserts the collectives",
        ),
        BackendInfo(
            "shard_map",
            "shardplan.runtime.backends.shard_map",
            "shardplan.runtime.backends.shard_map:fast_cost",
            "step_shard_map.py.tmpl",
            "jax.shard_map with the plan's explicit collectives",
        ),
    )
}

NAMES: tuple[str, ...] = tuple(BACKENDS)
DEFAULT = "auto"


def lookup(name: str, where: str = "backend") -> BackendInfo:
    """The registered backend ``name``.

    Raises:
        PlanCheckError: no backend of that name (``unknown-backend``).
    """
    info = BACKENDS.get(name)
    if info is None:
        raise as_error(
            [error("unknown-backend", f"unknown backend '{name}'", f"use one of: {', '.join(BACKENDS)}", path=where)]
        )
    return info
