"""The auto backend: arrays placed with NamedShardings, one ``jax.jit`` step, and XLA
(GSPMD) inserts every collective: gradient all-reduces over the batch axes, all-gathers
and reduce-scatters for sharded params.

The step is the single-device step. The only thing the plan adds is ``out_shardings``
for the updated state, so params and optimizer state keep the plan's placement across
steps; inputs come in already placed. That is exactly what one would write by hand with
NamedShardings, so the compiled program is the same (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardplan.runtime.placement import Placement, replicated

LossFn = Callable[[Any, Any], jax.Array]


def pure_step(loss_fn: LossFn, gm, go) -> Callable:
    """The single-device training step over split states: (model, opt, batch) -> new + loss."""

    def step(sm, so, batch):
        model, optimizer = nnx.merge(gm, sm), nnx.merge(go, so)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), loss

    return step


def build(placement: Placement, loss_fn: LossFn, model: Any, optimizer: Any):
    """A jitted step(model_state, opt_state, batch) -> (model_state, opt_state, loss)."""
    gm, go = nnx.graphdef(model), nnx.graphdef(optimizer)
    out = (placement.model_shardings(), placement.opt_shardings(), replicated(placement.mesh))
    return jax.jit(pure_step(loss_fn, gm, go), out_shardings=out, donate_argnums=(0, 1))
