"""Mixture of experts on 8 simulated devices, side by side in one run: the training step under
each MoE plan on both backends and under plain data parallelism, and fast mode against XLA's
compiled program (exact mode) for every MoE plan.

    python -m benchmarks.moe            # a small MoE (8 experts of 256, d_model 128), batch 32 x 64
    python -m benchmarks.moe --quick    # moe_tiny, one plan, one step: proves it runs

Targets (issue 31): step time shard_map / auto <= 1.15x (a timing); fast vs exact within the
engine's targets (each collective kind's bytes within 10%, peak within 15%, FLOPs within 2%).
Expert parallel / data parallel is reported without a target: on CPU it measures XLA:CPU's
collectives, not a network.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = ("moe_ep.splan", "moe_ep_tp.splan", "moe_ep_fsdp.splan")


def _config(quick: bool, dispatch: str = "capacity"):
    from dataclasses import replace

    from examples import models

    return replace(models.MOE_TINY if quick else models.MOE_SMALL, dispatch=dispatch)


def _setup(plan_name: str, backend: str, cfg, batch: int):
    """A step of ``plan_name`` on ``backend`` in benchmarks/run.py's setup form."""
    import numpy as np
    import optax
    from flax import nnx

    import shardplan
    from examples import models
    from examples import train as example

    plan = shardplan.load(ROOT / "plans" / plan_name)
    model, optimizer, placement = shardplan.init_sharded(plan, lambda: models.MoE(cfg, nnx.Rngs(0)),
                                                         optax.adamw(1e-3))
    data = example.synthetic_batch(np.random.default_rng(0), cfg.vocab, batch, cfg.max_len)
    step = shardplan.train_step(placement, example.moe_lm_loss, model, optimizer, backend=backend)
    placed = step.place(data)
    return lambda: step.fn(nnx.state(model), nnx.state(optimizer), placed), step, model, optimizer, data


def bench_steps(quick: bool) -> list[dict]:
    import warnings

    import shardplan
    from benchmarks.run import _time_steps

    steps, repeat, batch = (1, 1, 16) if quick else (10, 5, 32)
    cases = [("moe_ep.splan", "capacity")] if quick else [(p, d) for d in ("capacity", "dropless") for p in PLANS]
    rows = []
    for plan, dispatch in cases:
        cfg = _config(quick, dispatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", shardplan.ShardMapFallbackWarning)  # counted below, a target
            setups = [_setup(plan, "auto", cfg, batch), _setup(plan, "shard_map", cfg, batch),
                      _setup("dp.splan", "auto", cfg, batch)]
            t_auto, t_sm, t_dp = _time_steps(setups, steps, repeat)
        fallbacks = len(setups[1][1].fn.record(setups[1][1].place(setups[1][4])).fallbacks)
        rows.append({"plan": plan, "dispatch": dispatch, "auto_ms": 1e3 * t_auto, "shard_map_ms": 1e3 * t_sm,
                     "dp_ms": 1e3 * t_dp, "shard_map_vs_auto": t_sm / t_auto, "ep_vs_dp": t_auto / t_dp,
                     "shard_map_fallbacks": fallbacks})
    return rows


def bench_fast_vs_exact(quick: bool) -> list[dict]:
    import shardplan
    from benchmarks.run import fast_vs_exact

    plans = PLANS[:1] if quick else PLANS
    seq = 16 if quick else 32
    batch = [f"tokens=int32[32,{seq}],labels=int32[32,{seq}]"]
    factory = "moe_tiny" if quick else "moe_small"
    rows = []
    # (plan, model, backend, target): the capacity path on the auto backend; in the full run also the
    # dropless path on the shard_map backend (its grouped matmuls as each compiler runs them)
    cases = [(plan, factory, "auto", "cpu") for plan in plans]
    if not quick:
        cases += [(plan, "moe_small_dropless", "shard_map", "cpu") for plan in plans]
        cases += [("moe_ep.splan", "moe_small_dropless", "shard_map", t) for t in ("tpu-v5e:2x4", "h100:8")]
        # the dropless path on the auto backend: each compiler's own grouped matmul
        cases += [(plan, "moe_small_dropless", "auto", t) for plan in plans for t in ("cpu", "tpu-v5e:2x4", "h100:8")]
    for plan, model, backend, target in cases:
        kw = dict(model=f"{ROOT / 'benchmarks' / 'moe.py'}:{model}" if model.endswith("_dropless") else
                  f"{ROOT / 'examples' / 'models.py'}:{model}",
                  step=f"{ROOT / 'examples' / 'train.py'}:moe_lm_loss", batch=batch, devices=8, backend=backend,
                  target=target)
        fast = shardplan.api.analyze(ROOT / "plans" / plan, mode="fast", **kw)
        exact = shardplan.api.analyze(ROOT / "plans" / plan, mode="exact", **kw)
        rows.append({"plan": plan, "model": model, "backend": backend, "target": target,
                     **fast_vs_exact(fast, exact)})
    return rows


def moe_small_dropless():
    """moe_small with the dropless dispatch (tokens sorted by expert, grouped matmuls). Loaded by
    path (exact mode's compile process too): the project root made importable first."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flax import nnx

    from examples import models

    return models.MoE(_config(False, "dropless"), nnx.Rngs(0))


def run(quick: bool) -> dict:
    return {"steps": bench_steps(quick), "fast_vs_exact": bench_fast_vs_exact(quick)}


def checks(res: dict) -> list[dict]:
    """Target rows in benchmarks/run.py's form."""
    from benchmarks.run import _check, fast_vs_exact_checks

    out = []
    for r in res["steps"]:
        name = f"MoE step {r['plan']} ({r['dispatch']})"
        out.append(_check(f"{name}: shard_map / auto", r["shard_map_vs_auto"], 1.15, "<=", timing=True))
        out.append(_check(f"{name}: shard_map ops on whole operands (fallbacks)", r["shard_map_fallbacks"], 0, "<=",
                          "{:d}"))
    for r in res["fast_vs_exact"]:
        out += fast_vs_exact_checks(f"fast vs exact {_name(r)}", r)
    return out


def _name(r: dict) -> str:
    """A row's name: the plan and model, and the backend and target where not the auto backend on XLA:CPU."""
    where = "" if (r.get("backend"), r.get("target")) in ((None, None), ("auto", "cpu")) else (
        f" ({r['backend']}, {r['target']})")
    return f"{r['plan']} x {r['model']}{where}"


def report(res: dict) -> list[str]:
    from benchmarks.run import fast_vs_exact_lines

    lines = ["step (ms)               dispatch   auto  shard_map  data parallel  sm/auto  EP/DP  fallbacks"]
    for r in res["steps"]:
        lines.append(f"{r['plan']:22} {r['dispatch']:9} {r['auto_ms']:6.1f} {r['shard_map_ms']:9.1f} "
                     f"{r['dp_ms']:13.1f} {r['shard_map_vs_auto']:7.2f}x {r['ep_vs_dp']:5.2f}x "
                     f"{r['shard_map_fallbacks']:9d}")
    for r in res["fast_vs_exact"]:
        lines.append(f"fast vs exact, {_name(r)}:")
        lines += fast_vs_exact_lines(r)
    return lines


def main(argv=None) -> int:
    from benchmarks.run import section_main

    return section_main(__doc__, run, report, checks, argv)


if __name__ == "__main__":
    sys.exit(main())
