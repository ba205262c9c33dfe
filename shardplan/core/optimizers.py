"""The registry of optimizers shardplan can account for offline and build for the CLI.

``optimizer_leaves`` derives the state ``nnx.Optimizer(model, optax.<name>(...), wrt=nnx.Param)``
holds from param shapes alone (no jax); ``shardplan.runtime.model.make_tx`` builds the
optax transformation of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.core.leaves import Leaf
from shardplan.errors import as_error, error


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    moments: tuple[str, ...]  # per-param state of the param's shape, under opt_state/0/<moment>/
    has_count: bool  # opt_state/0/count (int32 scalar)


OPTIMIZERS: dict[str, OptimizerInfo] = {
    o.name: o
    for o in (
        OptimizerInfo("adam", ("mu", "nu"), True),
        OptimizerInfo("adamw", ("mu", "nu"), True),
        OptimizerInfo("sgd", (), False),
        OptimizerInfo("none", (), False),
    )
}

NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def lookup(name: str, where: str = "--optimizer") -> OptimizerInfo:
    info = OPTIMIZERS.get(name)
    if info is None:
        raise as_error(
            [
                error(
                    "unknown-optimizer",
                    f"unknown optimizer '{name}'",
                    f"use one of: {', '.join(OPTIMIZERS)}",
                    path=where,
                )
            ]
        )
    return info


def optimizer_leaves(params: list[Leaf], name: str) -> list[Leaf]:
    """The state leaves of optimizer ``name`` for these params, with nnx.Optimizer's paths."""
    info = lookup(name)
    params = [p for p in params if p.is_param]  # nnx.Optimizer(wrt=nnx.Param): no state for BatchStat, RNGs
    out = [Leaf("opt_state/0/count", (), "int32", 4)] if info.has_count else []
    for moment in info.moments:
        out += [Leaf(f"opt_state/0/{moment}/{p.path}", p.shape, p.dtype, p.itemsize) for p in params]
    return out + [Leaf("step", (), "uint32", 4)]
