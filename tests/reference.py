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


# -- "equal to one device" --------------------------------------------------------------------
# Sharded and 1-device runs add the same numbers in other orders (a matmul split over devices
# sums its blocks last; XLA fuses differently), so float32 results differ by reassociation: a few
# ulps in a loss, and in params a few 1e-6 -- more in the odd element whose Adam update divides a
# near-zero gradient by its near-zero second moment. A real bug (an update applied twice, a
# constant added once per device, a gradient summed over the wrong axis) moves the loss past a
# tight tolerance or many elements past it, or some element far past it. So: losses within
# LOSS_RTOL; per param, at most SHARE of its elements past the tight tolerance and none past the
# loose one (tests/test_reference.py plants such faults and shows each fails).
LOSS_RTOL = 1e-5
TIGHT = (1e-4, 5e-6)  # (rtol, atol)
LOOSE = (2e-3, 1e-4)
SHARE = 0.01


def mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    """Why ``got`` is not ``want`` up to float32 reassociation (None when it is)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    tight = err > TIGHT[1] + TIGHT[0] * np.abs(want)
    loose = err > LOOSE[1] + LOOSE[0] * np.abs(want)
    if loose.any():
        i = np.unravel_index(np.argmax(err - LOOSE[0] * np.abs(want)), err.shape)
        return f"{int(loose.sum())} element(s) past the loose tolerance, e.g. {i}: {got[i]!r} vs {want[i]!r}"
    if tight.sum() > max(1, SHARE * tight.size):
        return f"{int(tight.sum())} of {tight.size} elements past the tight tolerance (max |diff| {err.max():.3g})"
    return None


def assert_trains_alike(losses, params: dict, want_losses, want_params: dict) -> None:
    """A sharded run equal to the 1-device run up to float32 reassociation (see above)."""
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
    assert set(params) >= set(want_params), sorted(set(want_params) - set(params))
    bad = {path: why for path, want in want_params.items() if (why := mismatch(params[path], want)) is not None}
    assert not bad, bad
