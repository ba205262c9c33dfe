"""What XLA's fusion leaves in memory, from a jaxpr alone (no plan): which results are fused into
their readers, which kernels read what, what a compiler recomputes instead of holding, and where a
value's last wide reader is.
"""

from __future__ import annotations

import math
from typing import Any

from shardplan.runtime.fast.opsets import _EXPENSIVE, _FUSES_PRODUCER, _LAYOUT
from shardplan.runtime.fast.values import _is_float, _reads_narrow
from shardplan.runtime.primitives import ELEMENTWISE
from shardplan.runtime.primitives import subjaxpr as _subjaxpr


def _fused_outputs(jaxpr: Any, uses: dict[Any, int]) -> set[Any]:
    """Elementwise results XLA fuses into their single elementwise consumer (never materialized)."""
    consumer: dict[Any, str] = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):
                consumer[x] = eqn.primitive.name
    out = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("broadcast_in_dim", "iota"):  # recomputed inside each consumer's loop
            out.update(eqn.outvars)
        elif name in ELEMENTWISE or name in _LAYOUT:
            for v in eqn.outvars:
                if uses.get(v, 0) == 1 and consumer.get(v) in _FUSES_PRODUCER:
                    out.add(v)
    return out


def _last_wide_readers(jaxpr: Any, last: dict[Any, int], keep: set) -> dict[Any, int]:
    """``Compiler.narrows``: float32 values read after some equation by default-precision matmuls
    alone, each with that equation's index (its last reader that reads it whole, or the equation
    that makes it where matmuls alone read it)."""
    wide: dict[Any, int] = {}
    matmuls: dict[Any, bool] = {}
    defined: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for x in eqn.outvars:
            defined[x] = k
        narrow = _reads_narrow(eqn)
        for x in eqn.invars:
            if hasattr(x, "val"):
                continue
            if narrow:
                matmuls[x] = True
            else:
                wide[x] = k
                matmuls[x] = False
    out = {}
    for x, reads_narrow in matmuls.items():
        # the value's last reader is a matmul and it was read whole before: narrowed after that read
        if not reads_narrow or x in keep or not _is_float(x) or x.aval.dtype != "float32":
            continue
        at = wide.get(x, defined.get(x))  # read by matmuls alone: held narrow from its making
        if at is not None and at < last.get(x, -1):
            out[x] = at
    return out


def _recomputed(
    jaxpr: Any, fused: dict[Any, int], last: dict[Any, int], unheld: set[Any], duplicates: bool
) -> tuple[set[Any], dict[Any, int]]:
    """``Compiler.recomputes``: the elementwise results the readers compute again instead of reading
    a stored copy, and each value's last reader once its readers' recomputations read it. In program
    order:

    - a result ``_kernels`` fuses into every reader, where what it is computed from is held at least
      as long anyway (a SwiGLU's ``silu(gate)`` pieces, recomputed in the backward pass from the two
      matmul results it reads there too), and the result of a call of elementwise ops alone whose
      readers all fuse it (``jax.nn.silu``'s);
    - with ``duplicates`` (``Compiler.duplicates``), an expensive elementwise result every reader
      fuses (XLA:TPU's fusion duplicates an exponent into its readers), and a quotient read by matmuls alone
      that is computed from such a recomputed result (a softmax's probabilities: the backward pass's
      fusions that compute the exponent again also write the quotient its matmul reads), where
      holding what they are computed from to their last reader takes no more memory than holding
      them: those sources are then held that long (a softmax's scores, its maximum and its sum,
      where XLA:CPU holds the exponent and the probabilities; measured on XLA:TPU's buffer
      assignments: one scores-sized buffer per attention layer), and an elementwise result that
      matmuls alone read whose sources are held that long anyway, unless an expensive op of its
      size makes it (a norm's output is recomputed, a GELU's held). Sources under 1/16 of the
      result's bytes (a reduction's result) are not counted."""
    eqns = jaxpr.eqns
    readers = _readers(jaxpr)
    outs = {x for x in jaxpr.outvars if not hasattr(x, "val")}
    cand = dict(fused)
    unheld = set(unheld)
    costly: set[Any] = set()  # candidates whose sources may be held longer for them
    cheap: set[Any] = set()  # candidates dropped only where no expensive op of their size makes them
    for k, eqn in enumerate(eqns):
        for v in eqn.outvars:
            rs = readers.get(v, [])
            if v in cand or v in outs or not rs or not _is_float(v):
                continue
            if (
                duplicates
                and eqn.primitive.name in _EXPENSIVE
                and all(r.primitive.name in _FUSES_PRODUCER or _fuses_all(r, v) for r in rs)
            ):
                cand[v] = k
                costly.add(v)
            elif (sub := _subjaxpr(eqn)) is not None and eqn.primitive.name != "scan":
                if all(e.primitive.name in _FUSES_PRODUCER for e in sub.eqns) and all(
                    r.primitive.name in _FUSES_PRODUCER or _fuses_all(r, v) for r in rs
                ):
                    cand[v] = k
                    unheld.add(v)  # computed again inside its readers (the call's virtual outputs)
            elif duplicates and eqn.primitive.name == "div" and all(_matmul(r) for r in rs):
                cand[v] = k
                costly.add(v)
            elif duplicates and eqn.primitive.name in ELEMENTWISE and all(_matmul(r) for r in rs):
                # computed again in each matmul's operand fusion, from sources held anyway
                cand[v] = k
                cheap.add(v)
    last = dict(last)
    dropped: set[Any] = set()
    for x, k in sorted(cand.items(), key=lambda t: t[1]):
        end = last.get(x, -1)
        sources: set[Any] = set()
        through_costly = heavy = False
        stack, seen = [k], set()
        while stack:
            made = eqns[stack.pop()]
            if x in cheap and made.primitive.name in _EXPENSIVE:
                heavy |= _bytes_of(made.outvars[0]) * 16 >= _bytes_of(x)
            for z in made.invars:
                if hasattr(z, "val") or z in seen:
                    continue
                seen.add(z)
                if z in dropped or (z in unheld and z in cand):
                    through_costly |= z in costly
                    stack.append(cand[z])
                else:
                    sources.add(z)
        if heavy:  # a GELU's output: XLA:TPU holds it rather than its tanh again
            continue
        short = [z for z in sources if last.get(z, -1) < end]
        if not short:
            dropped.add(x)
            continue
        if x not in costly or (eqns[k].primitive.name == "div" and not through_costly):
            continue
        size = _bytes_of(x)
        if sum(b for z in short if (b := _bytes_of(z)) * 16 >= size) <= size:
            dropped.add(x)
            for z in short:
                last[z] = end
    return dropped, last


def _readers(jaxpr: Any) -> dict[Any, list[Any]]:
    """Each variable of ``jaxpr`` with the equations that read it, in program order."""
    readers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):
                readers.setdefault(x, []).append(eqn)
    return readers


def _matmul(eqn: Any) -> bool:
    return eqn.primitive.name == "dot_general"


def _bytes_of(var: Any) -> int:
    aval = var.aval
    return math.prod(aval.shape) * aval.dtype.itemsize


def _fuses_all(eqn: Any, var: Any) -> bool:
    """Whether a call computes its operand ``var`` inside its body's kernels wherever it reads it."""
    return any(x is var for x in eqn.invars) and all(_fuses(eqn, p) for p, x in enumerate(eqn.invars) if x is var)


def _kernels(jaxpr: Any, fusable_outs: dict[Any, int]) -> tuple[dict[Any, int], dict[Any, int], set]:
    """XLA's fusion, roughly: the results of elementwise, layout and broadcast ops whose every
    reader fuses its producers (elementwise ops, reductions; not matmuls, gathers or calls) are
    computed inside their readers (a result read twice is computed twice), and not stored. Returns
    those results (each with its producer's index), the results of calls whose readers all fuse
    (each with its readers' count; a call's body is inlined: see ``traffic``), and the fused
    results several equations read. ``fusable_outs``: the jaxpr's outputs its caller's readers
    fuse, with their count. (Peak memory keeps its own,
    simpler rule, ``_fused_outputs``: single-reader results, as measured against XLA:CPU's peaks.)"""
    readers: dict[Any, list[tuple[int, int]]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for pos, x in enumerate(eqn.invars):
            if not hasattr(x, "val"):
                readers.setdefault(x, []).append((k, pos))
    outs = {x for x in jaxpr.outvars if not hasattr(x, "val") and x not in fusable_outs}
    fused: dict[Any, int] = {}
    soft: dict[Any, int] = {}
    shared: set = set()
    fusible = ELEMENTWISE | _LAYOUT | {"broadcast_in_dim", "iota"}
    for k, eqn in enumerate(jaxpr.eqns):
        call = eqn.primitive.name != "scan" and _subjaxpr(eqn) is not None
        if eqn.primitive.name not in fusible and not call:
            continue
        for v in eqn.outvars:
            ks = readers.get(v, [])
            n = len({j for j, _ in ks}) + fusable_outs.get(v, 0)  # readers here and in the caller
            every = all(_fuses(jaxpr.eqns[j], pos) for j, pos in ks)
            # XLA does not compute an expensive op twice: read by several kernels, it is stored.
            if _expensive(eqn) and n > 1:
                every = False
            # A broadcast or iota is recomputed inside each reader (an output's reader is the caller's).
            cheap = eqn.primitive.name in ("broadcast_in_dim", "iota")
            if every and (v not in outs or cheap) and (ks or v in fusable_outs or cheap):
                if call:
                    soft[v] = n
                    continue
                fused[v] = k
                if n > 1:
                    shared.add(v)
    return fused, soft, shared


def _expensive(eqn: Any) -> bool:
    """An op XLA's fusion will not compute twice; a division by a scalar is not one (XLA turns
    it into a multiplication by the reciprocal)."""
    if eqn.primitive.name == "div":
        d = eqn.invars[1]
        return not (hasattr(d, "val") or not getattr(d.aval, "shape", ()))
    return eqn.primitive.name in _EXPENSIVE


def _fuses(eqn: Any, pos: int) -> bool:
    """Whether ``eqn`` computes its operand ``pos`` inside its own kernel when the operand's producer
    is elementwise: elementwise ops and reductions do; a call does where its body's readers do."""
    if eqn.primitive.name in _FUSES_PRODUCER:
        return True
    sub = _subjaxpr(eqn)
    if sub is None or eqn.primitive.name == "scan" or pos >= len(sub.invars):
        return False
    inner = sub.invars[pos]
    return (
        all(_fuses(e, p) for e in sub.eqns for p, x in enumerate(e.invars) if x is inner) and inner not in sub.outvars
    )
