"""Loops and calls in an HLO program: a ``while`` loop's trip count (XLA's known-trip-count
annotation, else its counter read from the condition) and how often each computation runs per step."""

from __future__ import annotations

import re

from shardplan.core.hlo.text import _BODY, _BRANCHES, _CALLEES, _CALLS, _OPERAND, _TRIP, _computations, _Instr

_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_CONSTANT = re.compile(r"constant\((\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")


def _trip_count(ins: _Instr, comps: dict[str, list[_Instr]]) -> int:
    """A while loop's iterations: its ``known_trip_count`` (XLA:CPU, XLA:GPU), else read from its
    condition as XLA:TPU leaves it, ``counter < N`` on a scalar integer constant (a scan's loop,
    counting from 0); 1 when neither says."""
    trip = _TRIP.search(ins.line)
    if trip:
        return int(trip.group(1))
    cond = _CONDITION.search(ins.line)
    body = comps.get(cond.group(1), []) if cond else []
    defs = {i.name: i for i in body}
    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), None)
    if root is None or root.op != "compare" or "direction=LT" not in root.line or len(root.operands) != 2:
        return 1
    counter, bound = (defs.get(o) for o in root.operands)
    if counter is None or bound is None or counter.op != "get-tuple-element" or bound.op != "constant":
        return 1
    m = _CONSTANT.search(bound.line)
    if not (m and re.match(r"[su](8|16|32|64)\[\]", bound.shape)):
        return 1
    index = _INDEX.search(counter.line)
    if index is None:
        return int(m.group(1))
    start, step = _counter(ins, comps, int(index.group(1)))
    return max(0, -(-(int(m.group(1)) - start) // step))


def _counter(loop: _Instr, comps: dict[str, list[_Instr]], index: int) -> tuple[int, int]:
    """Where a while loop's counter (tuple element ``index``) starts and by how much its body
    steps it: XLA:TPU unrolls its windowed einsums' loops, stepping 2 towards the same bound.
    (0, 1) where the program does not say."""

    def value(name: str, defs: dict[str, _Instr]) -> int | None:
        ins = defs.get(name)
        while ins is not None and ins.op == "copy" and ins.operands:
            ins = defs.get(ins.operands[0])
        m = _CONSTANT.search(ins.line) if ins is not None and ins.op == "constant" else None
        return int(m.group(1)) if m else None

    body = _BODY.search(loop.line)
    instrs = comps.get(body.group(1), []) if body else []
    defs = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.line.lstrip().startswith("ROOT ")), None)
    step = 1
    if root is not None and root.op == "tuple" and index < len(root.operands):
        bump = defs.get(root.operands[index])
        if bump is not None and bump.op == "add" and len(bump.operands) == 2:
            steps = [value(o, defs) for o in bump.operands]
            step = next((v for v in steps if v), 1)
    home = next((c for c in comps.values() if any(i is loop for i in c)), [])
    outer = {i.name: i for i in home}
    init = outer.get(loop.operands[0]) if loop.operands else None
    start = None
    if init is not None and init.op == "tuple" and index < len(init.operands):
        start = value(init.operands[index], outer)
    return start or 0, max(1, step)


def _runs(comps: dict[str, list[_Instr]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (while bodies x trip count)."""
    runs = {entry: 1} if entry else {}
    stack = [entry] if entry else []
    while stack:
        name = stack.pop()
        for ins in comps.get(name, []):
            mult = _trip_count(ins, comps) if ins.op == "while" else 1
            callees = _BODY.findall(ins.line) + _CALLEES.findall(ins.line)
            for b in _BRANCHES.findall(ins.line):
                callees += _OPERAND.findall(b)
            for callee in callees:
                n = runs[name] * (mult if callee in _BODY.findall(ins.line) else 1)
                if callee in comps and runs.get(callee, 0) < n:
                    runs[callee] = n
                    stack.append(callee)
    return runs


def _bodies(comps: dict[str, list[_Instr]]) -> set[str]:
    return {
        body.group(1)
        for instrs in comps.values()
        for ins in instrs
        if ins.op == "while" and (body := _BODY.search(ins.line)) and body.group(1) in comps
    }


def matmul_rings(hlo_text: str) -> int:
    """While loops whose body holds a collective-permute beside a matmul (a dot or convolution, in
    the body or a fusion it calls): XLA:TPU's windowed einsums, a matmul cut into chunks with the
    partial results (or operands) passed around a ring of devices while the next chunk computes."""
    comps, _ = _computations(hlo_text)

    def holds(name: str, ops: tuple[str, ...], seen: frozenset[str]) -> bool:
        for ins in comps.get(name, []):
            if ins.op in ops:
                return True
            for callee in _CALLS.findall(ins.line):
                if callee not in seen and holds(callee, ops, seen | {callee}):
                    return True
        return False

    permutes = ("collective-permute", "collective-permute-start")
    return sum(
        1
        for instrs in comps.values()
        for ins in instrs
        if ins.op == "while"
        and (body := _BODY.search(ins.line))
        and holds(body.group(1), permutes, frozenset({body.group(1)}))
        and holds(body.group(1), ("dot", "convolution"), frozenset({body.group(1)}))
    )
