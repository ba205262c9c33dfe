"""FLOPs of a compiled program counted from its HLO as XLA's cost analysis counts them: matmuls
and convolutions 2*M*N*K, elementwise ops one per element, reductions their reducer's flops, every
loop body times its trip count (the cost analysis counts a body once)."""

from __future__ import annotations

import math
import re

from shardplan.core.hlo.loops import _bodies, _runs, _trip_count
from shardplan.core.hlo.text import _ARRAY, _BODY, _CALLS, _computations, _dims_of, _Instr, _ints, _shape_bytes

# What XLA's cost analysis (HloCostAnalysis::HandleElementwiseOp) counts as one flop per output
# element: its transcendentals (exp, log, power, sqrt, rsqrt, tanh, atan2, ...) are counted apart,
# and a conversion is elementwise.
_ELEMENTWISE_FLOP = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "compare",
    "select",
    "negate",
    "abs",
    "and",
    "or",
    "xor",
    "not",
    "remainder",
    "clamp",
    "sign",
    "floor",
    "ceil",
    "round-nearest-even",
    "round-nearest-afz",
    "is-finite",
    "convert",
    "reduce-precision",
}


# An all-reduce: one flop per element of its result (HandleAllReduce: "we assume 2 replicas").
_ALL_REDUCE = {"all-reduce", "all-reduce-start"}


# A reduce, scatter or reduce-window's reducer (its flops per element reduced: ``_instr_flops``).
_TO_APPLY = re.compile(r"\bto_apply=%([\w.\-]+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(line: str) -> dict[str, list[int]]:
    """A convolution's ``window={size=.. stride=.. pad=.. lhs_dilate=.. rhs_dilate=..}``, per
    spatial dim (``pad``: low and high per dim, flattened)."""
    m = _WINDOW.search(line)
    out: dict[str, list[int]] = {}
    for part in m.group(1).split() if m else []:
        key, _, value = part.partition("=")
        out[key] = [int(x) for x in re.split(r"[x_]", value) if x.lstrip("-").isdigit()]
    return out


def _taps(size: int, out: int, window: int, stride: int, lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """How many (output position, window position) pairs of one spatial dim read an input element,
    not a hole of the input's dilation or its padding, as XLA's cost analysis counts them. XLA:TPU
    writes a batched matmul as a convolution whose window spans the batch with the input dilated by
    the window's size: one pair in ``window`` reads data there."""
    dilated = (size - 1) * lhs_dilate + 1 if size > 0 else 0
    if out * window > 4_000_000:  # too many to count one by one: the share a dilation leaves
        return out * -(-window // lhs_dilate)
    return sum(
        1
        for k in range(window)
        for o in range(out)
        if 0 <= (p := o * stride + k * rhs_dilate - lo) < dilated and p % lhs_dilate == 0
    )


def _conv_flops(ins: _Instr, lhs: list[int], labels: re.Match[str]) -> float:
    """A convolution's FLOPs as XLA's cost analysis counts them: 2 x (output elements over its
    spatial positions) x input features per group x the (output, window) pairs that read data."""
    lhs_labels, _, out_labels = labels.groups()
    out = _dims_of(ins.shape)
    features = math.prod(d for d, c in zip(lhs, lhs_labels, strict=False) if c == "f")
    groups = re.search(r"feature_group_count=(\d+)", ins.line)
    features //= int(groups.group(1)) if groups else 1
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    w = _window(ins.line)
    per_position = math.prod(out) // max(1, math.prod(out[out_labels.index(c)] for c in spatial))
    taps = 1
    for i, c in enumerate(spatial):
        size, o = lhs[lhs_labels.index(c)], out[out_labels.index(c)]
        window = w.get("size", [1] * len(spatial))[i]
        stride = w.get("stride", [1] * len(spatial))[i]
        lo = w.get("pad", [0] * 2 * len(spatial))[2 * i]
        taps *= _taps(
            size,
            o,
            window,
            stride,
            lo,
            w.get("lhs_dilate", [1] * len(spatial))[i],
            w.get("rhs_dilate", [1] * len(spatial))[i],
        )
    return 2.0 * per_position * features * taps


def program_flops(hlo_text: str) -> float:
    """A program's FLOPs per step counted from its HLO (every loop body times its runs), for a
    compiler that gives no cost analysis (XLA:GPU): matmuls (in fusions too, as XLA:GPU's gemm
    fusions hold them; XLA:TPU's convolutions) 2*M*N*K, elementwise ops and reductions one per
    element."""
    return loop_flops(hlo_text, whole=True)


def _instr_flops(
    ins: _Instr, defs: dict[str, _Instr], comps: dict[str, list[_Instr]], memo: dict[str, float], stack: frozenset[str]
) -> float:
    """FLOPs of one instruction and the fused or called computations it runs (not while bodies),
    as XLA's cost analysis counts them: matmuls 2*M*N*K, elementwise ops one per element (not
    transcendentals), reductions, scatters and reduce-windows their reducer's flops per element
    reduced, all-reduces one per element. ``memo``: per computation."""
    n = _shape_bytes(ins.shape)[2] if _ARRAY.search(ins.shape) else 0
    total = 0.0
    if ins.op == "dot":
        lhs = defs.get(ins.operands[0]) if ins.operands else None
        m = _CONTRACT.search(ins.line)
        k = math.prod(_dims_of(lhs.shape)[int(i)] for i in _ints(m.group(1))) if lhs and m else 1
        total += 2.0 * max(n, 0) * k
    elif ins.op == "convolution":  # XLA:TPU writes its matmuls as convolutions
        lhs = defs.get(ins.operands[0]) if ins.operands else None
        labels = _DIM_LABELS.search(ins.line)
        if lhs is not None and labels:
            total += _conv_flops(ins, _dims_of(lhs.shape), labels)
    elif ins.op in _ELEMENTWISE_FLOP:
        total += max(n, 0)
    elif ins.op in ("reduce", "scatter", "reduce-window") and ins.operands:
        # the reducer's flops per element reduced (a sum: 1; an argmax's compare-and-select: more)
        reducer = _TO_APPLY.search(ins.line)
        per = _comp_flops(reducer.group(1), comps, memo, stack) if reducer and reducer.group(1) in comps else 1.0
        if ins.op == "reduce":
            src = defs.get(ins.operands[0])
            total += per * max(_shape_bytes(src.shape)[2] - max(n, 1), 0) if src else 0
        elif ins.op == "reduce-window":  # each output element reduces its window: size - 1 steps
            total += per * (math.prod(_window(ins.line).get("size", [1])) - 1) * max(n, 0)
        else:
            updates = defs.get(ins.operands[-1])
            total += per * _shape_bytes(updates.shape)[2] if updates else 0
    elif ins.op in _ALL_REDUCE:
        total += sum(math.prod(_dims_of(array)) for array in _shape_bytes(ins.shape)[1])
    if ins.op in ("fusion", "call", "conditional"):
        for callee in _CALLS.findall(ins.line):
            if callee in comps and callee not in stack:
                total += _comp_flops(callee, comps, memo, stack)
    return total


def _comp_flops(name: str, comps: dict[str, list[_Instr]], memo: dict[str, float], stack: frozenset[str]) -> float:
    if name not in memo:
        defs = {i.name: i for i in comps[name]}
        memo[name] = sum(_instr_flops(i, defs, comps, memo, stack | {name}) for i in comps[name])
    return memo[name]


def loop_flops(hlo_text: str, entry_only: bool = False, whole: bool = False) -> float:
    """FLOPs that XLA's cost analysis leaves out: it counts a ``while`` body once, but the body
    runs once per iteration. Returns each body's own FLOPs x (its runs per step - 1) summed over
    loops, a body nested in another loop running trip x the outer body's runs (counted as the cost
    analysis counts: :func:`_instr_flops`). ``whole``: the program's own count instead
    (:func:`program_flops`)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    memo: dict[str, float] = {}

    def own(name: str, stack: frozenset[str]) -> float:
        """FLOPs of one execution of ``name`` and what it calls, except nested while bodies."""
        return _comp_flops(name, comps, memo, stack) if name in comps else 0.0

    if entry_only:
        return own(entry, frozenset())
    if whole:
        return own(entry, frozenset()) + sum(runs.get(b, 1) * own(b, frozenset()) for b in sorted(_bodies(comps)))
    bodies = {
        body.group(1)
        for instrs in comps.values()
        for ins in instrs
        if ins.op == "while"
        and _trip_count(ins, comps) > 1
        and (body := _BODY.search(ins.line))
        and body.group(1) in comps
    }
    return sum((runs.get(b, 1) - 1) * own(b, frozenset()) for b in sorted(bodies))


def matmul_by_source(hlo_text: str) -> dict[str, float]:
    """A program's matmul FLOPs per step (dots, and XLA:TPU's convolutions; in fusions too, every
    loop body times its runs) by the source line each comes from: the innermost frame outside
    libraries of its stack-frame metadata, else of the fusion or call that holds it ('' where
    neither says). What fast mode's FLOPs are checked against line by line (benchmarks'
    ``--flops`` differences)."""
    from shardplan.core.hlo.frames import _tables
    from shardplan.core.hlo.text import _FRAME

    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    frames = _tables(hlo_text)
    out: dict[str, float] = {}
    memo: dict[str, float] = {}

    def source(ins: _Instr, outer: str) -> str:
        frame = _FRAME.search(ins.line)
        return (frames.source(int(frame.group(1))) if frame else "") or outer

    def walk(name: str, times: int, outer: str, stack: frozenset[str]) -> None:
        instrs = comps.get(name, [])
        defs = {i.name: i for i in instrs}
        for ins in instrs:
            if ins.op in ("dot", "convolution"):
                flops = _instr_flops(ins, defs, comps, memo, stack)
                if flops:
                    where = source(ins, outer)
                    out[where] = out.get(where, 0.0) + times * flops
            elif ins.op in ("fusion", "call", "conditional"):
                for callee in _CALLS.findall(ins.line):
                    if callee in comps and callee not in stack:
                        walk(callee, times, source(ins, outer), stack | {callee})
            elif ins.op == "while":
                body = _BODY.search(ins.line)
                if body and body.group(1) in comps and body.group(1) not in stack:
                    walk(body.group(1), runs.get(body.group(1), times), source(ins, outer), stack | {body.group(1)})

    if entry:
        walk(entry, 1, "", frozenset({entry}))
    return out
