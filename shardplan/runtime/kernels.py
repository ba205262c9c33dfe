"""What a custom kernel (``pallas_call``) costs: its FLOPs and the bytes it moves in memory.

XLA runs a Pallas kernel as one opaque call, so fast mode costs it from the kernel's own
description rather than by XLA's fusion:

- **Memory traffic** follows the kernel's block specs. Each grid step works on one block of each
  operand and output. On TPU (Mosaic) the pipeline copies a block in only when its block index
  differs from the previous step's, and writes an output block back when its index moves on: the
  index maps are evaluated over the whole grid and the changes counted. This is what makes a
  causal flash attention skip the key blocks above the diagonal. Other Pallas backends (Triton,
  Mosaic GPU) run grid steps as parallel programs, each loading its own blocks: every step counts.
  An operand left in HBM for the kernel's own copies (``memory_space=ANY``) counts once, and this
  is said in the notes.
- **FLOPs** are the kernel's ``cost_estimate`` when its author gives one, else the kernel body's
  (matmuls 2*M*N*K, one per element of other arithmetic) times the grid's steps. The body's
  scalar arithmetic on its program ids is evaluated over the grid: a conditional on them (a
  causal kernel's ``pl.when`` skipping blocks above the diagonal) counts each branch as often as
  it runs, and a ``fori_loop`` whose bounds come from them (a causal attention kernel's loop over
  key blocks) runs as often as they say. Otherwise a conditional counts its costlier branch and a
  loop whose trip count is set at run time counts once, which the notes say.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardplan.core.notes import Note
from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS, TRANSCENDENTAL, itemsize

# Index maps are evaluated at every grid step; past this many steps the fetches are bounded
# above (every step copies its blocks) instead.
_MAX_GRID_STEPS = 1 << 22


@dataclass(frozen=True)
class KernelCost:
    """One ``pallas_call``'s cost per run: ``read``/``written`` are bytes in HBM."""

    name: str
    flops: float
    transcendentals: float
    read: int
    written: int
    notes: tuple[Note, ...] = ()


def pallas_cost(eqn: Any) -> KernelCost:
    """The cost of the ``pallas_call`` equation ``eqn`` (see the module docstring)."""
    gm = eqn.params["grid_mapping"]
    name = str(eqn.params.get("name") or _body_name(eqn) or "pallas_call")
    notes: list[Note] = []
    # A grid dim given as a traced value (a numpy integer too) is an operand of the call, leading
    # its operands: its size is known where that operand is a literal.
    bounds = iter(eqn.invars[: int(getattr(gm, "num_dynamic_grid_bounds", 0) or 0)])
    sizes = [size if (size := _static(g)) is not None else _literal(next(bounds, None)) for g in gm.grid]
    if any(g is None for g in sizes):  # a grid dim set at run time: counted as one step
        notes.append(
            Note(
                "kernel-dynamic-grid",
                f"kernel {name}: a grid dimension set at run time is counted as 1 (a lower bound)",
                name,
            )
        )
    grid = tuple(1 if g is None else g for g in sizes)
    steps = math.prod(grid) if grid else 1
    pipelined = _pipelined(eqn.params.get("compiler_params"))
    read = written = 0
    n_in = int(gm.num_inputs)
    for k, bm in enumerate(gm.block_mappings):
        nbytes, manual = _block_bytes(bm)
        if manual:
            notes.append(
                Note(
                    "kernel-manual-copy",
                    f"kernel {name}: an operand it copies itself (memory_space=ANY) is counted as read once",
                    name,
                )
            )
            moved = nbytes
        else:
            fetches = _fetches(bm, grid) if pipelined else None
            if pipelined and fetches is None:
                notes.append(
                    Note(
                        "kernel-index-map",
                        f"kernel {name}: a block index map that cannot be evaluated ahead (one reading prefetched "
                        "scalars, or a grid too large to walk) is counted as a copy at every grid step (an upper "
                        "bound)",
                        name,
                    )
                )
            moved = nbytes * (fetches if fetches is not None else steps)
        if k < n_in:
            read += moved
        else:
            written += moved
    estimate = eqn.params.get("cost_estimate")
    if estimate is not None and getattr(estimate, "flops", None) is not None:
        flops, trans = float(estimate.flops), float(getattr(estimate, "transcendentals", 0) or 0)
    else:
        dynamic: list[str] = []
        body = eqn.params["jaxpr"]
        trips = _loop_trips(getattr(body, "jaxpr", body), grid)
        flops, trans = _body_flops(body, dynamic, trips)
        flops, trans = flops * steps, trans * steps
        if dynamic:
            notes.append(
                Note(
                    "kernel-dynamic-loop",
                    f"kernel {name}: a loop whose trip count is set at run time is counted once per grid step "
                    "(its FLOPs are a lower bound; give the pallas_call a cost_estimate)",
                    name,
                )
            )
    return KernelCost(name, flops, trans, read, written, tuple(dict.fromkeys(notes)))


def _static(g: Any) -> int | None:
    """A grid dim's size, None where it is set at run time (a traced value)."""
    try:
        return operator.index(g)
    except TypeError:
        return None


def _literal(x: Any) -> int | None:
    return int(x.val) if x is not None and hasattr(x, "val") else None


def _body_name(eqn: Any) -> str:
    info = eqn.params.get("name_and_src_info")
    return str(getattr(info, "name", "") or "")


def _pipelined(params: Any) -> bool:
    """Whether the kernel runs under TPU's (Mosaic) pipeline, which skips unchanged blocks: told by
    its compiler params (``pltpu.CompilerParams``; a TPU kernel written without them is costed as
    a GPU one, every step's blocks copied: an upper bound)."""
    items = params.values() if isinstance(params, dict) else [params]
    return any(type(p).__module__.endswith("mosaic.core") for p in items if p is not None)


def _block_bytes(bm: Any) -> tuple[int, bool]:
    """Bytes of one block of ``bm``, and whether the kernel copies that operand itself."""
    aval = bm.array_aval
    each = itemsize(aval)
    space = getattr(bm.transformed_block_aval, "memory_space", None)
    if str(getattr(space, "value", space)).lower() in ("any", "hbm"):
        return math.prod(aval.shape) * each, True
    elems = 1
    for b, size in zip(bm.block_shape, aval.shape, strict=False):
        if isinstance(b, int):
            elems *= b
        elif b is None:
            continue
        else:
            elems *= int(getattr(b, "block_size", 1) or size)
    return elems * each, False


def _fetches(bm: Any, grid: tuple[int, ...]) -> int | None:
    """How many grid steps (in order, the last grid dim fastest) start a new block of ``bm``;
    None where the index map cannot be evaluated ahead (it reads prefetched scalars)."""
    import jax
    import jax.numpy as jnp

    closed = bm.index_map_jaxpr
    steps = math.prod(grid) if grid else 1
    if len(closed.jaxpr.invars) != len(grid) or steps > _MAX_GRID_STEPS:
        return None
    if steps <= 1:
        return steps
    ids = np.indices(grid).reshape(len(grid), -1).astype(np.int32)

    def index(*i: Any) -> Any:
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *i)

    try:
        outs = jax.vmap(index)(*(jnp.asarray(row) for row in ids))
    except Exception:  # an index map that does not run ahead (the caller notes the upper bound)
        return None
    idx = np.stack([np.broadcast_to(np.asarray(o), (steps,)) for o in outs]) if outs else np.zeros((1, steps))
    return 1 + int(np.any(idx[:, 1:] != idx[:, :-1], axis=0).sum())


def _body_flops(
    closed: Any, dynamic: list[str], trips: dict[int, float | tuple[float, ...]] | None = None
) -> tuple[float, float]:
    """FLOPs and transcendental ops of one run of a kernel body (or any jaxpr); ``trips`` (by id):
    the mean trip count over the grid of its ``while`` loops, and how often each branch of its
    conditionals runs, where they were evaluated (``_loop_trips``)."""
    jaxpr = getattr(closed, "jaxpr", closed)
    trips = trips or {}
    flops = trans = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs[i] for i in lc)
        elif name in ELEMENTWISE:
            n = _size(eqn.outvars[0].aval)
            flops += n
            if name in TRANSCENDENTAL:
                trans += n
        elif name in REDUCTIONS:
            flops += _size(eqn.invars[0].aval)
        elif name == "cond":
            costs = [_body_flops(b, dynamic) for b in eqn.params["branches"]]
            weights = trips.get(id(eqn))  # how often each branch runs over the grid, when known
            if isinstance(weights, tuple) and len(weights) == len(costs):
                f = sum(w * c[0] for w, c in zip(weights, costs, strict=True))
                t = sum(w * c[1] for w, c in zip(weights, costs, strict=True))
            else:
                f, t = max(costs) if costs else (0.0, 0.0)
            flops, trans = flops + f, trans + t
        elif name == "scan":
            f, t = _body_flops(eqn.params["jaxpr"], dynamic)
            n = int(eqn.params["length"])
            flops, trans = flops + f * n, trans + t * n
        elif name == "while":
            runs = trips.get(id(eqn))
            if not isinstance(runs, float):  # counted once
                dynamic.append(name)
                runs = 1.0
            f, t = _body_flops(eqn.params["body_jaxpr"], dynamic)
            flops, trans = flops + f * runs, trans + t * runs
        else:
            for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
                sub = eqn.params.get(key)
                if sub is not None and hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    f, t = _body_flops(sub, dynamic)
                    flops, trans = flops + f, trans + t
                    break
    return flops, trans


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _loop_trips(jaxpr: Any, grid: tuple[int, ...]) -> dict[int, float | tuple[float, ...]]:
    """Over the grid, the mean trip count of each counted ``while`` loop of a kernel body (a
    ``fori_loop`` whose bounds the body computes from its program ids, as a causal attention
    kernel's key loop) and the share of steps each branch of a conditional runs (``pl.when`` on
    the program ids: a causal kernel skipping the blocks above the diagonal): the body's scalar
    arithmetic evaluated at every grid step."""
    steps = math.prod(grid) if grid else 1
    if steps > _MAX_GRID_STEPS or not any(e.primitive.name in ("while", "cond") for e in jaxpr.eqns):
        return {}
    ids = np.indices(grid).reshape(len(grid), -1) if grid else np.zeros((0, 1), np.int64)
    vals: dict[Any, Any] = {}

    def value(x: Any) -> Any:
        return np.asarray(x.val) if hasattr(x, "val") else vals.get(x)

    out: dict[int, float | tuple[float, ...]] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "cond":
            index = value(eqn.invars[0])
            if index is not None:
                taken = np.broadcast_to(np.asarray(index, np.int64), (steps,))
                out[id(eqn)] = tuple(float(np.mean(taken == b)) for b in range(len(eqn.params["branches"])))
            continue
        if name == "while":
            n = _trips(eqn, value)
            if n is not None:
                out[id(eqn)] = float(np.mean(np.broadcast_to(n, (steps,))))
            continue
        if len(eqn.outvars) != 1 or getattr(eqn.outvars[0].aval, "shape", None) != ():
            continue
        if name == "program_id":
            vals[eqn.outvars[0]] = ids[int(eqn.params["axis"])]
        elif name == "num_programs":
            vals[eqn.outvars[0]] = np.int64(grid[int(eqn.params["axis"])])
        elif name in _SCALAR_OPS:
            args = [value(x) for x in eqn.invars]
            if all(a is not None for a in args):
                vals[eqn.outvars[0]] = _SCALAR_OPS[name](*args)
    return out


def _trips(eqn: Any, value: Any) -> Any:
    """A ``while`` loop's trip count (per grid step) when it counts ``i`` up by one while ``i < n``
    from values known ahead; else None."""
    cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
    nc, nb = int(eqn.params["cond_nconsts"]), int(eqn.params["body_nconsts"])
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "gt"):
        return None
    a, b = cond.eqns[0].invars
    if cond.eqns[0].primitive.name == "gt":
        a, b = b, a
    carry, init = cond.invars[nc:], eqn.invars[nc + nb :]
    if a not in carry:
        return None
    i = carry.index(a)
    # The counter steps by one in the body.
    step = next((e for e in body.eqns if e.outvars and e.outvars[0] is body.outvars[i]), None)
    if step is None or step.primitive.name != "add" or body.invars[nb + i] not in step.invars:
        return None
    other = [x for x in step.invars if x is not body.invars[nb + i]]
    if len(other) != 1 or not hasattr(other[0], "val") or int(other[0].val) != 1:
        return None
    if b in carry:
        j = carry.index(b)
        if body.outvars[j] is not body.invars[nb + j]:  # the bound must not change
            return None
        hi = value(init[j])
    elif hasattr(b, "val"):
        hi = np.asarray(b.val)
    elif b in cond.invars[:nc]:
        hi = value(eqn.invars[cond.invars.index(b)])
    else:
        return None
    lo = value(init[i])
    if hi is None or lo is None:
        return None
    return np.maximum(0, np.asarray(hi, np.int64) - np.asarray(lo, np.int64))


def _div(a: Any, b: Any) -> Any:
    """``lax.div``: integer division rounding toward zero (C's), true division for floats."""
    if np.issubdtype(np.asarray(a).dtype, np.integer) and np.issubdtype(np.asarray(b).dtype, np.integer):
        q = np.abs(a) // np.maximum(np.abs(b), 1)
        return np.where((np.asarray(a) < 0) ^ (np.asarray(b) < 0), -q, q)
    return np.asarray(a) / b


# Scalar arithmetic a kernel body does on its program ids (numpy, vectorized over the grid).
_SCALAR_OPS: dict[str, Any] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": _div,
    "rem": np.fmod,
    "max": np.maximum,
    "min": np.minimum,
    "and": np.logical_and,
    "or": np.logical_or,
    "not": np.logical_not,
    "neg": lambda a: -a,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "convert_element_type": lambda a: a,
    "select_n": lambda p, *cases: np.choose(np.asarray(p, int), cases),
}


# cuDNN's fused (flash) attention, as ``jax.nn.dot_product_attention(implementation="cudnn")``
# traces it: forward (q, k, v, bias and mask operands -> output, softmax statistics) and backward.
FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": "fwd", "dot_product_attention_bwd_wrapper": "bwd"}
# Matmuls per (query, key) pair and head dim: forward q.k and p.v; backward q.k again (the
# scores are recomputed, not stored), dO.v, p.dO, dS.k and dS.q.
_ATTENTION_MATMULS = {"fwd": 2, "bwd": 5}


def fused_attention_cost(eqn: Any) -> KernelCost:
    """One cuDNN flash-attention kernel: its matmuls (2*M*N*K each; under a causal mask only the
    (query, key) pairs at or below the diagonal, the tiles cuDNN skips above it not counted), one
    exp per score, each operand read and each result written once (the kernel keeps the scores
    on chip; keys and values reread per query tile are taken to hit the chip's caches)."""
    pass_ = FUSED_ATTENTION[eqn.primitive.name]
    q, k = eqn.invars[0].aval, eqn.invars[1].aval
    bnth = str(eqn.params.get("layout", "0")) in ("1", "Layout.BNTH", "BNTH")
    b, t, n, h = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if bnth else q.shape
    s = k.shape[2] if bnth else k.shape[1]
    pairs = float(t) * s
    mask = str(eqn.params.get("mask_type", ""))
    if "CAUSAL" in mask:  # query i sees keys 0..i (queries and keys end-aligned)
        first = max(s - t + 1, 1)  # keys seen by the first query that sees any, then one more each
        pairs = float(s * (s + 1) - (first - 1) * first) / 2
    flops = 2.0 * _ATTENTION_MATMULS[pass_] * b * n * pairs * h
    exps = float(b) * n * pairs
    read = sum(_size(x.aval) * itemsize(x.aval) for x in eqn.invars)
    written = sum(_size(x.aval) * itemsize(x.aval) for x in eqn.outvars)
    # Five elementwise ops per score in either pass (scale, max, subtract, exp, sum; backward: the
    # recomputed scale, subtract and exp, then dS = P * (dP - D)).
    return KernelCost(f"cudnn attention {pass_}", flops + 5 * exps, exps, read, written)


# The cuDNN version and GPU a step is traced for where no GPU is present (cuDNN 9.10: flash
# attention; compute capability 9.0: an H100 or H200).
TRACED_CUDNN = 91000
TRACED_CAPABILITY = (9, 0)


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@contextlib.contextmanager
def cudnn_traceable() -> Iterator[None]:
    """Tracing, ``jax.nn.dot_product_attention(implementation="cudnn")`` traces as on a GPU with
    cuDNN (jax looks for the library while tracing and fails without one): fast mode costs the
    step for an accelerator, whatever machine it runs on. Nothing changes where cuDNN is present.

    Why a patch: jax has no switch for it, and its check (``check_cudnn_version`` in a private
    module) is the only thing that needs the library to trace. The patch is process-wide for the
    length of one trace (fast mode traces on one thread) and undone after it; where jax moves the
    check, the user's own trace error stands."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:  # another jax layout: the user's own error stands
        yield
        return
    original = getattr(fa, "check_cudnn_version", None)
    try:
        present = original is not None and original() > 0
    except Exception:  # no cuDNN here
        present = False
    if present or original is None:
        yield
        return
    patched = {
        "check_cudnn_version": lambda: TRACED_CUDNN,
        "check_compute_capability": lambda c: _capability(c) <= TRACED_CAPABILITY,
        "is_cuda_compute_capability_equal": lambda c: _capability(c) == TRACED_CAPABILITY,
    }
    saved = {k: getattr(fa, k) for k in patched if hasattr(fa, k)}
    for k in saved:
        setattr(fa, k, patched[k])
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(fa, k, v)
