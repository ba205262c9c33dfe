"""Layouts as XLA chose them: an instruction's ``sharding={devices=[...]<=[...]T(...) ...}`` read
back into the mesh axes each dim is split over (a plan's terms), for a program whose shardings
are still on its instructions: XLA's module after sharding propagation, before it is partitioned
(dumped with ``--xla_dump_to=DIR --xla_dump_hlo_pass_re=shardy-xla``, the file
``*after_shardy-xla.before_spmd-partitioning.txt``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardplan.core.hlo.frames import _tables
from shardplan.core.hlo.groups import _iota, _unravel
from shardplan.core.hlo.text import _FRAME, _ints

Dims = tuple[tuple[str, ...], ...]  # per dim: the mesh axes it is split over, major first

_TILED = re.compile(r"devices=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_LISTED = re.compile(r"devices=\[([0-9,]+)\]([0-9,]+)(?=[ }]|$)")
_SHARDING = re.compile(r"sharding=\{([^{}]*)\}")
_RESULT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([0-9,]*)\]\S* ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def dims(sharding: str, rank: int, mesh: Sequence[tuple[str, int]]) -> Dims | None:
    """The mesh axes each of a rank-``rank`` value's dims is split over, from XLA's sharding text
    (``replicated``, or ``devices=[tiles]<=[iota dims]T(perm)`` and the listed form, with a
    trailing replicated tile dim: ``last_tile_dim_replicate``); the devices are the mesh's in
    order (``mesh``: axis name and size, major first). None where the tiles are not whole mesh
    axes (a part of an axis, a maximal or manual sharding)."""
    text = sharding.strip()
    if text in ("replicated", ""):
        return ((),) * rank
    m = _TILED.match(text)
    if m:
        tiles, shape = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(shape)))
        ids = _iota(shape, perm)
    else:
        listed = _LISTED.match(text)
        if not listed:
            return None
        tiles, ids = _ints(listed.group(1)), _ints(listed.group(2))
    sizes = [s for _, s in mesh]
    if len(tiles) < rank or math.prod(tiles) != len(ids) or len(ids) != math.prod(sizes):
        return None
    strides = [math.prod(tiles[i + 1 :]) for i in range(len(tiles))]
    out: list[tuple[str, ...]] = []
    for k in range(rank):
        if tiles[k] == 1:
            out.append(())
            continue
        # the devices along dim k (every other tile index 0), as mesh coordinates
        line = [_unravel(ids[j * strides[k]], sizes) for j in range(tiles[k])]
        varying = [a for a in range(len(sizes)) if len({c[a] for c in line}) > 1]
        if math.prod(sizes[a] for a in varying) != tiles[k]:
            return None
        changes = {a: sum(line[j][a] != line[j - 1][a] for j in range(1, len(line))) for a in varying}
        order = sorted(varying, key=lambda a: changes[a])  # major first: the axis that changes least
        base = line[0]
        for j, c in enumerate(line):  # the tiles must walk those axes in that order, whole
            rest = j
            for a in reversed(order):
                rest, want = divmod(rest, sizes[a])
                if c[a] != (base[a] + want) % sizes[a] or base[a] != 0:
                    return None
        out.append(tuple(mesh[a][0] for a in order))
    return tuple(out)


@dataclass(frozen=True)
class Chosen:
    """One instruction's result as XLA laid it out: its source line (the innermost frame outside
    libraries), the op (``op_name``'s last part: the jax primitive), shape and layout, and the whole
    ``op_name`` (jax's name stack: ``runtime.shardy`` names equations by their path there)."""

    source: str
    op: str
    shape: tuple[int, ...]
    dims: Dims | None
    name: str = ""


def layouts(hlo_text: str, mesh: Sequence[tuple[str, int]]) -> list[Chosen]:
    """Every array-valued instruction of a propagated (not yet partitioned) module, in program
    order, with the layout its sharding gives it (an instruction without one: whole)."""
    frames = _tables(hlo_text)
    out: list[Chosen] = []
    for line in hlo_text.split("\n"):
        m = _RESULT.match(line)
        if not m:
            continue
        shape = tuple(_ints(m.group(1))) if m.group(1) else ()
        sharding = _SHARDING.search(line)
        name = _OP_NAME.search(line)
        frame = _FRAME.search(line)
        source = frames.source(int(frame.group(1))) if frame else ""
        op = name.group(1).rsplit("/", 1)[-1] if name else m.group(2)
        out.append(
            Chosen(
                source,
                op,
                shape,
                dims(sharding.group(1), len(shape), mesh) if sharding else ((),) * len(shape),
                name.group(1) if name else "",
            )
        )
    return out
