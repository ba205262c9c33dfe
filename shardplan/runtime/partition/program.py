"""The per-device step: ``local_step`` (flat local params and batch -> loss and local gradients,
run under ``jax.shard_map``) and ``predict`` (a dry run: what it would issue, no devices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardplan.runtime.partition.partitioner import Partitioner
from shardplan.runtime.partition.values import Record, V
from shardplan.runtime.sharding import (
    Dims,
    update_paths,
)


def predict(
    closed: Any, mesh: dict[str, int], param_dims: list[Dims], batch_dims: list[Dims], paths: Sequence[str] = ()
) -> Record:
    """What the per-device code of ``closed`` issues on ``mesh``, from a dry run (no devices);
    ``paths``: the params' paths, named in what each collective moves."""
    record = Record()
    local_step(closed, mesh, param_dims, batch_dims, record, predict=True, paths=paths)(
        [None] * len(param_dims), [None] * len(batch_dims)
    )
    return record


def local_step(
    closed: Any,
    mesh: dict[str, int],
    param_dims: list[Dims],
    batch_dims: list[Dims],
    record: Record,
    predict: bool = False,
    paths: Sequence[str] = (),
) -> Callable:
    """The per-device function: (flat local params, flat local batch) -> (loss, flat local grads).
    ``paths`` (the params' paths, optional) name what each recorded collective moves: a param
    gathered where it is read, a gradient where its sum is reduced."""
    labels = update_paths(closed.jaxpr, paths, first=1) if paths else {}

    def fn(params: list, batch: list):
        batch_axes = frozenset(a for d in batch_dims for dd in d for a in dd)
        part = Partitioner(mesh, record, predict=predict, batch_axes=batch_axes)
        part.labels = labels
        record.issued.clear()
        record.fallbacks.clear()
        record.grouped.clear()
        args = []
        for x, d, var in zip(params, param_dims, closed.jaxpr.invars[: len(params)], strict=True):
            args.append(V(x, tuple(var.aval.shape), var.aval.dtype, d))
        for a, path in zip(args, paths, strict=False):
            part.name(a, path)
        for x, d, var in zip(batch, batch_dims, closed.jaxpr.invars[len(params) :], strict=True):
            args.append(V(x, tuple(var.aval.shape), var.aval.dtype, d, act=True))
        outs = part.run(closed.jaxpr, list(closed.consts), args, [None, *param_dims])
        part.source, part.op = "", "gradient"
        loss = part.whole(outs[0])
        for g, path in zip(outs[1:], paths, strict=False):
            part.name(g, path)
        grads = [part.to(g, d) for g, d in zip(outs[1:], param_dims, strict=True)]
        return loss.x, [g.x for g in grads]

    return fn
