"""What a resolved plan costs per device, from shapes and specs alone: memory at rest and
the shard_map lowering's communication per training step."""

from __future__ import annotations

from shardplan.core.leaves import Resolution
from shardplan.core.lowering import lower_params, predict, predict_by_axis
from shardplan.core.plan import Plan


def summary(res: Resolution) -> dict:
    """Per-device bytes of params, other model state (batch statistics, RNG state, caches) and
    optimizer state, their total, and leaf counts."""
    p, s, o = res.bytes_per_device("param"), res.bytes_per_device("state"), res.bytes_per_device("opt")
    return {
        "param_bytes_per_device": p,
        "state_bytes_per_device": s,
        "opt_bytes_per_device": o,
        "total_bytes_per_device": p + s + o,
        "param_bytes_global": sum(d.nbytes for d in res.decisions if d.role == "param"),
        "n_params": sum(1 for d in res.decisions if d.role == "param"),
        "n_state": sum(1 for d in res.decisions if d.role == "state"),
        "n_opt_leaves": sum(1 for d in res.decisions if d.role == "opt"),
    }


def communication(plan: Plan, res: Resolution) -> dict:
    """Predicted per-device bytes per training step, by kind and mesh axes, from specs alone.

    The shard_map lowering's collectives (exact for that backend; the auto backend's XLA
    may pick others, e.g. an all-reduce where a reduce-scatter would do). Assumes inputs
    split over the ``batch`` spec's dim-0 axes and a mean loss.
    """
    low = lower_params(res.decisions, res.mesh, plan.batch_dim0_axes)
    totals = predict(low)
    return {
        "batch_axes": list(low.batch_axes),
        "by_axis": predict_by_axis(low),
        "totals": {k: v["bytes"] for k, v in totals.items()},
    }
