"""The shard_map lowering: a plan's resolved specs -> the explicit collectives of a step.

Pure and jax-free: a :class:`Lowering` lists, per param, how its local shard is gathered
before use and how its gradient is reduced after. The shard_map backend runs it; the
source emitter (``shardplan lower``) prints it. docs/backends.md explains each choice.

Inside the step every device holds its local batch slice and the *whole* params
(gathered), so the local gradient of each param is a full-size array. With B the batch
axes (``batch``/``input`` rules) and n_B their total size, the global gradient is the mean
over B of the local gradients. For each dimension of a param, in the order of its axes:
- a batch axis: ``psum_scatter`` (tiled) along that dimension: sum over the axis and keep
  this device's block (FSDP's reduce-scatter);
- a non-batch axis: the local slice (``dynamic_slice`` at ``axis_index``): devices along
  that axis saw the same data, so their gradients are equal and no communication is needed;
then a ``psum`` over the batch axes that split no dimension (data parallel's all-reduce),
and one scale by 1/n_B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shardplan.core.leaves import Decision, Resolution
from shardplan.core.plan import Plan
from shardplan.errors import as_error, error

Kind = Literal["all_gather", "psum_scatter", "slice", "psum"]


@dataclass(frozen=True)
class Collective:
    """One operation on one param: kind, mesh axes, array dimension (None for psum)."""

    kind: Kind
    axes: tuple[str, ...]
    dim: int  # the array dimension; -1 for psum (no dimension)
    why: str


@dataclass(frozen=True)
class ParamLowering:
    path: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    itemsize: int
    spec: tuple[tuple[str, ...], ...]
    gather: tuple[Collective, ...]
    reduce: tuple[Collective, ...]


@dataclass(frozen=True)
class Lowering:
    mesh: dict[str, int]
    batch_axes: tuple[str, ...]
    batch_axis_size: int
    params: tuple[ParamLowering, ...]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.params:
            for c in p.gather + p.reduce:
                out[c.kind] = out.get(c.kind, 0) + 1
        return out


def _param(d: Decision, batch_axes: tuple[str, ...]) -> ParamLowering:
    dims = [(i, axes) for i, axes in enumerate(d.spec.dims) if axes]
    gather = tuple(Collective("all_gather", axes, i, f"gather dim {i} over {', '.join(axes)}") for i, axes in dims)
    used = {a for _, axes in dims for a in axes}
    ordered = sorted(dims, key=lambda ia: any(a in batch_axes for a in ia[1]))  # slice-only dims first
    reduce: list[Collective] = []
    for i, axes in ordered:
        for a in axes:  # the axes of one dim in their order: each narrows the block
            if a in batch_axes:
                reduce.append(
                    Collective(
                        "psum_scatter", (a,), i, f"batch axis '{a}': sum over it, keep this device's block of dim {i}"
                    )
                )
            else:
                reduce.append(
                    Collective(
                        "slice",
                        (a,),
                        i,
                        f"'{a}' is no batch axis (same data along it, "
                        f"equal gradients): keep the local block of dim {i}",
                    )
                )
    rest = tuple(a for a in batch_axes if a not in used)
    if rest:
        reduce.append(
            Collective("psum", rest, -1, f"sum over batch axes {', '.join(rest)} (scaled by 1/n_batch after: the mean)")
        )
    return ParamLowering(d.path, d.shape, d.shard_shape, d.itemsize, d.spec.dims, gather, tuple(reduce))


def check_inputs(plan: Plan, inputs: Resolution) -> tuple[str, ...]:
    """The batch axes, checking every input splits only dim 0, all over the same axes.

    Raises:
        PlanApplyError: an input split the shard_map backend cannot lower.
    """
    diags = []
    lead: tuple[str, ...] | None = None
    for d in inputs.decisions:
        for i, axes in enumerate(d.spec.dims[1:], start=1):
            if axes:
                diags.append(
                    error(
                        "cannot-lower",
                        f"input {d.path} splits dim {i} over {', '.join(axes)} ({d.origin}); the "
                        "shard_map backend runs the model per device on a slice of the batch (dim 0) and "
                        "cannot split other dims",
                        "split only dim 0 of inputs, or use backend auto",
                        path=d.path,
                    )
                )
        axes0 = d.spec.dims[0] if d.spec.dims else ()
        if lead is None:
            lead = axes0
        elif axes0 != lead:
            diags.append(
                error(
                    "cannot-lower",
                    f"input {d.path} splits dim 0 over {axes0 or 'nothing'} but another input over "
                    f"{lead or 'nothing'}; per-device batch slices must line up",
                    "give every input the same dim-0 axes (one batch statement)",
                    path=d.path,
                )
            )
    if diags:
        raise as_error(diags)
    return tuple(lead or ())


def lower(plan: Plan, params: Resolution, inputs: Resolution) -> Lowering:
    """The collectives for each param of ``params`` (decisions in flatten order)."""
    return lower_params(params.decisions, params.mesh, check_inputs(plan, inputs))


def lower_params(decisions, mesh: dict[str, int], batch_axes: tuple[str, ...]) -> Lowering:
    """The collectives for param decisions, given the batch axes (offline: no input shapes)."""
    n = math.prod(mesh[a] for a in batch_axes)
    return Lowering(
        dict(mesh), tuple(batch_axes), n, tuple(_param(d, batch_axes) for d in decisions if d.role == "param")
    )


def predict_by_axis(lowering: Lowering) -> dict[str, dict[str, int]]:
    """Per-device bytes per step by collective kind and mesh axes ("data", "data,model")."""
    out: dict[str, dict[str, int]] = {k: {} for k in ("all-gather", "reduce-scatter", "all-reduce")}

    def add(kind, axes, n):
        key = ",".join(axes)
        out[kind][key] = out[kind].get(key, 0) + n

    for p in lowering.params:
        shape = list(p.shard_shape)
        for c in p.gather:
            shape[c.dim] *= math.prod(lowering.mesh[a] for a in c.axes)
            add("all-gather", c.axes, math.prod(shape) * p.itemsize)
        shape = list(p.shape)
        for c in p.reduce:
            if c.kind == "psum":
                add("all-reduce", c.axes, math.prod(shape) * p.itemsize)
                continue
            if c.kind == "psum_scatter":
                add("reduce-scatter", c.axes, math.prod(shape) * p.itemsize)
            shape[c.dim] //= lowering.mesh[c.axes[0]]
    return out


def predict(lowering: Lowering, loss_bytes: int = 4) -> dict[str, dict[str, int]]:
    """Collectives the shard_map step issues, per device: {kind: {"count", "bytes"}}.

    Same byte conventions as ``shardplan.collectives`` (gathered result; reduce-scatter
    operand; all-reduce buffer), the scalar loss's all-reduce included. ``count`` is one
    per operation before XLA combines all-reduces (XLA may merge them into fewer
    instructions; bytes are unchanged).
    """
    by_axis, counts = predict_by_axis(lowering), lowering.counts()
    names = {"all-gather": "all_gather", "reduce-scatter": "psum_scatter", "all-reduce": "psum"}
    out = {k: {"count": counts.get(n, 0), "bytes": sum(by_axis[k].values())} for k, n in names.items()}
    if lowering.batch_axes:
        out["all-reduce"]["count"] += 1
        out["all-reduce"]["bytes"] += loss_bytes
    return out
