"""Device groups of a collective: replica groups as XLA prints them (a list, an iota with a
transpose, or named mesh axes) and source-target pairs, turned into tuples of device ids."""

from __future__ import annotations

import math
import re

from shardplan.core.hlo.text import _ints

_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
# The mesh form: XLA's own axes (``'axis_0'=4,...``), where the device order is not the mesh's
# row-major one a ``device_ids`` iota (``([2,4]T(1,0))``: iota over [2, 4], transposed) or list
# saying which device sits at each mesh position, then the axes a group varies along.
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=(?:\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\)|\{([0-9,]*)\}))?"
    r"\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


def _groups(line: str, n_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = _GROUPS_IOTA.search(line)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
        ids = _iota(dims, perm)
        size = shape[-1]
        return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))
    m = _GROUPS_MESH.search(line)
    if m:
        axes = [(a.split("=")[0].strip().strip("'"), int(a.split("=")[1])) for a in m.group(1).split(",") if a]
        over = {a.strip().strip("'") for a in m.group(5).split(",") if a.strip()}
        groups = _mesh_groups(axes, over)
        if m.group(2):  # the device at each mesh position: an iota, transposed
            dims = _ints(m.group(2))
            at = _iota(dims, _ints(m.group(3)) if m.group(3) else list(range(len(dims))))
        elif m.group(4) is not None:
            at = _ints(m.group(4))
        else:
            return groups
        return tuple(tuple(at[i] for i in g) for g in groups)
    m = _GROUPS_LIST.search(line)
    if m:
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = _PAIRS.search(line)
    if m:  # collective-permute: each (source, target) pair exchanges
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([0-9]+,[0-9]+)\}", m.group(1)))
    if n_devices:
        return (tuple(range(n_devices)),)
    return ()


def _iota(dims: list[int], perm: list[int]) -> list[int]:
    """iota(prod(dims)).reshape(dims).transpose(perm).flatten(), without numpy."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    out_strides = [strides[p] for p in perm]
    ids = []
    for flat in range(math.prod(dims)):
        rem, idx = flat, 0
        for d, s in zip(reversed(out_dims), reversed(out_strides), strict=True):
            rem, i = divmod(rem, d)
            idx += i * s
        ids.append(idx)
    return ids


def _mesh_groups(axes: list[tuple[str, int]], over: set[str]) -> tuple[tuple[int, ...], ...]:
    """Groups of the mesh form: device ids are an iota over ``axes``; a group varies along ``over``."""
    sizes = [s for _, s in axes]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    inner = [i for i, (name, _) in enumerate(axes) if name in over]
    outer = [i for i, (name, _) in enumerate(axes) if name not in over]

    def coords(dims: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[]]
        for d in dims:
            out = [c + [k] for c in out for k in range(sizes[d])]
        return out

    groups = []
    for oc in coords(outer):
        base = sum(k * strides[d] for d, k in zip(outer, oc, strict=True))
        groups.append(tuple(base + sum(k * strides[d] for d, k in zip(inner, ic, strict=True)) for ic in coords(inner)))
    return tuple(groups)


def _unravel(i: int, sizes: list[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        i, r = divmod(i, s)
        out.append(r)
    return tuple(reversed(out))
