"""The order of a compiled program: its kernels in program order, each with the collectives that
run beside it and the compute between them (the scheduled step of ``core.timing``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from shardplan.core.hlo.collectives import CollectiveOp
from shardplan.core.hlo.flops import _comp_flops, _instr_flops
from shardplan.core.hlo.loops import _trip_count
from shardplan.core.hlo.text import _BODY, _BRANCHES, _CALLS, _OPERAND, _computations
from shardplan.core.hlo.traffic import _NO_TRAFFIC, _instr_traffic


@dataclass(frozen=True)
class Step:
    """A compiled program's instructions in the order its schedule runs them (the order the
    optimized HLO prints a scheduled module in): kernels, collectives (a synchronous one, or the
    start and the done of an asynchronous one, which runs while the kernels between them run),
    and loops. Consecutive kernels are one ``work`` step (their FLOPs, bytes and count summed)."""

    kind: str  # "work", "sync", "start", "done" or "loop"
    flops: float = 0.0
    bytes: float = 0.0  # read and written in device memory
    kernels: int = 0
    collective: str = ""  # a collective's kind
    axes: tuple[str, ...] = ()  # its mesh axes
    moved: int = 0  # its bytes per device (as ``CollectiveOp.bytes``)
    key: str = ""  # a start's name, that its done names
    trips: int = 1  # a loop's iterations
    body: tuple[Step, ...] = ()  # a loop's (or a called computation's) steps


def schedule(hlo_text: str, ops: list[CollectiveOp]) -> tuple[Step, ...]:
    """The entry computation's :class:`Step` s in schedule order (``ops``: :func:`parse`'s
    collectives of the same program, :func:`with_axes` applied). A ``while`` is a loop of its
    body's steps; a call or conditional is its callee's (the branch with the most FLOPs)."""
    comps, entry = _computations(hlo_text)
    named: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for op in ops:
        kind, axes, moved = named.get(op.name, (op.kind, op.axes, 0))
        named[op.name] = (kind, axes, moved + op.bytes)
    inside = {  # an async computation -> the collective it runs
        comp: next((named[i.name] for i in instrs if i.name in named), None) for comp, instrs in comps.items()
    }
    memo: dict[str, float] = {}

    def steps(name: str, stack: frozenset[str]) -> tuple[Step, ...]:
        out: list[Step] = []
        defs = {i.name: i for i in comps.get(name, [])}

        def work(flops: float, nbytes: float) -> None:
            if out and out[-1].kind == "work":
                last = out.pop()
                out.append(replace(last, flops=last.flops + flops, bytes=last.bytes + nbytes, kernels=last.kernels + 1))
            else:
                out.append(Step("work", flops, nbytes, 1))

        for ins in comps.get(name, []):
            callees = [c for c in _CALLS.findall(ins.line) if c in comps]
            coll = named.get(ins.name) or (inside.get(callees[0]) if ins.op == "async-start" and callees else None)
            if ins.op == "while":
                body = _BODY.search(ins.line)
                if body and body.group(1) in comps and body.group(1) not in stack:
                    out.append(Step("loop", trips=_trip_count(ins, comps), body=steps(body.group(1), stack | {name})))
            elif ins.op in ("call", "conditional"):
                targets = re.findall(r"\b(?:to_apply|true_computation|false_computation)=%([\w.\-]+)", ins.line)
                for b in _BRANCHES.findall(ins.line):
                    targets += _OPERAND.findall(b)
                targets = [t for t in targets if t in comps and t not in stack]
                if targets:
                    best = max(targets, key=lambda t: _comp_flops(t, comps, memo, stack))
                    out.append(Step("loop", body=steps(best, stack | {name})))
            elif coll is not None and (ins.op.endswith("-start") or ins.op == "async-start"):
                out.append(Step("start", kernels=1, collective=coll[0], axes=coll[1], moved=coll[2], key=ins.name))
            elif coll is not None:
                out.append(Step("sync", kernels=1, collective=coll[0], axes=coll[1], moved=coll[2]))
            elif ins.op.endswith("-done") or ins.op == "async-done":
                if ins.operands:
                    out.append(Step("done", key=ins.operands[0]))
            elif ins.op not in _NO_TRAFFIC:
                work(_instr_flops(ins, defs, comps, memo, stack | {name}), _instr_traffic(ins, defs, comps))
        return tuple(out)

    return steps(entry, frozenset()) if entry in comps else ()
