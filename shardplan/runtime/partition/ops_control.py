"""The partitioner's local rules for control flow: ``cond`` / ``switch`` (every device takes the
same branch, each run on the operands' local blocks) and ``while_loop`` (the body and condition
run on the carry's local blocks, in layouts that are a fixed point of the body).
"""

from __future__ import annotations

from typing import Any

import jax

from shardplan.runtime.partition.partitioner import RULES, Partitioner
from shardplan.runtime.partition.values import Record, V
from shardplan.runtime.sharding import while_trips


def op_cond(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """``lax.cond`` / ``lax.switch`` run locally: the branch index whole (every device takes the same
    branch), each branch run on the operands' local blocks, its results laid out as the first
    branch's are, their pending sums done (a conditional's results carry none). Each branch's
    collectives are recorded once, as the compiled program holds them."""
    branches = eqn.params["branches"]
    index = part.whole(ins[0])
    ops = ins[1:]
    dry = Partitioner(part.mesh, Record(), dry=True, batch_axes=part.batch_axes)
    bare = [V(None, v.shape, v.dtype, v.dims, v.partial, v.act) for v in ops]
    first = dry.run(branches[0].jaxpr, list(branches[0].consts), bare)
    dims = [o.dims for o in first]
    act = any(v.act for v in ops)

    def branch(closed: Any) -> Any:
        def run(*xs: Any) -> list:
            vals = [V(x, v.shape, v.dtype, v.dims, v.partial, v.act, v.shared) for x, v in zip(xs, ops, strict=True)]
            part.caches.append({})
            try:
                outs = part.run(closed.jaxpr, list(closed.consts), vals)
                outs = [part.to(o, d) for o, d in zip(outs, dims, strict=True)]
            finally:
                part.caches.pop()
            return [o.x for o in outs]

        return run

    if part.dry:
        for closed in branches:
            branch(closed)(*[None] * len(ops))
        xs: list = [None] * len(dims)
    else:
        xs = list(jax.lax.switch(index.x, [branch(c) for c in branches], *[v.x for v in ops]))
    return [V(x, o.shape, o.dtype, d, frozenset(), act) for x, o, d in zip(xs, first, dims, strict=True)]


def op_while(part: Partitioner, eqn: Any, ins: list[V]) -> list[V]:
    """``lax.while_loop`` run locally: the carry laid out as a fixed point of the body (as a scan's),
    the body run on its local blocks, the condition's result whole (every device stops together).
    The body's collectives are recorded per trip where the jaxpr fixes the trip count
    (``sharding.while_trips``), else once, as exact mode reads such a loop."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    cconsts, bconsts = ins[:nc], ins[nc : nc + nb]
    carry = [part.resolve(c) for c in ins[nc + nb :]]
    dims, acts = part.carry_layouts(body, bconsts, carry, [])
    carry = [part.to(c, d) for c, d in zip(carry, dims, strict=True)]
    carry = [V(c.x, c.shape, c.dtype, c.dims, c.partial, a) for c, a in zip(carry, acts, strict=True)]

    def local(xs: Any) -> list[V]:
        return [V(x, c.shape, c.dtype, c.dims, frozenset(), c.act) for x, c in zip(xs, carry, strict=True)]

    def test(xs: Any) -> Any:
        part.caches.append({})
        try:
            (out,) = part.run(cond.jaxpr, list(cond.consts), [*cconsts, *local(xs)])
            return part.whole(out).x
        finally:
            part.caches.pop()

    outer, trips = part.mult, while_trips(eqn)

    def step(xs: Any) -> list:  # recorded per trip; the condition once, as the compiled program reads
        part.caches.append({})
        part.mult = outer * (trips if trips is not None else 1)
        try:
            outs = part.run(body.jaxpr, list(body.consts), [*bconsts, *local(xs)])
            return [part.to(o, d).x for o, d in zip(outs, dims, strict=True)]
        finally:
            part.mult = outer
            part.caches.pop()

    if part.dry:
        test([None] * len(carry))
        step([None] * len(carry))
        xs: list = [None] * len(carry)
    else:
        xs = list(jax.lax.while_loop(test, step, [c.x for c in carry]))
    return [V(x, c.shape, c.dtype, c.dims, frozenset(), c.act) for x, c in zip(xs, carry, strict=True)]


RULES.ops.update({"cond": op_cond, "while": op_while})
