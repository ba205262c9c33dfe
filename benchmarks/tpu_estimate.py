"""shardplan's step time against XLA:TPU's own estimate of the same step (docs/stepcost.md, "Step
time": "Against XLA:TPU's own estimate").

    python -m benchmarks.tpu_estimate            # three models, four or five plans each (~6 min)
    python -m benchmarks.tpu_estimate --quick    # gpt_small, two plans: proves it runs

XLA:TPU v5p's cost analysis gives ``optimal_seconds``, the compiler's estimate of its program's
step (read by exact mode as ``StepCost.compiler_seconds``; not given where the program has loops
whose bodies it counts once, such as v5p's windowed einsums, nor on v5e, where it is negative).
It is an estimate, not a measurement, but an independent one: XLA's own cost model of its own
program, on the chip the plan is for. Each row is one (model, batch, plan) on 8 v5p chips
(``tpu-v5p:2x2x2``, compiled offline, the test extra's XLA:TPU): fast mode's step told the target
(serial: no overlap; overlapped: communication hidden), shardplan's time model on the compiled
program (its FLOPs, traffic and collectives), and the compiler's estimate. Per model and batch,
the pairs of plans both estimates order alike are counted: what ``suggest`` needs of a time model
is the order. No target is set (an estimate against an estimate); the figures go to the docs.
"""

from __future__ import annotations

import sys
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tpu-v5p:2x2x2"
MODELS = ROOT / "examples" / "models.py"
WIDE = ROOT / "tests" / "fixtures" / "wide_models.py"
STEP = ROOT / "examples" / "train.py"
# (model FILE.py:FACTORY, batch, plans)
FULL = [
    (f"{MODELS}:gpt_small", "256,64", ("dp", "fsdp", "gpt_tp", "gpt_2d", "llama_tp")),
    (f"{MODELS}:llama_small", "256,64", ("dp", "fsdp", "gpt_tp", "gpt_2d", "llama_tp")),
    (f"{WIDE}:llama_kilo", "16,1024", ("dp", "fsdp", "llama_tp", "gpt_2d")),
]
QUICK = [(f"{MODELS}:gpt_small", "256,64", ("dp", "gpt_tp"))]


def row(model: str, batch: str, plan_name: str) -> dict:
    import shardplan
    from shardplan.core import chips, timing

    hw = chips.lookup("tpu-v5p")
    plan = shardplan.load(ROOT / "plans" / f"{plan_name}.splan")
    kw = dict(
        model=model,
        step=f"{STEP}:lm_loss",
        batch=[f"tokens=int32[{batch}],labels=int32[{batch}]"],
        devices=8,
        target=TARGET,
    )
    fast = shardplan.api.analyze(plan, mode="fast", **kw)
    exact = shardplan.api.analyze(plan, mode="exact", timeout_s=900, **kw)
    tf, te = timing.step_time(fast, plan, hw), timing.step_time(exact, plan, hw)
    return {
        "model": model.rsplit(":", 1)[1],
        "batch": batch,
        "plan": plan_name,
        "fast_serial_s": tf.serial_s,
        "fast_overlapped_s": tf.overlapped_s,
        "program_serial_s": te.serial_s,
        "xla_s": exact.compiler_seconds,
        "why_none": [n.code for n in exact.notes if n.code.startswith("exact-estimate")],
    }


def agreement(rows: list[dict], key: str) -> tuple[int, int]:
    """(pairs of plans ``key`` and the compiler's estimate order alike, pairs), within each model
    and batch, over the plans the compiler estimated."""
    alike = total = 0
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["xla_s"]:
            groups.setdefault((r["model"], r["batch"]), []).append(r)
    for group in groups.values():
        for a, b in combinations(group, 2):
            total += 1
            alike += (a[key] < b[key]) == (a["xla_s"] < b["xla_s"])
    return alike, total


def run(quick: bool) -> dict:
    rows = [row(m, b, p) for m, b, plans in (QUICK if quick else FULL) for p in plans]
    return {
        "rows": rows,
        "serial": agreement(rows, "fast_serial_s"),
        "overlapped": agreement(rows, "fast_overlapped_s"),
    }


def report(res: dict) -> list[str]:
    lines = [
        f"step on 8 v5p chips ({TARGET}), us: fast serial / fast overlapped / shardplan on the compiled "
        "program / XLA:TPU's optimal_seconds (fast overlapped / XLA)"
    ]
    for r in res["rows"]:
        xla = f"{r['xla_s'] * 1e6:9.1f}" if r["xla_s"] else f"{'-':>9}"
        ratio = f"{r['fast_overlapped_s'] / r['xla_s']:.2f}x" if r["xla_s"] else f"none: {', '.join(r['why_none'])}"
        lines.append(
            f"  {r['model']:12} {r['batch']:8} {r['plan']:9} {r['fast_serial_s'] * 1e6:9.1f} "
            f"{r['fast_overlapped_s'] * 1e6:9.1f} {r['program_serial_s'] * 1e6:9.1f} {xla}  ({ratio})"
        )
    for key in ("serial", "overlapped"):
        alike, total = res[key]
        lines.append(f"pairs of plans fast mode's {key} step orders as XLA:TPU's estimate does: {alike} of {total}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print("\n".join(report(run("--quick" in args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
