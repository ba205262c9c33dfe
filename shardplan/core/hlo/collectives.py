"""The collectives of a compiled step, read from its optimized HLO text.

Jax-free: it reads the text ``compiled.as_text()`` prints. For each collective it gives
the kind, the per-device bytes, how many times it runs per step (a collective inside a
``while`` body, e.g. a scan over layers, runs once per iteration), its device groups and,
given the mesh, the mesh axes it runs over, and where it comes from (the op name and the
innermost source line outside jax/flax/shardplan, from the HLO's stack-frame tables).

Bytes are per device, per execution: for all-reduce and all-to-all the buffer
reduced/exchanged; for all-gather the gathered result; for reduce-scatter the operand
(before scattering); for collective-permute the buffer sent.

XLA:CPU never emits a reduce-scatter for GSPMD programs: it all-reduces and each device
slices its block (an accelerator emits a reduce-scatter for the same program). An
all-reduce whose every use is such a per-device slice is reported with
``as_reduce_scatter=True`` so it can be compared with an accelerator's reduce-scatter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from shardplan.core.hlo.frames import _tables
from shardplan.core.hlo.groups import _groups, _unravel
from shardplan.core.hlo.loops import _runs
from shardplan.core.hlo.text import (
    _ARRAY,
    _CALLS,
    _CHANNEL,
    _DTYPE_BYTES,
    _FRAME,
    _OP_NAME,
    _PARAM_INDEX,
    KINDS,
    _async_result,
    _computations,
    _Instr,
    _shape_bytes,
)


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled step."""

    kind: str
    shapes: tuple[str, ...]
    bytes: int  # per device, per execution
    group_size: int = 1
    groups: tuple[tuple[int, ...], ...] = ()  # device groups (logical device ids)
    runs: int = 1  # executions per step (trip counts of enclosing while loops)
    name: str = ""
    op_name: str = ""  # jax's op name from the metadata, e.g. jit(step)/transpose(jvp())/dot_general
    source: str = ""  # innermost user source 'file:line' from the stack frames, if any
    as_reduce_scatter: bool = False  # an all-reduce whose every use is a per-device slice
    launch: bool = True  # False: a further array of one combined (tuple) all-reduce, launched with the first
    moves: str = ""  # the jitted function's argument it moves, when it reads one: "sm/blocks/0/attn/query/kernel"
    axes: tuple[str, ...] = field(default=())  # mesh axes, once :func:`with_axes` has named them

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.runs


_ARG_PATH = re.compile(r"\['([^']*)'\]|\[(\d+)\]")
_PASS_THROUGH = ("copy", "bitcast", "transpose", "reshape", "convert", "fusion", "get-tuple-element")


def _argument(ins: _Instr, defs: dict[str, _Instr], depth: int = 8) -> str:
    """The jitted function's argument a collective's operand is (through copies, layout
    changes and one-operand fusions): its path from the parameter's metadata, e.g.
    ``sm['blocks'][0]['attn']['key']['kernel'].value`` -> ``sm/blocks/0/attn/key/kernel``."""
    current = ins
    for _ in range(depth):
        if current.op == "parameter":
            m = _OP_NAME.search(current.line)
            if not m:
                return ""
            name = m.group(1).replace("\\'", "'")
            head = re.match(r"[A-Za-z_]\w*", name)
            parts = [a or b for a, b in _ARG_PATH.findall(name)]
            return "/".join(([head.group(0)] if head else []) + parts)
        operands = [defs[o] for o in current.operands if o in defs and defs[o].op != "constant"]
        if len(operands) != 1 or (current is not ins and not _same_data(current, operands[0])):
            return ""
        current = operands[0]
    return ""


def _same_data(ins: _Instr, operand: _Instr) -> bool:
    """``ins`` only moves, relayouts or casts ``operand``: a pass-through op with the same elements
    (and dtype, but for a convert: XLA:TPU casts f32 params to bf16 before gathering them)."""
    a, b = _ARRAY.findall(ins.shape), _ARRAY.findall(operand.shape)
    return (
        ins.op in _PASS_THROUGH
        and len(a) == len(b) == 1
        and (a[0][0] == b[0][0] or ins.op == "convert")
        and _shape_bytes(ins.shape)[2] == _shape_bytes(operand.shape)[2]
    )


def _is_slice_user(user: _Instr, value: str, elements: int, group: int, comps: dict[str, list[_Instr]]) -> bool:
    """A per-device slice of an all-reduce result ``value``: a dynamic-slice (or a fusion built
    around one) whose result is 1/group of the reduced buffer, or a fusion that only reads a
    1/group slice of it (inside a scan, where the slice is written into the stacked gradient)."""
    if user.op == "get-tuple-element" or group <= 1:
        return False
    by_device = any(o.startswith(("partition-id", "replica-id")) for o in user.operands)
    slicing = user.op == "dynamic-slice" or (user.op == "fusion" and ("dynamic-slice" in user.name or by_device))
    n = _shape_bytes(user.shape)[2]
    if slicing and n > 0 and n * group == elements:
        return True
    called = _CALLS.search(user.line) if user.op == "fusion" else None
    body = comps.get(called.group(1), []) if called else []
    positions = {str(i) for i, o in enumerate(user.operands) if o == value}
    params = {i.name for i in body if i.op == "parameter" and _param_index(i) in positions}
    reads = [i for i in body if params & set(i.operands)]
    return bool(reads) and all(
        i.op in ("dynamic-slice", "slice") and _shape_bytes(i.shape)[2] * group == elements for i in reads
    )


def _sliced(
    user: _Instr, value: str, elements: int, group: int, comps: dict[str, list[_Instr]], users: dict[str, list[_Instr]]
) -> bool:
    """``_is_slice_user``, also through another all-reduce (over other mesh axes) in between:
    sums commute, so a sum whose result is summed again and then only sliced per device (by the
    first sum's group) is that sum's reduce-scatter (an embedding's gradient summed over the
    tokens' two axes, its rows split over one)."""
    if _is_slice_user(user, value, elements, group, comps):
        return True
    if user.op != "all-reduce" or value not in user.operands:
        return False
    tuple_result = user.shape.startswith("(")
    nxt = _element_users(users, user, user.operands.index(value) if tuple_result else None)
    return bool(nxt) and all(_is_slice_user(u, name, elements, group, comps) for u, name in nxt)


def _param_index(ins: _Instr) -> str:
    m = _PARAM_INDEX.search(ins.line)
    return m.group(1) if m else ""


def _element_users(users: dict[str, list[_Instr]], ins: _Instr, index: int | None) -> list[tuple[_Instr, str]]:
    """Users of a collective's result, or of element ``index`` of its tuple result, each with
    the name it reads the value by."""
    if index is None:
        return [(u, ins.name) for u in users.get(ins.name, [])]
    out = []
    for gte in users.get(ins.name, []):
        if gte.op == "get-tuple-element" and re.search(rf"\bindex={index}\b", gte.line):
            out += [(u, gte.name) for u in users.get(gte.name, [])]
    return out


def parse(hlo_text: str, n_devices: int | None = None) -> list[CollectiveOp]:
    """Every collective instruction in optimized HLO (async ``-start`` halves counted once).

    One collective may be written several times: XLA:TPU's async collective fusions repeat the
    collective in flight (its ``channel_id`` and result) in the start fusion and in each
    continuation fusion that computes while it moves (a weight gathered during three matmuls
    is written three times). Instructions of one kind in those fusions that share a channel id
    are one collective, counted once."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    frames = _tables(hlo_text)
    users: dict[str, list[_Instr]] = {}
    defs: dict[str, _Instr] = {}
    for instrs in comps.values():
        for ins in instrs:
            defs[ins.name] = ins
            for o in ins.operands:
                users.setdefault(o, []).append(ins)
    ops = []
    channels: set[tuple[str, str]] = set()
    # The fusions XLA:TPU writes an async collective's copies in (its start, continuation and done
    # fusions); its reduce-scatter fusions (``all-reduce-scatter.N``) are one collective each, and
    # several share a channel id (measured: three gradient reduce-scatters, channel 1 each).
    fused = {
        m.group(1)
        for instrs in comps.values()
        for i in instrs
        if i.op == "fusion"
        and (m := _CALLS.search(i.line))
        and (i.name.startswith("async-collective") or m.group(1).startswith("async_collective_fusion"))
    }
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = ins.op[:-6] if ins.op.endswith("-start") else ins.op
            if kind not in KINDS:
                continue
            channel = _CHANNEL.search(ins.line) if comp in fused else None
            if channel:  # within fusions only: XLA:CPU's shard_map collectives may share one
                if (kind, channel.group(1)) in channels:
                    continue
                channels.add((kind, channel.group(1)))
            shape = ins.shape
            if ins.op.endswith("-start"):  # async start: count its result (the operands are in its tuple too)
                shape = _async_result(ins.op, shape)
            nbytes, shapes, elements = _shape_bytes(shape)
            groups = _groups(ins.line, n_devices)
            group = len(groups[0]) if groups else 1
            if kind == "reduce-scatter":
                nbytes *= group
            op_name = _OP_NAME.search(ins.line)
            frame = _FRAME.search(ins.line)
            base = CollectiveOp(
                kind,
                shapes,
                nbytes,
                group,
                groups,
                runs.get(comp, 1),
                ins.name,
                op_name.group(1) if op_name else "",
                frames.source(int(frame.group(1))) if frame else "",
            )
            moves = _argument(ins, defs) if comp == entry else ""
            if kind == "all-reduce":
                # One entry per reduced array (XLA combines several into one tuple all-reduce),
                # each checked for being only sliced per device: a reduce-scatter on an accelerator.
                arrays = [f"{d}[{dims}]" for d, dims in _ARRAY.findall(shape) if d in _DTYPE_BYTES]
                tuple_result = len(arrays) > 1 or shape.startswith("(")
                for i, text in enumerate(arrays):
                    b, _, n = _shape_bytes(text)
                    us = _element_users(users, ins, i if tuple_result else None)
                    rs = bool(us) and all(_sliced(u, name, n, group, comps, users) for u, name in us)
                    ops.append(
                        replace(
                            base,
                            shapes=(text,),
                            bytes=b,
                            as_reduce_scatter=rs,
                            moves="" if tuple_result else moves,
                            launch=i == 0,
                        )
                    )
                continue
            ops.append(replace(base, moves=moves))
    return ops


def with_axes(ops: list[CollectiveOp], mesh: dict[str, int]) -> list[CollectiveOp]:
    """Name each collective's mesh axes: the axes along which the devices of its first group
    differ (logical device id = position in the mesh's row-major device order)."""
    names, sizes = list(mesh), list(mesh.values())
    total = math.prod(sizes)
    out = []
    for op in ops:
        axes: tuple[str, ...] = ()
        if op.groups:
            ids = [i for i in op.groups[0] if i < total]
            coords = [_unravel(i, sizes) for i in ids]
            axes = tuple(n for k, n in enumerate(names) if len({c[k] for c in coords}) > 1)
            if op.kind == "collective-permute":  # pairs: the union over every pair
                varying = set()
                for g in op.groups:
                    cs = [_unravel(i, sizes) for i in g if i < total]
                    varying |= {k for k in range(len(names)) if len({c[k] for c in cs}) > 1}
                axes = tuple(names[k] for k in sorted(varying))
        out.append(replace(op, axes=axes))
    return out


def summarize(ops: list[CollectiveOp], *, reduce_scatter_on_cpu: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count": executions per step, "bytes": per-device bytes per step}} for every kind.

    ``reduce_scatter_on_cpu``: count an all-reduce that every device only slices as the
    reduce-scatter an accelerator would run (same bytes: the reduce-scatter's operand)."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for op in ops:
        kind = "reduce-scatter" if reduce_scatter_on_cpu and op.as_reduce_scatter else op.kind
        out[kind]["count"] += op.runs
        out[kind]["bytes"] += op.bytes_per_step
    return out


def report(compiled: Any) -> dict[str, dict[str, int]]:
    """The collectives summary of a compiled jax function (``.lower(...).compile()``)."""
    return summarize(parse(compiled.as_text()))
