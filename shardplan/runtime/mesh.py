"""A plan's mesh on real devices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from shardplan.core.plan import Plan
from shardplan.errors import PlanApplyError, as_error, error
from shardplan.runtime.distributed import require_joined

AxisTypes = Literal["auto", "explicit"]


def make_mesh(plan: Plan, devices: Sequence | None = None, axis_types: AxisTypes | None = None) -> Mesh:
    """Build the plan's ``Mesh`` over ``devices`` (default: all devices, every process).

    A ``*`` axis takes the remaining devices. The device order is ``jax.make_mesh``'s,
    which keeps the last mesh axis within a host (put ``model`` last). Under
    ``jax.distributed``, axes are laid out so the leading (data) axes span processes.

    Args:
        plan: a checked plan.
        devices: the devices to use; all of ``jax.devices()`` by default.
        axis_types: ``"auto"`` (XLA propagates shardings) or ``"explicit"`` (shardings are
            part of array types, ``jax.make_mesh``'s default in this JAX) for every axis; by
            default each axis's type from the plan (``mesh explicit ...``, ``model = 2 : explicit``;
            auto where the plan says nothing).

    Raises:
        PlanCheckError: the mesh does not fit the devices.
    """
    if devices is None:
        require_joined()  # one of several processes that did not join: never N silent copies
    devs = list(jax.devices() if devices is None else devices)
    shape = plan.mesh_shape(len(devs))
    if axis_types is not None and axis_types not in ("auto", "explicit"):
        raise as_error(
            [
                error(
                    "bad-axis-types",
                    f"unknown axis_types '{axis_types}'",
                    "use 'auto' or 'explicit'",
                    path="axis_types",
                )
            ]
        )
    names, sizes = tuple(shape), tuple(shape.values())
    kinds = jax_axis_types(plan, names, axis_types)
    if jax.process_count() > 1 and devices is None:
        return _multi_process_mesh(names, sizes, kinds, devs)
    try:
        return jax.make_mesh(sizes, names, axis_types=kinds, devices=devs)
    except NotImplementedError:
        # A TPU slice's torus (8x16x16) has no subset of physical axes for a mesh axis of this
        # size (1024 x 2): the axes are split across physical ones, as jax allows when asked.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(sizes, devs, allow_split_physical_axes=True)
        return Mesh(grid, names, axis_types=kinds)


def jax_axis_types(plan: Plan, names: Sequence[str], override: AxisTypes | None = None) -> tuple[AxisType, ...]:
    """JAX's AxisType of each of ``names``: ``override`` for all, else the plan's per axis."""
    return tuple(_KINDS[override or plan.axis_type(n)] for n in names)


_KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def has_explicit_axes(mesh) -> bool:
    """Whether ``mesh`` (concrete or abstract) has an Explicit axis."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()) or ())


def _multi_process_mesh(names, sizes, kinds, devs) -> Mesh:
    """Across processes: trailing (model) axes inside a process where their sizes allow, the
    leading (data) axes across processes. Each axis of size s is split s = outer x inner,
    filling a process's devices from the last axis; mesh index = outer * inner_size + inner."""
    nproc = jax.process_count()
    per = len(devs) // nproc
    inner: list[int] = []
    left = per
    for size in reversed(sizes):
        take = math.gcd(size, left)
        inner.insert(0, take)
        left //= take
    if left != 1:
        raise PlanApplyError(
            [
                error(
                    "mesh-processes",
                    f"mesh {dict(zip(names, sizes))} cannot be laid out over {nproc} processes of {per} devices",
                    "make the mesh's trailing axes fill a process's devices exactly",
                )
            ]
        )
    outer = [s // i for s, i in zip(sizes, inner)]
    by_proc = sorted(devs, key=lambda d: (d.process_index, d.id))
    grid = np.array(by_proc, dtype=object).reshape(*outer, *inner)  # (outer axes..., inner axes...)
    k = len(sizes)
    order = [ax for pair in zip(range(k), range(k, 2 * k)) for ax in pair]  # (o0, i0, o1, i1, ...)
    arr = grid.transpose(order).reshape(sizes)
    return Mesh(arr, names, axis_types=kinds)


def mesh_shape_of(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))
