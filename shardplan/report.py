"""Presenting a resolution: rich tables, a per-device memory summary, and JSON."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardplan.errors import Diagnostic
from shardplan.plan import Plan
from shardplan.resolve import Decision, Resolution

_NUM = re.compile(r"(?<=/)\d+(?=/|$)|^\d+(?=/)")


@dataclass(frozen=True)
class Row:
    """One table row: a leaf, or a group of leaves that differ only in layer indices."""

    path: str
    count: int
    first: Decision


def group(decisions: tuple[Decision, ...] | list[Decision], expand: bool = False) -> list[Row]:
    """Collapse ``blocks/0/x``, ``blocks/1/x``, ... with equal shape, spec and rule into one row."""
    if expand:
        return [Row(d.path, 1, d) for d in decisions]
    rows: dict[tuple, list] = {}
    for d in decisions:
        key = (_NUM.sub("*", d.path), d.shape, d.dtype, d.spec, d.how,
               d.origin if d.how != "mirror" else _NUM.sub("*", d.origin), d.role)
        if key in rows:
            rows[key][1] += 1
        else:
            rows[key] = [d, 1]
    return [Row(k[0] if n > 1 else d.path, n, d) for k, (d, n) in rows.items()]


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``512MiB``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B?)?\s*", text)
    if not m:
        raise ValueError(f"cannot read a size from '{text}' (write e.g. 80GB or 16GiB)")
    value, unit = float(m.group(1)), (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}.get(unit)
    if scale is None:
        raise ValueError(f"unknown unit in '{text}'")
    return int(value * scale)


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _short(origin: str) -> str:
    """'/long/path/plans/x.splan:7' -> 'x.splan:7' for the table."""
    return os.path.basename(origin)


def _how(d: Decision) -> str:
    return {"rule": _short(d.origin), "axes": "axis rules", "default": f"default {_short(d.origin)}",
            "mirror": "mirrors param", "scalar": "scalar", "replicated": "no param",
            "batch": f"batch {_short(d.origin)}"}[d.how]


def communication(plan: Plan, res: Resolution) -> dict:
    """Predicted per-device bytes per training step, by kind and mesh axes, from specs alone.

    The shard_map lowering's collectives (exact for that backend; the auto backend's XLA
    may pick others, e.g. an all-reduce where a reduce-scatter would do). Assumes inputs
    split over the ``batch`` spec's dim-0 axes and a mean loss.
    """
    from shardplan.lowering import lower_params, plan_batch_axes, predict, predict_by_axis

    low = lower_params(res.decisions, res.mesh, plan_batch_axes(plan))
    totals = predict(low)
    return {"batch_axes": list(low.batch_axes), "by_axis": predict_by_axis(low),
            "totals": {k: v["bytes"] for k, v in totals.items()}}


def summary(res: Resolution) -> dict:
    p, o = res.bytes_per_device("param"), res.bytes_per_device("opt")
    return {"param_bytes_per_device": p, "opt_bytes_per_device": o, "total_bytes_per_device": p + o,
            "param_bytes_global": sum(d.nbytes for d in res.decisions if d.role == "param"),
            "n_params": sum(1 for d in res.decisions if d.role == "param"),
            "n_opt_leaves": sum(1 for d in res.decisions if d.role == "opt")}


def print_communication(console: Console, plan: Plan, res: Resolution) -> None:
    comm = communication(plan, res)
    table = Table(title="communication per training step, per device (shard_map lowering)", header_style="bold")
    for col in ("collective", "mesh axes", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for kind, by in comm["by_axis"].items():
        for axes, n in sorted(by.items()):
            table.add_row(kind, axes, human_bytes(n))
    if not any(comm["by_axis"].values()):
        table.add_row("none", "-", "0 B")
    console.print(table)


def print_comparison(console: Console, results, budget: int | None = None) -> None:
    table = Table(title="plans side by side (per device)", header_style="bold")
    table.add_column("")
    for plan, res in results:
        mesh = ",".join(f"{k}={v}" for k, v in res.mesh.items())
        table.add_column(f"{plan.name or plan.files[0]}\n{mesh}", justify="right")
    rows = [("params", lambda p, r: summary(r)["param_bytes_per_device"]),
            ("optimizer state", lambda p, r: summary(r)["opt_bytes_per_device"]),
            ("total", lambda p, r: summary(r)["total_bytes_per_device"]),
            ("all-reduce / step", lambda p, r: communication(p, r)["totals"]["all-reduce"]),
            ("all-gather / step", lambda p, r: communication(p, r)["totals"]["all-gather"]),
            ("reduce-scatter / step", lambda p, r: communication(p, r)["totals"]["reduce-scatter"])]
    for name, fn in rows:
        table.add_row(name, *[human_bytes(fn(p, r)) for p, r in results])
    if budget is not None:
        table.add_row(f"fits {human_bytes(budget)}", *["yes" if summary(r)["total_bytes_per_device"] <= budget
                                                       else "no" for _, r in results])
    console.print(table)


def print_text(console: Console, plan: Plan, res: Resolution, *, expand: bool = False,
               show_opt: bool = False, budget: int | None = None) -> None:
    mesh = ", ".join(f"{k}={v}" for k, v in res.mesh.items())
    console.print(f"[bold]plan[/] {plan.name or plan.files[0]}  [bold]mesh[/] {mesh}  "
                  f"[bold]backend[/] {plan.backend}")
    roles = ("param", "opt") if show_opt else ("param",)
    table = Table(show_lines=False, header_style="bold")
    for col in ("param path", "global shape", "dtype", "spec", "shard / device", "bytes / device", "rule"):
        table.add_column(col, justify="right" if col.startswith("bytes") else "left")
    for row in group([d for d in res.decisions if d.role in roles], expand):
        d = row.first
        path = row.path + (f"  [dim]x{row.count}[/]" if row.count > 1 else "")
        table.add_row(path, _shape(d.shape), d.dtype, str(d.spec), _shape(d.shard_shape),
                      human_bytes(d.bytes_per_device), _how(d))
    console.print(table)
    s = summary(res)
    console.print(f"per device: params {human_bytes(s['param_bytes_per_device'])} "
                  f"({s['n_params']} arrays), optimizer state {human_bytes(s['opt_bytes_per_device'])} "
                  f"({s['n_opt_leaves']} arrays), total [bold]{human_bytes(s['total_bytes_per_device'])}[/]")
    if budget is not None:
        total = s["total_bytes_per_device"]
        verdict = "[green]fits[/]" if total <= budget else "[red]does not fit[/]"
        console.print(f"device memory budget {human_bytes(budget)}: {verdict} "
                      f"({100 * total / budget:.1f}% used by params + optimizer state)")


def print_diagnostics(console: Console, diagnostics: tuple[Diagnostic, ...] | list[Diagnostic],
                      limit: int = 20) -> None:
    """Diagnostics as plain text (no markup, no wrapping: the caret must stay under its column)."""
    for d in list(diagnostics)[:limit]:
        head, _, rest = d.render().partition("\n")
        console.print(Text(head, style="red" if d.severity == "error" else "yellow"), soft_wrap=True)
        if rest:
            console.print(Text(rest), soft_wrap=True)
    if len(diagnostics) > limit:
        console.print(f"... and {len(diagnostics) - limit} more")


def to_json(plan: Plan, res: Resolution | None, diagnostics, budget: int | None = None) -> dict:
    out: dict = {"plan": plan.name if plan else None, "files": list(plan.files) if plan else [],
                 "ok": not any(d.severity == "error" for d in diagnostics),
                 "diagnostics": [d.to_json() for d in diagnostics]}
    if res is not None:
        out["mesh"] = res.mesh
        out["leaves"] = [{"path": d.path, "role": d.role, "shape": list(d.shape), "dtype": d.dtype,
                          "spec": str(d.spec), "partition_spec": [list(x) for x in d.spec.dims],
                          "shard_shape": list(d.shard_shape), "bytes_per_device": d.bytes_per_device,
                          "decided_by": d.how, "origin": d.origin} for d in res.decisions]
        out["summary"] = summary(res)
        out["communication"] = communication(plan, res)
        if budget is not None:
            out["summary"]["device_memory"] = budget
            out["summary"]["fits"] = out["summary"]["total_bytes_per_device"] <= budget
    return out
