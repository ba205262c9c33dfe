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
