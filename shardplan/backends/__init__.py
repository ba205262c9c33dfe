"""Backends that turn a placement and a loss function into a training step.

Each backend module has ``build(placement, loss_fn, model, optimizer)`` returning a
jitted ``step(model_state, opt_state, batch) -> (model_state, opt_state, loss)``.
Adding a backend: one new module and one line in ``BACKENDS``.
"""

from __future__ import annotations

import importlib

BACKENDS: dict[str, str] = {
    "auto": "shardplan.backends.auto",
    "shard_map": "shardplan.backends.shard_map",
}


def get(name: str):
    return importlib.import_module(BACKENDS[name])
