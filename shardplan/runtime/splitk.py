"""XLA:GPU's split-K choice: how many chunks a matmul's contraction is cut into before it runs.

XLA:GPU's ``splitk-rewriter`` pass (openxla/xla, ``xla/backends/gpu/transforms/splitk_rewriter.cc``,
``ChooseSplitK``) costs each matmul of the partitioned program at every split of its contraction
(1, 2, 4, ..., 2048) by a small model of the GPU (output tiles of 128 x 128 in waves over the
SMs, memory traffic, and the extra reduction's traffic and launch) and takes the cheapest. A split
of ``s`` makes the matmul a batched one over ``s`` chunks of the contraction, writing ``s``
partial results in the accumulator's type (float32), and a reduction adds them up: a workspace of
``s`` times the result in float32 is alive between the two, and the reduction adds ``s`` times the
result's elements to the step's FLOPs. Small weight-gradient matmuls (few output tiles, a long
contraction over tokens) are split most.

Measured (2026-12-04, jax 0.10.2's XLA:GPU compiled offline): 30 random single matmuls on H100
(batch 1-32, dims 8-4,096, contractions 16-16,384, float32 and bfloat16) and 15 each on A100 and
B200 split exactly as :func:`choose` says (tests/test_splitk.py keeps a sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TILE = 128  # the output tile the cost model assumes, both sides


@dataclass(frozen=True)
class SplitK:
    """A GPU as the split-K cost model sees it: its SM count and its generation's weights
    (compute, memory, the reduction's memory, the reduction's launch)."""

    cores: int
    compute: float
    memory: float
    reduction_memory: float
    reduction_launch: float


# The weights per GPU generation (``GetCostWeights``), with each chip's SM count (core.targets.GPUS).
AMPERE = (100.0, 0.0666955, 467.815, 5.65307e07)
HOPPER = (100.0, 0.194136, 193.1384, 4.36e07)
BLACKWELL = (100.0, 0.0848863, 189.711, 1.21563e08)


def for_gpu(cores: int, compute_capability: tuple[int, int]) -> SplitK:
    """The model of a GPU with ``cores`` SMs of compute capability ``compute_capability``."""
    major = compute_capability[0]
    weights = BLACKWELL if major >= 10 else HOPPER if major >= 9 else AMPERE
    return SplitK(cores, *weights)


def cost(gpu: SplitK, b: int, m: int, n: int, k: int, bits: tuple[int, int, int], split: int) -> float:
    """The model's cost of a matmul (``b`` batches of ``m`` x ``k`` times ``k`` x ``n``; element
    bits of the left operand, the right one and the result) run with its contraction in
    ``split`` chunks (float32 partial results)."""
    lbits, rbits, obits = bits
    acc = 32
    chunk = -(-k // split)
    batch = b * split
    mt, nt = min(m, TILE), min(n, TILE)
    tiles = batch * -(-m // TILE) * -(-n // TILE)
    waves = max(1.0, tiles / (gpu.cores * (TILE * TILE) / (mt * nt)))
    compute = 2.0 * mt * nt * chunk * waves * gpu.compute
    written = m * n * batch * (acc if split > 1 else obits) / 8
    memory = (m * k * b * lbits / 8 + n * k * b * rbits / 8 + written) * gpu.memory
    total = max(compute, memory)
    if split > 1:
        total += gpu.reduction_launch + (batch * m * n * acc / 8 + b * m * n * obits / 8) * gpu.reduction_memory
    return total


def choose(gpu: SplitK, b: int, m: int, n: int, k: int, bits: tuple[int, int, int]) -> int:
    """The split XLA:GPU gives the matmul: the cheapest by :func:`cost` (the first of equals)."""
    costs = [cost(gpu, b, m, n, k, bits, s) for s in CANDIDATES]
    return CANDIDATES[costs.index(min(costs))]


def padded(k: int, split: int, bits: tuple[int, int, int]) -> int:
    """The contraction after padding: a multiple of ``split`` chunks of 16-byte-aligned length."""
    step = split * 128 // min(128, bits[0], bits[1])
    return -(-k // step) * step


MERGE_BYTES = 32 << 20  # XLA:GPU's ``xla_gpu_dot_merger_threshold_mb`` default (32)


def merged(jaxpr: Any) -> dict[int, tuple[int, float]]:
    """XLA:GPU's ``DotMerger`` (openxla/xla ``dot_merger.cc``, run before the split-K choice) on a
    jaxpr: matmuls that read one value on the same side, with the same dimension numbers and
    types and neither computed from the other, become one matmul over their other operands
    concatenated on their free dim (``x @ Wq``, ``x @ Wk``, ``x @ Wv`` as ``x @ [Wq Wk Wv]``; the
    weight gradients ``x.T @ dq``, ``x.T @ dk`` likewise). Returns, per merged matmul (``id`` of
    its equation), the side its group shares (0: left, 1: right) and the group's free size over
    its own on the other side, the factor by which its merged matmul is wider. A group merges in
    program order while one of each pair reads and writes at most ``MERGE_BYTES`` (checked where
    the layouts are known: ``fits``)."""
    eqns = list(getattr(jaxpr, "eqns", ()))
    below: dict[Any, int] = {}  # value -> bitset of the matmuls it is computed from
    dots: list[Any] = []
    index: dict[int, int] = {}
    for eqn in eqns:
        deps = 0
        for x in eqn.invars:
            if not hasattr(x, "val"):
                deps |= below.get(x, 0)
        if eqn.primitive.name == "dot_general" and all(_floating(x) for x in eqn.invars):
            index[id(eqn)] = len(dots)
            dots.append(eqn)
            deps |= 1 << index[id(eqn)]
        for x in eqn.outvars:
            below[x] = deps
    classes: dict[tuple[int, object], list[Any]] = {}
    for eqn in dots:
        for side in (0, 1):
            x = eqn.invars[side]
            if not hasattr(x, "val"):
                classes.setdefault((side, x), []).append(eqn)
    out: dict[int, tuple[int, float]] = {}
    done: set[int] = set()
    for (side, _), members in classes.items():
        groups: list[list[Any]] = []
        for eqn in members:
            if id(eqn) in done:
                continue
            for group in groups:
                if _mergeable(group[0], eqn, side) and not any(_reaches(below, a, eqn, index) for a in group):
                    group.append(eqn)
                    break
            else:
                groups.append([eqn])
        for group in groups:
            if len(group) < 2:
                continue
            widths = [_free(e, 1 - side) for e in group]
            total = sum(widths)
            for e, w in zip(group, widths, strict=True):
                out[id(e)] = (side, total / w)
                done.add(id(e))
    return out


def _floating(x: Any) -> bool:
    dtype = getattr(getattr(x, "aval", None), "dtype", None)
    return dtype is not None and getattr(dtype, "kind", "") == "f"


def _mergeable(a: Any, b: Any, side: int) -> bool:
    """Same dimension numbers and types, and the other operands alike but for one free dim."""
    if a.params["dimension_numbers"] != b.params["dimension_numbers"]:
        return False
    oa, ob = a.invars[1 - side], b.invars[1 - side]
    if oa.aval.dtype != ob.aval.dtype or a.outvars[0].aval.dtype != b.outvars[0].aval.dtype:
        return False
    (lc, rc), (lb, rb) = a.params["dimension_numbers"]
    used = set(rc) | set(rb) if side == 0 else set(lc) | set(lb)
    free = [i for i in range(len(oa.aval.shape)) if i not in used]
    return (
        len(free) == 1
        and len(oa.aval.shape) == len(ob.aval.shape)
        and all(oa.aval.shape[i] == ob.aval.shape[i] for i in used)
    )


def _free(eqn: Any, side: int) -> int:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    x = eqn.invars[side]
    used = set(lc) | set(lb) if side == 0 else set(rc) | set(rb)
    size = 1
    for i, d in enumerate(x.aval.shape):
        if i not in used:
            size *= d
    return size


def _reaches(below: dict[Any, int], a: Any, b: Any, index: dict[int, int]) -> bool:
    """Whether either matmul is computed from the other."""
    return bool(below[b.outvars[0]] >> index[id(a)] & 1) or bool(below[a.outvars[0]] >> index[id(b)] & 1)


VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})  # read without a copy: their readers read the operand


def reads(jaxpr: Any) -> dict[Any, int]:
    """How many kernels read each value of ``jaxpr``, a view's readers counted as its operand's:
    where a split matmul's partials are added up inside each reader, each reader adds them up."""
    eqns = list(getattr(jaxpr, "eqns", ()))
    out: dict[Any, int] = {}
    for eqn in reversed(eqns):
        for x in eqn.invars:
            if hasattr(x, "val"):
                continue
            if eqn.primitive.name in VIEWS:
                out[x] = out.get(x, 0) + max(1, out.get(eqn.outvars[0], 0))
            else:
                out[x] = out.get(x, 0) + 1
    return out


ADDS = frozenset({"add", "add_any", "sub"})  # what XLA:GPU adds partial sums with before reducing them


def summed_by_adds(jaxpr: Any) -> set[Any]:
    """The values of ``jaxpr`` that only additions (``ADDS``) read: a split matmul's partial sum
    there keeps its partials until the addition, which adds them up with the other term's
    (measured on XLA:GPU: a layer's two input gradients ``d_gate @ Wg.T + d_up @ Wu.T`` under
    Megatron TP, each split in 8, both workspaces alive until the one fusion that adds all
    partials, before the all-reduce)."""
    readers: dict[Any, list[str]] = {}
    for eqn in getattr(jaxpr, "eqns", ()):
        for x in eqn.invars:
            if not hasattr(x, "val"):
                readers.setdefault(x, []).append(eqn.primitive.name)
    return {x for x, names in readers.items() if all(n in ADDS for n in names)}
