"""Fast mode's rule books: what each target compiler's program does that another's does not
(measured on their offline compiles), one ``Compiler`` record per compiler and chip.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardplan.core.targets import BOOKS, COMPILER_NAMES, GPUS
from shardplan.runtime import splitk


@dataclass(frozen=True)
class Compiler:
    """Where the compilers users run part from XLA:CPU's program of the same step (measured on
    their offline compiles, shardplan/core/targets.py; docs/stepcost.md): fast mode's rule book for
    one compiler. Everything not named here is common to them (GSPMD's propagation).

    - ``sums``: elementwise ops through which operands holding the same pending sum keep one pending
      sum (XLA:TPU and XLA:GPU reassociate ``all-reduce(a) + all-reduce(b)`` into one all-reduce:
      a column-parallel layer's q, k and v input gradients are summed, then all-reduced once;
      XLA:CPU all-reduces each).
    - ``matmul_itemsize``: the bytes per element a float32 matmul operand moves at the default
      precision (XLA:TPU computes it as one bfloat16 pass and casts before it gathers: an FSDP
      weight is gathered in bfloat16); None: as the operand is.
    - ``gather_cse``: a weight gathered for a matmul is gathered again for each later matmul that
      reads it, unless that one sits within this many instructions of the first's reader in the
      program's height (XLA:TPU's ScheduleAwareCollectiveOpsCSE, ``runtime/gather_reuse.py``:
      the head's and the last block's MLP weights are gathered once and held across the turn to
      the backward pass, every other FSDP weight again for its backward matmul and not held
      between); None: gathered once and held to its last use (XLA:CPU, XLA:GPU).
    - ``recomputes``: an elementwise result that every reader fuses (``memory._kernels``) is not held where
      what it is computed from is held to its last reader anyway: the readers compute it again
      (XLA:GPU and XLA:TPU duplicate such producers into their consumers; measured on XLA:GPU's
      buffer assignment, a SwiGLU's ``silu(gate)`` pieces are recomputed in the backward pass from
      the gate and up matmul results it holds there; XLA:CPU holds each piece with several readers).
    - ``duplicates``: with ``recomputes``, an expensive elementwise result that every reader fuses
      (an exponent) is computed again in each reader too, and so is a quotient computed from one
      that matmuls alone read (a softmax's probabilities), where holding what they are computed
      from to their last reader takes no more memory than holding them: a softmax's scores are
      held, not its exponent and probabilities (XLA:TPU, measured on its buffer assignments: one
      scores-sized buffer per attention layer; XLA:GPU's choice depends on sizes and layouts: one
      per layer on a grouped-query attention over 1,024 tokens, two on the same over 32 tokens and
      on plain attention over 32-1,024 tokens, so its book holds both as XLA:CPU does). Likewise
      an elementwise result that matmuls alone read, made from values held to its last reader
      anyway by no expensive op of its size (a norm's output, ``x * rsqrt(mean(x^2)) * scale``,
      read by the next projections and their weight gradients), is computed again in each
      matmul's operand fusion, not held (nor its narrow copy); a GELU's output is held (XLA:TPU's
      buffer assignments, Llama-style d_model 1,024, 16 x 1,024 tokens, and gpt_small at 1,024 x
      64: no norm output is held, in float32 or bfloat16, on v5e or v5p).
    - ``tile``: the (second-minor, minor) tile every array in memory is padded to, in whole 512 B
      granules, the step's arguments included (XLA:TPU lays two dims of an array out in (8, 128)
      tiles: a (4, 8, 32, 32) float32 array of attention scores takes 4x its bytes; measured per
      array on its compiled programs); None: unpadded.
    - ``windowed``: a matmul whose result is reduce-scattered over an axis of at most 32 devices,
      contracting more elements than this (the tokens of a weight gradient), runs as a windowed
      einsum: its partial results passed around a ring of collective-permutes, (n + 1) / n times
      the result's bytes, and no reduce-scatter (XLA:TPU, measured on single weight-gradient
      matmuls: v5e and v5p above 8,192 tokens, v6e above 16,384, on 8, 16 and 32 devices; not on
      64 or 256; a loop of n / 4 iterations, two shards each way in each, and one more shard
      after it: 1.125x the gradient on 8 devices, 1.0625x on 16, 1.03x on 32).
    - ``narrows``: a float32 value whose remaining readers are all matmuls at the default precision
      is held from then on as the ``matmul_itemsize`` copy they read (XLA:TPU keeps the bfloat16
      cast of an activation for the backward pass's weight gradient, not the float32 value); a
      float32 input (a weight) that such matmuls read in place has that copy held beside it from
      its first matmul to its last reader (XLA:TPU casts a replicated weight once for the forward
      and backward pass; a gathered one is cast and gathered around each use).
    - ``dense_ragged``: a grouped matmul (``ragged_dot_general``) runs as jax's dense decomposition
      (``primitives.ragged_dense``: every group's masked copy of the tokens times its weights, the
      groups' count times the useful FLOPs), as jax lowers it for XLA:CPU.
    - ``whole_ragged``: elsewhere, the compiler's own grouped matmul runs with the group dim and
      the ragged rows whole (the experts' weights gathered over their group split, the tokens'
      pending sums reduced), its other dims as a matmul's (the weights' free splits kept, a
      contraction they split taken by the tokens: measured 2026-12-05 on a grouped layer of our
      own and the example MoE's three expert plans: XLA:GPU and XLA:TPU gather each weight once,
      forward and backward alike, and keep a tensor-parallel column split). Its
      FLOPs as the compiler counts them: "dense", every group over every row (XLA:GPU rewrites it
      into dense matmuls: the groups' count times the useful FLOPs); "kernel", the useful FLOPs
      where the rows are grouped (XLA:TPU's grouped-matmul kernel: each row times its group's
      weights) and dense where the rows are contracted (a weight gradient). None: not modelled
      (replicated, said in the step's notes).
    - ``whole_top_k``: a ``top_k`` runs on its whole operand whatever its split (XLA:CPU's top-k is
      a library call the partitioner does not split: the operand is gathered, the result sliced
      back; measured, a (64, 32, 8) operand split over its batch: all-gathered on XLA:CPU, local
      on XLA:TPU and XLA:GPU).
    - ``gathers_reduce``: an all-gather whose group is every device of the slice, where the slice
      has at least this many, is an all-reduce of the zero-padded shard (the gathered bytes; its
      time twice the gather's). XLA:TPU v5p, measured on single gathers of a weight and of an
      activation (2026-12-05): a 1-D mesh over 64 (4x4x4, 2x4x8), 128 and 256 chips all-reduces, over
      8-32 chips it gathers, and so does an axis of 128 of 256 chips; v5e and v6e gather at 64 and
      256 chips. The padded operand, whole and in the value's own type, is alive beside the result
      (read from a 70B step's buffers: f32[256,1024,28672] beside its bf16 result). None: gathered.
    - ``scatters_whole``: a reduce-scatter is an all-reduce of the whole followed by each device's
      slice (XLA:CPU emits no reduce-scatter for GSPMD): its FLOPs are the all-reduce's, one per
      element of the whole, as XLA's cost analysis counts an all-reduce (a reduce-scatter: none).
    - ``sums_per_dim``: a matmul whose contraction is split over different axes on different dims
      (tokens over `data` on the batch, over `seq` on the sequence: a weight gradient under
      sequence parallelism) sums its result once per such dim, one all-reduce over each dim's axes
      after the other (XLA:CPU, measured on single matmuls "bsd,bsf->df": two all-reduces of the
      whole result; XLA:TPU and XLA:GPU fold them into one over all the axes).
    - ``scatters_one_dim``: a pending sum wanted split over its summed axes on two dims or more
      (and on those dims over nothing else) is all-reduced whole and each device's block sliced,
      not reduce-scattered; XLA:CPU all-reduces once per such dim's axes (as ``sums_per_dim``),
      XLA:GPU once over them all, and a summed axis the layout leaves out is all-reduced after, on
      the block. Measured on single weight-gradient matmuls ``x.T @ g`` (tokens over the summed
      axes, 2026-12-07, tests/test_fast_rules.py): the result wanted ``(expert, data)``, ``(a, (b,
      c))`` or ``(a, b)`` with ``c`` summed too; XLA:TPU reduce-scatters onto the dims (False).
      A matmul's result that a spare axis splits on such a dim is reduce-scattered on every compiler.
    - ``scatters_early``: a pending sum larger than the combine threshold (``COMBINE_BYTES``: a
      layer's weight gradient) whose layout splits a dim over an axis it sums (FSDP) is held whole
      only at the op that makes it: the compiler reduce-scatters it there, not where its reader
      (the optimizer's update, a scanned layer's stacked gradient at the loop body's end) reads
      it; smaller ones are held whole until then (combined into one reduce-scatter). Measured on
      XLA:TPU and XLA:GPU buffer assignments (docs/stepcost.md, "Weight gradients scattered as
      they are made"): Llama-2-70B shapes, scanned, on 256 v5p chips 53.38 -> 50.10 GiB against
      50.16 compiled, on 2,048 v5p chips 9.35 -> 7.31 against 7.61. XLA:GPU may combine a loop's
      gradients far over the threshold (its combiner's limit for pipelined collectives is the
      device's free memory), held whole until then: there this frees them too early (a scanned
      Llama of 8-64 MiB gradients on 8 H100s: 552 / 608 MiB, 692 without the rule). XLA:CPU
      all-reduces the whole and slices it: held (``scatters_whole``).
    - ``transposes_in_place``: a transpose whose operand has no later reader is its operand's
      buffer laid out anew (layout assignment makes the producer write it transposed: a bitcast),
      not a copy beside it (XLA:TPU, XLA:GPU; measured on a 1.5B Llama's head weight gradient,
      a 1,002 MiB dot result transposed to the weight's shape: one buffer on XLA:GPU, two on
      XLA:CPU).
    - ``minor_gather``: what a step input (a param, its state) gathered along a dim that is not its
      outermost one of more than one element costs besides the gather: a collective concatenates
      whole buffers, so the layout assignment gathers a copy laid out with that dim outermost.
      ``"shard"``: the local shard is copied into that layout before the gather (a kernel
      reading and writing the shard); ``"whole"``: the gathered result is copied back into the
      layout its reader wants after it (the gathered bytes, read and written). Measured on
      single gathers of a (512, 256) weight split on its second dim over 8 devices and on whole
      steps (FSDP of llama_small with every kernel split on its second dim against its first,
      the same bytes moved): XLA:CPU copies both (+2 kernels a weight: 538 -> 596 kernels for 29
      weights), XLA:GPU the shard (its matmuls read the gathered layout as it is), XLA:TPU
      neither (its tiled layouts gather in place).
    - ``minor_scatter``: a param's gradient reduce-scattered onto a dim that is not its outermost
      of more than one element is scattered in a layout with that dim outermost (the matmul that
      makes it writes it so), the optimizer's update reads it so and writes the param and its
      state likewise, and each of them is copied back into the param's layout: a kernel per
      updated array, of the shard's bytes (XLA:GPU, the same llama_small steps: 87 copies for 29
      weights under Adam, 3 arrays each).
    - ``gathers_at_once``: a value gathered whole on several dims is gathered by one all-gather
      over all their axes (the whole result's bytes), not one per dim, the last dim first (XLA:TPU
      v5e, measured offline on single reshards over model=2, expert=2, data=2, 2026-12-07: (48,
      192) over (expert, data) made whole, 36,864 B, where XLA:CPU and XLA:GPU gather 18,432 B then
      36,864 B; an Adam update of a replicated weight whose gradient is laid out so, 3 x 36,864 B).
    - ``split_k``: the GPU a matmul's contraction is split for (``runtime/splitk.py``: XLA:GPU cuts
      the contraction of a matmul with few output tiles into chunks, computes their partial results
      in float32 side by side and adds them up: a workspace of the result times the chunks is alive
      between the two, and the sum's additions count as FLOPs); None: never split.
    """

    name: str
    dense_ragged: bool = False
    whole_ragged: str | None = None
    whole_top_k: bool = False
    sums: frozenset[str] = frozenset()
    matmul_itemsize: int | None = None
    gather_cse: int | None = None
    recomputes: bool = False
    duplicates: bool = False
    narrows: bool = False
    tile: tuple[int, int] | None = None
    windowed: int | None = None
    split_k: splitk.SplitK | None = None
    gathers_reduce: int | None = None
    scatters_whole: bool = False
    sums_per_dim: bool = False
    scatters_one_dim: bool = False
    scatters_early: bool = False
    transposes_in_place: bool = False
    minor_gather: frozenset[str] = frozenset()
    minor_scatter: bool = False
    gathers_at_once: bool = False


_REASSOCIATES = splitk.ADDS  # the ops XLA:GPU and XLA:TPU add partial sums with before reducing them


COMPILERS = {
    "cpu": Compiler(
        COMPILER_NAMES["cpu"],
        dense_ragged=True,
        whole_top_k=True,
        scatters_whole=True,
        sums_per_dim=True,
        scatters_one_dim=True,
        minor_gather=frozenset({"shard", "whole"}),
    ),
    "cuda": Compiler(  # H100 (and H200: the same SMs) unless a chip's book says otherwise
        COMPILER_NAMES["cuda"],
        sums=_REASSOCIATES,
        recomputes=True,
        scatters_early=True,
        scatters_one_dim=True,
        transposes_in_place=True,
        minor_gather=frozenset({"shard"}),
        minor_scatter=True,
        whole_ragged="dense",
        split_k=splitk.for_gpu(GPUS["h100"].sms, GPUS["h100"].compute_capability),
    ),
    "tpu": Compiler(
        COMPILER_NAMES["tpu"],
        sums=_REASSOCIATES,
        matmul_itemsize=2,
        gather_cse=100,
        narrows=True,
        recomputes=True,
        duplicates=True,
        tile=(8, 128),
        windowed=8192,
        scatters_early=True,
        transposes_in_place=True,
        whole_ragged="kernel",
        gathers_at_once=True,
    ),
}


COMPILERS["tpu-v6e"] = replace(COMPILERS["tpu"], windowed=16384)


COMPILERS["tpu-v5p"] = replace(COMPILERS["tpu"], gathers_reduce=64)


for _chip in sorted(BOOKS & set(GPUS)):  # GPUs whose split-K model differs from the H100's (SMs, generation)
    COMPILERS[_chip] = replace(
        COMPILERS["cuda"], split_k=splitk.for_gpu(GPUS[_chip].sms, GPUS[_chip].compute_capability)
    )


WINDOWED_MAX_DEVICES = 32  # the most devices a windowed einsum's ring was measured on (64: none)
