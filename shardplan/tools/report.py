"""Presenting a resolution: rich tables, a per-device memory summary, and JSON."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shardplan.core.cost import communication, summary
from shardplan.core.format import fmt_bytes, fmt_shape, layer_group
from shardplan.core.leaves import Decision, Resolution
from shardplan.core.plan import Plan
from shardplan.errors import MAX_SHOWN, Diagnostic


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
        key = (
            layer_group(d.path),
            d.shape,
            d.dtype,
            d.spec,
            d.how,
            d.origin if d.how != "mirror" else layer_group(d.origin),
            d.role,
        )
        if key in rows:
            rows[key][1] += 1
        else:
            rows[key] = [d, 1]
    return [Row(k[0] if n > 1 else d.path, n, d) for k, (d, n) in rows.items()]


def _short(origin: str) -> str:
    """'/long/path/plans/x.splan:7' -> 'x.splan:7' for the table."""
    return os.path.basename(origin)


def _how(d: Decision) -> str:
    return {
        "rule": _short(d.origin),
        "axes": "axis rules",
        "default": f"default {_short(d.origin)}",
        "mirror": "mirrors param",
        "scalar": "scalar",
        "replicated": "no param",
        "batch": f"batch {_short(d.origin)}",
    }[d.how]


def print_communication(console: Console, plan: Plan, res: Resolution) -> None:
    comm = communication(plan, res)
    table = Table(title="communication per training step, per device (shard_map lowering)", header_style="bold")
    for col in ("collective", "mesh axes", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for kind, by in comm["by_axis"].items():
        for axes, n in sorted(by.items()):
            table.add_row(kind, axes, fmt_bytes(n))
    if not any(comm["by_axis"].values()):
        table.add_row("none", "-", "0 B")
    console.print(table)


def print_comparison(console: Console, results, budget: int | None = None) -> None:
    table = Table(title="plans side by side (per device)", header_style="bold")
    table.add_column("")
    for plan, res in results:
        mesh = ",".join(f"{k}={v}" for k, v in res.mesh.items())
        table.add_column(escape(f"{plan.name or plan.files[0]}\n{mesh}"), justify="right")
    rows = [
        ("params", lambda p, r: summary(r)["param_bytes_per_device"]),
        ("optimizer state", lambda p, r: summary(r)["opt_bytes_per_device"]),
        ("total", lambda p, r: summary(r)["total_bytes_per_device"]),
        ("all-reduce / step", lambda p, r: communication(p, r)["totals"]["all-reduce"]),
        ("all-gather / step", lambda p, r: communication(p, r)["totals"]["all-gather"]),
        ("reduce-scatter / step", lambda p, r: communication(p, r)["totals"]["reduce-scatter"]),
    ]
    for name, fn in rows:
        table.add_row(name, *[fmt_bytes(fn(p, r)) for p, r in results])
    if budget is not None:
        table.add_row(
            f"fits {fmt_bytes(budget)}",
            *["yes" if summary(r)["total_bytes_per_device"] <= budget else "no" for _, r in results],
        )
    console.print(table)


def print_text(
    console: Console,
    plan: Plan,
    res: Resolution,
    *,
    expand: bool = False,
    show_opt: bool = False,
    budget: int | None = None,
) -> None:
    mesh = ", ".join(f"{k}={v}" for k, v in res.mesh.items())
    console.print(
        f"[bold]plan[/] {escape(plan.name or plan.files[0])}  [bold]mesh[/] {mesh}  [bold]backend[/] {plan.backend}"
    )
    roles = ("param", "opt") if show_opt else ("param",)
    table = Table(show_lines=False, header_style="bold")
    for col in ("param path", "global shape", "dtype", "spec", "shard / device", "bytes / device", "rule"):
        table.add_column(col, justify="right" if col.startswith("bytes") else "left")
    for row in group([d for d in res.decisions if d.role in roles], expand):
        d = row.first
        path = escape(row.path) + (f"  [dim]x{row.count}[/]" if row.count > 1 else "")
        table.add_row(
            path,
            fmt_shape(d.shape),
            d.dtype,
            str(d.spec),
            fmt_shape(d.shard_shape),
            fmt_bytes(d.bytes_per_device),
            escape(_how(d)),
        )
    console.print(table)
    s = summary(res)
    console.print(
        f"per device: params {fmt_bytes(s['param_bytes_per_device'])} "
        f"({s['n_params']} arrays), optimizer state {fmt_bytes(s['opt_bytes_per_device'])} "
        f"({s['n_opt_leaves']} arrays), total [bold]{fmt_bytes(s['total_bytes_per_device'])}[/]"
    )
    if budget is not None:
        total = s["total_bytes_per_device"]
        verdict = "[green]fits[/]" if total <= budget else "[red]does not fit[/]"
        console.print(
            f"device memory budget {fmt_bytes(budget)}: {verdict} "
            f"({100 * total / budget:.1f}% used by params + optimizer state)"
        )


def print_compiled_collectives(console: Console, name: str, mesh: dict[str, int], measured: dict) -> None:
    """``lower --report``: per backend, the collectives in its compiled step."""
    table = Table(title=escape(f"collectives per step, per device ({name}, mesh {mesh})"))
    for col in ("backend", "kind", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for backend, summary_ in measured.items():
        for kind, v in summary_.items():
            if v["count"]:
                table.add_row(backend, kind, str(v["count"]), f"{v['bytes']:,}")
    console.print(table)


def print_diagnostics(console: Console, diagnostics: Sequence[Diagnostic], limit: int = MAX_SHOWN) -> None:
    """Diagnostics as plain text (no markup, no wrapping: the caret must stay under its column)."""
    for d in list(diagnostics)[:limit]:
        head, _, rest = d.render().partition("\n")
        console.print(Text(head, style="red" if d.severity == "error" else "yellow"), soft_wrap=True)
        if rest:
            console.print(Text(rest), soft_wrap=True)
    if len(diagnostics) > limit:
        console.print(f"... and {len(diagnostics) - limit} more")


def to_json(plan: Plan, res: Resolution | None, diagnostics, budget: int | None = None) -> dict:
    out: dict = {
        "plan": plan.name if plan else None,
        "files": list(plan.files) if plan else [],
        "ok": not any(d.severity == "error" for d in diagnostics),
        "diagnostics": [d.to_json() for d in diagnostics],
    }
    if res is not None:
        out["mesh"] = res.mesh
        out["leaves"] = [
            {
                "path": d.path,
                "role": d.role,
                "shape": list(d.shape),
                "dtype": d.dtype,
                "spec": str(d.spec),
                "partition_spec": [list(x) for x in d.spec.dims],
                "shard_shape": list(d.shard_shape),
                "bytes_per_device": d.bytes_per_device,
                "decided_by": d.how,
                "origin": d.origin,
            }
            for d in res.decisions
        ]
        out["summary"] = summary(res)
        out["communication"] = communication(plan, res)
        if budget is not None:
            out["summary"]["device_memory"] = budget
            out["summary"]["fits"] = out["summary"]["total_bytes_per_device"] <= budget
    return out
