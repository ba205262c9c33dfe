"""Memory traffic and kernel launches of a compiled program read from its HLO: the bytes each
kernel reads and writes (slices read only what they take), loop bodies times their runs."""

from __future__ import annotations

import re

from shardplan.core.hlo.flops import _TO_APPLY
from shardplan.core.hlo.loops import _runs
from shardplan.core.hlo.text import (
    _ARRAY,
    _BRANCHES,
    _CALLS,
    _OPERAND,
    _PARAM_INDEX,
    KINDS,
    _async_result,
    _computations,
    _Instr,
    _shape_bytes,
)

# Instructions that move no data in memory themselves (their callees are counted where they run).
_NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "copy-start",
    "async-update",
    "domain",
    "add-dependency",
    "opt-barrier",
}


_SLICING = ("dynamic-slice", "slice", "gather")


def memory_bytes(hlo_text: str) -> float:
    """Bytes a program reads and writes in device memory per run: each instruction outside fused
    computations (a fusion is one kernel) reads its operands and writes its result, times the runs
    of its computation (a ``while`` body once per iteration; XLA's cost analysis counts it once
    and leaves out library calls such as cuBLAS matmuls). As XLA's cost analysis does, a fusion
    operand read only through slices counts the slices, and a fusion that updates a slice of an
    operand in place (``dynamic-update-slice``) writes the update, not the buffer."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    total = 0.0
    for name in _control_flow(comps, entry):
        defs = {i.name: i for i in comps[name]}
        for ins in comps[name]:
            if ins.op in _NO_TRAFFIC or ins.op.endswith("-done"):  # an async op counts at its start
                continue
            total += runs.get(name, 1) * _instr_traffic(ins, defs, comps)
    return total


def kernel_count(hlo_text: str) -> float:
    """Kernels a program launches per run: the instructions outside fused computations that move
    data (a fusion is one kernel; an async collective counts at its start), times the runs of
    their computation (a ``while`` body once per iteration)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    return float(
        sum(
            runs.get(name, 1)
            for name in _control_flow(comps, entry)
            for ins in comps[name]
            if ins.op not in _NO_TRAFFIC and not ins.op.endswith("-done")
        )
    )


def _control_flow(comps: dict[str, list[_Instr]], entry: str) -> list[str]:
    """The computations that run as instructions of their own: the entry, loop bodies and
    conditions, conditional branches and called computations (not fusions or reducers)."""
    out, stack = [], [entry] if entry in comps else []
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.append(name)
        for ins in comps[name]:
            callees: list[str] = []
            if ins.op == "while":
                callees = re.findall(r"\b(?:body|condition)=%([\w.\-]+)", ins.line)
            elif ins.op == "conditional":
                callees = re.findall(r"\b(?:true_computation|false_computation)=%([\w.\-]+)", ins.line)
                for b in _BRANCHES.findall(ins.line):
                    callees += _OPERAND.findall(b)
            elif ins.op == "call":
                callees = _TO_APPLY.findall(ins.line)
            stack += [c for c in callees if c in comps]
    return out


def _instr_traffic(ins: _Instr, defs: dict[str, _Instr], comps: dict[str, list[_Instr]]) -> float:
    size = {o: float(_shape_bytes(defs[o].shape)[0]) for o in ins.operands if o in defs}
    reads = [size.get(o, 0.0) for o in ins.operands]
    write = float(_shape_bytes(ins.shape)[0])
    if ins.op == "dynamic-update-slice" and len(reads) > 1:  # in place: the update is read and written
        return 2 * reads[1] + sum(reads[2:])
    if ins.op in ("dynamic-slice", "slice", "gather") and reads:  # reads of the operand what it returns
        return 2 * write + sum(reads[1:])
    if ins.op.endswith("-start") and ins.op != "fusion-start" and ins.shape.startswith("("):
        # An async op's result tuple holds its operands (and a context) beside its result.
        if ins.op[:-6] in KINDS:  # a collective: its results (several when combined)
            write = float(_shape_bytes(_async_result(ins.op, ins.shape))[0])
        else:
            write = max((float(_shape_bytes(f"{d}[{dims}]")[0]) for d, dims in _ARRAY.findall(ins.shape)), default=0.0)
    body = next(iter(_CALLS.findall(ins.line)), None) if ins.op in ("fusion", "fusion-start") else None
    if body is None or body not in comps:
        return sum(reads) + write
    if ins.op == "fusion-start":  # its result is (operands, output, context): the fused computation's root says
        write = 0.0
    fused = comps[body]
    params = {int(m.group(1)): i.name for i in fused if (m := _PARAM_INDEX.search(i.line)) and i.op == "parameter"}
    users: dict[str, list[_Instr]] = {}
    for i in fused:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = next((i for i in fused if i.line.lstrip().startswith("ROOT")), fused[-1] if fused else None)
    roots = (
        [next((i for i in fused if i.name == o), None) for o in root.operands]
        if root and root.op == "tuple"
        else [root]
    )
    in_place: set[str] = set()
    outs = 0.0
    for r in roots:
        if r is not None and r.op == "dynamic-update-slice" and r.operands and r.operands[0] in params.values():
            in_place.add(r.operands[0])
            upd = next((i for i in fused if i.name == r.operands[1]), None) if len(r.operands) > 1 else None
            outs += float(_shape_bytes(upd.shape)[0]) if upd else 0.0
        elif r is not None:
            outs += float(_shape_bytes(r.shape)[0])
    total = outs
    for k, o in enumerate(ins.operands):
        p = params.get(k)
        if p is None or p in in_place:
            continue
        us = users.get(p, [])
        if us and all(u.op in _SLICING and u.operands and u.operands[0] == p for u in us):
            total += sum(float(_shape_bytes(u.shape)[0]) for u in us)
        else:
            total += size.get(o, 0.0)
    return total
