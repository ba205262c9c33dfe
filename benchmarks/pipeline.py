"""Pipelines, side by side in one run: fast mode against XLA's compiled program (exact mode) on the
pipeline plans (8 simulated devices), and, offline, Llama-2-70B shapes on 2,048 devices (8 per
host) with a pipeline over the hosts next to the non-pipelined plans that fit.

    python -m benchmarks.pipeline            # both pipeline plans; 70B on 2,048 H100s
    python -m benchmarks.pipeline --quick    # GPipe only; the offline plans on a small Llama, 64 devices

Targets (issue 32): fast vs exact within the engine's targets (each collective kind's bytes within
10%, peak within 15%, FLOPs within 2%); the cost's bubble equal to the schedule's count of idle
stage-steps. The offline rows are predictions (fast mode, datasheet rates): they have no
compiled program to check against on this machine, and are printed with the plan that wins.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = ("llama_pp.splan", "llama_pp_circular.splan")

# 2,048 devices, 8 per host: `model` inside a host (NVLink), the rest across hosts (@dcn).
_LAYERS_2D = """param "layers/attn/(q|k|v)/kernel"   (S, D, model)
param "layers/attn/o/kernel"         (S, model, D)
param "layers/mlp/(gate|up)/kernel"  (S, D, model)
param "layers/mlp/down/kernel"       (S, model, D)
param "layers/.*"                    (S, ...)
"""
_PINNED = """act "embed"                          (data, _, _)
axis activation_batch  -> data
axis activation_length -> _
axis activation_embed  -> _
default replicated
"""


def _plan(name: str, mesh: str, pipeline: str, stage: bool, fsdp: bool) -> str:
    layers = _LAYERS_2D.replace("S, ", "stage, " if stage else "_, ").replace("D", "data" if fsdp else "_")
    if not stage:
        layers = "\n".join(line for line in layers.splitlines() if '"layers/.*"' not in line) + "\n"
    embed = "(model, data)" if fsdp else "(model, _)"
    head = "(data, model)" if fsdp else "(_, model)"
    return (f'plan "{name}"\nmesh {mesh}\n{pipeline}batch (data, _)\n'
            f'param "embed/embedding"              {embed}\n{layers}'
            f'param "lm_head/kernel"               {head}\n{_PINNED}')


def offline_plans(quick: bool) -> list[tuple[str, str, bool]]:
    """(name, plan text, pipelined): hosts of 8 (quick: 64 devices in hosts of 4)."""
    hosts, inner, stages, micro = (16, 4, 4, 8) if quick else (256, 8, 8, 16)
    across = hosts // stages
    pp = f"stage = {stages} @dcn, data = {across} @dcn, model = {inner}"
    flat = f"data = {hosts} @dcn, model = {inner}"
    gpipe = f"pipeline stage, microbatches = {micro}\n"
    circular = f"pipeline stage, microbatches = {micro}, schedule = circular, repeats = 2\n"
    return [
        ("pp-gpipe-dp", _plan("pp-gpipe-dp", pp, gpipe, True, False), True),
        ("pp-gpipe-fsdp", _plan("pp-gpipe-fsdp", pp, gpipe, True, True), True),
        ("pp-circular-dp", _plan("pp-circular-dp", pp, circular, True, False), True),
        ("fsdp-tp", _plan("fsdp-tp", flat, "", False, True), False),
        ("dp-tp", _plan("dp-tp", flat, "", False, False), False),
    ]


def bench_offline(quick: bool) -> list[dict]:
    import shardplan
    from shardplan.core import chips, timing

    chip = chips.lookup("h100")
    if quick:
        model, batch = f"{ROOT / 'examples' / 'models.py'}:llama_deep_scan", (64, 16)
    else:
        model, batch = f"{ROOT / 'benchmarks' / 'published.py'}:llama2_70b_bf16_naive", (1024, 4096)
    rows = []
    for name, text, piped in offline_plans(quick):
        plan = shardplan.loads(text, f"{name}.splan")
        cost = shardplan.api.analyze(plan, model=model, step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
                                     mode="fast", batch=[f"tokens=int32[{batch[0]},{batch[1]}],"
                                                         f"labels=int32[{batch[0]},{batch[1]}]"])
        t = timing.step_time(cost, plan, chip)
        pipe = cost.pipeline
        rows.append({"plan": name, "pipelined": piped, "text": text, "devices": math.prod(cost.mesh.values()),
                     "peak": cost.memory.peak, "fits": cost.memory.peak <= chip.hbm_bytes,
                     "step_s": (t.overlapped_s, t.serial_s), "mfu": (t.mfu_overlapped, t.mfu_serial),
                     "comm_by_link": t.comm_by_link, "compute_s": t.compute_s, "memory_s": t.memory_s,
                     "bubble": pipe.bubble if pipe else 0.0, "analysis_s": cost.seconds,
                     "permute_bytes": pipe.permute_bytes if pipe else 0})
    return rows


def bench_fast_vs_exact(quick: bool) -> list[dict]:
    import shardplan
    from benchmarks.run import fast_vs_exact
    from shardplan.core.pipeline import Schedule

    rows = []
    for plan in PLANS[:1] if quick else PLANS:
        kw = dict(model=f"{ROOT / 'examples' / 'models.py'}:llama_deep_scan",
                  step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
                  batch=["tokens=int32[16,16],labels=int32[16,16]"], devices=8)
        fast = shardplan.api.analyze(ROOT / "plans" / plan, mode="fast", **kw)
        exact = shardplan.api.analyze(ROOT / "plans" / plan, mode="exact", **kw)
        p = fast.pipeline
        sched = Schedule(stages=p.stages, microbatches=p.microbatches, repeats=p.repeats, layers=8)
        rows.append({"plan": plan, **fast_vs_exact(fast, exact),
                     "bubble": p.bubble, "idle": p.idle, "schedule_idle": sched.idle})
    return rows


def run(quick: bool) -> dict:
    return {"fast_vs_exact": bench_fast_vs_exact(quick), "offline": bench_offline(quick)}


def checks(res: dict) -> list[dict]:
    """Target rows in benchmarks/run.py's form."""
    from benchmarks.run import _check, fast_vs_exact_checks

    out = []
    for r in res["fast_vs_exact"]:
        name = f"pipeline fast vs exact {r['plan']}"
        out += fast_vs_exact_checks(name, r)
        out.append(_check(f"{name}: bubble's idle stage-steps - the schedule's", abs(r["idle"] - r["schedule_idle"]),
                          0, "<=", "{:d}"))
    return out


def report(res: dict) -> list[str]:
    from benchmarks.run import fast_vs_exact_lines

    lines = []
    for r in res["fast_vs_exact"]:
        lines.append(f"fast vs exact, {r['plan']} x llama_deep_scan (bubble {r['bubble']:.1%}, {r['idle']} idle "
                     f"stage-steps; the schedule's table: {r['schedule_idle']}):")
        lines += fast_vs_exact_lines(r)
    rows = res["offline"]
    if rows:
        lines.append(f"offline, {rows[0]['devices']} devices (fast mode, h100 datasheet rates):")
        lines.append("  plan             peak GiB  fits   step s (overlapped..serial)   MFU        dcn s    ici s  "
                     "bubble  analysed")
        for r in rows:
            lo, hi = r["step_s"]
            lines.append(f"  {r['plan']:16} {r['peak'] / 2**30:8.1f}  {'yes' if r['fits'] else 'NO ':4} "
                         f"{lo:9.2f} .. {hi:6.2f}            {r['mfu'][0]:4.0%}..{r['mfu'][1]:3.0%}  "
                         f"{r['comm_by_link'].get('dcn', 0):7.2f}  {r['comm_by_link'].get('ici', 0):7.2f}  "
                         f"{r['bubble']:5.1%}  {r['analysis_s']:6.1f} s")
        best = {k: min((r for r in rows if r["pipelined"] == k and r["fits"]), key=lambda r: r["step_s"][0],
                       default=None) for k in (True, False)}
        if best[True] and best[False]:
            ratio = best[True]["step_s"][0] / best[False]["step_s"][0]
            lines.append(f"  best pipelined ({best[True]['plan']}) / best non-pipelined ({best[False]['plan']}) that "
                         f"fit: {ratio:.2f}x the step time (overlapped)")
    return lines


def main(argv=None) -> int:
    from benchmarks.run import section_main

    return section_main(__doc__, run, report, checks, argv)


if __name__ == "__main__":
    sys.exit(main())
