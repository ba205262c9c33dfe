"""A training step from a placement and a loss function, on either backend."""

from __future__ import annotations

import linecache
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax._src.core import ShardingTypeError  # not exported in jax 0.10: the sharding type checker's error

from shardplan.core import backends as backends_registry
from shardplan.core.frames import user_frame
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
        strict: bool = False,
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
        wrapped = self.activations.wrap(pipelined(placement, loss_fn, name), mesh_context=True)
        # strict: an op the shard_map backend runs on whole operands is an error (auto has none).
        options = {"strict": True} if strict and name == "shard_map" else {}
        self.fn = backends.get(name).build(placement, wrapped, model, optimizer, **options)

    def _check_loss(self, model, batch) -> None:
        check_loss(self.activations.wrap(self.loss_fn, mesh_context=True), model, batch, plan=self.placement.plan)
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


def pipelined(placement: Placement, loss_fn: Callable[[Any, Any], jax.Array], backend: str):
    """``loss_fn`` with the plan's pipeline applied (itself when the plan has none). Both backends
    run the same pipelined program: auto hands it to XLA, shard_map partitions it itself."""
    from shardplan.runtime import pipeline

    return pipeline.pipelined(placement.plan, loss_fn, placement.mesh_shape, placement.params, placement.mesh)


def train_step(
    placement: Placement,
    loss_fn: Callable[[Any, Any], jax.Array],
    model: Any,
    optimizer: Any,
    backend: str | None = None,
    *,
    strict: bool = False,
) -> TrainStep:
    """The training step for ``placement`` on ``backend`` (default: the plan's ``backend``).

    The shard_map backend traces the step at its first call for each batch structure and warns
    then (``ShardMapFallbackWarning``, once) of every op it runs on whole (gathered) operands;
    ``strict=True`` makes that a ``PlanApplyError`` (``cannot-lower``), raised before the step runs.
    """
    return TrainStep(placement, loss_fn, model, optimizer, backend, strict)


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


# JAX's refusal of a PartitionSpec naming an axis that is not Explicit (jnp.zeros(out_sharding=),
# reshard, einsum(out_sharding=), .at[].get(out_sharding=)), as worded in jax 0.10.
_NOT_EXPLICIT = re.compile(
    r"PartitionSpec passed to (\S+) cannot contain axis names that are of type Auto or Manual\. "
    r"Got PartitionSpec: (.+?) with axis name: (\S+) of type: AxisType\.Auto"
)


def explicit_mesh_line(plan: Any, axes: tuple[str, ...] = ()) -> str:
    """The plan's ``mesh`` statement with ``axes`` (every axis when empty) typed explicit."""
    if plan is None or not plan.mesh:
        return "mesh explicit data = *"
    every = not axes or set(axes) >= set(plan.axis_names)

    def size(a) -> str:
        return ("*" if a.size is None else str(a.size)) + ("" if a.link == "ici" else f" @{a.link}")

    if every:
        return "mesh explicit " + ", ".join(f"{a.name} = {size(a)}" for a in plan.mesh)
    typed = set(axes) | set(plan.explicit_axes)
    return "mesh " + ", ".join(f"{a.name} = {size(a)}{' : explicit' if a.name in typed else ''}" for a in plan.mesh)


def _where_plan_says(plan: Any) -> str:
    if plan is None or plan.mesh_span is None:
        return ""
    return f" (the plan's mesh line is {plan.mesh_span.file}:{plan.mesh_span.line})"


def needs_explicit(e: BaseException, frame: str, plan: Any) -> Diagnostic | None:
    """The diagnostic for a model that types arrays by mesh axes (``out_sharding=P("data")``,
    ``reshard``) while the plan's mesh has those axes as auto."""
    m = _NOT_EXPLICIT.search(str(e))
    if m is None:
        return None
    op, spec, axis = m.group(1), m.group(2), m.group(3)
    where = f" at {frame}" if frame else ""
    every = "every axis" if plan is not None and not plan.explicit_axes else f"axis '{axis}'"
    return error(
        "needs-explicit-axes",
        f"the model passes {spec} to {op}{where}, which needs mesh axis '{axis}' to be explicit "
        f"(sharding in types), but the plan's mesh has it as auto",
        f"type the plan's mesh axes explicit: write `{explicit_mesh_line(plan)}`{_where_plan_says(plan)}; "
        f"`{explicit_mesh_line(plan, (axis,))}` types {every if every == 'every axis' else 'that axis'} only",
        path=frame or "model",
    )


def _source_text(frame: str) -> str:
    file, _, line = frame.rpartition(":")
    return linecache.getline(file, int(line)).strip() if file and line.isdigit() else ""


def sharding_type(e: BaseException, frame: str, plan: Any) -> Diagnostic | None:
    """The diagnostic for an operation JAX's sharding type checker rejects (``ShardingTypeError``):
    the user's line, and JAX's own advice kept whole."""
    if not isinstance(e, ShardingTypeError):
        return None
    text = _source_text(frame)
    where = f" at {frame}" + (f" ({text})" if text else "") if frame else ""
    axes = ", ".join(plan.explicit_axes) if plan is not None and plan.explicit_axes else "explicit"
    return error(
        "sharding-type",
        f"JAX's sharding type check rejects an operation{where}: {e}",
        "follow JAX's advice above in the model or loss: give the operation its output sharding "
        "(out_sharding=), or jax.sharding.reshard its operands first (an integer-label cross-entropy over "
        "logits split on the vocabulary: reshard the logits to P(<batch axes>, None, None) before it); "
        f"or type the axes involved auto in the plan (mesh axes {axes} are explicit now)",
        path=frame or "loss_fn",
    )


def check_loss(loss_fn: Any, model: Any, batch: Any, *, where: str = "loss_fn", plan: Any = None) -> None:
    """The loss must trace on the model and batch (abstractly: nothing runs) and return a float scalar.

    ``plan``: the plan the step runs under, named in the hints of sharding-type errors.

    Raises:
        PlanApplyError: it fails (naming the innermost frame of the user's code), or returns no scalar.
    """
    try:
        out = nnx.eval_shape(loss_fn, model, batch)
    except ShardPlanError:
        raise
    except Exception as e:  # the user's code: show their error and their frame, not ours
        frame = user_frame(e.__traceback__)
        known = axis_mismatch(e, frame) or needs_explicit(e, frame, plan) or sharding_type(e, frame, plan)
        if known is not None:
            raise as_error([known]) from None
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
