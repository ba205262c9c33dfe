"""The HLO text itself: computations and their instructions, array shapes and their bytes, the
regular expressions the readers share. Jax-free: it reads what ``compiled.as_text()`` prints."""

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
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)


_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_PARAM_INDEX = re.compile(r"\bparameter\((\d+)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _shape_bytes(shape: str) -> tuple[int, tuple[str, ...], int]:
    """(bytes, array shapes, elements of the first array) of an HLO shape string."""
    total, shapes, first = 0, [], -1
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
        first = n if first < 0 else first
    return total, tuple(shapes), first


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array. Commas
    inside layouts (``{1,0:T(8,128)}``) and dims are not separators."""
    text = shape.strip()
    if not text.startswith("("):
        return [text]
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text[1 : text.rindex(")")]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _async_result(op: str, shape: str) -> str:
    """The result of an async collective's ``-start``, from its shape. ``all-reduce-start`` returns
    its result (a tuple of results when XLA combined several); the other starts return
    ``(operands, results, contexts...)``: element 1 (a tuple when combined: XLA:GPU's combined
    all-gathers), not the last array (TPU's collective-permute-start ends in ``u32[]`` contexts)."""
    if op == "all-reduce-start" or not shape.strip().startswith("("):
        return shape
    parts = _elements(shape)
    return parts[1] if len(parts) >= 2 else shape


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo_text.split("\n"):
        c = None if line.startswith(" ") else _COMP.match(line)  # headers are not indented
        if c:
            current = c.group("name")
            comps[current] = []
            if c.group("entry"):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(
                _Instr(m.group("name"), m.group("shape"), m.group("op"), _OPERAND.findall(m.group("args")), line)
            )
    return comps, entry


def _dims_of(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []
