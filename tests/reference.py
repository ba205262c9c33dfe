"""The reference that sharded training is compared with: plain Flax NNX + optax on the default
device, with nothing of shardplan in it (no plan, no placement, no `train_step`), so a fault in
shardplan's own step (an update applied twice, a gradient summed over the wrong devices) shows
as a difference instead of being repeated on both sides."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def params_of(model) -> dict[str, np.ndarray]:
    """Every nnx.Param of a model as a host array, by '/'-joined path (read with jax's own
    key paths, not shardplan's)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp): np.asarray(x) for kp, x in flat}


_RUNS: dict = {}


def train(factory, tx, loss_fn, batches, *, key=None) -> tuple[list[float], dict[str, np.ndarray]]:
    """``factory()`` trained with ``tx`` on ``batches``, one ``nnx.jit`` step per batch.

    ``key``: names the optimizer's settings when several tests compare with the same run (the
    factory, loss and batch values complete it): the run is made once and its result reused.

    Returns:
        (the loss of every step, the params after the last)
    """
    if key is not None:
        full = (factory, loss_fn, key, tuple(_digest(b) for b in batches))
        if full not in _RUNS:
            _RUNS[full] = train(factory, tx, loss_fn, batches)
        return _RUNS[full]
    with nnx.use_eager_sharding(False):  # annotated models name logical axes no mesh has here
        model = factory()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in batches]
    return losses, params_of(model)


def _digest(batch) -> tuple:
    """A batch's values as a hashable key."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    return tuple((jax.tree_util.keystr(k), np.asarray(x).tobytes()) for k, x in leaves)
