"""Which values Shardy lays out before any matmul propagates: its first op priority.

Shardy's propagation (``op_priority_propagation.cc`` in openxla/shardy) runs in three rounds, each
to a fixed point: first only through pass-through ops (elementwise ops, reshapes, transposes, the
data-flow edges that tie a loop's carried values and slices to its operands and results, and
``dynamic_slice``/``dynamic_update_slice`` forward), then also through the factors every op passes
through (a matmul's free and batch dims), then through everything. A value the first round reaches
from the step's inputs or from a sharding constraint has its layout before any matmul is laid out.

Inside a loop body this decides a matmul whose operands split different dims over the same axis
(measured on XLA:CPU, XLA:GPU and XLA:TPU: a scanned layer's weight split over `data` on its output
dim against activations carried in over `data` on the batch): where the weight's slice has its
layout from the first round and the carried activations only from a later one (they were made by
a matmul or a slice before the loop), the weight's split wins, and the activations are gathered.
Where both have it from the first round, the sizes decide (``matmul._rhs_yields``). "Late" follows
the carried value through pass-through ops only while nothing laid out otherwise joins it (an
elementwise op all of whose operands of its shape are late), and the rule is applied where one
axis clashes (where two do, XLA's program lies between the two choices: docs/stepcost.md).
"""

from __future__ import annotations

from typing import Any

from shardplan.runtime.primitives import ELEMENTWISE, named, subjaxpr
from shardplan.runtime.sharding import scan_counts

_BOTH = ELEMENTWISE | named(kinds=("view",))  # pass-through both ways
_FORWARD = frozenset({"dynamic_slice", "dynamic_update_slice"})  # pass-through from operands to result
_FIXED = frozenset({"sharding_constraint"})  # laid out before propagation starts
_MAX_ROUNDS = 8  # a fixed point is reached in two or three over a step's jaxpr


def early_values(jaxpr: Any) -> tuple[frozenset, frozenset]:
    """The values of ``jaxpr`` (the step's: every input laid out) and of the jaxprs it calls that
    Shardy's first round lays out (a body called from several places counts where any call does),
    and the values of loop bodies that wait for a later round: a carried value whose initial value
    the first round does not reach, and what pass-through ops make of it."""
    found: set = set()
    _walk(jaxpr, frozenset(v for v in jaxpr.invars), found, {})
    late: set = set()
    _late(jaxpr, frozenset(found), late)
    return frozenset(found), frozenset(late - found)


def _late(jaxpr: Any, early: frozenset, late: set) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            nc, ncarry = scan_counts(eqn)
            _late_body(body, body.invars[nc : nc + ncarry], early, late)
        elif name == "while":
            body = eqn.params["body_jaxpr"].jaxpr
            _late_body(body, body.invars[eqn.params["body_nconsts"] :], early, late)
        elif name == "cond":
            for branch in eqn.params["branches"]:
                _late(branch.jaxpr, early, late)
        else:
            body = subjaxpr(eqn)
            if body is not None:
                _late(body, early, late)


def _late_body(body: Any, carried: Any, early: frozenset, late: set) -> None:
    """A loop body's late values: its carried values the first round does not lay out, and what
    pass-through ops make of them (into and out of the calls that read them)."""
    _late_from(body, {v for v in carried if v not in early}, early, late)
    _late(body, early, late)


def _late_from(jaxpr: Any, mine: set, early: frozenset, late: set) -> set[int]:
    """Values of ``jaxpr`` late from ``mine`` (added to ``late``); its late outputs' positions."""
    for eqn in jaxpr.eqns:
        ins = [_var(x) and x in mine for x in eqn.invars]
        if not any(ins):
            continue
        if eqn.primitive.name in _BOTH:
            shape = tuple(eqn.outvars[0].aval.shape)
            tied = [is_late for x, is_late in zip(eqn.invars, ins, strict=True) if _var(x) and x.aval.shape == shape]
            if eqn.primitive.name not in ELEMENTWISE or tied and all(tied):
                mine.update(o for o in eqn.outvars if o not in early)
            continue
        sub = subjaxpr(eqn) if eqn.primitive.name not in ("scan", "while", "cond") else None
        if sub is not None:
            inner = {v for v, is_late in zip(sub.invars, ins, strict=False) if is_late and v not in early}
            for i in _late_from(sub, inner, early, late):
                if i < len(eqn.outvars) and eqn.outvars[i] not in early:
                    mine.add(eqn.outvars[i])
    late |= mine
    return {i for i, x in enumerate(jaxpr.outvars) if _var(x) and x in mine}


def _var(x: Any) -> bool:
    return not hasattr(x, "val")


def _walk(jaxpr: Any, early_in: frozenset, found: set, seen: dict) -> frozenset:
    """Early values of one jaxpr given its early inputs (added to ``found``); its early outputs."""
    key = (id(jaxpr), early_in)
    if key in seen:
        return seen[key]
    seen[key] = frozenset()  # (a recursive call sees no early outputs)
    early = set(early_in)
    for _ in range(_MAX_ROUNDS):
        before = len(early)
        for eqn in jaxpr.eqns:
            _step(eqn, early, found, seen)
        if len(early) == before:
            break
    found |= early
    outs = frozenset(i for i, x in enumerate(jaxpr.outvars) if _var(x) and x in early)
    seen[key] = outs
    return outs


def _step(eqn: Any, early: set, found: set, seen: dict) -> None:
    name = eqn.primitive.name
    ins = [x for x in eqn.invars if _var(x)]
    if name in _FIXED:
        early.update(eqn.outvars)
    elif name in _BOTH:
        # (an elementwise operand broadcast over size-1 dims is a broadcast in StableHLO: not
        # pass-through in the first round)
        shape = tuple(eqn.outvars[0].aval.shape)
        tied = [x for x in ins if tuple(x.aval.shape) == shape] if name in ELEMENTWISE else ins[:1]
        if any(x in early for x in tied) or any(o in early for o in eqn.outvars):
            early.update(eqn.outvars)
            early.update(tied)
    elif name in _FORWARD:
        if ins and ins[0] in early or name == "dynamic_update_slice" and len(ins) > 1 and ins[1] in early:
            early.update(eqn.outvars)
    elif name == "scan":
        _scan(eqn, early, found, seen)
    elif name == "while":
        _while(eqn, early, found, seen)
    elif name == "cond":
        for branch in eqn.params["branches"]:
            body = branch.jaxpr
            inner = frozenset(v for v, x in zip(body.invars, eqn.invars[1:], strict=True) if x in early)
            for i in _walk(body, inner, found, seen):
                early.add(eqn.outvars[i])
    else:
        body = subjaxpr(eqn)
        if body is None:
            return
        inner = frozenset(v for v, x in zip(body.invars, eqn.invars, strict=False) if _var(x) and x in early)
        for i in _walk(body, inner, found, seen):
            if i < len(eqn.outvars):
                early.add(eqn.outvars[i])


def _scan(eqn: Any, early: set, found: set, seen: dict) -> None:
    """A scan's body: its constants and slices early where the operands are, a carried value where
    its initial value is or where the body's result for it is (the loop's data-flow edge ties
    them)."""
    body = eqn.params["jaxpr"].jaxpr
    nc, ncarry = scan_counts(eqn)
    inner = {v for v, x in zip(body.invars, eqn.invars, strict=True) if _var(x) and x in early}
    outs: frozenset = frozenset()
    for _ in range(2):
        outs = _walk(body, frozenset(inner), found, seen)
        grown = {body.invars[nc + i] for i in outs if i < ncarry} - inner
        if not grown:
            break
        inner |= grown
    for i in outs:
        early.add(eqn.outvars[i])
    for i in range(ncarry):
        if body.invars[nc + i] in inner:
            early.add(eqn.outvars[i])


def _while(eqn: Any, early: set, found: set, seen: dict) -> None:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    body = p["body_jaxpr"].jaxpr
    inner = {v for v, x in zip(body.invars, eqn.invars[nc:], strict=True) if _var(x) and x in early}
    outs: frozenset = frozenset()
    for _ in range(2):
        outs = _walk(body, frozenset(inner), found, seen)
        grown = {body.invars[nb + i] for i in outs} - inner
        if not grown:
            break
        inner |= grown
    for i, v in enumerate(body.invars[nb:]):
        if v in inner or i in outs:
            early.add(eqn.outvars[i])
