"""Backends that turn a placement and a loss function into a training step.

Each backend module has ``build(placement, loss_fn, model, optimizer)`` returning a
jitted ``step(model_state, opt_state, batch) -> (model_state, opt_state, loss)``. Which
modules exist is ``shardplan.core.backends.BACKENDS``: adding a backend is one new module
here and one line there.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from shardplan.core.backends import BACKENDS


def get(name: str) -> ModuleType:
    """The runtime module of the backend registered as ``name``."""
    return importlib.import_module(BACKENDS[name].module)
