"""A training step from a placement and a loss function, on either backend."""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardplan.core import backends as backends_registry
from shardplan.core import hlo
from shardplan.errors import Diagnostic, PlanApplyError, ShardPlanError, as_error, error
from shardplan.runtime import backends
from shardplan.runtime.activations import Activations
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
        backends_registry.lookup(name)
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
        self._traced = False
        # The activations the plan constrains (logical names, act rules, the mesh context).
        self.activations = Activations(placement.plan, placement.mesh, name)
        # Both backends trace the loss over global values (shard_map partitions the traced program).
        wrapped = self.activations.wrap(loss_fn, mesh_context=True)
        self.fn = backends.get(name).build(placement, wrapped, model, optimizer)

    def _check_loss(self, model, batch) -> None:
        check_loss(self.activations.wrap(self.loss_fn, mesh_context=True), model, batch)
        self._checked = True

    def place(self, batch: Any) -> Any:
        return self.placement.shard_batch(batch)

    def __call__(self, model: Any, optimizer: Any, batch: Any) -> jax.Array:
        batch = self.place(batch)
        if not self._checked:
            self._check_loss(model, batch)
        first = not self._traced
        sm, so, loss = self.fn(nnx.state(model), nnx.state(optimizer), batch)
        nnx.update(model, sm)
        nnx.update(optimizer, so)
        if first:
            self._traced = True
            for note in self.activations.notes():  # said once, when the step is first traced
                warnings.warn(f"shardplan: {note}", stacklevel=2)
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


def user_frame(tb: Any) -> str:
    """'file:line' of the innermost traceback frame in the user's code (not jax, flax or shardplan)."""
    frames = [f for f in traceback.extract_tb(tb) if not any(p in f.filename for p in hlo.LIBRARY_PATHS)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


_MISSING_AXIS = re.compile(r"Resource axis: (\S+) of (.+?) is not found in mesh: \((.*?)\)")


def axis_mismatch(e: BaseException, frame: str = "") -> Diagnostic | None:
    """The diagnostic for a model that names a mesh axis the plan's mesh lacks (a model written
    for ``P('fsdp', ..., 'tensor')`` run under a plan whose mesh is ``data, model``)."""
    m = _MISSING_AXIS.search(str(e))
    if m is None:
        return None
    axis, spec, mesh = m.group(1), m.group(2), m.group(3).replace("'", "")
    where = f" at {frame}" if frame else ""
    return error(
        "model-axis",
        f"the model names mesh axis '{axis}' ({spec}{where}), but the plan's mesh has axes ({mesh})",
        f"name the plan's mesh axes as the model does (mesh {axis} = ..., with rules over them), or make the "
        "model's axis names configurable and pass the plan's",
        path=frame or "model",
    )


def check_loss(loss_fn: Any, model: Any, batch: Any, *, where: str = "loss_fn") -> None:
    """The loss must trace on the model and batch (abstractly: nothing runs) and return a float scalar.

    Raises:
        PlanApplyError: it fails (naming the innermost frame of the user's code), or returns no scalar.
    """
    try:
        out = nnx.eval_shape(loss_fn, model, batch)
    except ShardPlanError:
        raise
    except Exception as e:  # the user's code: show their error and their frame, not ours
        frame = user_frame(e.__traceback__)
        mismatch = axis_mismatch(e, frame)
        if mismatch is not None:
            raise as_error([mismatch]) from None
        raise as_error(
            [
                error(
                    "loss-failed",
                    f"the loss function failed to trace{' at ' + frame if frame else ''}: {type(e).__name__}: {e}",
                    "loss_fn(model, batch) must run on the model and a batch of these shapes",
                    path=where,
                )
            ]
        ) from None
    if not (hasattr(out, "shape") and out.shape == () and jax.numpy.issubdtype(out.dtype, jax.numpy.floating)):
        got = f"shape {out.shape}" if hasattr(out, "shape") else type(out).__name__
        raise as_error(
            [
                error(
                    "loss-not-scalar",
                    f"the loss function returned {got}, not a float scalar",
                    "reduce the loss to one number, e.g. .mean()",
                    path=where,
                )
            ]
        )
