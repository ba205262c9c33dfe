"""What a compiled step communicates: collectives read from optimized HLO text.

Bytes are per device, per step: for all-reduce and all-to-all the buffer reduced/exchanged;
for all-gather the gathered result; for reduce-scatter the operand (before scattering);
for collective-permute the buffer sent.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")


@dataclass(frozen=True)
class CollectiveOp:
    kind: str
    shapes: tuple[str, ...]
    bytes: int
    group_size: int


def _shape_bytes(shape: str) -> tuple[int, tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _group_size(line: str) -> int:
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return 1


def parse(hlo_text: str) -> list[CollectiveOp]:
    """Every collective instruction in optimized HLO (async ``-start`` halves counted once)."""
    ops = []
    for line in hlo_text.split("\n"):
        m = _INSTR.match(line)
        if not m:
            continue
        kind = m.group("op")
        shape = m.group("shape")
        if m.group("start"):  # async start: result tuple holds (operand, result); count the result
            inner = _ARRAY.findall(shape)
            shape = f"{inner[-1][0]}[{inner[-1][1]}]" if inner else shape
        nbytes, shapes = _shape_bytes(shape)
        group = _group_size(line)
        if kind == "reduce-scatter":
            nbytes *= group
        ops.append(CollectiveOp(kind, shapes, nbytes, group))
    return ops


def summarize(ops: list[CollectiveOp]) -> dict[str, dict[str, int]]:
    """{kind: {"count": instructions, "bytes": per-device bytes}} for every kind."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for op in ops:
        out[op.kind]["count"] += 1
        out[op.kind]["bytes"] += op.bytes
    return out


def report(compiled) -> dict[str, dict[str, int]]:
    """The collectives summary of a compiled jax function (``.lower(...).compile()``)."""
    return summarize(parse(compiled.as_text()))
