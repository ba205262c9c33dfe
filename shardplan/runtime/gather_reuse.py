"""Which matmul reads of a step's input share one all-gather where the compiler gathers again
around each use (XLA:TPU, fast mode's ``Compiler.gather_cse``).

XLA:TPU's SPMD partitioner gathers a split weight once per matmul that reads it (the forward
pass's and the backward pass's); its ``ScheduleAwareCollectiveOpsCSE`` pass then merges a later
gather of the same operand into the first when the first's readers sit at most ``threshold``
instructions further from the program's root than the later gather (openxla/xla
``xla/service/spmd/schedule_aware_collective_ops_cse.cc``: a node's height is
``max(h, height(user)) + 1`` over its users in turn; a gather merged into the first lowers the
first's lowest reader). XLA:TPU's threshold (libtpu flag ``xla_tpu_spmd_threshold_for_allgather_cse``)
behaves as 100: measured on the example models' FSDP steps (v5e, 8 chips), a merge at 83
instructions and none at 106; the flag set to 10..1000 gives the compiled gather counts that this
rule computes on the same programs at every value tried. Fast mode counts heights on the step's
jaxpr (calls inlined as XLA inlines them; a loop's body is a program of its own, never merged
across): within 4 instructions of the partitioned HLO's heights for the gathers near the threshold
(the head's and the last block's MLP weights of a 4-layer GPT: 26, 64, 74, 79 here, 22, 63, 73,
83 in XLA:TPU's program).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardplan.runtime.primitives import CALLS, subjaxpr


@dataclass(frozen=True)
class Share:
    """One matmul's read of a step input: the gather it uses (``group``: the first reader's
    index), whether it makes that gather (``first``) and is its last reader (``last``)."""

    group: int
    first: bool
    last: bool


def _flatten(jaxpr: Any) -> tuple[list[tuple[Any, list[Any]]], list[Any]]:
    """The jaxpr's equations with calls inlined, in program order: (eqn, sources of its operands),
    a source being ``("in", top-level input var)`` (through calls only) or ``("node", index)``;
    and the outputs' sources."""
    nodes: list[tuple[Any, list[Any]]] = []

    def walk(jx: Any, env: dict[Any, Any]) -> None:
        for eqn in jx.eqns:
            srcs = [env.get(v) if not hasattr(v, "val") else None for v in eqn.invars]
            sub = subjaxpr(eqn) if eqn.primitive.name in CALLS else None
            if sub is not None:
                inner = dict(zip(sub.invars, srcs, strict=False))
                walk(sub, inner)
                for v, o in zip(eqn.outvars, sub.outvars, strict=False):
                    env[v] = inner.get(o) if not hasattr(o, "val") else None
                continue
            k = len(nodes)
            nodes.append((eqn, srcs))
            for v in eqn.outvars:
                env[v] = ("node", k)

    env: dict[Any, Any] = {v: ("in", v) for v in jaxpr.invars}
    walk(jaxpr, env)
    outs = [env.get(v) for v in jaxpr.outvars if not hasattr(v, "val")]
    return nodes, outs


def shares(jaxpr: Any, threshold: int) -> dict[tuple[int, Any], Share]:
    """Per (``id`` of a matmul equation, the step input it reads) the gather that read uses, by
    XLA's rule above; a pair met more than once in the inlined program (a shared call body reading
    the same input twice) is left out (fast mode then gathers per pass)."""
    nodes, outs = _flatten(jaxpr)
    root = len(nodes)
    users: list[list[int]] = [[] for _ in range(root + 1)]
    for k, (_, srcs) in enumerate(nodes):
        for s in srcs:
            if s is not None and s[0] == "node" and k not in users[s[1]]:
                users[s[1]].append(k)
    for s in outs:
        if s is not None and s[0] == "node" and root not in users[s[1]]:
            users[s[1]].append(root)
    height = [0] * (root + 1)
    for k in range(root - 1, -1, -1):
        h = 0
        for u in users[k]:
            h = max(h, height[u]) + 1
        height[k] = h
    reads: dict[Any, list[int]] = {}  # step input -> the matmuls reading it, in program order
    seen: dict[tuple[int, Any], int] = {}
    for k, (eqn, srcs) in enumerate(nodes):
        if eqn.primitive.name != "dot_general":
            continue
        for s in dict.fromkeys(s for s in srcs if s is not None and s[0] == "in"):
            key = (id(eqn), s[1])
            seen[key] = seen.get(key, 0) + 1
            reads.setdefault(s[1], []).append(k)
    out: dict[tuple[int, Any], Share] = {}
    for var, ks in reads.items():
        first, lowest = ks[0], height[ks[0]]
        groups = []
        for k in ks:  # in program order, as XLA's pass visits them
            if lowest - height[k] <= threshold:  # merged: the first gather's lowest reader is now this one
                groups.append(first)
                lowest = min(lowest, height[k])
            else:
                groups.append(k)
        for k, g in zip(ks, groups, strict=True):
            key = (id(nodes[k][0]), var)
            if seen[key] == 1:
                last = max(j for j, h in zip(ks, groups, strict=True) if h == g)
                out[key] = Share(g, k == g, k == last)
    return out
