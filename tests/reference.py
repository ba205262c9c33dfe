"""The reference that sharded training is compared with: plain Flax NNX + optax on the default
device, with nothing of shardplan in it (no plan, no placement, no `train_step`), so a fault in
shardplan's own step (an update applied twice, a gradient summed over the wrong devices) shows
as a difference instead of being repeated on both sides."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

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
            _RUNS[full] = _shared(full, lambda: train(factory, tx, loss_fn, batches))
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


def _shared(full: tuple, run) -> tuple[list[float], dict[str, np.ndarray]]:
    """``run()``'s result, made once per test run and shared by the xdist workers through
    $SHARDPLAN_REF_DIR (tests/conftest.py: a fresh folder per run), a lock per run so a second
    worker waits for the first instead of training again. Without the folder: ``run()``."""
    folder = os.environ.get("SHARDPLAN_REF_DIR")
    if not folder:
        return run()
    factory, loss_fn, key, digests = full
    name = hashlib.sha256(repr((getattr(factory, "__module__", ""), getattr(factory, "__qualname__", repr(factory)),
                                getattr(loss_fn, "__module__", ""), getattr(loss_fn, "__qualname__", repr(loss_fn)),
                                key, digests)).encode()).hexdigest()[:32]
    path = Path(folder) / f"{name}.npz"
    with open(Path(folder) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            with np.load(path) as z:
                return [float(x) for x in z["__losses__"]], {k: z[k] for k in z.files if k != "__losses__"}
        losses, params = run()
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, __losses__=np.asarray(losses, np.float64), **params)
        os.replace(tmp, path)
        return losses, params


def _digest(batch) -> tuple:
    """A batch's values as a hashable key."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    return tuple((jax.tree_util.keystr(k), np.asarray(x).tobytes()) for k, x in leaves)
