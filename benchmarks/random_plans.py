"""Fast mode against exact mode on plans nobody wrote (shardplan issue 29).

    python -m benchmarks.random_plans [--pairs N] [--seed S] [--json OUT] [--target T] [--layouts]
                                      [--xla-propagation] [--pod]

Draws N (plan, model) pairs: a model from a pool (tests/fixtures/engine_models.py: a Llama-style
decoder, a GShard-style top-2 MoE, a decoder that builds its KV cache in the step, a GPT-2-style
decoder with a fused q/k/v projection and a tied head, a GPT-J-style decoder with parallel
attention and MLP and fused projections; the example models gpt_tiny, llama_tiny,
llama_tiny_scan) and a plan drawn from the model's shapes alone: a mesh of 2 or 3 axes over 8
devices in a random order, per param family (leaves grouped by shape,
dims named by what they equal: d_model, a stacked leading dim, or their size) replicated or split
on one or two dims over one or two axes, the batch over one or two axes or batch x sequence, and
sometimes `act` constraints on module outputs. Each pair is costed both ways (auto backend,
tokens/labels int32[8,16]) and the errors are reported as a distribution over pairs: per
collective kind |fast - exact| / (the step's total collective bytes in exact mode), peak memory
and FLOPs relative to exact mode. ``--target tpu-v5e:2x4`` (or ``h100:8``) measures fast mode told
that target against the program its compiler makes offline (the pool's models have dims under 128,
which XLA:TPU pads to its tiles: read the peak column with that in mind).

A pair among the worst ten for FLOPs lists the model lines whose matmuls' FLOPs per device the two
modes count most differently (``StepCost.matmul_flops``: fast mode's rules against the compiled
program's dots, by source line).

``--layouts`` also reads XLA's module after its sharding propagation (dumped by the compile) and
lists, per pair, the largest values (source line, op, shape) that XLA lays out otherwise than
fast mode: where XLA went another way (XLA:CPU only).

``--xla-propagation`` also costs each pair in fast mode on XLA's own layouts (``check
--propagation xla``: Shardy's propagation run offline, fast mode's rules for what moves) and
prints that distribution beside fast mode's own, measured against the same compile.

``--pod`` draws at pod scale instead: Llama-2-70B shapes with scanned layers
(examples/models.py:llama2_70b_scan) on every chip of a TPU slice or GPU cluster (``--target``,
default ``tpu-v5p:4x4x4``: 64 chips), one 1,024-token sequence per chip, meshes of 2 or 3 axes over
that many devices; exact mode is that target's compiler (minutes a pair). Most random plans of a
70B model do not fit a chip (every param family whole on some axis; at pod scale none is drawn
whole by choice, and none is plain data parallel): a draw whose fast-mode peak
is over twice the chip's memory is drawn again (listed with the redraws, code
``fast-peak-over-2x-memory``, so a fast mode that over-predicts by up to 2x still meets the
compiler); one the compiler refuses for memory is recorded with fast mode's peak beside it.

The generator is pure and seeded: pair i of seed S is ``draw_pair(S, i)`` whatever N is.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "fixtures" / "engine_models.py"
EXAMPLES = ROOT / "examples" / "models.py"
TRAIN = ROOT / "examples" / "train.py"

# name -> (model FILE.py:FACTORY, loss FILE.py:FN)
POOL: dict[str, tuple[str, str]] = {
    "decoder": (f"{ENGINE}:decoder", f"{ENGINE}:decoder_loss"),
    "moe": (f"{ENGINE}:moe", f"{ENGINE}:moe_loss"),
    "kv_decoder": (f"{ENGINE}:kv_decoder", f"{ENGINE}:kv_decoder_loss"),
    "gpt_tiny": (f"{EXAMPLES}:gpt_tiny", f"{TRAIN}:lm_loss"),
    "llama_tiny": (f"{EXAMPLES}:llama_tiny", f"{TRAIN}:lm_loss"),
    "llama_tiny_scan": (f"{EXAMPLES}:llama_tiny_scan", f"{TRAIN}:lm_loss"),
    "gpt2": (f"{ENGINE}:gpt2", f"{ENGINE}:gpt2_loss"),
    "parallel": (f"{ENGINE}:parallel", f"{ENGINE}:parallel_loss"),
}
# The pool before the GPT-2- and GPT-J-style decoders joined it (2026-12-06): the pairs tests and
# docs name by seed and index up to then were drawn from these.
FIRST_POOL = ("decoder", "gpt_tiny", "kv_decoder", "llama_tiny", "llama_tiny_scan", "moe")
BATCH = (8, 16)
BATCH_ARG = [f"tokens=int32[{BATCH[0]},{BATCH[1]}],labels=int32[{BATCH[0]},{BATCH[1]}]"]
DEVICES = 8
AXIS_NAMES = ("data", "model", "expert", "seq")
# Axis sizes over 8 devices, in mesh order.
MESH_SIZES = ((2, 4), (4, 2), (2, 2, 2))
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
TARGETS = {"comm": 0.10, "peak": 0.15, "flops": 0.02}  # on the p90 over pairs
POD_POOL: dict[str, tuple[str, str]] = {"llama2_70b_scan": (f"{EXAMPLES}:llama2_70b_scan", f"{TRAIN}:lm_loss")}
POD_TARGET = "tpu-v5p:4x4x4"
POD_SEQ = 1024


@dataclass(frozen=True)
class Scale:
    """Where pairs are drawn: the model pool, the devices, the batch (sequences, tokens each) and the
    meshes' axis sizes (in mesh order)."""

    pool: dict[str, tuple[str, str]]
    devices: int
    batch: tuple[int, int]
    meshes: tuple[tuple[int, ...], ...]
    memory: float = 0.0  # the chip's memory in bytes (a draw fast mode puts over twice it is redrawn)

    @property
    def batch_arg(self) -> list[str]:
        n, t = self.batch
        return [f"tokens=int32[{n},{t}],labels=int32[{n},{t}]"]


def mesh_sizes(devices: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered way of writing ``devices`` as 2 or 3 axis sizes of at least 2 each."""
    two = [(a, devices // a) for a in range(2, devices // 2 + 1) if devices % a == 0]
    three = [(a, b, c // b) for a, c in two for b in range(2, c // 2 + 1) if c % b == 0]
    return tuple(two + three)


def pod_scale(devices: int, memory: float = 0.0) -> Scale:
    """``--pod``: the 70B shapes on ``devices`` chips of ``memory`` bytes, one sequence each."""
    return Scale(POD_POOL, devices, (devices, POD_SEQ), mesh_sizes(devices), memory)


EXACT_TIMEOUT_S = 300.0
DATA_PARALLEL = 0.15  # the share of plans that keep every param whole (plain data parallel)

Leaves = Sequence[tuple[str, tuple[int, ...]]]


# -- the generator (pure) -----------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """Param leaves that share a shape signature: ``dims`` names each dim ('d' for d_model, 'L'
    for the leading dim of a stacked (rank >= 3) leaf, else its size)."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    paths: tuple[str, ...]


def d_model_of(leaves: Leaves) -> int:
    """The model width from shapes alone: the commonest size of rank-1 leaves (norm scales), or of
    the trailing dim of stacked norm scales, else the commonest dim of any leaf."""
    sizes = Counter(s[-1] for _, s in leaves if len(s) == 1 or (len(s) == 2 and s[0] <= 16 and s[0] < s[1]))
    if not sizes:
        sizes = Counter(d for _, s in leaves for d in s)
    return sizes.most_common(1)[0][0]


def families(leaves: Leaves) -> tuple[Family, ...]:
    d = d_model_of(leaves)
    groups: dict[tuple[tuple[str, ...], tuple[int, ...]], list[str]] = {}
    for path, shape in leaves:
        dims = tuple("L" if i == 0 and len(shape) >= 3 else "d" if n == d else str(n) for i, n in enumerate(shape))
        groups.setdefault((dims, tuple(shape)), []).append(path)
    return tuple(Family(dims, shape, tuple(sorted(p))) for (dims, shape), p in sorted(groups.items()))


def regex_for(paths: Sequence[str], all_paths: Sequence[str]) -> str:
    """A full-match regex for exactly ``paths``: numbered components generalized to ``\\d+``
    where that still matches nothing else, else the paths spelt out."""
    general = sorted({"/".join(r"\d+" if c.isdigit() else re.escape(c) for c in p.split("/")) for p in paths})
    rx = general[0] if len(general) == 1 else "(?:" + "|".join(general) + ")"
    want = set(paths)
    if {p for p in all_paths if re.fullmatch(rx, p)} == want:
        return rx
    exact = sorted(re.escape(p) for p in paths)
    return exact[0] if len(exact) == 1 else "(?:" + "|".join(exact) + ")"


def _axes_text(axes: Sequence[str]) -> str:
    return axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def spec_text(dims: Sequence[Sequence[str]]) -> str:
    """Per dim, its mesh axes -> plan spec text: ``(data, _)``, ``((data, model), _)``, ``replicated``."""
    if not any(dims):
        return "replicated"
    return "(" + ", ".join(_axes_text(a) if a else "_" for a in dims) + ")"


def _divides(shape: Sequence[int], dims: Sequence[Sequence[str]], sizes: dict[str, int]) -> bool:
    for n, axes in zip(shape, dims):
        k = 1
        for a in axes:
            k *= sizes[a]
        if n % k:
            return False
    return True


def draw_param_spec(rng: random.Random, fam: Family, sizes: dict[str, int], split: bool = False) -> list[list[str]]:
    """Replicated, one dim split over one or two axes, or two dims split (different axes);
    redrawn while a dim is indivisible (replicated after 20 tries). ``split``: never replicated
    by choice (at pod scale, where a whole 70B weight family fits no chip)."""
    axes = list(sizes)
    rank = len(fam.shape)
    for _ in range(20):
        dims: list[list[str]] = [[] for _ in range(rank)]
        r = rng.random()
        # A stacked leading dim (layers or experts) is split less often than the others.
        free = [i for i in range(rank) if fam.dims[i] != "L" or rng.random() < 0.3]
        if (r < 0.25 and not split) or not free:
            return dims
        if r < 0.55 or rank == 1 or len(free) == 1:
            dims[rng.choice(free)] = rng.sample(axes, 2 if r < 0.4 and len(axes) >= 2 else 1)
        else:
            i, j = rng.sample(free, 2)
            pick = rng.sample(axes, 3 if len(axes) == 3 and r > 0.9 else 2)
            dims[i], dims[j] = pick[:1], pick[1:]
        if _divides(fam.shape, dims, sizes):
            return dims
    return [[] for _ in range(rank)]


def draw_batch(rng: random.Random, sizes: dict[str, int], batch: tuple[int, int] = BATCH) -> list[list[str]]:
    """Batch over one axis, two or three axes, or batch x sequence; always divisible for ``batch``."""
    axes = list(sizes)
    for _ in range(20):
        r = rng.random()
        if r < 0.4:
            dims = [rng.sample(axes, 1), []]
        elif r < 0.7:
            dims = [rng.sample(axes, 2), []]
        elif r < 0.8 and len(axes) == 3:
            dims = [rng.sample(axes, 3), []]
        else:
            a, b = rng.sample(axes, 2)
            dims = [[a], [b]]
        if _divides(batch, dims, sizes):
            return dims
    return [[axes[0]], []]


def module_paths(leaves: Leaves) -> tuple[str, ...]:
    """Module paths from param paths (the parents of the leaves, at one and two levels up)."""
    out = set()
    for path, _ in leaves:
        parts = path.split("/")
        for k in (1, 2):
            if len(parts) > k:
                out.add("/".join(parts[:-k]))
    return tuple(sorted(out))


def draw_acts(rng: random.Random, leaves: Leaves, sizes: dict[str, int]) -> list[tuple[str, str]]:
    """Zero (most plans), one or two `act` rules: a module family and a batch-dim, batch+last or
    last-dim layout written with `...` so any rank fits."""
    if rng.random() >= 0.35:
        return []
    mods = module_paths(leaves)
    general = sorted({re.sub(r"(^|/)\d+(?=/|$)", r"\1\\d+", m) for m in mods})
    out = []
    for _ in range(rng.choice((1, 2))):
        rx = rng.choice(general)
        a, b = rng.sample(list(sizes), 2)
        spec = rng.choice([f"({a}, ...)", f"({a}, ..., {b})", f"(..., {b})", f"({a}, {b}, ...)"])
        out.append((rx, spec))
    return out


def draw_plan(rng: random.Random, leaves: Leaves, name: str = "random", scale: Scale | None = None) -> str:
    """A plan's text for a model with these param leaves ((path, shape) pairs); ``scale``: its
    meshes and batch (default: 8 devices, ``MESH_SIZES``, ``BATCH``)."""
    sizes_t = rng.choice(MESH_SIZES if scale is None else scale.meshes)
    names = rng.sample(AXIS_NAMES, len(sizes_t))
    sizes = dict(zip(names, sizes_t))
    lines = [f'plan "{name}"', "mesh " + ", ".join(f"{a} = {n}" for a, n in sizes.items())]
    lines.append("batch " + spec_text(draw_batch(rng, sizes, BATCH if scale is None else scale.batch)))
    lines += [f'act "{rx}" {spec}' for rx, spec in draw_acts(rng, leaves, sizes)]
    all_paths = [p for p, _ in leaves]
    data_parallel = rng.random() < DATA_PARALLEL and scale is None  # (no 70B fits a chip whole)
    for fam in () if data_parallel else families(leaves):
        spec = spec_text(draw_param_spec(rng, fam, sizes, split=scale is not None))
        if spec != "replicated":
            lines.append(f'param "{regex_for(fam.paths, all_paths)}" {spec}  # {fam.dims}')
    lines.append("default replicated")
    return "\n".join(lines) + "\n"


def pair_rng(seed: int, index: int, attempt: int = 0) -> random.Random:
    return random.Random(f"{seed}/{index}/{attempt}")


def draw_pair(
    seed: int, index: int, leaves_of, attempt: int = 0, models: Sequence[str] | None = None, scale: Scale | None = None
) -> tuple[str, str]:
    """(model name, plan text) of pair ``index``; ``leaves_of(name)`` gives a model's param leaves.
    ``models``: the pool's names to draw from (default: all of them; ``FIRST_POOL`` redraws the
    pairs measured before the pool grew); ``scale``: a pod's (default: 8 devices, ``POOL``)."""
    rng = pair_rng(seed, index, attempt)
    pool = POOL if scale is None else scale.pool
    model = rng.choice(sorted(pool) if models is None else sorted(models))
    return model, draw_plan(rng, leaves_of(model), f"random-{seed}-{index}-{attempt}", scale)


# -- measuring ----------------------------------------------------------------------------------
_LEAVES: dict[str, list[tuple[str, tuple[int, ...]]]] = {}


def leaves_of(name: str) -> list[tuple[str, tuple[int, ...]]]:
    if name not in _LEAVES:
        import shardplan

        params, _ = shardplan.api.model_leaves(model={**POOL, **POD_POOL}[name][0], cache=False)
        _LEAVES[name] = [(leaf.path, tuple(leaf.shape)) for leaf in params]
    return _LEAVES[name]


def _by_source(cost) -> dict[tuple[str, str], tuple[int, str]]:
    """(kind, source) -> (bytes, the op of its largest entry)."""
    out: dict[tuple[str, str], list] = {}
    for c in cost.communication:
        row = out.setdefault((c.kind, c.source or "(no source)"), [0, "", 0])
        row[0] += c.bytes
        if c.bytes > row[2]:
            row[1], row[2] = c.op, c.bytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def differences(fast, exact, top: int = 3) -> list[dict]:
    """The collectives (by kind and model source line) where the two modes differ most."""
    f, e = _by_source(fast), _by_source(exact)
    rows = []
    for key in set(f) | set(e):
        fb, fo = f.get(key, (0, ""))
        eb, eo = e.get(key, (0, ""))
        if fb != eb:
            rows.append(
                {"kind": key[0], "source": key[1], "fast": fb, "exact": eb, "fast_op": fo[:120], "exact_op": eo[:120]}
            )
    rows.sort(key=lambda r: -abs(r["fast"] - r["exact"]))
    return rows[:top]


def flop_differences(fast, exact, top: int = 3) -> list[dict]:
    """The model source lines whose matmul FLOPs per device the two modes count most differently
    (``StepCost.matmul_flops``: fast mode's rules; the compiled program's dots and convolutions)."""
    f, e = dict(fast.matmul_flops), dict(exact.matmul_flops)
    rows = [{"source": k, "fast": f.get(k, 0.0), "exact": e.get(k, 0.0)} for k in set(f) | set(e)]
    rows = [r for r in rows if abs(r["fast"] - r["exact"]) > 0.01 * max(r["fast"], r["exact"])]
    rows.sort(key=lambda r: (-abs(r["fast"] - r["exact"]), r["source"]))
    return rows[:top]


# Values fast mode reads at each reader's layout (a broadcast is sliced for free where it is read),
# which XLA gives one layout of their own: no layout of fast mode's to set beside XLA's.
VIEWED = frozenset({"broadcast_in_dim", "iota"})
LAYOUT_DUMP: list[Path] = []  # where the compiles dump XLA's propagated module (``--layouts``)
XLA_PROPAGATION: list[bool] = []  # non-empty: also cost each pair on XLA's propagation (``--xla-propagation``)


def divergences(fast: Sequence[tuple], xla: Sequence, top: int = 3) -> list[dict]:
    """The largest values (the first in XLA's program order among equals) that XLA lays out
    otherwise than fast mode: per (source line, op, shape), the layouts each gives such values
    (fast mode's without a pending sum: ``fast.costing.chosen``; XLA's:
    ``core.hlo.shardings.layouts``)."""
    mine: dict[tuple, set] = {}
    for src, op, shape, dims in fast:
        mine.setdefault((Path(src.rsplit(":", 1)[0]).name + ":" + src.rsplit(":", 1)[-1], op, tuple(shape)), set()).add(
            tuple(tuple(d) for d in dims)
        )
    theirs: dict[tuple, set] = {}
    order: list[tuple] = []
    for c in xla:
        if not c.source or not c.shape or c.dims is None or c.op in VIEWED:
            continue
        key = (Path(c.source.rsplit(":", 1)[0]).name + ":" + c.source.rsplit(":", 1)[-1], c.op, c.shape)
        if key not in theirs:
            order.append(key)
        theirs.setdefault(key, set()).add(c.dims)
    out = []
    # the largest values first (a mask's or a norm's broadcast laid out otherwise moves little)
    for key in sorted(order, key=lambda k: -math.prod(k[2])):
        if key in mine and theirs[key] != mine[key]:
            out.append(
                {
                    "source": key[0],
                    "op": key[1],
                    "shape": list(key[2]),
                    "xla": _shown(theirs[key]),
                    "fast": _shown(mine[key]),
                }
            )
            if len(out) == top:
                break
    return out


def _shown(layouts: set) -> list[str]:
    """Layouts as a plan writes them: ``(data, _, (model, seq))``."""
    from shardplan.tools.report import layout_text

    return sorted(layout_text(x) for x in layouts)


def _layouts(plan, model: str) -> list[dict]:
    """Where XLA's propagated layouts and fast mode's part (:func:`divergences`), from the module
    the last compile dumped into ``LAYOUT_DUMP``."""
    import shardplan
    from shardplan.core.hlo.shardings import layouts
    from shardplan.runtime.fast.costing import chosen

    dumped = sorted(
        LAYOUT_DUMP[0].glob("*after_shardy-xla.before_spmd-partitioning.txt"), key=lambda f: f.stat().st_mtime
    )
    if not dumped:
        return []
    text = dumped[-1].read_text()
    for f in dumped:  # one compile's module at a time
        f.unlink()
    ref, step = POOL[model]
    sizes = plan.mesh_shape(DEVICES)
    coster = shardplan.api.step_coster(model=ref, step=step, batch=BATCH_ARG)
    mesh = [(a, int(n)) for a, n in sizes.items()]
    return divergences(chosen(coster.tracer, plan, dict(sizes)), layouts(text, mesh))


class _TooBig(Exception):
    """A pod-scale draw fast mode puts at over twice the chip's memory (drawn again)."""


def measure(model: str, text: str, target: str = "cpu", scale: Scale | None = None) -> dict:
    """Fast and exact mode on one pair, for ``target``'s compiler (fast mode told the target).
    Raises ShardPlanError from fast mode (an invalid draw); an exact-mode failure is recorded in
    the row (with fast mode's peak: a compiler's refusal for memory is fast mode's to foresee)."""
    import shardplan
    from shardplan.errors import ShardPlanError

    plan = shardplan.loads(text, "random.splan")
    ref, step = (POOL if scale is None else scale.pool)[model]
    batch, devices = (BATCH_ARG, DEVICES) if scale is None else (scale.batch_arg, scale.devices)
    kw = dict(model=ref, step=step, batch=batch, devices=devices, target=target)
    fast = shardplan.api.analyze(plan, mode="fast", **kw)
    if scale is not None and scale.memory and fast.memory.peak > 2 * scale.memory:
        raise _TooBig(fast.memory.peak)
    on_xla = shardplan.api.analyze(plan, mode="fast", propagation="xla", **kw) if XLA_PROPAGATION else None
    row: dict = {"model": model, "plan": text, "fast_s": fast.seconds, "peak_fast": fast.memory.peak}
    timeout = EXACT_TIMEOUT_S if scale is None else 4 * EXACT_TIMEOUT_S
    try:
        exact = shardplan.api.analyze(plan, mode="exact", timeout_s=timeout, **kw)
    except ShardPlanError as err:
        row["exact_error"] = str(err)[-600:]
        return row
    fk, ek = fast.bytes_by_kind(), exact.bytes_by_kind()
    total = sum(ek.values())
    denom = total or sum(fk.values()) or 1
    row.update(
        exact_s=exact.seconds,
        comm={
            k: {"fast": fk.get(k, 0), "exact": ek.get(k, 0), "error": abs(fk.get(k, 0) - ek.get(k, 0)) / denom}
            for k in KINDS
        },
        total_exact=total,
        peak_fast=fast.memory.peak,
        peak_exact=exact.memory.peak,
        peak_error=abs(fast.memory.peak - exact.memory.peak) / max(exact.memory.peak, 1),
        flops_fast=fast.flops,
        flops_exact=exact.flops,
        flops_error=abs(fast.flops - exact.flops) / max(exact.flops, 1.0),
        state_fast=fast.memory.params + fast.memory.opt_state,
        state_exact=exact.memory.params + exact.memory.opt_state,
        differences=differences(fast, exact),
        flop_differences=flop_differences(fast, exact),
        # exact mode's collectives by (kind, model line): enough to re-cost fast mode alone later
        exact_by_source=[[k, s, b, o[:120]] for (k, s), (b, o) in sorted(_by_source(exact).items())],
    )
    if on_xla is not None:  # the same errors for fast mode on XLA's propagation
        xk = on_xla.bytes_by_kind()
        row["xla"] = {
            "fast_s": on_xla.seconds,
            "comm": {
                k: {"fast": xk.get(k, 0), "exact": ek.get(k, 0), "error": abs(xk.get(k, 0) - ek.get(k, 0)) / denom}
                for k in KINDS
            },
            "peak_fast": on_xla.memory.peak,
            "peak_error": abs(on_xla.memory.peak - exact.memory.peak) / max(exact.memory.peak, 1),
            "flops_fast": on_xla.flops,
            "flops_error": abs(on_xla.flops - exact.flops) / max(exact.flops, 1.0),
        }
    if LAYOUT_DUMP and target == "cpu":
        row["layouts"] = _layouts(plan, model)
    return row


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default)."""
    s = sorted(xs)
    if not s:
        return 0.0
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(rows: Sequence[dict]) -> dict:
    ok = [r for r in rows if "comm" in r]
    series = {f"comm/{k}": [r["comm"][k]["error"] for r in ok] for k in KINDS}
    series["peak"] = [r["peak_error"] for r in ok]
    series["flops"] = [r["flops_error"] for r in ok]
    return {
        name: {"median": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "worst": max(xs, default=0.0), "pairs": len(xs)}
        for name, xs in series.items()
    }


def _target(name: str) -> float:
    return TARGETS["comm"] if name.startswith("comm/") else TARGETS[name]


def worst(rows: Sequence[dict], n: int = 10, comm_only: bool = False) -> list[dict]:
    """The n pairs with the largest error against its target, with the kind it is in
    (``comm_only``: among the collective kinds only)."""
    scored = []
    for r in rows:
        if "comm" not in r:
            continue
        errs = {f"comm/{k}": c["error"] for k, c in r["comm"].items()}
        if not comm_only:
            errs.update(peak=r["peak_error"], flops=r["flops_error"])
        name = max(errs, key=lambda k: errs[k] / _target(k))
        scored.append((errs[name] / _target(name), name, r))
    scored.sort(key=lambda x: -x[0])
    out = []
    for score, name, r in scored[:n]:
        if name.startswith("comm/"):
            c = r["comm"][name[5:]]
            figures = {"fast": c["fast"], "exact": c["exact"], "total_exact": r["total_exact"]}
        else:
            figures = {"fast": r[f"{name}_fast"], "exact": r[f"{name}_exact"]}
        out.append(
            {
                "index": r["index"],
                "model": r["model"],
                "kind": name,
                "error": errs_of(r, name),
                "over_target": score,
                "figures": figures,
                "key_lines": key_lines(r["plan"]),
                "differences": r["differences"],
                "flop_differences": r.get("flop_differences", []) if name == "flops" else [],
                "layouts": r.get("layouts", []),
            }
        )
    return out


def errs_of(row: dict, name: str) -> float:
    return row["comm"][name[5:]]["error"] if name.startswith("comm/") else row[f"{name}_error"]


def key_lines(text: str) -> list[str]:
    """The plan's lines that decide anything (mesh, batch, act, param), comments dropped."""
    keep = ("mesh ", "batch ", "act ", "param ")
    return [line.split("  #")[0] for line in text.splitlines() if line.startswith(keep)]


def measure_pair(
    seed: int, index: int, target: str = "cpu", scale: Scale | None = None
) -> tuple[dict | None, list[dict], dict | None]:
    """(row, redraws, crash) of pair ``index``: a draw that fast mode rejects (ShardPlanError: a
    plan invalid for the model) is drawn again (up to 10 times) and listed in ``redraws``; a fast
    mode that raises anything else is the ``crash`` (no row)."""
    from shardplan.errors import ShardPlanError

    redraws: list[dict] = []
    for attempt in range(10):
        model, text = draw_pair(seed, index, leaves_of, attempt, scale=scale)
        try:
            row = measure(model, text, target, scale)
        except _TooBig as err:
            peak = err.args[0]
            redraws.append(
                {
                    "index": index,
                    "attempt": attempt,
                    "model": model,
                    "codes": ["fast-peak-over-2x-memory"],
                    "error": f"fast mode's peak {peak / 2**30:.1f} GiB",
                }
            )
            continue
        except ShardPlanError as err:
            codes = sorted({d.code for d in err.errors})
            redraws.append(
                {"index": index, "attempt": attempt, "model": model, "codes": codes, "error": str(err)[:400]}
            )
            continue
        except Exception as err:  # an engine crash in fast mode: listed, never hidden
            return (
                None,
                redraws,
                {"index": index, "model": model, "plan": text, "error": f"{type(err).__name__}: {err}"[:600]},
            )
        row.update(index=index, attempt=attempt)
        return row, redraws, None
    return None, redraws, None


def run_pairs(
    pairs: int, seed: int = 0, out: str | None = None, log=None, target: str = "cpu", scale: Scale | None = None
) -> dict:
    """Draw and measure ``pairs`` pairs (:func:`measure_pair`) for ``target``'s compiler, at
    ``scale`` (default: 8 devices); written to ``out`` after every pair."""
    rows: list[dict] = []
    redraws: list[dict] = []
    crashes: list[dict] = []
    t0 = time.perf_counter()
    commit = _commit()  # at the start: fast mode is imported once, by the first pair
    res: dict = {}
    for i in range(pairs):
        row, again, crash = measure_pair(seed, i, target, scale)
        redraws += again
        rows += [row] if row else []
        crashes += [crash] if crash else []
        if log and rows and rows[-1]["index"] == i:
            r = rows[-1]
            if "comm" in r:
                worst_kind = max(KINDS, key=lambda k: r["comm"][k]["error"])
                log(
                    f"[{i + 1}/{pairs}] {r['model']:16s} {worst_kind} {r['comm'][worst_kind]['error']:.1%} "
                    f"peak {r['peak_error']:.1%} flops {r['flops_error']:.2%} ({time.perf_counter() - t0:.0f} s)"
                )
            else:
                log(
                    f"[{i + 1}/{pairs}] {r['model']:16s} exact mode failed (fast mode's peak "
                    f"{r['peak_fast'] / 2**30:.2f} GiB): {r['exact_error'][-160:]}"
                )
        res = summarize(rows, redraws, crashes, seed, time.perf_counter() - t0, i + 1, commit)
        res["target"] = target
        if scale is not None:
            res["pod"] = {"devices": scale.devices, "batch": list(scale.batch), "models": sorted(scale.pool)}
        if out:
            Path(out).write_text(json.dumps(res, indent=1))
    return res


def _commit() -> str:
    """HEAD, and whether the cost engine's files differ from it in the working tree."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "shardplan"], cwd=ROOT)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" (shardplan/ modified)" if dirty.returncode else "")


def summarize(rows, redraws, crashes, seed, seconds, drawn, commit: str = "") -> dict:
    failed = [
        {"index": r["index"], "model": r["model"], "plan": r["plan"], "error": r["exact_error"]}
        for r in rows
        if "exact_error" in r
    ]
    return {
        "seed": seed,
        "commit": commit,
        "drawn": drawn,  # pair indices drawn; those with no row gave up after 10 redraws or crashed
        "pairs": len(rows),
        "measured": sum("comm" in r for r in rows),
        "seconds": seconds,
        "distribution": distribution(rows),
        # fast mode on XLA's propagation, where measured (``--xla-propagation``)
        "distribution_xla": distribution([r["xla"] for r in rows if "xla" in r]),
        "by_model": {m: distribution([r for r in rows if r["model"] == m]) for m in sorted({r["model"] for r in rows})},
        "worst": worst(rows),
        "worst_comm": worst(rows, comm_only=True),
        "exact_failed": failed,
        "fast_crashed": crashes,
        "redraws": redraws,
        "state_mismatch": [r["index"] for r in rows if "comm" in r and r["state_fast"] != r["state_exact"]],
        "rows": rows,
    }


def run(quick: bool) -> dict:
    """Quick: 2 pairs (proves it runs), fast mode costed on XLA's propagation too; full: 200 pairs."""
    if quick:
        XLA_PROPAGATION.append(True)
        try:
            return run_pairs(2, seed=0)
        finally:
            XLA_PROPAGATION.clear()
    return run_pairs(200, seed=0)


def _check(name, value, target, fmt="{:.1%}") -> dict:
    met = value <= target
    return {
        "measurement": name,
        "value": fmt.format(value),
        "target": f"<= {fmt.format(target)}",
        "met": "yes" if met else "NO (missed)",
        "timing": False,
    }


def checks(res: dict) -> list[dict]:
    """The targets on the distribution (p90 over pairs), in the style of benchmarks/run.py."""
    n = res["measured"]
    out = []
    for name, d in res["distribution"].items():
        what = (
            f"{name[5:]} bytes error (share of the step's bytes)"
            if name.startswith("comm/")
            else f"{name} error (relative)"
        )
        out.append(
            _check(
                f"random plans ({n} pairs): fast vs exact {what}, p90 (worst {d['worst']:.1%})",
                d["p90"],
                _target(name),
                "{:.2%}" if name == "flops" else "{:.1%}",
            )
        )
    out.append(
        _check(f"random plans: pairs whose exact mode failed (of {res['pairs']})", len(res["exact_failed"]), 0, "{:d}")
    )
    out.append(_check("random plans: pairs whose fast mode crashed", len(res["fast_crashed"]), 0, "{:d}"))
    return out


def _worst_lines(rows: Sequence[dict]) -> list[str]:
    lines = []
    for w in rows:
        lines.append(
            f"- pair {w['index']} {w['model']}: {w['kind']} {w['error']:.1%} "
            f"({w['over_target']:.1f}x target) {w['figures']}"
        )
        lines += [f"    {k}" for k in w["key_lines"]]
        for d in w["differences"]:
            where = Path(d["source"]).name if d["source"] != "(no source)" else d["source"]
            lines.append(
                f"    {d['kind']} at {where}: fast {d['fast']:,} B vs exact {d['exact']:,} B "
                f"(fast op {d['fast_op'] or '-'}; exact op {d['exact_op'] or '-'})"
            )
        for d in w.get("flop_differences", []):
            where = Path(d["source"]).name if d["source"] else "(no source)"
            lines.append(f"    matmuls at {where}: fast {d['fast']:,.0f} vs exact {d['exact']:,.0f} FLOPs")
        for d in w.get("layouts", []):
            lines.append(
                f"    XLA lays out {d['op']} {tuple(d['shape'])} at {d['source']} as {' or '.join(d['xla'])}, "
                f"fast mode as {' or '.join(d['fast'])}"
            )
    return lines


def report(res: dict) -> str:
    lines = [
        f"{res['measured']} pairs measured of {res['pairs']} drawn as {res['drawn']} indices "
        f"(seed {res['seed']}, {res['seconds']:.0f} s, compiler {res.get('target', 'cpu')}); "
        f"{len(res['exact_failed'])} exact-mode failures, {len(res['fast_crashed'])} fast-mode crashes, "
        f"{len(res['redraws'])} redraws (plans fast mode rejected)",
        *(
            [
                f"at pod scale: {', '.join(res['pod']['models'])} on {res['pod']['devices']} devices, batch "
                f"{res['pod']['batch'][0]} x {res['pod']['batch'][1]}"
            ]
            if res.get("pod")
            else []
        ),
        "",
        f"{'error':22s} {'median':>8s} {'p90':>8s} {'worst':>8s}  target (p90)",
    ]
    for name, d in res["distribution"].items():
        t = _target(name)
        met = "met" if d["p90"] <= t else "NOT met"
        lines.append(f"{name:22s} {d['median']:8.2%} {d['p90']:8.2%} {d['worst']:8.2%}  <= {t:.0%} {met}")
    xla = res.get("distribution_xla") or {}
    if any(d["pairs"] for d in xla.values()):
        lines += [
            "",
            "fast mode on XLA's own propagation (--propagation xla) beside its own, against the same compiles:",
            f"  {'error':22s} {'p90 own':>8s} {'p90 xla':>8s} {'med own':>8s} {'med xla':>8s}",
        ]
        for name, d in xla.items():
            own = res["distribution"][name]
            lines.append(f"  {name:22s} {own['p90']:8.2%} {d['p90']:8.2%} {own['median']:8.2%} {d['median']:8.2%}")
    kinds = [k for k in res["distribution"] if res["distribution"][k]["worst"] > 0]
    lines += ["", "p90 by model: " + ", ".join(k.removeprefix("comm/") for k in kinds)]
    for m, dist in res.get("by_model", {}).items():
        lines.append(
            f"  {m:16s} ({dist['peak']['pairs']:3d} pairs) " + " ".join(f"{dist[k]['p90']:7.1%}" for k in kinds)
        )
    for title, key in (
        ("worst ten pairs (error / target)", "worst"),
        ("worst ten pairs in collective bytes", "worst_comm"),
    ):
        lines += ["", f"{title}:"]
        lines += _worst_lines(res.get(key, []))
    if res["exact_failed"]:
        lines += ["", "exact mode failed:"] + [
            f"- pair {f['index']} {f['model']}: {f['error'][-300:]}" for f in res["exact_failed"]
        ]
    if res["fast_crashed"]:
        lines += ["", "fast mode crashed:"] + [
            f"- pair {f['index']} {f['model']}: {f['error'][-300:]}" for f in res["fast_crashed"]
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=200, help="(plan, model) pairs to draw (default 200)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    p.add_argument("--json", help="write every figure here (after every pair)")
    p.add_argument("--report", metavar="JSON", help="measure nothing: summarize and print a saved run")
    p.add_argument(
        "--target",
        default="cpu",
        help="the compiler: cpu (default), or a target such as tpu-v5e:2x4 "
        "or h100:8 (exact mode compiles for it offline; fast mode is told it)",
    )
    p.add_argument(
        "--layouts",
        action="store_true",
        help="list where XLA's propagated layouts and fast mode's "
        "part (XLA:CPU; the compiles dump their propagated module, the compile cache is off)",
    )
    p.add_argument(
        "--pod",
        action="store_true",
        help="draw at pod scale: Llama-2-70B shapes (scanned) on every chip of --target (default "
        f"{POD_TARGET}), one {POD_SEQ}-token sequence per chip",
    )
    p.add_argument(
        "--xla-propagation",
        action="store_true",
        help="also cost each pair in fast mode on XLA's own layouts (Shardy's propagation, offline) and "
        "print that distribution beside fast mode's own",
    )
    args = p.parse_args(argv)
    if args.xla_propagation:
        XLA_PROPAGATION.append(True)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        res = summarize(
            saved["rows"],
            saved["redraws"],
            saved["fast_crashed"],
            saved["seed"],
            saved["seconds"],
            saved.get("drawn", max((r["index"] for r in saved["rows"]), default=-1) + 1),
            saved.get("commit", "unknown"),
        )
        print(report(res))
        for c in checks(res):
            print(f"{c['measurement']}: {c['value']} (target {c['target']}) {c['met']}")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return 0
    sys.path.insert(0, str(ROOT))
    from shardplan.runtime.devices import simulate

    if args.layouts:  # before jax starts: XLA reads its flags once
        import os
        import tempfile

        LAYOUT_DUMP.append(Path(tempfile.mkdtemp(prefix="shardplan-layouts-")))
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_dump_to={LAYOUT_DUMP[0]} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=shardy-xla"
        )
        os.environ["SHARDPLAN_COMPILE_CACHE"] = "0"
    scale = None
    if args.pod:
        from shardplan.core import targets

        args.target = POD_TARGET if args.target == "cpu" else args.target
        from shardplan.core import chips

        target = targets.parse(args.target)
        scale = pod_scale(target.devices, chips.lookup(target.chip).hbm_bytes)
    simulate(DEVICES)
    res = run_pairs(
        args.pairs, args.seed, args.json, log=lambda s: print(s, flush=True), target=args.target, scale=scale
    )
    print(report(res))
    for c in checks(res):
        print(f"{c['measurement']}: {c['value']} (target {c['target']}) {c['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
