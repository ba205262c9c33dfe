"""Stage 4 (live): a plan's mesh on real devices."""

from __future__ import annotations

from typing import Literal, Sequence

import jax
from jax.sharding import AxisType, Mesh

from shardplan.errors import PlanApplyError, PlanCheckError, error
from shardplan.plan import Plan

AxisTypes = Literal["auto", "explicit"]


def make_mesh(plan: Plan, devices: Sequence | None = None, axis_types: AxisTypes = "auto") -> Mesh:
    """Build the plan's ``Mesh`` over ``devices`` (default: all devices, every process).

    A ``*`` axis takes the remaining devices. The device order is ``jax.make_mesh``'s,
    which keeps the last mesh axis within a host (put ``model`` last). Under
    ``jax.distributed``, axes are laid out so the leading (data) axes span processes.

    Args:
        plan: a checked plan.
        devices: the devices to use; all of ``jax.devices()`` by default.
        axis_types: ``"auto"`` (XLA propagates shardings; the default) or ``"explicit"``
            (shardings are part of array types, ``jax.make_mesh``'s default in this JAX).

    Raises:
        PlanApplyError: the mesh does not fit the devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    try:
        shape = plan.mesh_shape(len(devs))
    except PlanCheckError as e:
        raise PlanApplyError(e.diagnostics) from None
    if axis_types not in ("auto", "explicit"):
        raise PlanApplyError([error("bad-axis-types", f"unknown axis_types '{axis_types}'",
                                    "use 'auto' or 'explicit'", path="axis_types")])
    kind = AxisType.Auto if axis_types == "auto" else AxisType.Explicit
    names, sizes = tuple(shape), tuple(shape.values())
    if jax.process_count() > 1 and devices is None:
        return _multi_process_mesh(names, sizes, kind, devs)
    return jax.make_mesh(sizes, names, axis_types=(kind,) * len(names), devices=devs)


def _multi_process_mesh(names, sizes, kind, devs) -> Mesh:
    """Across processes: the inner axes within a process where their sizes allow, the rest
    (the leading, data axes) across processes (``create_hybrid_device_mesh``)."""
    from jax.experimental import mesh_utils

    per_process = len(devs) // jax.process_count()
    inner, outer, left = [], [], per_process
    for size in reversed(sizes):  # fill each process from the last axis
        if left % size == 0 and left >= size:
            inner.insert(0, size)
            outer.insert(0, 1)
            left //= size
        else:
            if size % left:
                raise PlanApplyError([error(
                    "mesh-processes", f"mesh {dict(zip(names, sizes))} cannot be laid out over "
                    f"{jax.process_count()} processes of {per_process} devices",
                    "make the product of the trailing axes divide the devices per process")])
            inner.insert(0, left)
            outer.insert(0, size // left)
            left = 1
    if left != 1:
        inner[0] *= left
        outer[0] //= left
    arr = mesh_utils.create_hybrid_device_mesh(inner, outer, devices=devs, process_is_granule=True)
    return Mesh(arr, names, axis_types=(kind,) * len(names))


def mesh_shape_of(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))
