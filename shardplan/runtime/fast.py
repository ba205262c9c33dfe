"""Fast mode: what the auto backend's step costs, from the step's jaxpr (no XLA compile).

The step (forward, backward and optimizer update: the auto backend's ``pure_step``) is
traced over abstract values. The plan's shardings of params, optimizer state and batch
are then propagated through the jaxpr's equations the way GSPMD does for the common
cases, and every collective it needs is recorded with why:

- a contraction over a dimension split on both sides runs locally and leaves a partial
  sum (an all-reduce, or a reduce-scatter where the consumer is split on that axis, as a
  data-parallel gradient feeding an FSDP-split optimizer update is);
- an operand split where the consumer needs it whole is all-gathered (an FSDP weight
  before its matmul; gathered once, reused by the backward pass as XLA's CSE does);
- a mesh axis moving from one dimension to another is an all-to-all;
- a lookup in a table split over its rows is a masked local lookup and an all-reduce.

Per-device FLOPs count 2*M*N*K per matmul and one per element of other ops, divided by
how the iteration space is split, as XLA's cost analysis counts them (transcendental functions
apart, a reduction one per element reduced, an all-reduce one per element). What it does not
model (an unknown primitive) is listed in the result's notes, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from shardplan.core.leaves import records
from shardplan.core.stepcost import Communication, Constrained, Memory, StepCost
from shardplan.core.targets import BOOKS, COMPILER_NAMES, GPUS
from shardplan.core.timing import combined, combined_launches
from shardplan.ledger import merged
from shardplan.runtime import gather_reuse, splitk
from shardplan.runtime.gather_reuse import Share
from shardplan.runtime.kernels import FUSED_ATTENTION, fused_attention_cost, pallas_cost
from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS, TRANSCENDENTAL, itemsize, named, ragged_dense
from shardplan.runtime.primitives import subjaxpr as _subjaxpr
from shardplan.runtime.sharding import constraint_target, permuted, scan_counts, update_paths
from shardplan.runtime.sources import INTERNAL_SCOPE, eqn_source
from shardplan.runtime.tracing import Resolution, Trace, trace_key

_T = TypeVar("_T")

Dims = tuple[tuple[str, ...], ...]

# fast mode's sets, as policy over the primitive catalogue (shardplan/runtime/primitives.py).
# Ops through which a pending partial sum stays pending: linear ops that move or fold elements
# (views, broadcasts, sums) and conversions. Not elementwise arithmetic: GSPMD all-reduces each
# operand of an add of partial sums (measured: a column-parallel layer's q, k and v input
# gradients are three all-reduces, not one).
_LINEAR = named(traits=("linear",)) - named(kinds=("elementwise",)) | {"convert_element_type", "copy", "copy_p"}
# Ops XLA does as a bitcast of the same buffer (no memory traffic) or folds into the consumer's
# operand layout (``name`` is ``checkpoint_name``: an identity that tags a value for a remat
# policy). A bitcast to another dtype is not modelled (a declared fallback, below).
_VIEWS = named(traits=("bitcast",)) - {"bitcast_convert_type"}
_LAYOUT = _VIEWS | {"convert_element_type"}
# Consumers XLA fuses a single-use elementwise producer into (loop and input fusion).
_FUSES_PRODUCER = ELEMENTWISE | _LAYOUT | REDUCTIONS | {"broadcast_in_dim"}
_FREE = {"iota", "stop_gradient"}
_IN_PLACE = {"scatter-add", "scatter_add", "scatter", "dynamic_update_slice"}  # write into operand 0
# Elementwise ops XLA's fusion will not duplicate into several consumers (instruction_fusion's
# IsExpensive): transcendental functions and divisions.
_EXPENSIVE = named(traits=("expensive",))
# Ops whose output dims of unchanged size keep their operands' layout (a wanted layout flows back;
# not scans along a dim, cumsum or rev, where a split would change what each device computes).
_LAYOUT_PRESERVING = named(traits=("keeps-layout",))


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
    - ``recomputes``: an elementwise result that every reader fuses (``_kernels``) is not held where
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
      256 chips. None: gathered.
    - ``scatters_whole``: a reduce-scatter is an all-reduce of the whole followed by each device's
      slice (XLA:CPU emits no reduce-scatter for GSPMD): its FLOPs are the all-reduce's, one per
      element of the whole, as XLA's cost analysis counts an all-reduce (a reduce-scatter: none).
    - ``sums_per_dim``: a matmul whose contraction is split over different axes on different dims
      (tokens over `data` on the batch, over `seq` on the sequence: a weight gradient under
      sequence parallelism) sums its result once per such dim, one all-reduce over each dim's axes
      after the other (XLA:CPU, measured on single matmuls "bsd,bsf->df": two all-reduces of the
      whole result; XLA:TPU and XLA:GPU fold them into one over all the axes).
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


_REASSOCIATES = splitk.ADDS  # the ops XLA:GPU and XLA:TPU add partial sums with before reducing them
COMPILERS = {
    "cpu": Compiler(COMPILER_NAMES["cpu"], dense_ragged=True, whole_top_k=True, scatters_whole=True, sums_per_dim=True),
    "cuda": Compiler(  # H100 (and H200: the same SMs) unless a chip's book says otherwise
        COMPILER_NAMES["cuda"],
        sums=_REASSOCIATES,
        recomputes=True,
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
        whole_ragged="kernel",
    ),
}
COMPILERS["tpu-v6e"] = replace(COMPILERS["tpu"], windowed=16384)
COMPILERS["tpu-v5p"] = replace(COMPILERS["tpu"], gathers_reduce=64)
for _chip in sorted(BOOKS & set(GPUS)):  # GPUs whose split-K model differs from the H100's (SMs, generation)
    COMPILERS[_chip] = replace(
        COMPILERS["cuda"], split_k=splitk.for_gpu(GPUS[_chip].sms, GPUS[_chip].compute_capability)
    )
WINDOWED_MAX_DEVICES = 32  # the most devices a windowed einsum's ring was measured on (64: none)


@dataclass(frozen=True)
class Val:
    """An abstract value and how it is split: per dim the mesh axes, and pending partial sums."""

    shape: tuple[int, ...]
    itemsize: int
    dims: Dims
    partial: frozenset[str] = frozenset()

    @property
    def axes(self) -> set[str]:
        return {a for d in self.dims for a in d}


@dataclass
class _Ctx:
    mesh: dict[str, int]
    batch_axes: tuple[str, ...] = ()  # the axes inputs are split over (activations carry them)
    book: Compiler = COMPILERS["cpu"]  # the compiler whose program is predicted
    comm: list[Communication] = field(default_factory=list)
    labelled: set[int] = field(default_factory=set)  # rows of ``comm`` whose ``moves`` is a label only
    backward: bool = False  # the equation being costed is in the backward pass (a transpose's)
    backward_rows: set[int] = field(default_factory=set)  # rows of ``comm`` added in the backward pass
    flops: float = 0.0
    transcendentals: float = 0.0
    hbm: float = 0.0  # bytes read and written in memory (XLA's fusion assumed: see _Propagator.traffic)
    launches: float = 0.0  # kernels launched (equations whose results are stored, collectives)
    unmodeled: dict[str, int] = field(default_factory=dict)
    cache: dict[tuple, Val] = field(default_factory=dict)
    gathered_now: int = 0
    gathered_peak: int = 0
    held_gathers: dict[Any, int] = field(default_factory=dict)  # gathers merged across matmuls, held
    # XLA combines the step's gradient reductions into one (tuple) collective before the
    # optimizer (see core.timing.combined): its results are new buffers, alive with the unreduced
    # gradients. ``reduced``: their bytes per device (results); ``reduced_from``: what the step
    # held at the first of them (program order), None before it.
    reduced: int = 0
    reduced_from: int | None = None
    reducing: bool = False
    lookups: list[str] = field(default_factory=list)  # sources of lookups whose table and indices share an axis
    kernels: list[str] = field(default_factory=list)  # what the Pallas kernels' costs estimate
    source: str = ""  # 'file:line' in the user's code of the equation being propagated

    memo: dict[Any, int] = field(default_factory=dict)  # split and local sizes asked again and again

    def split_dims(self, dims: Dims) -> int:
        """Devices a layout splits a value over (the product of its dims' splits)."""
        return math.prod(self.split(tuple(d)) for d in dims)

    def split(self, axes: tuple[str, ...]) -> int:
        key = axes if type(axes) is tuple else tuple(axes)
        n = self.memo.get(key)
        if n is None:
            n = self.memo[key] = math.prod(self.mesh[a] for a in key)
        return n

    def local(self, v: Val) -> int:
        key = (v.shape, v.dims, v.itemsize)
        n = self.memo.get(key)
        if n is None:
            n = v.itemsize
            for size, axes in zip(v.shape, v.dims, strict=True):
                n *= size // self.split(axes) if axes else size
            self.memo[key] = n
        return n

    def held(self, v: Val) -> int:
        """Bytes ``v``'s local part takes in memory: :meth:`local`, padded to the compiler's tiles."""
        tile = self.book.tile
        if tile is None or not v.shape:
            return self.local(v)
        key = ("held", v.shape, v.dims, v.itemsize)
        n = self.memo.get(key)
        if n is None:
            local = [size // self.split(axes) if axes else size for size, axes in zip(v.shape, v.dims, strict=True)]
            n = self.memo[key] = tiled_bytes(local, v.itemsize, tile)
        return n

    def add(
        self,
        kind: str,
        axes: tuple[str, ...],
        nbytes: int,
        mult: int,
        why: str,
        moves: str = "",
        label: bool = False,
        itemsize: int = 4,
    ) -> None:
        """One collective; ``label``: ``moves`` names the param only for the ledger (a scanned
        layer's slice of it, see ``_Propagator.scan``): its launches are counted as they are.
        An all-reduce adds one flop per element of its result, as XLA's cost analysis counts it (a
        reduce-scatter none; XLA:CPU's is an all-reduce of the whole: ``Compiler.scatters_whole``)."""
        if axes and nbytes and self.split(tuple(axes)) > 1:  # over axes of size 1 nothing moves
            # A collective reads its buffer and writes its result (``nbytes``: an all-gather's
            # result, a reduce-scatter's input; the other side is 1/n of it).
            n = self.split(tuple(axes))
            if kind == "all-gather" and self.book.gathers_reduce and n >= self.book.gathers_reduce:
                if n == self.split(tuple(self.mesh)):  # over the whole slice: a padded shard all-reduced
                    kind = "all-reduce"
            self.hbm += (nbytes + nbytes // n if kind in ("all-gather", "reduce-scatter") else 2 * nbytes) * mult
            if kind == "all-reduce" or (kind == "reduce-scatter" and self.book.scatters_whole):
                self.flops += nbytes / itemsize * mult
            self.launches += mult
            self.comm.append(Communication(kind, tuple(axes), nbytes * mult, mult, why, self.source, moves))
            if label and moves:
                self.labelled.add(len(self.comm) - 1)
            if self.backward:
                self.backward_rows.add(len(self.comm) - 1)


@dataclass(frozen=True)
class _Boundary:
    """What a call's caller holds of the call's inputs and outputs (memory traffic; XLA inlines
    calls): the inputs in memory, the outputs the caller's readers fuse, and for the other inputs
    the values in memory their fused producers read."""

    stored: frozenset
    fusable_outs: dict[Any, int]  # -> how many of the caller's equations read it
    reads: dict[Any, frozenset]


@dataclass
class _Frame:
    """Memory-traffic state of one jaxpr being run (mutable working state of ``_Propagator.run``)."""

    jaxpr: Any
    env: dict[Any, Val]
    stored: set  # values in memory
    fused: dict[Any, int]  # results computed inside their readers -> their producer's index
    shared: set  # fused results several equations read
    soft: dict[Any, int]  # call results the readers fuse -> how many read it
    closures: dict[Any, frozenset]  # value -> the (value in memory, layout) pairs reading it reads
    written: set = field(default_factory=set)  # values from literals alone, written where first read


_NONE: frozenset = frozenset()  # an empty set nothing adds to
_NORMAL: dict[tuple, Dims] = {}  # (dims, rank) -> normal dims: asked ~100,000 times per costing


def _norm(dims: Dims, rank: int) -> Dims:
    if type(dims) is tuple:
        try:
            hit = _NORMAL.get((dims, rank))
        except TypeError:  # a list inside: not hashable, normalised below
            hit = None
        if hit is not None:
            return hit
    out = tuple(tuple(d) for d in dims) + ((),) * (rank - len(dims))
    if type(dims) is tuple and len(_NORMAL) < 100_000:
        try:
            _NORMAL[(dims, rank)] = out
        except TypeError:
            pass
    return out


class _Propagator:
    """Shardings through one jaxpr (recursing into nested jaxprs)."""

    def __init__(
        self, ctx: _Ctx, names: dict[Any, str], ignore_constraints: bool = False, free: dict[Any, Dims] | None = None
    ):
        self.ctx = ctx
        self.ignore_constraints = ignore_constraints  # propagate as if the step constrained nothing
        self.names = names  # top-level invar -> leaf path (for 'moves')
        # A scanned body's slices of stacked params and gradients -> their path: what the ledger's
        # rows say they move (``scan``); the layouts and the memory read ``names`` alone.
        self.labels: dict[Any, str] = {}
        self.updates: dict[Any, str] = {}  # a value -> the param it updates (a gradient's sums name it)
        self.hints: dict[Any, Dims] = {}
        self.claimed: dict[Any, Dims] = {}  # values a closed sharding constraint lays out (see _claims)
        self.back: dict[Any, Dims] = {}  # layouts propagated back from those (see _claims_back, _back_claim)
        self.wants: dict[Any, Dims] = {}  # splits readers want (see _wants)
        # Whole values an elementwise op met with split ones (XLA's propagation would have computed
        # them split: slicing a whole value is free); a second propagation takes them as ``free``.
        self.slices: dict[Any, Dims] = {}
        self.free: dict[Any, Dims] = dict(free or {})
        self.constant: set[Any] = set()  # values computed from literals alone (XLA keeps them whole)
        # A broadcast's result -> (its operand, the operand's layout, broadcast_dimensions): where an
        # elementwise op moves it, XLA moves the operand at its own size.
        self.expanded: dict[Any, tuple[Any, Val, tuple[int, ...]]] = {}
        self.memo: dict[Any, tuple] = {}  # what depends on the trace alone, kept between plans (see cost)
        # A value holding a pending sum -> (op, source) of the equation that made it: the collective
        # that completes the sum is that op's (a gradient's all-reduce belongs to the model line whose
        # matmul's transpose made it, not to the optimizer's read of it).
        # where each pending sum was made: (primitive, source, elements a matmul contracted or 0)
        # a pending sum -> (the op that made it, its source, the elements it contracts, the axes
        # each contracted dim is split over where several dims are: ``Compiler.sums_per_dim``)
        self.sum_origin: dict[Any, tuple[str, str, int, tuple[frozenset[str], ...]]] = {}
        self.sum_dims: dict[Any, tuple[frozenset[str], ...]] = {}  # a matmul's result -> those axes
        # a matmul's pending sum -> the dim its operands' rows (an operand's leading dim) went to,
        # None where they went nowhere (the experts' dim leads a dispatched buffer)
        self.rows: dict[Any, int | None] = {}
        # A matmul's result all-reduced over these axes (see ``resolve``): read in a layout that splits
        # one of its split dims further over them, XLA gathers that dim first (``reshard``).
        self.dot_reduced: dict[Any, tuple[frozenset[str], int]] = {}  # -> (summed axes, batch dims)
        self.dot_batch: dict[Any, int] = {}  # a batched matmul's summed result -> its batch dims (leading)
        self.stand_ins: dict[Any, dict[str, str]] = {}  # a matmul's result -> {idle axis: the summed one it stands for}
        self.peak = 0  # most bytes of intermediates alive at once in the jaxpr being run
        # A matmul's result held as its split contraction's float32 partials (``_split_k``)
        self.widened: dict[Any, int] = {}
        self.aliased: set[Any] = set()  # step outputs written into their donated input buffers
        self.inlined: Any = None  # the last call walked in place (``inline``)
        # a call's result -> the layout of a value already made that an elementwise reader of the
        # result adds it to (GSPMD's propagation gives the producer that layout; ``scatter``)
        self.siblings: dict[Any, Dims] = {}
        self.inlined_peak = 0  # that call's peak less its results (held by the caller from then)
        self.peak_without_outputs = 0  # the last jaxpr run's peak, less its outputs held then
        self.virtual_outs: set[int] | frozenset[int] = set()  # outputs of the last run jaxpr that are broadcasts
        self.depth = 0
        self.backward = False  # in the backward pass (a transpose's equations): for ``Compiler.gather_cse``
        # (id of a matmul, the step input it reads) -> the gather that read uses (``gather_reuse``)
        self.shares: dict[tuple[int, Any], Share] = {}
        # Layouts only (no memory traffic, no sum origins for the collectives' labels): a pass
        # whose collectives and traffic are thrown away, run only for what it finds (``slices``).
        self.layouts_only = False
        # Memory traffic: the jaxpr being run, and the last one run (a call's body, read back by
        # its caller: XLA inlines calls, so fused chains cross them).
        self._frame: _Frame | None = None
        self._last_frame: _Frame | None = None
        self.constrained: list[Constrained] = []  # activations with a set layout, in program order
        # A call's inner variables stand for the outer ones they are bound to (and its outer
        # results for the inner ones): XLA inlines calls and does each reshard of a value once.
        self.origin: dict[Any, Any] = {}
        self.call_source = ""  # the source line of the call being run (for library code inside it)
        self.runs = 0  # jaxpr runs so far
        self.defined: dict[Any, int] = {}  # variable -> the run that last defined it
        # A scan's loop-invariant operands -> the runs outside the loop: XLA hoists their reshards out
        # of the while body (measured: a weight closed over by a scanned body is gathered once).
        self.invariant: dict[Any, int] = {}

    def root(self, var: Any) -> Any:
        while var in self.origin:
            var = self.origin[var]
        return var

    def key(self, var: Any) -> tuple[int, int | None]:
        """A value's identity for the reshard cache: its root variable and the run that defined it
        (a jaxpr called from several places, e.g. one ``jnp.where`` per layer, reuses its variables)."""
        root = self.root(var)
        return id(root), self.defined.get(root)

    # -- resharding ------------------------------------------------------------------------
    def resolve(self, var: Any, v: Val, target: Dims | None, mult: int, why: str, contracted: int = 0) -> Val:
        """``v`` with its pending sums done: reduce-scatter over partial axes the target
        splits a dim on (when ``v`` leaves that dim whole), all-reduce over the rest.
        ``contracted``: the elements the matmul that made ``v`` contracts (``Compiler.windowed``)."""
        if not v.partial:
            return v
        if target is None and var not in self.hints and var not in self.wants:
            target = _batch_scatter(v, self.ctx, self.rows.get(self.root(var), 0))
        target = target if target is not None else self.hints.get(var, self.wants.get(var, v.dims))
        key = ("resolve", self.key(var), target)
        hit = self.ctx.cache.get(key)
        if hit is not None:
            return hit
        dims = [list(d) for d in v.dims]
        origin = self.sum_origin.get(var)
        # A matmul's sum is scattered onto a dim (whole, or split further); onto a batch dim its
        # operands split, XLA's dot partitioner all-reduces, gathers that dim and slices (measured:
        # "gsec,egcd->gsd" with g over data, e over expert, the result wanted over (data, expert)).
        batch = self.dot_batch.get(self.root(var), 0) if origin is not None and origin[0] == "dot_general" else 0
        scatter: list[str] = []
        # summed axes an idle axis stands in for (``_idle_split``): all-reduced, then permuted
        stands_for = set(self.stand_ins.get(self.root(var), {}).values())
        for i, t in enumerate(_norm(target, len(v.shape))):
            for a in t:
                if (
                    a in v.partial
                    and a not in dims[i]
                    and not (i < batch and v.dims[i])
                    and a not in stands_for
                    and v.shape[i] % (self.ctx.split((*dims[i], a))) == 0
                ):
                    scatter.append(a)
                    dims[i].append(a)
        rest = tuple(a for a in sorted(v.partial) if a not in scatter)
        if batch and rest:
            self.dot_reduced[var] = (frozenset(rest), batch)
        reader_source = self.ctx.source
        if origin is not None:  # the sum is the op's that made it, at its line
            why, self.ctx.source = origin[0], origin[1] or reader_source
            contracted = contracted or origin[2]
        moves = self.updates.get(var) or self.updates.get(self.root(var), "")  # a gradient: its param
        label = moves or self.labels.get(var) or self.labels.get(self.root(var), "")
        only = bool(label) and not moves  # named for the ledger alone
        if scatter:
            n = self.ctx.split(tuple(scatter))
            windowed = self.ctx.book.windowed
            if windowed and contracted > windowed and n <= WINDOWED_MAX_DEVICES:  # a ring inside the matmul
                ring = self.ctx.local(v) * (n + 1) // n
                self.ctx.add("collective-permute", tuple(scatter), ring, mult, why, label, only)
            else:
                self.ctx.add("reduce-scatter", tuple(scatter), self.ctx.local(v), mult, why, label, only, v.itemsize)
        out = Val(v.shape, v.itemsize, tuple(tuple(d) for d in dims))
        for part in _per_dim(rest, origin[3] if origin is not None else ()):
            self.ctx.add("all-reduce", part, self.ctx.local(out), mult, why, label, only, out.itemsize)
        if moves and mult == 1 and (scatter or rest) and self.depth == 1:
            self.ctx.reduced += self.ctx.local(out)
            self.ctx.reducing = True
        self.ctx.source = reader_source
        self.ctx.cache[key] = out
        return out

    def reshard(self, var: Any, v: Val, target: Dims, mult: int, why: str, tag: Any = None) -> Val:
        """``v`` (no pending sums) laid out as ``target``: gathers, slices, all-to-alls. ``tag``:
        what else tells this reshard from another of the same value to the same layout (a matmul
        operand's cast and pass, where the compiler gathers again: :class:`Compiler`)."""
        target = _norm(target, len(v.shape))
        if v.dims == target:
            return v
        key = ("reshard", self.key(var), target, tag)
        hit = self.ctx.cache.get(key)
        if hit is not None:
            return hit
        want = {a: i for i, d in enumerate(target) for a in d}
        dims = [list(d) for d in v.dims]
        moves = self.names.get(self.root(var), "")
        label = moves or self.labels.get(self.root(var), "")
        only = bool(label) and not moves  # named for the ledger alone
        mult = self.invariant.get(self.root(var), mult)
        if any(any(want.get(a, i) != i for a in d) and any(a not in want for a in d) for i, d in enumerate(v.dims)):
            # One dim's axes both moving to another dim and gathered (``(data, expert)`` on the
            # tokens to ``expert`` on the experts): GSPMD has no reshard for that and replicates
            # the value (an all-gather over every axis it is split on, "involuntary full
            # rematerialization"), then slices it (measured).
            whole = Val(v.shape, v.itemsize, ((),) * len(v.shape))
            self.ctx.add(
                "all-gather",
                tuple(a for a in self.ctx.mesh if a in v.axes),
                self.ctx.local(whole),
                mult,
                why,
                label,
                only,
            )
            dims = [[] for _ in v.dims]
        # An axis that moves to another dim: all-to-all of the local buffer.
        for i, d in enumerate(v.dims):
            for a in d:
                j = want.get(a)
                if j is not None and j != i and a in dims[i] and a not in dims[j]:
                    self.ctx.add(
                        "all-to-all",
                        (a,),
                        self.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
                        mult,
                        why,
                        label,
                        only,
                    )
                    dims[i].remove(a)
                    dims[j].append(a)
        # A matmul's all-reduced result whose split dim the target splits further over an axis it
        # was summed over: XLA gathers the dim whole, then slices it (``resolve``). Where a mesh
        # axis is idle (neither splitting the value nor summed), XLA splits the matmul's batch over
        # it instead and permutes the summed result into place (``_idle_split``'s stand-ins).
        summed, batch = self.dot_reduced.get(var, (frozenset(), 0))
        origin = self.sum_origin.get(var)
        idle = bool(self.stand_ins.get(self.root(var))) or any(
            n > 1 and a not in v.axes and a not in summed for a, n in self.ctx.mesh.items()
        )
        for i, t in enumerate(target[:batch]):
            if origin is not None and not idle and dims[i] and any(a in summed and a not in dims[i] for a in t):
                undivided = [list(d) for d in dims]
                undivided[i] = []
                reader, self.ctx.source = self.ctx.source, origin[1] or self.ctx.source  # the matmul's
                nbytes = self.ctx.local(Val(v.shape, v.itemsize, _tuple(undivided)))
                self.ctx.add("all-gather", tuple(dims[i]), nbytes, mult, origin[0], label, only)
                self.ctx.source = reader
                dims[i] = []
        # Axes replaced on a dim by others of the same size that split nothing else: the local part
        # sent to the device that holds it in the target, a collective-permute (measured: a value
        # over (data, model) to (data, expert), and over model to expert, on either dim).
        held = {a for d in dims for a in d}
        wanted_axes = {a for t in target for a in t}
        for i, t in enumerate(target):
            cur = dims[i]
            k = next((n for n, (x, y) in enumerate(zip(cur, t, strict=False)) if x != y), min(len(cur), len(t)))
            old, new = cur[k:], list(t[k:])
            if (
                old
                and new
                and self.ctx.split(tuple(old)) == self.ctx.split(tuple(new))
                and not set(old) & wanted_axes
                and not set(new) & held
            ):
                self.ctx.add(
                    "collective-permute",
                    (*old, *new),
                    self.ctx.local(Val(v.shape, v.itemsize, _tuple(dims))),
                    mult,
                    why,
                    label,
                    only,
                )
                dims[i] = cur[:k] + new
                held = {a for d in dims for a in d}
        # Axes the target adds: a free local slice, taken before any gather (so a gather moves
        # only the part the target keeps: measured, a broadcast split over `model` met by a value
        # split over `data` is gathered over `model` in its `data` slice).
        for i, t in enumerate(target):
            for a in t:
                if a not in dims[i] and all(a not in d for d in dims):
                    dims[i].append(a)
        # Axes the target leaves out: all-gather (the gathered result's bytes), the last dim first
        # (measured: (data, model) made whole gathers `model` on the small buffer, then `data`).
        for i, cur in reversed(list(enumerate(list(dims)))):
            drop = [a for a in cur if a not in target[i]]
            if drop:
                dims[i] = [a for a in cur if a in target[i]]
                gathered = Val(v.shape, v.itemsize, _tuple(dims))
                nbytes = self.ctx.local(gathered)
                self.ctx.add("all-gather", tuple(drop), nbytes, mult, why, label, only)
                if moves and self.ctx.book.gather_cse is None:  # held to its last use (else: ``_cast_gather``)
                    self.ctx.gathered_now += nbytes
                    self.ctx.gathered_peak = max(self.ctx.gathered_peak, self.ctx.gathered_now)
        # What a gather freed for the target: a free local slice.
        for i, t in enumerate(target):
            for a in t:
                if a not in dims[i] and all(a not in d for d in dims):
                    dims[i].append(a)
        out = Val(v.shape, v.itemsize, _tuple(dims))
        self.ctx.cache[key] = out
        return out

    def to_layout(self, var: Any, v: Val, target: Dims, mult: int, why: str) -> Val:
        """``v`` set to a layout (a constraint, a reshard): its pending sums done onto it, then moved."""
        return self.reshard(var, self.resolve(var, v, target, mult, why), target, mult, why)

    # -- equations -------------------------------------------------------------------------
    def run(self, jaxpr: Any, env: dict[Any, Val], mult: int, boundary: _Boundary | None = None) -> list[Val]:
        """Propagate through ``jaxpr``; also track the bytes its intermediates hold at once
        (``self.peak``: the most live at any point, on top of its inputs) and the memory traffic
        of its kernels (``boundary``: where ``jaxpr`` is a call's body, what its caller holds)."""
        self._hints(jaxpr)
        self._wants(jaxpr)
        top = self.depth == 0
        self.depth += 1
        last, uses, keep, fused, (fused_v, soft, shared) = self._structure(jaxpr, boundary)
        live = peak = peak_ex = out_live = 0
        results = {x for x in jaxpr.outvars if not hasattr(x, "val")}
        held: dict[Any, int] = {}
        narrow = self.ctx.book.matmul_itemsize or 4
        # Values in memory (not fused away): a jaxpr's inputs, unless a call's caller fused them.
        stored = (set(jaxpr.invars) if boundary is None else set(boundary.stored)) | set(jaxpr.constvars)
        frame = _Frame(jaxpr, env, stored, fused_v, shared, soft, {} if boundary is None else dict(boundary.reads))
        outer_frame, self._frame = self._frame, frame
        self.runs += 1
        this_run = self.runs
        copies: dict[Any, int] = {}  # the narrow copies of the jaxpr's inputs its matmuls read
        for eqn, literals, variables, dying, narrowing, copying in self._steps(jaxpr, last, keep):
            ins = [env[x] if lit is None else lit for x, lit in zip(eqn.invars, literals, strict=True)]
            for var in eqn.outvars:
                self.defined[var] = this_run
                self.origin.pop(var, None)
            if all(x in self.constant for x in variables) and eqn.primitive.name != "scan":
                self.constant.update(eqn.outvars)
            else:
                self.constant.difference_update(eqn.outvars)
            outer_peak, self.peak = self.peak, 0
            self.virtual_outs = _NONE
            outs = self.eqn(eqn, ins, mult)
            inner, self.peak = self.peak, outer_peak
            virtual = (
                {eqn.outvars[i] for i in self.virtual_outs if i < len(eqn.outvars)} if self.virtual_outs else _NONE
            )
            if not self.layouts_only:
                self.traffic(frame, eqn, outs, virtual, mult)
                self._sum_origins(eqn, outs)
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
                wide = self.widened.pop(var, 0) if self.widened else 0  # (only a GPU book's split matmuls)
                if not wide and self.widened and eqn.primitive.name in splitk.VIEWS and eqn.invars[0] in self.widened:
                    wide = self.widened[eqn.invars[0]]  # a view of a split matmul's result: its partials
                if wide:
                    self.widened[var] = wide
                if var not in fused and var not in self.aliased and var not in virtual:
                    held[var] = max(self.ctx.held(val), wide)
                    live += held[var]
                    out_live += held[var] if var in results else 0
            for x in copying:
                # made for its first matmul, where the weight is read in place (not gathered: then
                # the cast is gathered around its uses, ``Compiler.gather_cse``)
                if x not in copies and not any(a in self.ctx.batch_axes for a in env[x].axes):
                    copies[x] = self.ctx.held(env[x]) * narrow // 4
                    live += copies[x]
            # An update in place (a scatter into zeros, a slice written into a cache) shares its
            # operand's buffer where this is the operand's last reader: one buffer, not two.
            shared = held.get(eqn.invars[0], 0) if eqn.primitive.name in _IN_PLACE and eqn.invars[0] in dying else 0
            if self.inlined is eqn:  # a call's body holds its results, which the caller now holds: once
                inner = self.inlined_peak
            # Gathered weights stay alive for their reuse in the backward pass (XLA's CSE).
            peak = max(peak, live - shared + inner + (self.ctx.gathered_now if top else 0))
            peak_ex = max(peak_ex, live - shared - out_live + inner)
            if top and self.ctx.reducing:  # the first gradient reduced: the combined one's moment
                self.ctx.reducing = False
                if self.ctx.reduced_from is None:
                    self.ctx.reduced_from = live + inner
            for x in dying:
                if x in held:
                    out_live -= held[x] if x in results else 0
                    live -= held.pop(x)
            for x in dying:
                if x in copies:  # the weight's last reader (the optimizer's update)
                    live -= copies.pop(x)
            for x in narrowing:  # read by default-precision matmuls alone from here: their narrow copy
                if x in held:
                    cut = held[x] - held[x] * narrow // 4
                    held[x] -= cut
                    live -= cut
        self._last_frame, self._frame = frame, outer_frame
        self.peak = max(self.peak, peak)
        self.peak_without_outputs = peak_ex
        # Outputs that are broadcasts (a call's jvp residuals, masks): recomputed where used.
        self.virtual_outs = {i for i, x in enumerate(jaxpr.outvars) if x in fused}
        self.depth -= 1
        return [self._read(env, x) for x in jaxpr.outvars]

    def traffic(self, frame: _Frame, eqn: Any, outs: list[Val], virtual: set | frozenset, mult: int) -> None:
        """Memory traffic of one equation, as XLA's fusion leaves it (see ``_kernels``): a result
        fused into its readers costs nothing where it is computed; an equation whose results are
        stored is a kernel that reads the values in memory its fused producers read (each once)
        and writes its results. A result several kernels read is stored when computing it reads
        more bytes than it holds (XLA's fusion weighs the same). Reshapes of stored values are
        views; a call's body counts for itself (see ``eqn``)."""
        name = eqn.primitive.name
        if name in ("scan", "shard_map", "pallas_call") or name in FUSED_ATTENTION:  # results stored (a kernel
            # counts its own traffic)
            frame.stored.update(v for v in eqn.outvars if v not in virtual)
            return
        if self.body(eqn) is not None:
            return
        if name in _VIEWS and eqn.invars[0] in frame.stored:
            frame.stored.update(eqn.outvars)
            return
        fused_away = all(v in frame.fused or v in virtual for v in eqn.outvars)
        if fused_away and not any(v in frame.shared and v not in virtual for v in eqn.outvars):
            return  # computed inside its readers: they count what it reads
        reads = frozenset().union(*(self._closure(frame, x) for x in eqn.invars))
        # A value computed from literals alone (zeros a scatter adds into) takes its reader's split
        # (GSPMD shards it like its user): written there, not where it was held whole.
        nbytes = 0
        for x, v in reads:
            n = self._read_bytes(v, outs)
            if x in self.constant and x not in frame.written:  # written once, at its first reader's split
                frame.written.add(x)
                n *= 2
            nbytes += n
        if fused_away:
            for v, val in zip(eqn.outvars, outs, strict=True):
                if v in frame.shared and v not in virtual and nbytes > self.ctx.local(val):
                    frame.stored.add(v)
                    self.ctx.hbm += (nbytes + self.ctx.local(val)) * mult
            return
        stored = False
        for var, val in zip(eqn.outvars, outs, strict=True):
            if var not in frame.fused and var not in virtual:
                frame.stored.add(var)
                stored = True
                nbytes += 0 if var in self.constant else self.ctx.local(val)
        self.ctx.hbm += nbytes * mult
        if stored:
            self.ctx.launches += mult

    def _closure(self, frame: _Frame, x: Any) -> frozenset:
        """The values in memory (each with its layout) a kernel reading ``x`` reads: ``x`` if it is
        stored, else what its fused producers read (across calls: a call's body is inlined)."""
        if hasattr(x, "val"):
            return frozenset()
        if x in frame.stored:
            return frozenset(((x, frame.env[x]),))
        hit = frame.closures.get(x)
        if hit is None:
            if x not in frame.fused:
                return frozenset()
            producer = frame.jaxpr.eqns[frame.fused[x]]
            hit = frozenset().union(*(self._closure(frame, y) for y in producer.invars))
            frame.closures[x] = hit
        return hit

    def _read_bytes(self, v: Val, outs: list[Val]) -> int:
        """Bytes a kernel reads of ``v``: an operand of an output's shape is read where that output
        is computed (a value held whole, say zeros from a literal, is read in its split part)."""
        n = self.ctx.local(v)
        return min([n] + [self.ctx.local(o) * v.itemsize // o.itemsize for o in outs if o.shape == v.shape])

    def _read(self, env: dict[Any, Val], x: Any) -> Val:
        if hasattr(x, "val"):  # a literal
            shape = tuple(getattr(x.aval, "shape", ()))
            return Val(shape, itemsize(x.aval), ((),) * len(shape))
        return env[x]

    def _hints(self, jaxpr: Any) -> None:
        """Backward pass: an elementwise chain ending in a value of known layout wants that layout
        (so a partial gradient is reduce-scattered straight into an FSDP-split update)."""
        if not self.ignore_constraints:
            self._claims(jaxpr)
        for eqn in reversed(jaxpr.eqns):
            if eqn.primitive.name not in ELEMENTWISE:
                continue
            out = self.hints.get(eqn.outvars[0])
            if out is None:
                continue
            for x in eqn.invars:
                if not hasattr(x, "val") and tuple(x.aval.shape) == tuple(eqn.outvars[0].aval.shape):
                    self.hints.setdefault(x, out)

    def _claims(self, jaxpr: Any) -> None:
        """Shardy gives a fully closed sharding constraint's layout to the op computing its operand
        (its import pass ``apply-sharding-constraints``), unless the operand is an input or another
        constraint reads it with another layout. See ``elementwise`` for what that changes."""

        made = {o for eqn in jaxpr.eqns for o in eqn.outvars}
        seen: dict[Any, Dims] = {}
        clash: set[Any] = set()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "sharding_constraint":
                continue
            x = eqn.invars[0]
            spec = getattr(eqn.params.get("sharding"), "spec", None)
            unconstrained = getattr(type(spec), "UNCONSTRAINED", object())
            if x not in made or spec is None or any(e is unconstrained for e in spec):
                continue
            target = constraint_target(eqn, ((),) * len(x.aval.shape))
            if target is None:
                continue
            target = _norm(target, len(x.aval.shape))
            if seen.get(x, target) != target:
                clash.add(x)
            seen[x] = target
        for x, target in seen.items():
            if x not in clash:
                self.claimed.setdefault(x, target)
        # Seeds: this jaxpr's values laid out already (its constraints', a caller's); none, no walk.
        seeds = {}
        for o in [o for eqn in jaxpr.eqns for o in eqn.outvars] + [o for o in jaxpr.outvars if not hasattr(o, "val")]:
            t = self.claimed.get(o, self.back.get(o))
            if t is not None:
                seeds[o] = t
        if seeds:
            for x, target in _claims_back(jaxpr, seeds, self.ctx.split_dims).items():
                if x not in self.claimed:
                    self.back.setdefault(x, target)

    def _wants(self, jaxpr: Any) -> None:
        """Backward pass: the splits a value's readers want, from constrained activations back
        through elementwise and layout ops and matmuls (XLA's propagation runs both ways), so a
        pending sum is reduce-scattered onto a split its readers keep (the gradient of keys and
        values gathered over a split sequence). Only where a pending sum is resolved."""
        _spread(jaxpr, self.wants, None if self.ignore_constraints else "seed")
        if self.free:
            _spread(jaxpr, self.free, "stop")

    def _structure(self, jaxpr: Any, boundary: _Boundary | None) -> tuple:
        """What a jaxpr's run needs that no plan changes: each value's last reader and reader count,
        its outputs, the values fused into their readers, and its kernels (fresh copies of a memo
        kept per trace: the run updates them)."""
        recomputes, duplicates = self.ctx.book.recomputes, self.ctx.book.duplicates
        outs = None if boundary is None else frozenset(boundary.fusable_outs.items())
        key = ("structure", id(jaxpr), outs, recomputes, duplicates)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            last: dict[Any, int] = {}
            uses: dict[Any, int] = {}
            for k, eqn in enumerate(jaxpr.eqns):
                for x in eqn.invars:
                    if not hasattr(x, "val"):
                        last[x] = k
                        uses[x] = uses.get(x, 0) + 1
            keep = {x for x in jaxpr.outvars if not hasattr(x, "val")}
            kernels = _kernels(jaxpr, {} if boundary is None else boundary.fusable_outs)
            fused = _fused_outputs(jaxpr, uses)
            if recomputes:
                dropped, last = _recomputed(jaxpr, kernels[0], last, fused, duplicates)
                fused = fused | dropped
            hit = (jaxpr, last, uses, keep, fused, kernels)
            self.memo[key] = hit
        _, last, uses, keep, fused, (fused_v, soft, shared) = hit
        return last, uses, keep, fused, (dict(fused_v), dict(soft), set(shared))

    def _steps(self, jaxpr: Any, last: dict[Any, int], keep: set) -> list[tuple]:
        """Per equation of ``jaxpr``, what no plan changes: its literal operands' values (None for a
        variable), its variable operands, and the values whose last reader it is (memoised)."""
        book = self.ctx.book
        key = ("steps", id(jaxpr), book.recomputes, book.duplicates, book.narrows)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            steps = []
            narrows = book.narrows and book.matmul_itemsize
            wide = _last_wide_readers(jaxpr, last, keep) if narrows else {}
            narrowing: dict[int, list] = {}
            for x, k in wide.items():
                narrowing.setdefault(k, []).append(x)
            inputs = {x for x in jaxpr.invars if _is_float(x) and x.aval.dtype == "float32"} if narrows else set()
            ends: dict[int, list] = {}  # a value dies after its last reader (or its last recomputation's)
            for x, k in last.items():
                if x not in keep:
                    ends.setdefault(k, []).append(x)
            for k, eqn in enumerate(jaxpr.eqns):
                literals = tuple(self._read({}, x) if hasattr(x, "val") else None for x in eqn.invars)
                variables = tuple(x for x in eqn.invars if not hasattr(x, "val"))
                dying = tuple(ends.get(k, ()))
                copying = tuple(x for x in variables if x in inputs) if _reads_narrow(eqn) else ()
                steps.append((eqn, literals, variables, dying, tuple(narrowing.get(k, ())), copying))
            hit = self.memo[key] = (jaxpr, steps)
        return hit[1]

    def body(self, eqn: Any) -> Any:
        """:func:`_subjaxpr`, once per equation of a trace (asked several times per equation); a
        grouped matmul's dense decomposition (:func:`ragged_dense`, what XLA:CPU runs)."""
        key = ("body", id(eqn), self.ctx.book.dense_ragged)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not eqn:
            if eqn.primitive.name == "ragged_dot_general":
                sub = ragged_dense(eqn) if self.ctx.book.dense_ragged else None
            else:
                sub = _subjaxpr(eqn)
            hit = self.memo[key] = (eqn, sub)
        return hit[1]

    def source_of(self, eqn: Any) -> str:
        """:func:`eqn_source`, once per equation of a trace (``memo`` outlives one plan's costing)."""
        hit = self.memo.get(id(eqn))
        if hit is None or hit[0] is not eqn:
            hit = self.memo[id(eqn)] = (eqn, eqn_source(eqn))
        return hit[1]

    def _sum_origins(self, eqn: Any, outs: list[Val]) -> None:
        """Where each output's pending sum was made: carried through from an input that has one, from
        a call's body, else this equation."""
        if not any(v.partial for v in outs):
            return
        if eqn.primitive.name == "transpose" and not hasattr(eqn.invars[0], "val"):
            # a matmul's batch dims kept in front (a transposed einsum result): still its batch dims
            batch = self.dot_batch.get(self.root(eqn.invars[0]), 0)
            if batch and tuple(eqn.params["permutation"][:batch]) == tuple(range(batch)):
                self.dot_batch[self.root(eqn.outvars[0])] = batch
            if self.root(eqn.invars[0]) in self.rows:  # a matmul's rows follow the permutation
                row = self.rows[self.root(eqn.invars[0])]
                perm = tuple(eqn.params["permutation"])
                self.rows[self.root(eqn.outvars[0])] = None if row is None else perm.index(row)
        carried = next((self.sum_origin[x] for x in eqn.invars if not hasattr(x, "val") and x in self.sum_origin), None)
        sub = self.body(eqn)
        body = getattr(sub, "jaxpr", sub)
        for i, (var, val) in enumerate(zip(eqn.outvars, outs, strict=True)):
            if not val.partial:
                continue
            inner = body.outvars[i] if body is not None and i < len(body.outvars) else None
            self.sum_origin[var] = (
                self.sum_origin.get(inner)
                or carried
                or (eqn.primitive.name, self.ctx.source, _contracted(eqn), self.sum_dims.pop(var, ()))
            )

    def eqn(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """One equation by fast mode's rule book (``_RULES``); a call of a primitive the catalogue
        does not name is inlined; anything else is a declared fallback (``_FALLBACKS``) or not
        catalogued: replicated results, counted in the step's notes as not modelled."""
        name = eqn.primitive.name
        self.ctx.source = self.source_of(eqn) or self.call_source
        if self.depth == 1:  # the step's own equations: the backward pass's are a transpose's
            hit = self.memo.get(("backward", id(eqn)))
            if hit is None or hit[0] is not eqn:
                stack = str(getattr(eqn.source_info, "name_stack", ""))
                hit = self.memo[("backward", id(eqn))] = (eqn, "transpose(" in stack)
            self.ctx.backward = hit[1]
        if name in ELEMENTWISE:  # most equations (no elementwise primitive has a body)
            return [self.elementwise(eqn, ins, mult)]
        rule = _RULES.get(name)
        outer = self.backward
        if not outer and self.ctx.book.gather_cse is not None:
            self.backward = "transpose(" in str(getattr(eqn.source_info, "name_stack", ""))
        try:
            got = rule(self, eqn, ins, mult) if rule is not None else None
            if got is None and rule is None and name not in ("scan", "while", "cond"):
                got = self.inline(eqn, ins, mult)
        finally:
            self.backward = outer
        if got is not None:
            return got
        self.ctx.unmodeled[name] = self.ctx.unmodeled.get(name, 0) + 1
        return [_replicated(o.aval) for o in eqn.outvars]

    def _made_beside(self, frame: _Frame, var: Any) -> Dims | None:
        """The layout of a value already made that an elementwise reader of ``var`` combines it
        with (same shape, split over some axis), or None."""
        key = ("readers", id(frame.jaxpr))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not frame.jaxpr:
            hit = self.memo[key] = (frame.jaxpr, _readers(frame.jaxpr))
        shape = tuple(var.aval.shape)
        for e in hit[1].get(var, ()):
            if e.primitive.name not in ELEMENTWISE:
                continue
            for x in e.invars:
                if x is not var and not hasattr(x, "val") and tuple(x.aval.shape) == shape and x in frame.env:
                    if frame.env[x].axes:
                        return frame.env[x].dims
        return None

    def inline(self, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
        """A call XLA inlines: its body walked in place (None: no body)."""
        sub = self.body(eqn)
        if sub is None:
            return None
        for inner_var, outer_var in zip(sub.invars, eqn.invars, strict=False):
            if not hasattr(outer_var, "val"):
                self.origin[inner_var] = self.root(outer_var)
            if hasattr(outer_var, "val") or outer_var in self.constant:
                self.constant.add(inner_var)
            else:
                self.constant.discard(inner_var)
        for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
            if outer_var in self.hints and not hasattr(inner_var, "val"):
                self.hints.setdefault(inner_var, self.hints[outer_var])
            if outer_var in self.wants and not hasattr(inner_var, "val"):
                self.wants.setdefault(inner_var, self.wants[outer_var])
            if outer_var in self.claimed and not hasattr(inner_var, "val"):
                self.claimed.setdefault(inner_var, self.claimed[outer_var])
            if outer_var in self.back and not hasattr(inner_var, "val"):
                self.back.setdefault(inner_var, self.back[outer_var])
        outer_call, self.call_source = self.call_source, self.ctx.source
        outer = self._frame
        assert outer is not None  # equations run inside a jaxpr
        for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
            made = self._made_beside(outer, outer_var)
            if made is not None and not hasattr(inner_var, "val"):
                self.siblings[inner_var] = made
        bound = [(i, o) for i, o in zip(sub.invars, eqn.invars, strict=False) if not hasattr(o, "val")]
        boundary = _Boundary(
            frozenset(i for i, o in bound if o in outer.stored),
            {i: outer.soft[o] for i, o in zip(sub.outvars, eqn.outvars, strict=False) if o in outer.soft},
            {} if self.layouts_only else {i: self._closure(outer, o) for i, o in bound if o not in outer.stored},
        )
        inner = self.run(sub, dict(zip(sub.invars, ins, strict=False)), mult, boundary)
        self.inlined, self.inlined_peak = eqn, self.peak_without_outputs
        body = self._last_frame
        assert body is not None
        for i, o in zip(sub.outvars, eqn.outvars, strict=False):
            if hasattr(i, "val"):
                continue
            if i in body.stored:
                outer.stored.add(o)
            elif o in outer.soft:  # fused in the body and in the caller's readers: one chain
                outer.closures[o] = self._closure(body, i)
        self.call_source = outer_call
        for inner_var, outer_var in zip(sub.outvars, eqn.outvars, strict=False):
            if not hasattr(inner_var, "val") and self.root(inner_var) is not outer_var:
                self.origin[outer_var] = self.root(inner_var)
        return inner

    def broadcast(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        v = ins[0]
        bdims = eqn.params["broadcast_dimensions"]
        out_aval = eqn.outvars[0].aval
        shape = tuple(out_aval.shape)
        claim = None
        if eqn.outvars[0] in self.back:
            natural = tuple(
                v.dims[bdims.index(j)] if j in bdims and v.shape[bdims.index(j)] == shape[j] else ()
                for j in range(len(shape))
            )
            claim = self._back_claim(eqn.outvars[0], natural)
        if claim is not None and not v.partial and _fits(shape, claim, self.ctx):
            # Built in the layout its readers were given (Shardy): the operand moved first, at
            # its own (smaller) size; the new dims are split for free.
            mine = tuple(claim[j] if v.shape[i] == shape[j] else () for i, j in enumerate(bdims))
            if mine != v.dims and _fits(v.shape, mine, self.ctx):
                self.reshard(eqn.invars[0], v, mine, mult, "broadcast_in_dim")
                return [Val(shape, itemsize(out_aval), _norm(claim, len(shape)))]
        dims: list[tuple[str, ...]] = [()] * len(shape)
        for i, j in enumerate(bdims):
            if v.shape[i] == shape[j]:
                dims[j] = v.dims[i]
        if not v.partial and not hasattr(eqn.invars[0], "val") and math.prod(v.shape) < math.prod(shape):
            self.expanded[eqn.outvars[0]] = (eqn.invars[0], v, tuple(bdims))
        return [Val(shape, itemsize(out_aval), tuple(dims), v.partial)]

    def unstack(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """``unstack`` along ``axis``: that dim whole first (gathered where split), each result
        the operand's layout less that dim."""
        v = ins[0]
        axis = eqn.params["axis"] % len(v.shape)
        whole = self.to_layout(
            eqn.invars[0], v, tuple(() if i == axis else d for i, d in enumerate(v.dims)), mult, "unstack"
        )
        dims = whole.dims[:axis] + whole.dims[axis + 1 :]
        return [Val(tuple(o.aval.shape), itemsize(o.aval), dims) for o in eqn.outvars]

    def reshard_op(self, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
        """``jax.sharding.reshard`` in library code (e.g. an optimizer's scalar)."""
        target = constraint_target(eqn, ins[0].dims)
        if target is None:
            return None
        return [self.to_layout(eqn.invars[0], ins[0], target, mult, "reshard")]

    def _back_claim(self, var: Any, natural: Dims) -> Dims | None:
        """The layout propagated back to ``var`` from a constraint (``_claims_back``), where it
        splits over at least as many devices as ``natural``, the layout the value would have: the
        more split layout wins where the two meet (measured on XLA:CPU: a dispatch mask is built
        split over data x expert on two dims rather than over both on one, while the tokens
        stay split over both and are gathered at the dispatch)."""
        claim = self.back.get(var)
        if claim is None or self.ctx.split_dims(claim) < self.ctx.split_dims(natural):
            return None
        return claim

    def _gathers_alike(self, outvar: Any, full: list) -> bool:
        """Whether the layout a step output wants of ``outvar`` (``hints``) only gathers operands that
        are laid out alike with no pending sum: XLA computes the op where they lie and moves its
        result where the chain ends (measured: ZeRO-1's update ``mu / (sqrt(nu) + eps)`` over
        split moments is computed split and the new replicated param gathered once, 3.25 MiB on
        llama_small over 8 devices; computed whole, both operands were gathered: 6.5 MiB)."""
        hint = self.hints[outvar]
        first = full[0][1].dims
        if any(v.partial or v.dims != first for _, v in full):
            return False
        return all(set(h) <= set(d) for h, d in zip(_norm(hint, len(first)), first, strict=True))

    def _flops(self, n: float, mult: int, name: str) -> None:
        """``n`` flops of ``name`` (times ``mult``). A transcendental function's count apart: XLA's
        cost analysis counts exp, log, power, sqrt, tanh, logistic, ... as no flops."""
        if name in TRANSCENDENTAL:
            self.ctx.transcendentals += n * mult
        else:
            self.ctx.flops += n * mult

    def elementwise(self, eqn: Any, ins: list[Val], mult: int) -> Val:
        out_aval = eqn.outvars[0].aval
        shape = tuple(out_aval.shape)
        name = eqn.primitive.name
        # Operands of the output's rank (size-1 dims broadcast: they carry no split).
        rank = len(shape)
        full = [
            (x, v if v.shape == shape else _broadcast(v, shape))
            for x, v in zip(eqn.invars, ins, strict=True)
            if rank and len(v.shape) == rank
        ]
        outvar = eqn.outvars[0]
        back = None
        if (
            outvar in self.back
            and full
            and outvar not in self.hints
            and outvar not in self.claimed
            and not any(v.partial for v in ins)
        ):
            back = self._back_claim(outvar, max((v.dims for _, v in full), key=self.ctx.split_dims))
        if back is not None and _fits(shape, back, self.ctx):
            # Built in the layout propagated back from a constraint: each operand moved to it at its
            # own size (one broadcast over a size-1 dim is gathered there, not after; measured).
            for x, v in zip(eqn.invars, ins, strict=True):
                if len(v.shape) == rank:
                    own = tuple(t if v.shape[i] == shape[i] else () for i, t in enumerate(_norm(back, rank)))
                    if own != v.dims:
                        self.reshard(x, v, own, mult, name)
            out = Val(shape, itemsize(out_aval), _norm(back, rank))
            self._flops(self.ctx.local(out) / out.itemsize, mult, name)
            return out
        if (
            full
            and (outvar not in self.hints or self._gathers_alike(outvar, full))
            and outvar not in self.claimed
            and (outvar not in self.free)
        ):
            first = full[0][1].dims
            if all(v.dims == first and not v.partial for _, v in full):  # operands laid out alike: nothing moves
                out = Val(shape, itemsize(out_aval), _norm(first, rank))
                self._flops(self.ctx.local(out) / out.itemsize, mult, name)
                return out
        linear = name in _LINEAR or name in self.ctx.book.sums
        partials = {v.partial for _, v in full}
        if linear and len(partials) == 1 and next(iter(partials)):
            # Every operand has the same pending sum: it stays pending (a sum of partial sums).
            target = max((v for _, v in full), key=lambda v: math.prod(self.ctx.split(d) for d in v.dims)).dims
            for x, v in full:
                self.reshard(x, replace(v, partial=frozenset()), target, mult, name)
            out = Val(shape, itemsize(out_aval), target, next(iter(partials)))
            self._flops(self.ctx.local(out) / out.itemsize, mult, name)
            return out
        hint = self.hints.get(outvar)
        claim = self.claimed.get(outvar)
        if hint is None and claim is not None and len({v.dims for _, v in full}) > 1:
            # Computed in a constrained layout its operands do not share: XLA moves each operand to
            # it (a select's mask and values gathered apart, its constant fill whole already);
            # operands laid out alike are combined first and the result moved (measured).
            hint = claim
        if hint is not None and claim is None and not any(hint):
            # A step output wanted whole carries no layout back: XLA computes the op where its
            # operands lie and moves the result where the chain ends, once per output (measured:
            # Adam's update of a replicated weight whose gradient comes split over `expert` runs
            # split, and the new weight, mu and nu are each gathered, three gathers where moving
            # the gradient first is one). An output split anywhere is computed in its layout
            # (XLA computes that too where the operands lie, in their splits and the output's
            # together: tests/test_fast_rules.py, an xfail; followed, it moved other chains
            # of the backward pass that XLA computes in the output's layout).
            hint = None
        done = [(x, self.resolve(x, v, hint, mult, name)) for x, v in full]
        if not done:
            return _replicated(out_aval)
        as_is = {id(x): v for x, v in zip(eqn.invars, ins, strict=True)}  # each at its own shape (size-1 dims)
        target = hint if hint is not None and _fits(shape, hint, self.ctx) else self._merged(done, as_is, shape)
        hinted = target is hint
        free = self.free.get(eqn.outvars[0])
        if free is not None and hint is None:
            used = {a for d in target for a in d}
            merged = tuple(
                t if t or not f or any(a in used for a in f) else f
                for t, f in zip(_norm(target, len(shape)), free, strict=True)
            )
            if _fits(shape, merged, self.ctx):
                target = merged
        for x, v in done:
            if v.shape == shape and not hasattr(x, "val") and x not in self.constant:
                whole = tuple(t if not d and t else () for d, t in zip(v.dims, _norm(target, len(shape)), strict=True))
                if any(whole):
                    self.slices.setdefault(x, whole)
            if hinted:  # XLA computes in the operands' layout and moves the result (about this size)
                self.reshard(x, v, target, mult, name)
            else:
                self._moved(x, v, as_is[id(x)], target, mult, name)
        out = Val(shape, itemsize(out_aval), _norm(target, len(shape)))
        self._flops(self.ctx.local(out) / out.itemsize, mult, name)
        return out

    def _merged(self, done: list[tuple[Any, Val]], own: dict[int, Val], shape: tuple[int, ...]) -> Dims:
        """An elementwise op's layout from its operands' (no hint): the largest operand's splits
        kept, each other's added where their axes are free (a broadcast counted at its operand's
        size; ties: the most split first). Measured: a norm's scale split over `data` on the width
        meets activations split over `data` on the batch; XLA gathers the scale (its own bytes),
        it does not move the activations' split."""

        def real(x: Any, v: Val) -> int:
            src = None if hasattr(x, "val") else self.expanded.get(x)
            return math.prod(src[1].shape) if src is not None else math.prod(own[id(x)].shape)

        order = sorted(done, key=lambda xv: (-real(*xv), -self.ctx.split_dims(xv[1].dims)))
        target: list[list[str]] = [[] for _ in shape]
        used: set[str] = set()
        for _, v in order:
            for i, d in enumerate(_norm(v.dims, len(shape))):
                free = [a for a in d if a not in used]
                if (
                    free
                    and not target[i]
                    and _fits(shape, _tuple([free if k == i else t for k, t in enumerate(target)]), self.ctx)
                ):
                    target[i] = free
                    used |= set(free)
        return _tuple(target)

    def _moved(self, x: Any, v: Val, mine: Val, target: Dims, mult: int, why: str) -> None:
        """``v`` (value ``x``, ``mine`` at its own shape) moved to ``target`` for an elementwise op:
        at its own size (size-1 dims carry no split), a broadcast's operand at that operand's size
        where it fits the projected layout."""
        full = _norm(target, len(v.shape))
        if full == v.dims:
            return
        src = None if hasattr(x, "val") else self.expanded.get(x)
        if src is not None:
            var, sv, bdims = src
            shape = mine.shape
            proj = tuple(
                full[j] if sv.shape[i] == shape[j] and shape[j] == v.shape[j] else () for i, j in enumerate(bdims)
            )
            if _fits(sv.shape, proj, self.ctx):
                self.reshard(var, sv, proj, mult, why)
                return
        if mine.shape != v.shape and len(mine.shape) == len(v.shape):
            self.reshard(
                x, mine, tuple(t if mine.shape[i] == v.shape[i] else () for i, t in enumerate(full)), mult, why
            )
            return
        self.reshard(x, v, target, mult, why)

    def dot(self, eqn: Any, ins: list[Val], mult: int) -> Val:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lx, rx = eqn.invars
        lhs, rhs = ins
        out_aval = eqn.outvars[0].aval
        # One pending sum at a time: a partial operand times a whole one stays partial.
        if lhs.partial and rhs.partial:
            rhs = self.resolve(rx, rhs, None, mult, "dot_general")
        partial = set(lhs.partial | rhs.partial)
        pending = set(partial)
        lhs, rhs = replace(lhs, partial=frozenset()), replace(rhs, partial=frozenset())
        lfree = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rhs.shape)) if i not in rc and i not in rb]
        ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
        # Batch dims: both sides must agree; keep the more split one. Where they disagree, XLA
        # partitions the matmul over the batch dims alone: both operands' contracting dims are
        # gathered (measured: an expert weight's gradient, experts split on one side and tokens
        # on the other, gathers both rather than summing a split over `data`).
        # An axis splits one batch dim only: where each side splits a different batch dim over it
        # (heads over an axis on one side, the same axis on the other's sequence), the first keeps it.
        conflict = False
        batch_axes: set[str] = set()
        for i, j in zip(lb, rb, strict=True):
            # One side's split extends the other's ((data, expert) against data) by axes the other
            # operand splits a free dim over: where the extending side is the smaller operand and
            # not a weight, XLA keeps the other's free split and the extending side's longest prefix
            # free of it on the batch dim, the rest gathered off (measured on single matmuls
            # "gsd,egcd->gsec": tokens over (data, expert) against experts' buffers over expert on e
            # and data on g, 4x the tokens' bytes: the tokens gathered over expert; the buffers
            # smaller than the tokens: the buffers moved. A weight's split stays: its gradient's
            # layout is fixed, and the step's propagation carries it to the tokens).
            prefix = None
            for longer, shorter, other, free, x, mine, theirs in (
                (ldims[i], rdims[j], rdims, rfree, lx, lhs, rhs),
                (rdims[j], ldims[i], ldims, lfree, rx, rhs, lhs),
            ):
                taken = {a for k in free for a in other[k]}
                if (
                    len(longer) > len(shorter)
                    and longer[: len(shorter)] == shorter
                    and taken & set(longer)
                    and self.names.get(self.root(x)) is None
                    and math.prod(mine.shape) * mine.itemsize < math.prod(theirs.shape) * theirs.itemsize
                ):
                    prefix = list(itertools.takewhile(lambda a, t=taken: a not in t, longer))  # type: ignore[misc]
                    break
            if prefix is not None and not batch_axes & set(prefix):
                ldims[i], rdims[j] = list(prefix), list(prefix)
            elif ldims[i] != rdims[j]:
                options = sorted((ldims[i], rdims[j]), key=lambda d: -self.ctx.split(tuple(d)))
                keep = next((d for d in options if not batch_axes & set(d)), [])
                ldims[i], rdims[j] = list(keep), list(keep)
                conflict = True
            batch_axes |= set(ldims[i])
        if conflict:
            for i, j in zip(lc, rc, strict=True):
                ldims[i], rdims[j] = [], []
            # an axis the batch dims now take leaves the operands' other dims (gathered there)
            taken_b = {a for i in lb for a in ldims[i]}
            for k in range(len(ldims)):
                if k not in lb:
                    ldims[k] = [a for a in ldims[k] if a not in taken_b]
            for k in range(len(rdims)):
                if k not in rb:
                    rdims[k] = [a for a in rdims[k] if a not in taken_b]
        # Contracting dims: split the same way on both sides -> local, then a pending sum.
        for i, j in zip(lc, rc, strict=True):
            a, b = ldims[i], rdims[j]
            if a == b:
                partial |= set(a)
                continue
            # One side split on the contraction: gather it there, or slice the other side and sum
            # the partial results (GSPMD weighs the bytes; so do we).
            if (moved := self._contraction_moves(lhs, rhs, i, j, ldims, rdims, lb, lfree, rfree)) is not None:
                # One side whole on the dim, or split over different axes free on it, and the
                # result's pending sum cheaper than gathering the other side: that side is gathered
                # whole on the dim (XLA's dot partitioner replicates it there; a whole side or a
                # split the other extends is only sliced) and sliced as the other is; the matmul
                # stays split (measured: a row-parallel weight split over `data` meets hidden states
                # split over `model` on the contraction: XLA gathers the weight and all-reduces the
                # result; a replicated weight meets them: XLA gathers the states, whose bytes are
                # fewer than the result's).
                if moved == "rhs":
                    if b != a[: len(b)]:
                        rhs = self._gathered_on(rx, rhs, j, eqn, mult)
                    rdims[j] = list(a)
                else:
                    if a != b[: len(a)]:
                        lhs = self._gathered_on(lx, lhs, i, eqn, mult)
                    ldims[i] = list(b)
                partial |= set(ldims[i])
            else:
                # Conflict (the axis also splits the other operand elsewhere): gather the cheaper side.
                ltotal = self.ctx.local(Val(lhs.shape, lhs.itemsize, _tuple(ldims)))
                rtotal = self.ctx.local(Val(rhs.shape, rhs.itemsize, _tuple(rdims)))
                if ltotal * self.ctx.split(tuple(a)) <= rtotal * self.ctx.split(tuple(b)):
                    ldims[i] = [x for x in a if x in b]
                else:
                    rdims[j] = [x for x in b if x in a]
                common = [x for x in ldims[i] if x in rdims[j]]
                ldims[i], rdims[j] = list(common), list(common)
                partial |= set(common)
        # Free dims: an axis may split only one operand's free dims and not the contraction.
        contract_axes = {x for i in lc for x in ldims[i]} | {x for i in lb for x in ldims[i]}
        for i in lfree:
            ldims[i] = [x for x in ldims[i] if x not in contract_axes]
        used = {x for i in lfree for x in ldims[i]} | contract_axes
        for j in rfree:
            clash = [x for x in rdims[j] if x in used]
            if clash:
                # The same axis splits a free dim of each side: XLA's propagation keeps the split of
                # the larger operand (its whole size) and gathers the other (measured: under sequence
                # parallelism a layer's weights are gathered, the sequence stays split).
                if _rhs_yields(lhs, rhs):
                    rdims[j] = [x for x in rdims[j] if x not in used]
                else:
                    for i in lfree:
                        ldims[i] = [x for x in ldims[i] if x not in clash]
        claimed = self.claimed.get(eqn.outvars[0])
        if claimed is None and lb and eqn.outvars[0] in self.back:  # a plain matmul keeps its pending sum
            claimed = self._back_claim(
                eqn.outvars[0],
                tuple(
                    [tuple(ldims[i]) for i in lb] + [tuple(ldims[i]) for i in lfree] + [tuple(rdims[j]) for j in rfree]
                ),
            )
        if claimed is not None and not lb and partial & {a for d in claimed for a in d}:
            # A plain matmul whose contraction both sides split over an axis the constraint wants on
            # the result: the sum stays (reduce-scattered, or all-reduced beside an idle axis that
            # stands in: ``_idle_split``), the operands are not gathered (measured on single matmuls)
            claimed = None
        if claimed is not None and not pending and len(claimed) == len(lb) + len(lfree) + len(rfree):
            # A constraint's layout given to the matmul's result (Shardy's apply-sharding-constraints):
            # XLA's partitioner then lays the operands out to produce it, each batch and free dim
            # split as the result is (measured: tokens split over data x expert, dispatched to
            # experts split over expert, are gathered over expert first, not moved after).
            taken = {a for d in claimed for a in d}
            for k, (i, j) in enumerate(zip(lb, rb, strict=True)):
                ldims[i], rdims[j] = list(claimed[k]), list(claimed[k])
            for p, i in enumerate(lfree):
                ldims[i] = list(claimed[len(lb) + p])
            for q, j in enumerate(rfree):
                rdims[j] = list(claimed[len(lb) + len(lfree) + q])
            partial = set()
            for i, j in zip(lc, rc, strict=True):
                if ldims[i] != rdims[j] or any(a in taken for a in ldims[i]):
                    ldims[i], rdims[j] = [], []
                partial |= set(ldims[i])
        wanted = self.wants.get(eqn.outvars[0], self.hints.get(eqn.outvars[0]))
        if wanted is not None:
            stand_ins = self._idle_split(
                _norm(wanted, len(out_aval.shape)), tuple(out_aval.shape), ldims, rdims, lb, rb, lfree, rfree, partial
            )
            if stand_ins:
                self.stand_ins[self.root(eqn.outvars[0])] = stand_ins
        lt, rt = _tuple(ldims), _tuple(rdims)
        narrow = self.ctx.book.matmul_itemsize
        if narrow and _reads_narrow(eqn):
            # Cast before it moves (the default precision computes in a narrower type); gathered
            # again for a later matmul where the compiler does (``Compiler.gather_cse``).
            for x, v, t in ((lx, lhs, lt), (rx, rhs, rt)):
                if v.itemsize == 4 and _is_float(x):
                    self._cast_gather(eqn, x, v, t, mult, narrow)
                else:
                    self.reshard(x, v, t, mult, "dot_general")
        else:
            self.reshard(lx, lhs, lt, mult, "dot_general")
            self.reshard(rx, rhs, rt, mult, "dot_general")
        out_dims = [lt[i] for i in lb] + [lt[i] for i in lfree] + [rt[j] for j in rfree]
        shape = tuple(out_aval.shape)
        out = Val(shape, itemsize(out_aval), tuple(out_dims), frozenset(partial))
        summed = tuple(frozenset(lt[i]) for i in lc if lt[i])
        if self.ctx.book.sums_per_dim and len(summed) > 1:
            self.sum_dims[eqn.outvars[0]] = summed
        k = math.prod(lhs.shape[i] for i in lc)
        kshards = self.ctx.split(tuple(x for i in lc for x in lt[i]))
        self._flops(2 * (self.ctx.local(out) / out.itemsize) * (k / kshards), mult, "dot_general")
        if self.ctx.book.split_k is not None:
            self._split_k(eqn, Val(lhs.shape, lhs.itemsize, lt), Val(rhs.shape, rhs.itemsize, rt), out, mult)
        if out.partial and lb:  # its leading dims are the batch dims (see ``resolve``)
            self.dot_batch[self.root(eqn.outvars[0])] = len(lb)
        if out.partial:  # where its operands' rows went: an operand's leading dim, else none
            first = lb[:1] or lfree[:1]
            rows_kept = first == [0] if first else rfree[:1] == [0]
            self.rows[self.root(eqn.outvars[0])] = 0 if rows_kept else None
        want = self.wants.get(eqn.outvars[0])
        if out.partial and want is not None and any(a in out.partial for d in want for a in d):
            # Its readers keep a split over a pending axis: reduce-scattered onto it here.
            return self.resolve(eqn.outvars[0], out, want, mult, "dot_general", contracted=k)
        return out

    def _idle_split(
        self,
        want: Dims,
        shape: tuple[int, ...],
        ldims: list[list[str]],
        rdims: list[list[str]],
        lb: Sequence[int],
        rb: Sequence[int],
        lfree: list[int],
        rfree: list[int],
        partial: set[str],
    ) -> dict[str, str]:
        """A matmul's result dim that its readers want split further, over axes neither operand
        nor the pending sum uses, is computed split so: the operand that holds the dim is sliced
        there (no collective), the matmul does that share of the work and a pending sum is reduced
        on that share (XLA's dot partitioner lays the result out as wanted; measured on single
        matmuls ``a @ b`` with ``a`` over ``data`` and the result wanted over ``(data, model)`` or
        ``model`` on its columns, ``model`` idle: a quarter or half of the FLOPs, the all-reduce of
        the half). Where the readers want it split over an axis the sum is over, an idle axis of
        the same size stands in for it: the result computed split over the idle axis, all-reduced
        over the summed one and permuted into place (measured: the result wanted over ``(data,
        expert)``, summed over ``expert``, ``model`` idle: an all-reduce and a collective-permute of
        the quarter, where a reduce-scatter of the half was predicted). Updates ``ldims`` /
        ``rdims`` in place; returns the stand-ins (idle axis -> summed axis)."""
        used = {a for d in (*ldims, *rdims) for a in d} | partial
        named = {a for d in want for a in d}
        dims: list[tuple[list[str], ...]] = [(ldims[i], rdims[j]) for i, j in zip(lb, rb, strict=True)]
        dims += [(ldims[i],) for i in lfree] + [(rdims[j],) for j in rfree]
        stand_ins: dict[str, str] = {}
        for p, sides in enumerate(dims):
            cur, w = sides[0], list(want[p])
            if w[: len(cur)] != cur:
                continue
            extra: list[str] = []
            for a in w[len(cur) :]:
                if a in partial:
                    idle = next(
                        (m for m, n in self.ctx.mesh.items() if n == self.ctx.mesh[a] and m not in used | named),
                        None,
                    )
                    if idle is None:
                        break
                    stand_ins[idle] = a
                    used.add(idle)
                    a = idle
                elif a in used or self.ctx.mesh.get(a, 1) == 1:
                    break
                extra.append(a)
            while extra and shape[p] % self.ctx.split((*cur, *extra)):
                stand_ins.pop(extra.pop(), None)
            for side in sides:
                side.extend(extra)
            used.update(extra)
        return stand_ins

    def _split_k(self, eqn: Any, lhs: Val, rhs: Val, out: Val, mult: int) -> None:
        """XLA:GPU's split of the local matmul's contraction (``Compiler.split_k``): the float32
        partial results' workspace alive while they are added up (on top of the result), the
        additions and the padded contraction's products counted as FLOPs."""
        gpu = self.ctx.book.split_k
        assert gpu is not None
        lc = eqn.params["dimension_numbers"][0][0]
        lb = eqn.params["dimension_numbers"][1][0]
        if not lc or 0 in lhs.shape or not all(_is_float(x) for x in eqn.invars):  # XLA:GPU splits no integer matmul
            return
        # Its dims merged as XLA:GPU canonicalises a matmul: batch, free and contracting dims each one
        # (measured: "mhd,hdn->mn" splits as a contraction of h x d).
        ls, rs = _local_shape(lhs, self.ctx), _local_shape(rhs, self.ctx)
        b = math.prod(ls[i] for i in lb)
        k = math.prod(ls[i] for i in lc)
        m = math.prod(ls) // (b * k)
        n = math.prod(rs) // (b * k)
        bits = (lhs.itemsize * 8, rhs.itemsize * 8, out.itemsize * 8)
        side, wider = self._dot_merged(eqn)
        if wider > 1 and (
            math.prod(ls) * lhs.itemsize + math.prod(rs) * rhs.itemsize + b * m * n * out.itemsize <= splitk.MERGE_BYTES
        ):
            # merged with the matmuls that share an operand with it: split as the wider matmul
            m, n = (m, round(n * wider)) if side == 0 else (round(m * wider), n)
            split = splitk.choose(gpu, b, m, n, k, bits)
            m, n = (m, round(n / wider)) if side == 0 else (round(m / wider), n)
        else:
            split = splitk.choose(gpu, b, m, n, k, bits)
        if split == 1:
            return
        partials = b * split * m * n
        if out.partial and eqn.outvars[0] not in self._summed_by_adds():
            # summed over devices first: the partials added up before the collective
            self.peak = max(self.peak, partials * 4)
            adds = partials * wider
        elif out.partial:  # added to another partial sum first: held until that addition adds them up
            self.widened[eqn.outvars[0]] = partials * 4
            adds = partials * wider
        else:  # the addition fused into every reader: the partials held as long as the result
            self.widened[eqn.outvars[0]] = partials * 4
            adds = partials * wider * self._reads(eqn.outvars[0])
        self._flops(adds + 2 * b * m * n * (splitk.padded(k, split, bits) - k), mult, "dot_general")

    def _of_frame(self, read: Callable[[Any], _T]) -> _T:
        """``read(jaxpr)`` of the jaxpr being run, once per trace (kept in the memo)."""
        jaxpr = self._frame.jaxpr if self._frame is not None else None
        key = (read.__name__, id(jaxpr))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            hit = self.memo[key] = (jaxpr, read(jaxpr))
        return hit[1]

    def _summed_by_adds(self) -> set[Any]:
        """The values of the jaxpr being run that only additions read (``splitk.summed_by_adds``)."""
        return self._of_frame(splitk.summed_by_adds)

    def _reads(self, var: Any) -> int:
        """How many kernels of the jaxpr being run read ``var`` (``splitk.reads``)."""
        return max(1, self._of_frame(splitk.reads).get(var, 0))

    def _dot_merged(self, eqn: Any) -> tuple[int, float]:
        """The side a matmul shares with those XLA:GPU merges it with, and how much wider the merged
        matmul is (``splitk.merged``; 1.0 where it stays alone)."""
        return self._of_frame(splitk.merged).get(id(eqn), (0, 1.0))

    def _contraction_moves(
        self, lhs: Val, rhs: Val, i: int, j: int, ldims: list, rdims: list, lb: Any, lfree: list, rfree: list
    ) -> str | None:
        """Which operand (``"lhs"``/``"rhs"``) takes the other's split on contracting dims ``i``/``j``
        split over different axes, or None (both gathered there). An operand may take the other's
        axes where they split none of its other dims; it does where the result's pending sum costs
        less than gathering the other operand on the contraction (GSPMD weighs the two)."""
        a, b = ldims[i], rdims[j]
        used_l = {x for k, d in enumerate(ldims) if k != i for x in d}
        used_r = {x for k, d in enumerate(rdims) if k != j for x in d}
        ltotal = self.ctx.local(Val(lhs.shape, lhs.itemsize, _tuple(ldims))) * self.ctx.split(tuple(a))
        rtotal = self.ctx.local(Val(rhs.shape, rhs.itemsize, _tuple(rdims))) * self.ctx.split(tuple(b))
        shape = tuple(lhs.shape[k] for k in (*lb, *lfree)) + tuple(rhs.shape[k] for k in rfree)
        mine = [tuple(ldims[k]) for k in (*lb, *lfree)]
        theirs = [tuple(rdims[k]) for k in rfree]
        taken = {x for d in mine for x in d}
        if any(x in taken for d in theirs for x in d):  # a free dim of each side over one axis: see ``dot``
            if _rhs_yields(lhs, rhs):
                theirs = [tuple(x for x in d if x not in taken) for d in theirs]
            else:
                clash = {x for d in theirs for x in d}
                mine = [tuple(x for x in d if x not in clash) for d in mine]
        dims = tuple(mine) + tuple(theirs)
        if not any(dims):
            # a result split nowhere: XLA gathers the contraction whatever the sizes (measured:
            # 64x1024 @ 1024x16 split over `model` on the 1024 gathers 256 KiB, not a 4 KiB sum)
            return None
        out = self.ctx.local(Val(shape, max(lhs.itemsize, rhs.itemsize), dims))
        options = []
        if a and not set(a) & used_r and (not b or out <= ltotal):
            options.append((rtotal if b else 0, "rhs"))  # a whole side is sliced for free
        if b and not set(b) & used_l and (not a or out <= rtotal):
            options.append((ltotal if a else 0, "lhs"))
        return min(options)[1] if options else None

    def _gathered_on(self, x: Any, v: Val, dim: int, eqn: Any, mult: int) -> Val:
        """``v`` gathered whole on ``dim`` for a matmul (cast first where the compiler narrows)."""
        target = tuple(() if k == dim else d for k, d in enumerate(v.dims))
        narrow = self.ctx.book.matmul_itemsize
        if narrow and eqn.params.get("precision") in (None, (None, None)) and v.itemsize == 4 and _is_float(x):
            return replace(self._cast_gather(eqn, x, v, target, mult, narrow), itemsize=v.itemsize)
        return self.reshard(x, v, target, mult, "dot_general")

    def _cast_gather(self, eqn: Any, x: Any, v: Val, target: Dims, mult: int, narrow: int) -> Val:
        """``v`` cast to ``narrow`` bytes per element and moved to ``target`` for the matmul ``eqn``:
        one gather per matmul, or the gather an earlier matmul made where the compiler merges them
        (``Compiler.gather_cse``, ``self.shares``), held from its first reader to its last."""
        share = self.shares.get((id(eqn), self.root(x)))
        tag = (narrow, self.backward) if share is None else (narrow, "shared", share.group)
        moved = self.reshard(x, replace(v, itemsize=narrow), target, mult, "dot_general", tag)
        if share is not None and share.first != share.last:
            key = ("held gather", self.root(x), share.group)
            if share.first and moved.dims != v.dims:
                n = self.ctx.held_gathers[key] = self.ctx.held(moved)
                self.ctx.gathered_now += n
                self.ctx.gathered_peak = max(self.ctx.gathered_peak, self.ctx.gathered_now)
            elif share.last:
                self.ctx.gathered_now -= self.ctx.held_gathers.pop(key, 0)
        return moved

    def reduce(self, eqn: Any, v: Val, mult: int) -> Val:
        axes = tuple(eqn.params.get("axes", ()))
        out_aval = eqn.outvars[0].aval
        kept = [i for i in range(len(v.shape)) if i not in axes]
        reduced = tuple(x for i in axes for x in v.dims[i])
        name = eqn.primitive.name
        out = Val(tuple(out_aval.shape), itemsize(out_aval), tuple(v.dims[i] for i in kept))
        # XLA's cost analysis: one per element reduced (the operand's elements less the result's)
        self._flops(self.ctx.local(v) / v.itemsize - self.ctx.local(out) / out.itemsize, mult, name)
        # reduced dims split over different axes: XLA:CPU reduces over each dim's axes in turn
        summed = tuple(frozenset(v.dims[i]) for i in axes if v.dims[i]) if self.ctx.book.sums_per_dim else ()
        if name == "reduce_sum":
            if len(summed) > 1 and not v.partial:
                self.sum_dims[eqn.outvars[0]] = summed
            return replace(out, partial=v.partial | frozenset(reduced))
        if v.partial:  # max / min of a pending sum: the sum is done first
            self.resolve(eqn.invars[0], v, None, mult, name)
        for part in _per_dim(reduced, summed):  # max / min / argmax over a split dim: a small all-reduce
            self.ctx.add("all-reduce", part, self.ctx.local(out), mult, name, itemsize=out.itemsize)
        return out

    def reshape(self, var: Any, v: Val, shape: tuple[int, ...], mult: int) -> Val:
        """Keep a split on the major factor of a merged/split dim; otherwise gather it."""
        out: list[tuple[str, ...]] = [()] * len(shape)
        i = j = 0
        gathered = list(v.dims)
        while i < len(v.shape) and j < len(shape):
            a, b = v.shape[i], shape[j]
            if a == b:
                out[j] = v.dims[i]
                i, j = i + 1, j + 1
                continue
            if b == 1:  # a size-1 dim inserted: the split stays for the dims that follow ([L] -> [1, P, K])
                j += 1
                continue
            if a == 1 and not v.dims[i]:  # a size-1 dim dropped
                i += 1
                continue
            if a > b:  # split dim i into several output dims: the major one keeps the split
                n = self.ctx.split(v.dims[i])
                if v.dims[i] and b % n == 0:
                    out[j] = v.dims[i]
                elif v.dims[i]:
                    gathered[i] = ()
                prod = b
                j += 1
                while prod < a and j < len(shape):
                    prod *= shape[j]
                    j += 1
                i += 1
            else:  # merge dims i.. into output dim j: the major input dim's split carries over
                out[j] = v.dims[i]
                prod = a
                i += 1
                while prod < b and i < len(v.shape):
                    if v.dims[i]:
                        gathered[i] = ()
                    prod *= v.shape[i]
                    i += 1
                j += 1
        if tuple(gathered) != v.dims and not v.partial:
            self.reshard(var, v, tuple(gathered), mult, "reshape")
        return Val(shape, v.itemsize, tuple(out), v.partial)

    def constraint(self, eqn: Any, v: Val, mult: int) -> Val:
        """An activation constrained to a layout (``with_sharding_constraint``: a plan's ``act``
        rule, a logical name, the model's own): pending sums resolved onto it (a reduce-scatter
        where it splits a dim the sum leaves whole), then resharded to it."""

        scope = str(getattr(eqn.source_info, "name_stack", ""))
        internal = INTERNAL_SCOPE in scope  # shardplan's own (a pipeline's buffers): kept, not listed
        if self.ignore_constraints and not internal:
            return v
        target = constraint_target(eqn, v.dims)
        if target is None:
            self.ctx.unmodeled["sharding_constraint"] = self.ctx.unmodeled.get("sharding_constraint", 0) + 1
            return v
        dims = _tuple(list(target))
        # An act rule's constraint runs in a named scope, which transforms wrap: jvp(act rule f:8 on m).
        named = re.search(r"act rule \S+ on [^()/]+", scope)
        what = named.group(0) if named else "sharding constraint"
        why = f"{what} (activation constraint)"
        out = self.to_layout(eqn.invars[0], v, dims, mult, "pipeline buffer" if internal else why)
        if internal:
            return out
        written = ", ".join("_" if not d else d[0] if len(d) == 1 else f"({', '.join(d)})" for d in dims)
        self.constrained.append(Constrained(what, self.ctx.source, v.shape, f"({written})", self.ctx.local(out), mult))
        return out

    def gather(self, eqn: Any, ins: list[Val], mult: int) -> Val:
        table, idx = ins[0], ins[1]
        out_aval = eqn.outvars[0].aval
        dn = eqn.params["dimension_numbers"]
        offset = tuple(dn.offset_dims)
        collapsed = tuple(dn.collapsed_slice_dims)
        shape = tuple(out_aval.shape)
        # Batch dims of the output follow the indices; offset dims follow the table's kept dims.
        batch_out = [k for k in range(len(shape)) if k not in offset]
        dims: list[tuple[str, ...]] = [()] * len(shape)
        for k, b in zip(batch_out, range(len(idx.shape)), strict=False):
            dims[k] = idx.dims[b] if b < len(idx.dims) else ()
        kept = [i for i in range(len(table.shape)) if i not in collapsed]
        whole = [k for k, i in zip(offset, kept, strict=False) if table.shape[i] == shape[k]]
        # An axis that splits both a kept dim of the table (an embedding's width) and the
        # indices (the batch): GSPMD keeps the table in place, gathers the indices over that
        # axis and looks up the table's slice for every index (measured, with the lookup's
        # output then resharded to where it is used: an all-to-all when the batch split is
        # wanted back).
        clash = {a for k, i in zip(offset, kept, strict=False) if k in whole for a in table.dims[i]} & {
            a for k in batch_out for a in dims[k]
        }
        if clash:
            self.ctx.lookups.append(self.ctx.source)
            for k in batch_out:
                dims[k] = tuple(a for a in dims[k] if a not in clash)
        valid = Val(shape, 1, tuple(dims))  # the fill mode's mask of valid indices: split like them
        for k, i in zip(offset, kept, strict=False):
            if k in whole:
                dims[k] = tuple(a for a in table.dims[i] if all(a not in d for d in dims))
        rows = tuple(a for i in collapsed for a in table.dims[i])
        out = Val(shape, itemsize(out_aval), tuple(dims))
        self._flops(self.ctx.local(out) / out.itemsize, mult, "gather")
        # A table split over its rows: a masked local lookup summed over those axes (an
        # all-reduce of the output), as GSPMD does even where gathering the table would move
        # fewer bytes (measured); an axis that also splits the activations (the output, or
        # the indices) makes it gather the table instead. Indices made whole (a global sort's
        # order, the dropless MoE's) are looked up where the rows lie (measured).
        wanted = {a for d in self.wants.get(eqn.outvars[0], ()) for a in d}
        # (indices that are literals, positions: XLA slices the table and moves it as the batch wants)
        activations = idx.axes if eqn.invars[1] not in self.constant else set(self.ctx.batch_axes)
        masked = bool(rows) and not any(a in out.axes or a in activations or a in wanted for a in rows)
        if clash:
            self.lookup_indices(eqn.invars[1], idx, clash, rows if masked else (), mult)
        if masked:
            return self.filled(eqn, replace(out, partial=frozenset(rows)), valid, mult)
        if rows:
            regrouped = self.regroup_table(eqn, table, out, rows, batch_out, mult)
            if regrouped is not None:
                return self.filled(eqn, regrouped, valid, mult)
            if not clash and not any(table.dims[i] for i in kept) and _size(out) < _size(table):
                return self.masked_all_indices(eqn, idx, out, rows, mult)
            self.reshard(eqn.invars[0], table, _without(table.dims, set(rows)), mult, "gather")
        return self.filled(eqn, out, valid, mult)

    def masked_all_indices(self, eqn: Any, idx: Val, out: Val, rows: tuple[str, ...], mult: int) -> Val:
        """A table split over its rows alone, looked up by indices split over those axes too (an
        FSDP embedding under a batch split over the same axis), where the whole lookup's output is
        smaller than the table: XLA's gather partitioner gathers the indices instead of the table,
        looks every index up in the rows each device holds (masked), and reduce-scatters the output
        over the rows' axes onto the indices' split; its
        transpose gathers the updates instead of reducing the table's gradient (``scatter``).
        Measured on XLA:CPU, one lookup on data=8 (a 128-wide table of 256-8192 rows, 32 x 32
        indices: the table gathered up to 1,024 rows, whose 512 KiB equal the output's, the indices
        above) and on a model's FSDP step (4,096 x 512 table, 16 x 128 tokens; XLA:TPU alike)."""
        self.reshard(eqn.invars[1], idx, _without(idx.dims, set(rows)), mult, "gather")
        whole = Val(out.shape, out.itemsize, _without(out.dims, set(rows)), frozenset(rows))
        self._flops((self.ctx.local(whole) - self.ctx.local(out)) / out.itemsize, mult, "gather")
        # the sum reduce-scattered onto the indices' split, the layout GSPMD gives the lookup
        return self.resolve(eqn.outvars[0], whole, out.dims, mult, "gather")

    def filled(self, eqn: Any, out: Val, mask: Val, mult: int) -> Val:
        """A lookup that fills out-of-range indices (``jnp.take``'s default) is lowered as the gather,
        a mask of the valid indices and a ``select`` of the looked-up values or the fill constant.
        A closed constraint on the lookup's result lays out that select, whose operands differ in
        layout (the fill is a constant): XLA moves the values and the mask to the constraint's
        layout apart (measured: a residual constrained whole gathers both)."""
        claim = self.claimed.get(eqn.outvars[0])
        if claim is None or getattr(eqn.params.get("mode"), "name", "") != "FILL_OR_DROP":
            return out
        if out.dims == claim and not out.partial:
            return out
        out = self.to_layout(eqn.outvars[0], out, claim, mult, "gather")
        self.reshard(("fill mask", eqn.outvars[0]), mask, claim, mult, "gather")
        return out

    def regroup_table(
        self, eqn: Any, table: Val, out: Val, rows: tuple[str, ...], batch_out: list[int], mult: int
    ) -> Val | None:
        """A table split over its rows on axes that split the lookup's output too (a position table
        split over the batch axis, looked up for a batch split over it). XLA's gather partitioner
        splits the output's batch over those axes and, within each group of devices, needs the
        table whole over them: where the table is replicated over other axes whose size divides, or
        is divided by, the rows' split, it moves the rows' split onto them (a collective-permute of
        the local rows, an all-gather of the rest where the rows' split is the larger) and looks up
        masked over them (an all-reduce of the output), rather than gathering the table (measured:
        data=2,4,8 x model=2,4, three batch sizes). None where that does not apply."""
        wanted = _norm(self.wants.get(eqn.outvars[0], ()), len(out.shape))
        groups = self.ctx.split(rows)
        free = tuple(a for a in self.ctx.mesh if a not in table.axes and a not in out.axes and a not in rows)
        spare = self.ctx.split(free)
        dims = list(out.dims)
        for k in batch_out:
            dims[k] = (*dims[k], *(a for a in wanted[k] if a in rows))
        split = {a for k in batch_out for a in dims[k]}
        fits = _fits(out.shape, _tuple(dims), self.ctx)
        if spare < 2 or (groups % spare and spare % groups) or split != set(rows) or not fits:
            return None
        self.move_split(eqn.invars[0], self.ctx.local(table), rows, free, mult)
        return Val(out.shape, out.itemsize, _tuple(dims), frozenset(free))

    def move_split(self, var: Any, local: int, held: tuple[str, ...], spare: tuple[str, ...], mult: int) -> int:
        """A value split over ``held`` moved onto ``spare`` axes (which it is not split over) as XLA's
        gather partitioner regroups devices: a collective-permute of each device's ``local`` bytes,
        then an all-gather over ``held`` of what the spare axes cannot take (where ``held`` splits
        more). Returns the bytes each device then holds."""
        moves = self.names.get(self.root(var), "")
        n, m = self.ctx.split(held), self.ctx.split(spare)
        pair = tuple(a for a in self.ctx.mesh if a in held or a in spare)  # in mesh order, as XLA's groups
        self.ctx.add("collective-permute", pair, local, mult, "gather", moves)
        if n > m:
            self.ctx.add("all-gather", held, local * n // m, mult, "gather", moves)
        return local * max(1, n // m)

    def regroup_gradient(self, eqn: Any, target: Dims, idx: Val, updates: Val, mult: int) -> Val | None:
        """The transpose of ``regroup_table``'s lookup: the gradient of a table wanted split over its
        rows on the axes that split the updates' batch. XLA scatters each device's updates into the
        rows regrouped onto the spare axes, sums that over the batch axes (an all-reduce) and moves
        each device's rows back (a collective-permute) (measured). None where that does not apply."""
        dn = eqn.params["dimension_numbers"]
        inserted = tuple(dn.inserted_window_dims)
        rows = tuple(a for i in inserted for a in target[i])
        if not rows or any(target[i] for i in range(len(target)) if i not in inserted) or updates.partial:
            return None
        window = tuple(dn.update_window_dims)
        split = {a for k, d in enumerate(updates.dims) if k not in window for a in d}
        free = tuple(a for a in self.ctx.mesh if a not in rows and a not in updates.axes and a not in idx.axes)
        groups, spare = self.ctx.split(rows), self.ctx.split(free)
        if split != set(rows) or spare < 2 or (groups % spare and spare % groups):
            return None
        shape = tuple(eqn.outvars[0].aval.shape)
        out = Val(shape, itemsize(eqn.outvars[0].aval), target)
        local = self.ctx.local(out)
        pair = tuple(a for a in self.ctx.mesh if a in rows or a in free)
        self.ctx.add("all-reduce", rows, local * max(1, groups // spare), mult, "scatter-add")
        self.ctx.add("collective-permute", pair, local, mult, "scatter-add")
        return out

    def lookup_indices(self, var: Any, idx: Val, clash: set[str], rows: tuple[str, ...], mult: int) -> Val:
        """A lookup's indices gathered whole over ``clash`` (the axes that split both the table's
        width and the batch). Where a masked lookup follows over the table's row axes ``rows``,
        XLA's gather partitioner groups the devices by the width split and keeps the indices split
        over the row axes within each group: a collective-permute moves the batch's split onto the
        row axes, an all-gather collects the rest of it, and an all-gather over the row axes makes
        the indices whole (measured on data=4,8,16 x model=2 and data=4,8 x model=4). XLA picks
        another way where the batch's split is smaller than the rows', and at other sizes (its
        gather partitioner orders its ways by a dry-run cost): fast mode's notes say so."""
        target = _without(idx.dims, clash)
        held = self.ctx.split(tuple(a for a in idx.axes if a in clash))
        groups = self.ctx.split(tuple(a for a in rows if a not in idx.axes))
        key = ("reshard", self.key(var), target, None)
        if groups == 1 or held < groups or held % groups or key in self.ctx.cache:
            return self.reshard(var, idx, target, mult, "gather")
        axes = tuple(a for a in self.ctx.mesh if a in clash and a in idx.axes)
        row_axes = tuple(a for a in rows if a not in idx.axes)
        regrouped = self.move_split(var, self.ctx.local(idx), axes, row_axes, mult)
        self.ctx.add("all-gather", row_axes, regrouped * groups, mult, "gather", self.names.get(self.root(var), ""))
        out = Val(idx.shape, idx.itemsize, target)
        self.ctx.cache[key] = out
        return out

    def scatter(self, eqn: Any, ins: list[Val], mult: int) -> Val:
        operand, updates = ins[0], ins[2] if len(ins) > 2 else ins[-1]
        out_aval = eqn.outvars[0].aval
        shape = tuple(out_aval.shape)
        self._flops(self.ctx.local(updates) / updates.itemsize, mult, "scatter-add")
        hint = self.hints.get(eqn.outvars[0])
        dn = eqn.params["dimension_numbers"]
        window = tuple(dn.update_window_dims)
        kept = [i for i in range(len(shape)) if i not in tuple(dn.inserted_window_dims)]
        if hint is not None and len(ins) > 2 and len(window) == len(kept):
            # The transpose of a lookup whose result is wanted split like the table (an embedding's
            # gradient under a 2-D plan): where an axis splits both the table's kept dim and the
            # updates' batch, GSPMD moves the updates onto the table's split (all-to-all), scatters
            # every index into the rows it holds whole and reduce-scatters over the axes that split
            # the rows (measured).
            target = _norm(hint, len(shape))
            rows = {a for i in range(len(shape)) if i not in kept for a in target[i]}
            scatter_dims = [k for k in range(len(updates.shape)) if k not in window]
            clash = {a for w, i in zip(window, kept, strict=True) for a in target[i]} & {
                a for k in scatter_dims for a in updates.dims[k]
            }
            if clash and _fits(shape, target, self.ctx):
                moved = [[a for a in d if a not in clash] for d in updates.dims]
                for w, i in zip(window, kept, strict=True):
                    if updates.shape[w] == shape[i]:
                        moved[w] = [a for a in target[i] if a in clash or a in moved[w]]
                self.reshard(eqn.invars[2], replace(updates, partial=frozenset()), _tuple(moved), mult, "scatter-add")
                self.reshard(eqn.invars[1], ins[1], _without(ins[1].dims, clash), mult, "scatter-add")
                dims = [tuple(a for a in target[i] if a in clash) if i in kept else () for i in range(len(shape))]
                return Val(shape, itemsize(out_aval), tuple(dims), frozenset(rows) | updates.partial)
        if hint is not None and len(ins) > 2 and not operand.axes:
            regrouped = self.regroup_gradient(eqn, _norm(hint, len(shape)), ins[1], updates, mult)
            if regrouped is not None:
                return regrouped
        # The result (e.g. an embedding's gradient) takes the operand's layout; updates split
        # over axes the result is not split on are summed across them.
        dims = list(operand.dims)
        if not operand.axes and len(ins) > 2:
            # Batched indices (``take_along_axis``'s gradient) split a whole operand (zeros) on its
            # batch dims as they are split: each device scatters into its own rows.
            batching = zip(
                tuple(getattr(dn, "operand_batching_dims", ())),
                tuple(getattr(dn, "scatter_indices_batching_dims", ())),
                strict=False,
            )
            for od, idd in batching:
                if ins[1].shape[idd] == shape[od]:
                    dims[od] = ins[1].dims[idd]
            if hint is not None and not any(dims):
                # A gradient wanted split over its rows (a table split over its vocabulary): each
                # device scatters only the updates that fall in its own rows (XLA drops the others),
                # so the sum over the updates' split is over that device's rows (measured).
                moving = updates.axes | ins[1].axes | updates.partial
                target = _norm(hint, len(shape))
                rows = {a for i in tuple(dn.inserted_window_dims) for a in target[i]}
                if (
                    rows & (updates.axes | ins[1].axes)
                    and not any(target[i] for i in kept)
                    and _size(updates) < math.prod(shape) * itemsize(out_aval)
                ):
                    # Updates split over the rows' axes and smaller than the table (the transpose
                    # of ``masked_all_indices``): XLA gathers the updates and the indices and each
                    # device scatters into the rows it holds; no sum over the rows (measured).
                    self.reshard(
                        eqn.invars[2],
                        replace(updates, partial=frozenset()),
                        _without(updates.dims, rows),
                        mult,
                        "scatter-add",
                    )
                    self.reshard(eqn.invars[1], ins[1], _without(ins[1].dims, rows), mult, "scatter-add")
                    for i in tuple(dn.inserted_window_dims):
                        dims[i] = target[i]
                    return Val(shape, itemsize(out_aval), tuple(dims), updates.partial)
                for i in tuple(dn.inserted_window_dims):
                    dims[i] = tuple(a for a in target[i] if a not in moving)
            elif hint is None and eqn.outvars[0] in self.siblings:
                # ``take_along_axis``'s gradient into zeros, added to a value already split over
                # the scattered dim (logits over the vocabulary): made split so (GSPMD's
                # propagation), each device scattering the updates that fall in its share
                beside = _norm(self.siblings[eqn.outvars[0]], len(shape))
                used = {a for d in dims for a in d} | updates.axes | updates.partial | ins[1].axes
                for i in tuple(dn.inserted_window_dims):
                    dims[i] = tuple(a for a in beside[i] if a not in used)
        out = Val(shape, itemsize(out_aval), tuple(dims))
        pending = frozenset(a for d in updates.dims for a in d if a not in out.axes) | updates.partial
        if len(ins) > 2 and not tuple(getattr(dn, "scatter_indices_batching_dims", ())):
            # Indices split over an axis (a lookup's tokens) split the updates with them (a free
            # slice where they are whole): each device adds its share, summed across the axis.
            pending |= frozenset(a for d in ins[1].dims[:-1] for a in d if a not in out.axes)
        return replace(out, partial=pending)

    def stack(self, eqn: Any, ins: list[Val], mult: int) -> Val:
        axis = eqn.params["axis"]
        base = max(ins, key=lambda v: self.ctx.split_dims(v.dims))
        for x, v in zip(eqn.invars, ins, strict=True):
            self.reshard(x, self.resolve(x, v, None, mult, "stack"), base.dims, mult, "stack")
        o = eqn.outvars[0]
        return Val(tuple(o.aval.shape), itemsize(o.aval), base.dims[:axis] + ((),) + base.dims[axis:])

    def layout_preserving(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """Slices, pads, concatenations: keep splits on dims whose size is unchanged, gather the rest."""
        outs = []
        for o in eqn.outvars:
            shape = tuple(o.aval.shape)
            # A value made in the step from literals alone (a cache of ``jnp.zeros`` a
            # dynamic_update_slice writes) has no layout of its own: XLA splits it the way the
            # other operands are (measured: no collective; it was gathered whole to the zeros').
            same = [(x, v) for x, v in zip(eqn.invars, ins, strict=True) if len(v.shape) == len(shape)]
            made = [v for x, v in same if not (hasattr(x, "val") or x in self.constant)]
            candidates = made or [v for _, v in same]
            base = candidates[0] if candidates else None
            if base is None:
                outs.append(_replicated(o.aval))
                continue
            dims = [d if base.shape[i] == shape[i] else () for i, d in enumerate(base.dims)]
            for x, v in zip(eqn.invars, ins, strict=True):
                if v is base or len(v.shape) == len(shape):
                    v2 = self.resolve(x, v, None, mult, eqn.primitive.name)
                    self.reshard(
                        x,
                        v2,
                        _tuple([d if v.shape[i] == shape[i] else () for i, d in enumerate(dims)]),
                        mult,
                        eqn.primitive.name,
                    )
            outs.append(Val(shape, itemsize(o.aval), _tuple(dims)))
        return outs

    def top_k(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """``top_k`` along its last dim: laid out as a slice (that dim gathered), or on its whole
        operand where the compiler cannot split it (``Compiler.whole_top_k``; the results then
        sliced back to the operand's other splits, free)."""
        x, v = eqn.invars[0], ins[0]
        if not self.ctx.book.whole_top_k or not (v.axes or v.partial):
            return self.layout_preserving(eqn, ins, mult)
        self.to_layout(x, v, ((),) * len(v.shape), mult, "top_k")
        kept = (*v.dims[:-1], ())
        return [Val(tuple(o.aval.shape), itemsize(o.aval), kept) for o in eqn.outvars]

    def grouped(self, eqn: Any, ins: list[Val], mult: int) -> list[Val] | None:
        """A grouped matmul (``ragged_dot_general``): jax's dense decomposition walked in place where
        the compiler runs that (``Compiler.dense_ragged``), else the compiler's own with the group
        dim and the ragged rows whole (the experts' weights gathered over their group split, the
        tokens' pending sums reduced) and the other dims as a matmul's: a contraction the weights
        split is taken by the tokens (a pending sum), the weights' free dims keep their split (so
        does the result); FLOPs as that compiler counts them (``whole_ragged``)."""
        book = self.ctx.book
        if book.dense_ragged:
            return self.inline(eqn, ins, mult)
        if book.whole_ragged is None:
            return None
        nums = eqn.params["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = nums.dot_dimension_numbers
        if lb or rb or len(nums.lhs_ragged_dimensions) != 1:
            return None
        (r,) = nums.lhs_ragged_dimensions
        lhs, rhs = ins[0], ins[1]
        gd = set(nums.rhs_group_dimensions)
        rhs_dims = [() if j in gd else d for j, d in enumerate(rhs.dims)]
        pairs = dict(zip(lc, rc, strict=True))
        if r in pairs:  # the ragged rows contracted (a weight gradient): whole on both sides
            rhs_dims[pairs[r]] = ()
        taken = {a for d in rhs_dims for a in d}
        lhs_dims = [
            () if i == r else tuple(rhs_dims[pairs[i]]) if i in pairs else tuple(a for a in d if a not in taken)
            for i, d in enumerate(lhs.dims)
        ]
        for x, v, want in ((eqn.invars[0], lhs, lhs_dims), (eqn.invars[1], rhs, rhs_dims)):
            if v.dims != tuple(want) or v.partial:
                self.to_layout(x, v, tuple(want), mult, "ragged_dot_general")
        if ins[2].axes or ins[2].partial:
            self.to_layout(eqn.invars[2], ins[2], ((),) * len(ins[2].shape), mult, "ragged_dot_general")
        lfree = [i for i in range(len(lhs.shape)) if i not in pairs]
        rfree = [j for j in range(len(rhs.shape)) if j not in rc and j not in gd]
        out = eqn.outvars[0].aval
        out_dims = [lhs_dims[i] for i in lfree] + [rhs_dims[j] for j in rfree]
        if not gd:
            out_dims = [(), *out_dims]
        summed = {a for i in pairs for a in lhs_dims[i]}
        groups = math.prod(eqn.invars[2].aval.shape[-1:])
        # 2 x result x contraction: for grouped rows the useful FLOPs (times the groups where each
        # runs over every row), for a contraction over the ragged rows every group over every row.
        result = Val(tuple(out.shape), itemsize(out), _norm(tuple(out_dims), len(out.shape)), frozenset(summed))
        local = self.ctx.local(result) / result.itemsize
        k = math.prod(lhs.shape[i] for i in lc) / self.ctx.split(tuple(summed))
        dense = gd and book.whole_ragged == "dense"
        self._flops(2 * local * k * (groups if dense else 1), mult, "ragged_dot_general")
        return [result]

    def along(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """An op along a dim whose result depends on the whole dim, that dim split (measured on
        single ops): a scan (cumsum and kin) gathers it (its result sliced back, free); a sort
        moves its axes to the largest other dim they divide and its results back (all-to-alls;
        gathered where none does, a 1-D sort); a reverse swaps the blocks between devices (a
        collective-permute of each device's block)."""
        name = eqn.primitive.name
        dim = eqn.params["dimension"] if name == "sort" else eqn.params.get("axis")
        along = tuple(eqn.params["dimensions"]) if name == "rev" else (dim,)
        if not any(ins[0].dims[i] for i in along):
            return self.layout_preserving(eqn, ins, mult)
        v0 = self.resolve(eqn.invars[0], ins[0], None, mult, name)
        if name == "rev":
            for x, v in zip(eqn.invars, ins, strict=True):
                self.ctx.add(
                    "collective-permute",
                    tuple(a for i in along for a in v.dims[i]),
                    self.ctx.local(v),
                    mult,
                    name,
                    self.names.get(self.root(x), ""),
                )
            return [Val(tuple(o.aval.shape), itemsize(o.aval), v0.dims) for o in eqn.outvars]
        dims = [list(d) for d in v0.dims]
        moving = dims[dim]
        dims[dim] = []
        moved = False
        if name == "sort":
            others = sorted(
                (j for j in range(len(dims)) if j != dim and v0.shape[j] % self.ctx.split((*dims[j], *moving)) == 0),
                key=lambda j: -v0.shape[j],
            )
            if others:
                dims[others[0]] = dims[others[0]] + moving
                moved = True
        target = _tuple(dims)
        for x, v in zip(eqn.invars, ins, strict=True):
            self.reshard(x, self.resolve(x, v, None, mult, name), target, mult, name)
        outs = []
        for o in eqn.outvars:
            out = Val(tuple(o.aval.shape), itemsize(o.aval), target)
            if moved and type(o).__name__ != "DropVar":
                # the result laid out as its operand was (Shardy's rule): moved back by all-to-all
                self.ctx.add("all-to-all", tuple(moving), self.ctx.local(out), mult, name)
            outs.append(Val(out.shape, out.itemsize, v0.dims) if moved or name != "sort" else out)
        return outs

    def kernel(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """A Pallas kernel (``kernels.pallas_cost``). XLA cannot split a custom call: outside
        shard_map every device runs it on whole operands (gathered first) and holds the whole result."""
        cost = pallas_cost(eqn)
        why = f"kernel {cost.name}"
        if any(v.axes or v.partial for v in ins):
            self.ctx.kernels.append(
                f"kernel {cost.name} ({self.ctx.source or 'step'}) runs outside shard_map on split operands: XLA "
                "gathers them whole on every device (wrap the kernel in jax.shard_map to run it on each device's block)"
            )
        for x, v in zip(eqn.invars, ins, strict=True):
            if v.axes or v.partial:
                self.to_layout(x, v, ((),) * len(v.shape), mult, why)
        self.ctx.flops += cost.flops * mult
        self.ctx.transcendentals += cost.transcendentals * mult
        self.ctx.hbm += (cost.read + cost.written) * mult
        self.ctx.kernels.extend(n for n in cost.notes if n not in self.ctx.kernels)
        return [_replicated(o.aval) for o in eqn.outvars]

    def fused_attention(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """cuDNN's flash attention (``kernels.fused_attention_cost``). jax partitions it over the
        batch and the heads: operands keep those splits (a key/value head split only where its
        query's is the same) and are gathered on the others; results take their operands' splits."""
        bnth = str(eqn.params.get("layout", "0")) in ("1", "Layout.BNTH", "BNTH")
        keep = (0, 1) if bnth else (0, 2)  # batch, heads
        q = ins[0]
        target_q = tuple(d if i in keep else () for i, d in enumerate(q.dims))
        moved: list[Val] = []
        for x, v in zip(eqn.invars, ins, strict=True):
            if len(v.shape) == 4 and all(v.shape):
                target = tuple(
                    target_q[i] if i in keep and v.shape[i] % self.ctx.split(target_q[i]) == 0 else () for i in range(4)
                )
            elif len(v.shape) == 3 and all(v.shape):  # the softmax statistics (batch, heads, time)
                target = (target_q[keep[0]], target_q[keep[1]], ())
            else:  # empty placeholders (no bias, no sequence lengths)
                target = ((),) * len(v.shape)
            moved.append(self.to_layout(x, v, _norm(target, len(v.shape)), mult, "cudnn attention"))
        cost = fused_attention_cost(eqn)
        # Per device: the split of the queries' batch and heads.
        share = self.ctx.split(tuple(a for i in keep for a in target_q[i]))
        self.ctx.flops += cost.flops / share * mult
        self.ctx.transcendentals += cost.transcendentals / share * mult
        self.ctx.hbm += (sum(self.ctx.local(v) for v in moved) + cost.written / share) * mult
        outs = []
        for o in eqn.outvars:
            shape = tuple(o.aval.shape)
            src = next((v for v in moved if v.shape == shape and len(shape) == 4), None)
            if src is not None:
                dims = src.dims
            elif len(shape) == 3:  # statistics
                dims = (target_q[keep[0]], target_q[keep[1]], ())
            else:
                dims = ((),) * len(shape)
            outs.append(Val(shape, itemsize(o.aval), _norm(dims, len(shape))))
        return outs

    def shard_map(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """A ``jax.shard_map`` region: its operands set to ``in_specs`` over the manual axes (GSPMD's
        reshards; their splits over the axes it leaves automatic are kept), its body run per
        device on local blocks (the collectives in it are the user's own), its results laid out as
        ``out_specs`` plus the body's automatic splits."""
        body = eqn.params["jaxpr"]
        body = getattr(body, "jaxpr", body)
        manual = set(eqn.params.get("newly_manual_axes") or eqn.params.get("manual_axes") or self.ctx.mesh)
        env: dict[Any, Val] = {}
        for x, inner, v, spec in zip(eqn.invars, body.invars, ins, eqn.params["in_specs"], strict=True):
            wanted = _spec_dims(spec, len(v.shape))
            auto = tuple(tuple(a for a in d if a not in manual) for d in v.dims)
            self.to_layout(x, v, tuple(w + a for w, a in zip(wanted, auto, strict=True)), mult, "shard_map in_specs")
            env[inner] = Val(tuple(inner.aval.shape), itemsize(inner.aval), auto)
        results = self.run(body, env, mult, _Boundary(frozenset(body.invars), {}, {}))
        outs = []
        for o, spec, r in zip(eqn.outvars, eqn.params["out_specs"], results, strict=True):
            dims = _spec_dims(spec, len(o.aval.shape))
            auto = tuple(tuple(a for a in d if a not in manual) for d in r.dims) if len(r.dims) == len(dims) else ()
            if auto:
                dims = tuple(d + a for d, a in zip(dims, auto, strict=True))
            outs.append(Val(tuple(o.aval.shape), itemsize(o.aval), dims, frozenset(r.partial) - manual))
        return outs

    def manual_collective(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """A collective the user wrote inside shard_map (``lax.psum``, ``all_gather``, ...), one
        per operand."""
        name = eqn.primitive.name
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if isinstance(a, str))
        kind = _MANUAL_COLLECTIVES[name]
        outs = []
        for v, o in zip(ins, eqn.outvars, strict=True):
            shape = tuple(o.aval.shape)
            out = Val(shape, itemsize(o.aval), v.dims if shape == tuple(v.shape) else ((),) * len(shape))
            self.ctx.add(
                kind,
                axes,
                self.ctx.local(out) if kind == "all-gather" else self.ctx.local(v),
                mult,
                f"shard_map {name}",
            )
            outs.append(out)
        return outs

    def scan(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        length = int(eqn.params["length"])
        body = eqn.params["jaxpr"].jaxpr

        nc, ncarry = scan_counts(eqn)
        env: dict[Any, Val] = {}
        # For the ledger's rows only: a layer's slice of a stacked param is the param its gathers
        # move, the body's slice of a stacked gradient the param its sums update.
        for var, outer in zip(body.invars, eqn.invars, strict=True):
            name = "" if hasattr(outer, "val") else self.names.get(self.root(outer)) or self.labels.get(outer, "")
            if name:
                self.labels.setdefault(var, name)
        for inner, outer in zip(body.outvars[ncarry:], eqn.outvars[ncarry:], strict=True):
            param = self.updates.get(outer) or self.labels.get(outer)
            if param and not hasattr(inner, "val"):
                self.labels.setdefault(inner, param)
        for k, (var, v) in enumerate(zip(body.invars, ins, strict=True)):
            if k < nc:
                self.invariant[var] = mult
            if k >= nc + ncarry:  # scanned over: the body sees one slice (the leading dim dropped)
                v = Val(v.shape[1:], v.itemsize, v.dims[1:], v.partial)
            env[var] = v
        outs = self.run(body, env, mult * length)
        result = list(outs[:ncarry])
        for o, inner, v in zip(eqn.outvars[ncarry:], body.outvars[ncarry:], outs[ncarry:], strict=True):
            # Stacked outputs; a pending sum wanted split (a layer's weight gradient under FSDP)
            # is reduce-scattered in each iteration, so the stack is held split.
            hint = self.hints.get(o)
            if v.partial and hint is not None and len(hint) == len(v.shape) + 1:
                v = self.resolve(inner, v, hint[1:], mult * length, "scan")
            result.append(Val(tuple(o.aval.shape), v.itemsize, ((),) + v.dims, v.partial))
        return result


def _spread(jaxpr: Any, table: dict[Any, Dims], constraints: str | None) -> None:
    """Wanted splits (``table``: var -> per-dim axes) carried from values back to the values they
    are computed from, through elementwise, layout and reduction ops and matmuls. ``constraints``:
    "seed" starts a want at each constrained activation (its layout), "stop" ends one there, None
    passes through."""

    def want(x: Any, dims: Dims) -> None:
        if not hasattr(x, "val") and any(dims) and len(dims) == len(getattr(x.aval, "shape", ())):
            table.setdefault(x, dims)

    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "sharding_constraint" and constraints is not None:
            x = eqn.invars[0]
            target = constraint_target(eqn, ((),) * len(getattr(x.aval, "shape", ())))
            if target is not None and constraints == "seed":
                want(x, target)
            continue
        out = table.get(eqn.outvars[0]) if eqn.outvars else None
        if out is None:
            continue
        shape = tuple(eqn.outvars[0].aval.shape)
        if name in ELEMENTWISE or name in _LAYOUT_PRESERVING:
            for x in eqn.invars:
                xs = tuple(getattr(x.aval, "shape", ()))
                if len(xs) == len(shape):
                    want(x, tuple(d if xs[i] == shape[i] else () for i, d in enumerate(out)))
        elif name == "transpose":
            want(eqn.invars[0], permuted(out, eqn.params["permutation"]))
        elif name in ("reshape", "squeeze", "expand_dims"):
            xs = tuple(eqn.invars[0].aval.shape)
            dims: list[tuple[str, ...]] = [()] * len(xs)
            for i in range(min(len(xs), len(shape))):  # the leading dims both shapes share
                if xs[i] != shape[i]:
                    break
                dims[i] = out[i]
            want(eqn.invars[0], tuple(dims))
        elif name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
            axes = tuple(eqn.params.get("axes", ()))
            xs = tuple(eqn.invars[0].aval.shape)
            kept = [i for i in range(len(xs)) if i not in axes]
            red: list[tuple[str, ...]] = [()] * len(xs)
            for k, i in enumerate(kept):
                red[i] = out[k]
            want(eqn.invars[0], tuple(red))
        elif name == "broadcast_in_dim":
            xs = tuple(eqn.invars[0].aval.shape)
            want(
                eqn.invars[0],
                tuple(out[j] if xs[i] == shape[j] else () for i, j in enumerate(eqn.params["broadcast_dimensions"])),
            )
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lx, rx = eqn.invars
            lfree = [i for i in range(len(lx.aval.shape)) if i not in lc and i not in lb]
            rfree = [i for i in range(len(rx.aval.shape)) if i not in rc and i not in rb]
            ld: list[tuple[str, ...]] = [()] * len(lx.aval.shape)
            rd: list[tuple[str, ...]] = [()] * len(rx.aval.shape)
            k = 0
            for i, j in zip(lb, rb, strict=True):
                ld[i] = rd[j] = out[k]
                k += 1
            for i in lfree:
                ld[i] = out[k]
                k += 1
            for j in rfree:
                rd[j] = out[k]
                k += 1
            want(lx, tuple(ld))
            want(rx, tuple(rd))


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


def _per_dim(axes: tuple[str, ...], dims: tuple[frozenset[str], ...]) -> list[tuple[str, ...]]:
    """The all-reduces of a pending sum over ``axes``: one over all of them, or where the matmul
    that made it summed over several contracted dims split apart (``dims``, the axes of each:
    ``Compiler.sums_per_dim``), one per dim's axes, then one over any left."""
    if not axes:
        return []
    parts = [tuple(a for a in axes if a in d) for d in dims]
    parts = [p for p in parts if p]
    left = tuple(a for a in axes if not any(a in p for p in parts))
    return [*parts, left] if left else parts or [axes]


def _contracted(eqn: Any) -> int:
    """Elements a matmul contracts (0: not a matmul)."""
    if eqn.primitive.name != "dot_general":
        return 0
    (lc, _), _ = eqn.params["dimension_numbers"]
    return math.prod(eqn.invars[0].aval.shape[i] for i in lc)


def _reads_narrow(eqn: Any) -> bool:
    """A matmul at the default precision (its float32 operands read in ``Compiler.matmul_itemsize``)."""
    return eqn.primitive.name == "dot_general" and eqn.params.get("precision") in (None, (None, None))


GRANULE = 512  # bytes: XLA:TPU's smallest buffer (a float32[3] takes 512 B; measured per array)


def tiled_bytes(shape: Sequence[int], itemsize: int, tile: tuple[int, int]) -> int:
    """Bytes an array takes laid out in (second-minor, minor) ``tile``s: dims of 1 take no place;
    the compiler lays the two tiled dims out where they pad least (measured: a (64, 16) float32
    parameter takes 8 KiB, laid out as (16, 64)); whole granules of 512 B."""
    dims = [d for d in shape if d != 1] or [1]
    whole = math.prod(dims)
    if len(dims) == 1:
        n = _round_up(whole, tile[1])
    else:
        n = min(
            whole // (a * b) * _round_up(a, tile[0]) * _round_up(b, tile[1])
            for i, a in enumerate(dims)
            for j, b in enumerate(dims)
            if i != j
        )
    return _round_up(n * itemsize, GRANULE)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


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


def _batch_scatter(v: Val, ctx: _Ctx, rows: int | None = 0) -> Dims:
    """Where an activation's pending sum over a batch axis goes when no reader says: onto its rows
    (a matmul's: the dim its operands' leading dims went to; else its leading dim), where they are
    whole (measured: under a 2-D plan whose embedding width is split over the batch axis, XLA
    reduce-scatters a projection's sum over `data` onto the batch rows; a GShard dispatch
    "gsec,gsd->egcd" summed over the sequence's `data`, its groups split over `model`, is
    all-reduced, not scattered onto the experts' dim)."""
    dims = [tuple(d) for d in v.dims]
    if rows is not None and len(v.shape) >= 2 and rows < len(dims) and not dims[rows]:
        axes = tuple(a for a in ctx.batch_axes if a in v.partial and a not in v.axes)
        if axes and v.shape[rows] % ctx.split(axes) == 0:
            dims[rows] = axes
    return tuple(dims)


def _adapts(eqn: Any) -> bool:
    """A reader that takes its operand in any layout (an elementwise op, a matmul or a call of one,
    ``jnp.einsum``'s body, a reduction of one operand: a norm's mean), where a gather keeps the
    layout it finds."""
    if eqn is None:
        return False
    if eqn.primitive.name == "dot_general" or eqn.primitive.name in ELEMENTWISE:
        return True
    if eqn.primitive.name in REDUCTIONS and len(eqn.invars) == 1:
        return True
    sub = _subjaxpr(eqn) if eqn.primitive.name in ("jit", "pjit", "closed_call") else None
    return sub is not None and any(e.primitive.name == "dot_general" for e in sub.eqns)


def _claims_back(jaxpr: Any, claimed: dict[Any, Dims], split: Callable[[Dims], int]) -> dict[Any, Dims]:
    """The layouts Shardy's propagation gives the ops that build a claimed value, walking back
    from it: through transposes and elementwise ops (to operands of the same shape: an operand
    broadcast over a size-1 dim, or by ``broadcast_in_dim``, keeps its own layout), through
    reductions (the kept dims as the result's, the reduced whole: a norm), into calls
    (an einsum's body) and through a batched matmul to its operands (batch and free dims as the
    result's, contracting dims whole). Only values made in ``jaxpr`` (or a call's inputs, mapped
    out to the caller's values) are claimed; params and inputs keep their own layouts. Where a
    claim applies is ``_back_claim``'s decision. Pure: returns the claims, ``claimed`` included."""
    out = dict(claimed)
    made = {o for eqn in jaxpr.eqns for o in eqn.outvars} | set(jaxpr.invars)  # invars: a call's, mapped out
    readers: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):
                readers.setdefault(x, []).append(eqn)
    for x in jaxpr.outvars:
        if not hasattr(x, "val"):
            readers.setdefault(x, []).append(None)
    proposed: dict[Any, dict] = {}  # value -> {reading eqn id: the layout it asks for}
    reader: list = [None]

    def claim(x: Any, dims: Dims) -> None:
        if not hasattr(x, "val") and x in made and x not in out and any(dims):
            proposed.setdefault(x, {})[id(reader[0])] = tuple(dims)

    def settle(x: Any) -> None:
        # Claimed where every reader asks for it or takes any layout (an elementwise op, a matmul);
        # a reader that keeps the value's own layout (a reduction, a gather) keeps it. Readers that
        # ask for different layouts: the most split wins (a tie, neither).
        asks = proposed.get(x)
        if x in out or not asks or not all(id(r) in asks or _adapts(r) for r in readers.get(x, [])):
            return
        ranked = sorted(set(asks.values()), key=lambda d: -split(d))
        if len(ranked) == 1 or split(ranked[0]) > split(ranked[1]):
            out[x] = ranked[0]

    for eqn in reversed(jaxpr.eqns):
        for o in eqn.outvars:
            settle(o)
        reader[0] = eqn
        target = next((out[o] for o in eqn.outvars if o in out), None)
        if target is None:
            continue
        name = eqn.primitive.name
        shape = tuple(eqn.outvars[0].aval.shape)
        if name == "transpose":
            inner: list = [()] * len(shape)
            for k, p in enumerate(eqn.params["permutation"]):
                inner[p] = target[k]
            claim(eqn.invars[0], tuple(inner))
        elif name in ELEMENTWISE or name == "convert_element_type":
            for x in eqn.invars:
                if tuple(getattr(x.aval, "shape", ())) == shape and shape:  # not through a size-1 broadcast
                    claim(x, target)
        elif name in REDUCTIONS and len(eqn.invars) == 1:
            # through a reduction (a norm's mean): the kept dims as the result's, the reduced whole
            axes = set(eqn.params.get("axes", ()))
            kept = iter(target)
            x = eqn.invars[0]
            claim(x, tuple(() if i in axes else next(kept, ()) for i in range(len(x.aval.shape))))
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            if not lb:
                continue  # a plain matmul: its operands keep their own splits (weights, sequence)
            lx, rx = eqn.invars
            lfree = [i for i in range(len(lx.aval.shape)) if i not in lc and i not in lb]
            rfree = [i for i in range(len(rx.aval.shape)) if i not in rc and i not in rb]
            ld: list = [()] * len(lx.aval.shape)
            rd: list = [()] * len(rx.aval.shape)
            for k, (i, j) in enumerate(zip(lb, rb, strict=True)):
                ld[i], rd[j] = target[k], target[k]
            for p, i in enumerate(lfree):
                ld[i] = target[len(lb) + p]
            for q, j in enumerate(rfree):
                rd[j] = target[len(lb) + len(lfree) + q]
            claim(lx, tuple(ld))
            claim(rx, tuple(rd))
        elif name in ("jit", "pjit", "closed_call", "core_call"):
            sub = _subjaxpr(eqn)
            if sub is None:
                continue
            pairs = zip(sub.outvars, eqn.outvars, strict=False)
            seeds = {i: out[o] for i, o in pairs if o in out and not hasattr(i, "val")}
            inner_claims = _claims_back(sub, seeds, split)
            for i, o in zip(sub.invars, eqn.invars, strict=False):
                if i in inner_claims and not hasattr(o, "val"):
                    claim(o, inner_claims[i])
    for x in jaxpr.invars:
        settle(x)
    return out


def _rhs_yields(lhs: Val, rhs: Val) -> bool:
    """Where one axis splits a free dim of each matmul operand: whether the right-hand one gives
    it up (XLA's propagation keeps the larger operand's split; ties: the left's)."""
    return math.prod(rhs.shape) * rhs.itemsize <= math.prod(lhs.shape) * lhs.itemsize


def _broadcast(v: Val, shape: tuple[int, ...]) -> Val:
    """``v`` seen at the output's shape: its size-1 dims (broadcast) are whole."""
    dims = tuple(d if v.shape[i] == shape[i] else () for i, d in enumerate(v.dims))
    return Val(shape, v.itemsize, dims, v.partial)


# Collectives written inside shard_map, by the kind XLA names them.
_MANUAL_COLLECTIVES = {
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "psum2": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}


def _one(method: Callable[..., Any]) -> Callable[..., list[Val]]:
    """A rule of one result from a walker method of one result."""
    return lambda self, eqn, ins, mult: [method(self, eqn, ins, mult)]


_P = _Propagator
# fast mode's rule book: primitive -> rule(walker, eqn, operands' Vals, multiplicity) -> result
# Vals (None: not modelled for these operands). Elementwise primitives go to ``_P.elementwise``
# before the table is read; a call of a primitive not catalogued is inlined.
_RULES: dict[str, Callable[..., list[Val] | None]] = {
    **dict.fromkeys(ELEMENTWISE, _one(_P.elementwise)),
    **dict.fromkeys(named(traits=("call",)), _P.inline),
    "scan": _P.scan,
    "ragged_dot_general": _P.grouped,
    "pallas_call": _P.kernel,
    **dict.fromkeys(FUSED_ATTENTION, _P.fused_attention),
    "shard_map": _P.shard_map,
    **dict.fromkeys(_MANUAL_COLLECTIVES, _P.manual_collective),
    "name": lambda self, eqn, ins, mult: [ins[0]],  # checkpoint_name: the value itself
    "pvary": lambda self, eqn, ins, mult: list(ins),  # marks values as varying over axes: nothing moves
    **dict.fromkeys(
        {"axis_index", "iota"} | _FREE | named(kinds=("random",)),
        lambda self, eqn, ins, mult: [_replicated(o.aval) for o in eqn.outvars],
    ),
    "dot_general": _one(_P.dot),
    **dict.fromkeys(REDUCTIONS, lambda self, eqn, ins, mult: [self.reduce(eqn, ins[0], mult)]),
    "broadcast_in_dim": _P.broadcast,
    "transpose": lambda self, eqn, ins, mult: [
        Val(
            tuple(ins[0].shape[p] for p in eqn.params["permutation"]),
            ins[0].itemsize,
            tuple(ins[0].dims[p] for p in eqn.params["permutation"]),
            ins[0].partial,
        )
    ],
    **dict.fromkeys(
        ("reshape", "squeeze", "expand_dims"),
        lambda self, eqn, ins, mult: [self.reshape(eqn.invars[0], ins[0], tuple(eqn.outvars[0].aval.shape), mult)],
    ),
    "sharding_constraint": lambda self, eqn, ins, mult: [self.constraint(eqn, ins[0], mult)],
    "reshard": _P.reshard_op,
    "gather": _one(_P.gather),
    **dict.fromkeys(("scatter-add", "scatter_add", "scatter"), _one(_P.scatter)),
    "unstack": _P.unstack,
    "stack": _one(_P.stack),  # jnp.stack (a primitive in this jax): operands laid out alike, a new whole dim
    **dict.fromkeys(
        named(kinds=("slicing", "along")) - {"stack", "unstack"}
        | _LAYOUT_PRESERVING - named(kinds=("elementwise", "identity")),
        _P.layout_preserving,
    ),
    # along a dim
    **dict.fromkeys(named(kinds=("along",)) - {"top_k"}, _P.along),
    "top_k": _P.top_k,
}
# What fast mode declares it does not model: replicated results, reported in the step's notes
# (XLA's program for them is not predicted). The coverage test (tests/test_primitives.py) holds
# every catalogued primitive to a rule here or an entry in this set.
_FALLBACKS = frozenset(
    {"while", "cond", "optimization_barrier", "bitcast_convert_type", "scatter-mul", "scatter_mul"}
    | {"sharding_cast", "mesh_cast"}  # other jax releases' names of reshard
    | set(_MANUAL_COLLECTIVES) - set(_RULES)
)


def rule_book() -> tuple[frozenset[str], frozenset[str]]:
    """fast mode's primitives with a rule, and its declared fallbacks (for the coverage test)."""
    return frozenset(_RULES) | ELEMENTWISE, _FALLBACKS


def _spec_dims(spec: Any, rank: int) -> Dims:
    """A PartitionSpec's entries as per-dim axis tuples."""
    dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in tuple(spec)]
    return _norm(tuple(dims), rank)


def _size(v: Val) -> int:
    """A value's bytes over the whole mesh (what XLA's gather partitioner compares)."""
    return math.prod(v.shape) * v.itemsize


def _without(dims: Dims, axes: set[str]) -> Dims:
    """``dims`` with ``axes`` taken off every dim (those dims gathered over them)."""
    return tuple(tuple(a for a in d if a not in axes) for d in dims)


def _tuple(dims: list) -> Dims:
    return tuple(tuple(d) for d in dims)


def _is_float(var: Any) -> bool:
    import numpy as np

    return bool(np.issubdtype(var.aval.dtype, np.floating))


def _replicated(aval: Any) -> Val:
    shape = tuple(getattr(aval, "shape", ()))
    return Val(shape, itemsize(aval), ((),) * len(shape))


def _local_shape(v: Val, ctx: _Ctx) -> tuple[int, ...]:
    return tuple(size // ctx.split(axes) if axes else size for size, axes in zip(v.shape, v.dims, strict=True))


def _fits(shape: tuple[int, ...], dims: Dims, ctx: _Ctx) -> bool:
    return len(dims) <= len(shape) and all(shape[i] % ctx.split(d) == 0 for i, d in enumerate(dims) if d)


def step_cost(tracer: Any, plan: Any, mesh: dict[str, int], *, delta: bool = True, compiler: str = "cpu") -> StepCost:
    """The auto backend's step cost in fast mode (the backend registry's entry): ``plan``
    resolved once and propagated through the step ``tracer`` (a ``tracing.Tracer``) traced once
    per trace key. ``delta``: also what the step's constraints change. ``compiler``: the platform
    whose compiler's program is predicted (``cpu``, ``cuda``, ``tpu``: :data:`COMPILERS`)."""
    t0 = time.perf_counter()
    res = tracer.resolve(plan, mesh)
    traced = tracer.step(plan, mesh, res)
    got = cost(traced, plan, mesh, delta=delta, res=res, compiler=compiler)
    return replace(got, seconds=time.perf_counter() - t0)


def cost(
    traced: Trace,
    plan: Any,
    mesh: dict[str, int],
    *,
    delta: bool = True,
    res: Resolution | None = None,
    compiler: str = "cpu",
) -> StepCost:
    """``plan``'s step cost on ``mesh`` over a step traced once (:func:`trace`), without tracing
    again: the plan's shardings resolved (``res``: already, by ``Tracer.resolve``) and propagated
    through the traced jaxpr. ``delta``: also what the step's constraints change (a second
    propagation without them). ``compiler``: whose program (:data:`COMPILERS`).

    Raises:
        ValueError: ``traced`` was traced under other activation rules, mesh or axis types.
    """
    import jax
    import numpy as np

    from shardplan.runtime import specs

    if res is None:
        params, opt = specs.model_resolver(traced.abs_model, traced.abs_opt)(plan, mesh)
        res = Resolution(params, opt, specs.resolve_batch(plan, traced.batch_abs, mesh=mesh))
    book = COMPILERS[compiler]
    if trace_key(plan, mesh, res.params) != traced.key:
        raise ValueError("the plan's act/axis rules, mesh or axis types differ from the ones the step was traced under")
    t0 = time.perf_counter()
    acts, closed = traced.acts, traced.closed
    params, opt, inputs = res.params, res.opt, res.inputs
    assert opt is not None
    jaxpr = closed.jaxpr
    decisions = list(params.decisions) + list(opt.decisions) + list(inputs.decisions)
    prefixes = ["param"] * len(params.decisions) + ["opt"] * len(opt.decisions) + ["input"] * len(inputs.decisions)
    if len(decisions) != len(jaxpr.invars):
        raise RuntimeError(f"traced {len(jaxpr.invars)} inputs for {len(decisions)} leaves")
    out_specs = list(params.decisions) + list(opt.decisions)

    def propagate(
        ignore_constraints: bool, free: dict[Any, Dims] | None = None, layouts_only: bool = False
    ) -> tuple[_Ctx, _Propagator]:
        ctx = _Ctx(dict(mesh), plan.batch_axes, book=book)
        names: dict[Any, str] = {}
        env: dict[Any, Val] = {}
        for var, d, role in zip(jaxpr.invars, decisions, prefixes, strict=True):
            env[var] = Val(tuple(var.aval.shape), itemsize(var.aval), _norm(d.spec.dims, len(var.aval.shape)))
            if role != "input":
                names[var] = d.path
        for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
            env[var] = _replicated(jax.ShapeDtypeStruct(np.shape(c), np.result_type(c)))
        prop = _Propagator(ctx, names, ignore_constraints, free)
        prop.layouts_only = layouts_only
        prop.memo = traced.memo
        # The step's outputs keep the plan's layout (the backend's out_shardings).
        for var, d in zip(jaxpr.outvars, out_specs, strict=False):
            if not hasattr(var, "val"):
                prop.hints[var] = _norm(d.spec.dims, len(var.aval.shape))
        prop.aliased = {v for v in jaxpr.outvars[: len(out_specs)] if not hasattr(v, "val")}
        updates = traced.memo.get("updates")
        if updates is None:  # what depends on the trace alone: once per trace
            updates = traced.memo["updates"] = update_paths(jaxpr, [d.path for d in params.decisions])
        prop.updates = updates
        if book.gather_cse is not None:
            shared = traced.memo.get(("gathers", book.gather_cse))
            if shared is None:
                shared = traced.memo[("gathers", book.gather_cse)] = gather_reuse.shares(jaxpr, book.gather_cse)
            prop.shares = shared
        outs = prop.run(jaxpr, env, 1)
        for var, v, d in zip(jaxpr.outvars, outs, out_specs, strict=False):
            target = _norm(d.spec.dims, len(v.shape))
            done = prop.resolve(var, v, target, 1, "out_shardings")
            prop.reshard(var, done, target, 1, "out_shardings")
        if len(outs) > len(out_specs):  # the loss: a scalar, summed over the batch axes
            loss = outs[-1]
            prop.resolve(jaxpr.outvars[-1], loss, (), 1, "loss")
        return ctx, prop

    def settled(ignore_constraints: bool) -> tuple[_Ctx, _Propagator]:
        # Whole values that met split ones (``slices``) need a second pass with them computed
        # split; when the last plan costed on this trace had some, the first pass is run for its
        # layouts only (its collectives and traffic are thrown away). The figures are the same
        # either way: a guess that turns out wrong costs one more pass.
        guess = ("slices", ignore_constraints, compiler)
        lite = bool(traced.memo.get(guess))
        ctx, prop = propagate(ignore_constraints, layouts_only=lite)
        traced.memo[guess] = bool(prop.slices)
        if prop.slices:  # whole values met split ones: propagate again with them computed split
            return propagate(ignore_constraints, prop.slices)
        if lite:
            return propagate(ignore_constraints)
        return ctx, prop

    ctx, prop = settled(False)
    changed: tuple[tuple[str, str, int], ...] = ()
    if prop.constrained and delta:  # what the constraints change: the same step propagated without them
        bare, _ = settled(True)
        changed = _delta(ctx.comm, bare.comm)
    comm = merge_communication(ctx.comm, params, opt)
    # the collectives XLA combines for the kernel count: those that move a param by its own name
    combining = [c for k, c in enumerate(ctx.comm) if c.moves and k not in ctx.labelled]
    # the backward pass's collectives of activations (for the scheduled step: ``timing.step_time``)
    backward: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for k in sorted(ctx.backward_rows):
        c = ctx.comm[k]
        if not c.moves:
            acc = backward.setdefault((c.kind, c.axes), [0, 0])
            acc[0] += c.bytes
            acc[1] += c.count
    notes = [
        "fast mode: shardings propagated through the step's jaxpr as GSPMD does for common patterns"
        + (f", with {book.name}'s own choices (its casts, sums and gathers)" if compiler != "cpu" else "")
        + "; XLA may choose other collectives (compare with --compile)"
    ]
    two_d = [
        d.path
        for d in params.decisions
        if any(a in plan.batch_axes for a in d.spec.axes) and any(a not in plan.batch_axes for a in d.spec.axes)
    ]
    if two_d and not prop.constrained:
        notes.append(
            f"{len(two_d)} param(s) are split over a batch axis and another axis (e.g. {two_d[0]}) and the step "
            "constrains no activation: where such a split meets the batch's, XLA may carry it into the "
            "activations and move them (all-gathers, all-to-alls) in ways fast mode does not predict; pin the "
            "residual stream (an act rule, or axis rules for the model's logical names, as plans/gpt_2d.splan "
            "does) or use --compile for this plan's communication"
        )
    if ctx.lookups:
        notes.append(
            f"lookups in a table split over an axis that also splits their indices ({sorted(set(ctx.lookups))[0]}): "
            "fast mode counts one of XLA's ways (the indices gathered, the lookup where the table's width is split, "
            "an all-to-all onto the batch split), but XLA's gather partitioner picks its way by a dry-run cost of "
            "each, which depends on the mesh and the sizes (measured on a 256x128 table on data=4,model=2: 32 "
            "sequences of 32 tokens looked up this way, 8 or 128 sequences another way; a 32000x8192 table on "
            "data=32,model=8 regathered and the output all-gathered, 1 GiB per device; on data=2,model=4 the table "
            "gathered): use --compile for this lookup's cost"
        )
    notes += acts.notes()
    notes += ctx.kernels
    if ctx.unmodeled:
        notes.append(
            "not modelled (outputs taken as replicated, no communication counted): "
            + ", ".join(f"{k} x{n}" for k, n in sorted(ctx.unmodeled.items()))
        )
    p_bytes, o_bytes, b_bytes = params.bytes_per_device(), opt.bytes_per_device(), inputs.bytes_per_device()
    if book.tile:  # the step's arguments laid out in the compiler's tiles too
        p_bytes, o_bytes, b_bytes = (
            sum(tiled_bytes(d.shard_shape, d.itemsize, book.tile) for d in records(r.decisions))
            for r in (params, opt, inputs)
        )
    # The step's arguments stay alive (updated params and moments alias them); on top, the
    # most its intermediates (activations saved for the backward pass, gradients, gathered
    # weights, temporaries) hold at once in program order, or, where XLA reduces the gradients
    # in one combined collective, what was held then with its results beside the unreduced
    # gradients (measured: data parallel on a 254 KB model, 1 sequence per device: XLA:CPU's
    # temporaries 552 KB, XLA:GPU's 519 KB, program order 280 KB).
    temporaries = max(prop.peak, (ctx.reduced_from or 0) + ctx.reduced)
    memory = Memory(
        params=p_bytes,
        opt_state=o_bytes,
        batch=b_bytes,
        gradients=p_bytes,
        gathered=ctx.gathered_peak,
        temporaries=temporaries,
        peak=p_bytes + o_bytes + b_bytes + temporaries,
    )
    return StepCost(
        "fast",
        "auto",
        dict(mesh),
        ctx.flops,
        memory,
        tuple(comm),
        ctx.transcendentals,
        time.perf_counter() - t0,
        tuple(notes),
        _merge_constrained(prop.constrained),
        tuple(sorted(acts.used)),
        changed,
        hbm_bytes=ctx.hbm,
        # each collective counted once above; XLA launches a combined group's together
        kernels=ctx.launches - sum(c.count for c in combining) + combined_launches(combined(combining)),
        compiler="" if compiler == "cpu" else book.name,
        backward=tuple((kind, axes, n, count) for (kind, axes), (n, count) in backward.items()),
    )


def merge_communication(comm: list[Communication], params: Any, opt: Any) -> tuple[Communication, ...]:
    """The ledger's rows merged (``ledger.merged``), each named with the plan rule that placed
    what it moves (``params``/``opt``: the resolutions that name them)."""
    rules = {d.path: d.origin for d in list(params.decisions) + list(opt.decisions) if d.how in ("rule", "default")}
    return merged(comm, lambda moves: (moves, rules.get(moves, "")))


def _merge_constrained(items: list[Constrained]) -> tuple[Constrained, ...]:
    """One row per (what, source, shape, spec): the forward constraint and its transpose in the
    backward pass, and the same act rule on every layer, are counted together."""
    out: dict[tuple, Constrained] = {}
    for c in items:
        what = c.what.split(" on ")[0] if c.what.startswith("act ") else c.what
        key = (what, c.source, c.shape, c.spec)
        prev = out.get(key)
        out[key] = replace(c, what=what, count=c.count + (prev.count if prev else 0))
    return tuple(out.values())


def _delta(with_: list[Communication], without: list[Communication]) -> tuple[tuple[str, str, int], ...]:
    """Per (kind, axes), the bytes the constraints add (> 0) or remove (< 0)."""
    totals: dict[tuple[str, str], int] = {}
    for sign, comm in ((1, with_), (-1, without)):
        for c in comm:
            key = (c.kind, ",".join(c.axes))
            totals[key] = totals.get(key, 0) + sign * c.bytes
    return tuple((kind, axes, n) for (kind, axes), n in sorted(totals.items()) if n)


@dataclass(frozen=True)
class Ledger:
    """What fast mode's rules predict for one function (``propagate_function``): per device, the
    collective ledger's rows (merged), FLOPs, memory traffic and the intermediates' peak."""

    communication: tuple[Communication, ...]
    flops: float
    hbm_bytes: float
    temporaries: int
    unmodeled: tuple[str, ...]

    def bytes_of(self, kind: str) -> int:
        return sum(c.bytes for c in self.communication if c.kind == kind)


def propagate_function(
    fn: Callable[..., Any],
    avals: tuple[Any, ...],
    in_dims: tuple[Dims, ...],
    mesh: dict[str, int],
    out_dims: tuple[Dims | None, ...] | None = None,
) -> Ledger:
    """Fast mode's rules on ``fn(*avals)`` (abstract inputs split as ``in_dims``: per input, per dim
    the mesh axes), its outputs set to ``out_dims`` (None: where the rules leave them), as
    ``jax.jit(fn, in_shardings=..., out_shardings=...)`` would compile it. For testing a rule
    against XLA one or two ops at a time (tests/test_fast_rules.py)."""
    import jax
    import numpy as np

    closed = jax.make_jaxpr(fn)(*avals)
    jaxpr = closed.jaxpr
    ctx = _Ctx(dict(mesh))
    env = {
        var: Val(tuple(var.aval.shape), itemsize(var.aval), _norm(d, len(var.aval.shape)))
        for var, d in zip(jaxpr.invars, in_dims, strict=True)
    }
    for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = _replicated(jax.ShapeDtypeStruct(np.shape(c), np.result_type(c)))
    prop = _Propagator(ctx, {})
    targets = list(out_dims or (None,) * len(jaxpr.outvars))
    for var, d in zip(jaxpr.outvars, targets, strict=True):
        if d is not None and not hasattr(var, "val"):
            prop.hints[var] = _norm(d, len(var.aval.shape))
    outs = prop.run(jaxpr, env, 1)
    for var, v, d in zip(jaxpr.outvars, outs, targets, strict=True):
        target = _norm(d, len(v.shape)) if d is not None else None
        done = prop.resolve(var, v, target if target is not None else v.dims, 1, "out_shardings")
        if target is not None:
            prop.reshard(var, done, target, 1, "out_shardings")
    return Ledger(merged(ctx.comm), ctx.flops, ctx.hbm, prop.peak, tuple(sorted(ctx.unmodeled)))
