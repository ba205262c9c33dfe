"""A training step from a placement and a loss function, on either backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardplan.core.backends import BACKENDS
from shardplan.errors import PlanApplyError, as_error, error
from shardplan.runtime import backends
from shardplan.runtime.placement import Placement


class TrainStep:
    """``step(model, optimizer, batch) -> loss``, updating model and optimizer in place.

    The loss function is ``loss_fn(model, batch) -> scalar``, written for one device.
    The batch is placed per the plan's batch rules on each call (a no-op when it
    already is).
    """

    def __init__(
        self,
        placement: Placement,
        loss_fn: Callable[[Any, Any], jax.Array],
        model: Any,
        optimizer: Any,
        backend: str | None = None,
    ):
        name = backend or placement.plan.backend
        if name not in BACKENDS:
            raise as_error(
                [
                    error(
                        "unknown-backend",
                        f"unknown backend '{name}'",
                        f"use one of: {', '.join(BACKENDS)}",
                        path="backend",
                    )
                ]
            )
        if placement.opt is None:
            raise PlanApplyError(
                [
                    error(
                        "no-optimizer",
                        "the placement has no optimizer state",
                        "place the optimizer too: shard_model(plan, model, optimizer) or "
                        "init_sharded(plan, factory, tx)",
                        path="optimizer",
                    )
                ]
            )
        self.placement = placement
        self.backend = name
        self.loss_fn = loss_fn
        self._checked = False
        self.fn = backends.get(name).build(placement, loss_fn, model, optimizer)

    def _check_loss(self, model, batch) -> None:
        try:
            out = nnx.eval_shape(self.loss_fn, model, batch)
        except Exception as e:
            raise PlanApplyError(
                [
                    error(
                        "loss-failed",
                        f"the loss function failed on this batch: {type(e).__name__}: {e}",
                        "loss_fn(model, batch) must run on the model and batch as given",
                        path="loss_fn",
                    )
                ]
            ) from None
        if not (hasattr(out, "shape") and out.shape == () and jax.numpy.issubdtype(out.dtype, jax.numpy.floating)):
            got = f"shape {getattr(out, 'shape', None)}" if hasattr(out, "shape") else type(out).__name__
            raise PlanApplyError(
                [
                    error(
                        "loss-not-scalar",
                        f"the loss function returned {got}, not a float scalar",
                        "reduce the loss to one number, e.g. .mean()",
                        path="loss_fn",
                    )
                ]
            )
        self._checked = True

    def place(self, batch: Any) -> Any:
        return self.placement.shard_batch(batch)

    def __call__(self, model: Any, optimizer: Any, batch: Any) -> jax.Array:
        batch = self.place(batch)
        if not self._checked:
            self._check_loss(model, batch)
        sm, so, loss = self.fn(nnx.state(model), nnx.state(optimizer), batch)
        nnx.update(model, sm)
        nnx.update(optimizer, so)
        return loss

    def lower(self, model: Any, optimizer: Any, batch: Any):
        """The lowered step (``.compile().as_text()`` for the optimized HLO)."""
        return self.fn.lower(nnx.state(model), nnx.state(optimizer), self.place(batch))


def train_step(
    placement: Placement,
    loss_fn: Callable[[Any, Any], jax.Array],
    model: Any,
    optimizer: Any,
    backend: str | None = None,
) -> TrainStep:
    """The training step for ``placement`` on ``backend`` (default: the plan's ``backend``)."""
    return TrainStep(placement, loss_fn, model, optimizer, backend)
