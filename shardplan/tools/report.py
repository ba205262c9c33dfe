"""Presenting a resolution: rich tables, a per-device memory summary, and JSON."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shardplan.core import chips, routing
from shardplan.core.cost import communication, summary
from shardplan.core.format import fmt_bytes, fmt_op, fmt_seconds, fmt_shape, layer_group
from shardplan.core.leaves import Decision, Resolution
from shardplan.core.plan import Plan
from shardplan.core.routing import Capacity, ExpertLoad
from shardplan.core.stepcost import KINDS, StepCost
from shardplan.core.timing import StepTime
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
        "state": d.origin,
    }[d.how]


def print_step_hint(console: Console, plan: Plan) -> None:
    """Without a step, what check cannot know (the backend's collectives) and the one way to get it."""
    console.print(
        f"communication per step (backend {plan.backend}): name the step to cost it, "
        "--step FILE:LOSS_FN --batch 'tokens=int32[B,T],...' (fast mode, from the step's jaxpr; "
        "add --compile for XLA's compiled program)",
        markup=False,
        highlight=False,
    )


def print_expert_load(
    console: Console, cost: StepCost, time: StepTime | None, load: ExpertLoad, capacities: Sequence[Capacity]
) -> None:
    """What a stated routing does to the step: the busiest expert shard's share per grouped
    matmul and the compute the step waits for (with a chip's time); the tokens a capacity-style
    dispatch drops; or why it changes nothing."""
    said = f"expert load ({escape(load.describe())})"
    if cost.grouped and time is not None:
        sites = "; ".join(
            f"{escape(os.path.basename(src))} ({groups} experts over {'x'.join(axes)}: busiest shard "
            f"{routing.imbalance(load, groups, math.prod(cost.mesh.get(a, 1) for a in axes)):.2f}x)"
            for src, groups, axes, _ in cost.grouped
        )
        console.print(
            f"{said}: the step waits for the busiest expert shard, {time.imbalance:.2f}x the mean tokens: "
            f"+{fmt_seconds(time.imbalance_s)} of compute (in the figures above) on its grouped matmuls: {sites}"
        )
    elif cost.grouped:
        console.print(f"{said}: name a chip (--chip) for the time the busiest expert shard adds")
    for cap in capacities:
        if not cap.k:
            console.print(
                f"{said}: capacity dispatch ({cap.describe()}) routed by no top-k over the experts, nor argmaxes "
                "as many per layer: the tokens it drops are not estimated"
            )
            continue
        fraction, busiest = routing.dropped(load, cap)
        even, _ = routing.dropped(None, cap)
        console.print(
            f"{said}: capacity dispatch ({cap.describe()}): {fraction:.1%} of token choices over capacity, "
            f"dropped (every expert alike: {even:.1%}); the busiest expert is routed {busiest:.2f}x its slots. "
            "At least this many where groups route differently; the step's time does not change (fixed buffers)"
        )
    if not cost.grouped and not capacities:
        console.print(
            f"{said}: no effect on this step: no grouped matmul runs on split experts with a kernel whose work "
            "follows the routing, and no capacity dispatch (the experts' work is fixed by the program: grouped "
            "matmuls run densely, or experts whole on every device)"
        )


def capacity_json(capacities: Sequence[Capacity], load: ExpertLoad) -> list[dict]:
    out = []
    for cap in capacities:
        row: dict[str, Any] = dict(cap.__dict__, capacity_factor=cap.factor)
        if cap.k:
            row["dropped_fraction"], row["busiest_over_slots"] = routing.dropped(load, cap)
        out.append(row)
    return out


def print_step_cost(
    console: Console,
    name: str,
    cost: StepCost,
    time: StepTime | None = None,
    *,
    limit: int = 15,
) -> None:
    """One step's cost: FLOPs, memory, and every collective with where it comes from."""
    mesh = ",".join(f"{k}={v}" for k, v in cost.mesh.items())
    what = (
        f"{cost.compiler or 'XLA'}'s compiled program"
        if cost.mode == "exact"
        else "the step's jaxpr (no compile)"
        + (", laid out by XLA's propagation" if cost.propagation == "xla" else "")
        + (f", as {cost.compiler} compiles it" if cost.compiler else "")
    )
    console.print(
        f"[bold]step cost[/] {escape(name)}: backend [bold]{cost.backend}[/], {cost.mode} mode ({what}), "
        f"mesh {mesh}, per device; analysed in {cost.seconds:.1f} s"
    )
    m = cost.memory
    mem = Table(title="memory per device", header_style="bold")
    for col in ("params", "optimizer state", "batch", "temporaries", "outputs - aliased", "peak"):
        mem.add_column(col, justify="right", overflow="fold")
    mem.add_row(*(fmt_bytes(x) for x in (m.params, m.opt_state, m.batch, m.temporaries, m.outputs - m.aliased, m.peak)))
    console.print(mem)
    chip = cost.compiler.split(" ", 1)[1].split(":")[0] if " " in cost.compiler else None
    if chip in chips.CHIPS:  # a target's program ("XLA:TPU tpu-v5p:2x2x2"): its peak against the chip's memory
        room = chips.lookup(chip).hbm_bytes
        verdict = "fits" if m.peak <= room else f"does not fit (over by {fmt_bytes(int(m.peak - room))})"
        console.print(
            f"peak {fmt_bytes(m.peak)} per device against {chip}'s {fmt_bytes(int(room))}: {verdict}"
            + (" (fast mode's estimate: add --compile for the compiler's own)" if cost.mode == "fast" else "")
        )
    console.print(
        f"compute: {cost.flops / 1e9:,.3f} GFLOP per device per step; memory traffic: "
        f"{fmt_bytes(int(cost.hbm_bytes))} read and written per device per step"
        + (" (XLA's fusion of elementwise chains assumed)" if cost.mode == "fast" else "")
    )
    if cost.pipeline is not None:
        pp = cost.pipeline
        sched = pp.schedule + (f" x {pp.repeats} repeats" if pp.repeats > 1 else "")
        console.print(
            f"pipeline over {pp.axis} ({pp.stages} stages{' @dcn' if pp.link == 'dcn' else ''}, {sched}, "
            f"{pp.microbatches} microbatches): {pp.steps} loop steps, bubble {pp.bubble:.1%} "
            f"({pp.idle} of {pp.steps * pp.stages} stage-steps idle; they run on stale activations, so the "
            f"FLOPs and time include them); stage to stage: {pp.permute_count} collective permutes, "
            f"{fmt_bytes(pp.permute_bytes)} per device per step"
        )
    by = Table(title="communication per step, per device, by kind and mesh axes", header_style="bold")
    for col in ("collective", "mesh axes", "count", "bytes"):
        by.add_column(col, justify="right" if col in ("count", "bytes") else "left", overflow="fold")
    counts: dict[tuple[str, str], list[int]] = {}
    for c in cost.communication:
        acc = counts.setdefault((c.kind, ",".join(c.axes) or "-"), [0, 0])
        acc[0] += c.count
        acc[1] += c.bytes
    for (kind, axes), (count, nbytes) in sorted(counts.items()):
        by.add_row(kind, axes, str(count), fmt_bytes(nbytes))
    if not counts:
        by.add_row("none", "-", "0", "0 B")
    console.print(by)
    top = Table(title=f"largest collectives (of {len(cost.communication)} groups)", header_style="bold")
    for col in ("collective", "axes", "bytes", "op", "source", "moves (rule)"):
        top.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
    for c in sorted(cost.communication, key=lambda c: -c.bytes)[:limit]:
        source = os.path.basename(c.source) if c.source else "none (library code)"
        moves = f"{c.moves} ({_short(c.rule)})" if c.rule else c.moves
        top.add_row(c.kind, ",".join(c.axes), fmt_bytes(c.bytes), escape(fmt_op(c.op)), escape(source), escape(moves))
    console.print(top)
    if cost.constrained:
        acts = Table(title="constrained activations (per device, one instance)", header_style="bold")
        for col in ("by", "source", "shape", "layout", "bytes", "count"):
            acts.add_column(col, justify="right" if col in ("bytes", "count") else "left", overflow="fold")
        for a in cost.constrained:
            where = os.path.basename(a.source) if a.source else ""
            acts.add_row(
                escape(a.what), escape(where), fmt_shape(a.shape), escape(a.spec), fmt_bytes(a.bytes), str(a.count)
            )
        console.print(acts)
        if cost.constraint_delta:
            moved = "; ".join(
                f"{kind} over {axes or '-'} {'+' if n > 0 else '-'}{fmt_bytes(abs(n))}"
                for kind, axes, n in cost.constraint_delta
            )
            console.print(f"the constraints change this step's communication (vs none): {moved}")
        else:
            console.print("the constraints change no communication of this step")
    if cost.compiler_seconds is not None:
        console.print(f"{cost.compiler}'s own estimate of the step: {fmt_seconds(cost.compiler_seconds)}")
    if time is not None:
        links = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in sorted(time.comm_by_link.items())) or "none"
        local = time.compute_s + time.memory_s + time.launch_s
        console.print(
            f"[bold]step time on {time.chip}[/] (estimate at datasheet rates: compute at peak, memory traffic at "
            f"HBM bandwidth, collectives over their links): compute {fmt_seconds(time.compute_s)} + memory "
            f"{fmt_seconds(time.memory_s)} ({fmt_bytes(int(cost.hbm_bytes))}) + kernel launches "
            f"{fmt_seconds(time.launch_s)} ({cost.kernels:,.0f} kernels) = {fmt_seconds(local)} on the device; "
            f"communication {fmt_seconds(time.comm_s)} ({links}; of it latency {fmt_seconds(time.latency_s)}). "
            f"Step {fmt_seconds(time.overlapped_s)} with communication overlapped (the larger of the two) to "
            f"{fmt_seconds(time.serial_s)} serial (their sum), MFU {time.mfu_overlapped:.0%} to {time.mfu_serial:.0%}"
        )
        how = (
            f"as {cost.compiler}'s schedule runs it: each asynchronous collective while the kernels between "
            "its start and its done run"
            if cost.schedule
            else "as XLA schedules it on an accelerator: gathers of params and sums of gradients combined, the "
            "first gather and the last sum waited for, the others run while layers compute; collectives of "
            "activations waited for, the backward pass's beside its weight gradients' matmuls"
            if cost.mode == "fast"
            else f"{cost.compiler} runs every collective synchronously"
        )
        console.print(
            f"scheduled step {fmt_seconds(time.scheduled_s)}, communication exposed {fmt_seconds(time.exposed_s)} "
            f"of {fmt_seconds(time.comm_s)} ({how})"
        )
    for n in cost.notes:
        console.print(f"[dim]note: {escape(n.text)}[/]")


def print_comparison(
    console: Console, results, budget: int | None = None, costs: Sequence | None = None, times: Sequence | None = None
) -> None:
    table = Table(title="plans side by side (per device)", header_style="bold")
    table.add_column("", overflow="fold")
    for plan, res in results:
        mesh = ",".join(f"{k}={v}" for k, v in res.mesh.items())
        table.add_column(escape(f"{plan.name or plan.files[0]}\n{mesh}"), justify="right", overflow="fold")
    rows = [
        ("params", lambda p, r: summary(r)["param_bytes_per_device"]),
        ("other state", lambda p, r: summary(r)["state_bytes_per_device"]),
        ("optimizer state", lambda p, r: summary(r)["opt_bytes_per_device"]),
        ("total", lambda p, r: summary(r)["total_bytes_per_device"]),
    ]
    for name, fn in rows:
        table.add_row(name, *[fmt_bytes(fn(p, r)) for p, r in results])
    if costs is not None:
        c0 = costs[0]
        label = f"{c0.backend}, {c0.mode}" if all(c.backend == c0.backend for c in costs) else "each plan's backend"
        table.add_row(f"step peak memory ({label})", *[fmt_bytes(c.memory.peak) for c in costs])
        table.add_row(f"step GFLOP ({label})", *[f"{c.flops / 1e9:,.3f}" for c in costs])
        table.add_row(f"memory traffic / step ({label})", *[fmt_bytes(int(c.hbm_bytes)) for c in costs])
        if times is not None:
            table.add_row(
                f"step time on {times[0].chip} (overlapped .. serial)",
                *[f"{fmt_seconds(t.overlapped_s)} .. {fmt_seconds(t.serial_s)}" for t in times],
            )
        for kind in KINDS:
            values = [c.bytes_by_kind().get(kind, 0) for c in costs]
            if any(values):
                table.add_row(f"{kind} / step ({label})", *[fmt_bytes(v) for v in values])
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
    backend: str | None = None,
) -> None:
    mesh = ", ".join(f"{k}={v}" for k, v in res.mesh.items())
    used = backend or plan.backend
    said = f" (--backend; the plan says {plan.backend})" if used != plan.backend else ""
    console.print(
        f"[bold]plan[/] {escape(plan.name or plan.files[0])}  [bold]mesh[/] {mesh}  [bold]backend[/] {used}{said}"
    )
    roles = ("param", "state", "opt") if show_opt else ("param", "state")
    table = Table(
        show_lines=False,
        header_style="bold",
        caption="x N: N arrays of one shape, spec and rule in one row; bytes are each array's (--expand: one row each)",
    )
    for col in ("param path", "global shape", "dtype", "spec", "shard / device", "bytes / device, each", "rule"):
        table.add_column(col, justify="right" if col.startswith("bytes") else "left", overflow="fold")
    for row in group([d for d in res.decisions if d.role in roles], expand):
        d = row.first
        path = escape(row.path) + (f"  [dim]x{row.count}[/]" if row.count > 1 else "")
        if d.role == "state":
            path += "  [dim](state)[/]"
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
        f"({s['n_params']} arrays), "
        + (f"other state {fmt_bytes(s['state_bytes_per_device'])} ({s['n_state']} arrays), " if s["n_state"] else "")
        + f"optimizer state {fmt_bytes(s['opt_bytes_per_device'])} "
        f"({s['n_opt_leaves']} arrays), total [bold]{fmt_bytes(s['total_bytes_per_device'])}[/]"
    )
    if budget is not None:
        total = s["total_bytes_per_device"]
        verdict = "[green]fits[/]" if total <= budget else "[red]does not fit[/]"
        console.print(
            f"device memory budget {fmt_bytes(budget)}: {verdict} "
            f"({100 * total / budget:.1f}% used by params, state and optimizer state at rest)"
        )


def print_compiled_collectives(console: Console, name: str, mesh: dict[str, int], measured: dict) -> None:
    """``lower --report``: per backend, the collectives in its compiled step."""
    table = Table(title=escape(f"collectives per step, per device ({name}, mesh {mesh})"))
    for col in ("backend", "kind", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left", overflow="fold")
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
        out["communication"] = dict(communication(plan, res), backend="gather-whole lowering", mode="specs only")
        if budget is not None:
            out["summary"]["device_memory"] = budget
            out["summary"]["fits"] = out["summary"]["total_bytes_per_device"] <= budget
    return out


# -- diff and explain ------------------------------------------------------------------------------
def _pair_groups(changed, expand: bool) -> list[tuple[str, int, Decision, Decision, list]]:
    rows: dict[tuple, list] = {}
    for a, b in changed:
        key = (a.path if expand else layer_group(a.path), a.shape, a.dtype, a.spec, b.spec, a.role)
        if key in rows:
            rows[key][1] += 1
            rows[key][4].append(a.path)
        else:
            rows[key] = [a.path, 1, a, b, [a.path]]
    return [(k[0] if n > 1 else p, n, a, b, paths) for k, (p, n, a, b, paths) in rows.items()]


def print_diff(console: Console, d, before: str, after: str, *, expand: bool = False) -> None:
    ra, rb = d.before.resolution, d.after.resolution
    mesh = lambda r: ",".join(f"{k}={v}" for k, v in r.mesh.items())
    console.print(
        f"[bold]before[/] {escape(d.before.plan.name or before)} (mesh {mesh(ra)})  ->  "
        f"[bold]after[/] {escape(d.after.plan.name or after)} (mesh {mesh(rb)})"
    )
    if not d.changed:
        console.print("no param or optimizer leaf changes placement")
    else:
        per_path: dict[str, list] = {}
        for m in d.moves:
            per_path.setdefault(m.path, []).append(m)
        table = Table(
            header_style="bold",
            title=f"{len(d.changed)} of {len(ra.decisions)} leaves change placement",
            caption="x N: N arrays in one row; bytes and reshard are the row's total (--expand: one row each)",
        )
        for col in ("path", "global shape", "before", "after", "bytes / device, row total", "reshard, row total"):
            table.add_column(col, justify="right" if col.startswith(("bytes", "reshard")) else "left")
        for path, n, a, b, paths in _pair_groups(d.changed, expand):
            moved: dict[str, int] = {}
            for p in paths:
                for m in per_path.get(p, []):
                    label = f"{m.kind} {','.join(m.axes)}"
                    moved[label] = moved.get(label, 0) + m.bytes
            table.add_row(
                escape(path) + (f"  [dim]x{n}[/]" if n > 1 else "") + ("  [dim](opt)[/]" if a.role == "opt" else ""),
                fmt_shape(a.shape),
                str(a.spec),
                str(b.spec),
                f"{fmt_bytes(a.bytes_per_device * n)} -> {fmt_bytes(b.bytes_per_device * n)}",
                "\n".join(f"{k} {fmt_bytes(v)}" for k, v in moved.items()) or "local slice",
            )
        console.print(table)
    sa, sb = summary(ra), summary(rb)
    console.print(
        f"per device at rest: params {fmt_bytes(sa['param_bytes_per_device'])} -> "
        f"{fmt_bytes(sb['param_bytes_per_device'])}, optimizer state {fmt_bytes(sa['opt_bytes_per_device'])} -> "
        f"{fmt_bytes(sb['opt_bytes_per_device'])}, total {fmt_bytes(sa['total_bytes_per_device'])} -> "
        f"[bold]{fmt_bytes(sb['total_bytes_per_device'])}[/]"
    )
    totals = d.reshard_bytes()
    if totals:
        parts = ", ".join(f"{k} over {','.join(ax)} {fmt_bytes(v)}" for (k, ax), v in sorted(totals.items()))
        console.print(
            f"resharding live state or a checkpoint from before to after moves, per device: {parts} "
            f"({fmt_bytes(sum(totals.values()))} in all; the collectives of the compiled reshard)",
            highlight=False,
        )


def diff_json(d) -> dict:
    def side(r) -> dict:
        return {"plan": r.plan.name, "mesh": r.resolution.mesh, "summary": summary(r.resolution)}

    reshard = sorted(d.reshard_bytes().items())
    return {
        "before": side(d.before),
        "after": side(d.after),
        "changed": [
            {
                "path": a.path,
                "role": a.role,
                "shape": list(a.shape),
                "before": str(a.spec),
                "after": str(b.spec),
                "bytes_per_device_before": a.bytes_per_device,
                "bytes_per_device_after": b.bytes_per_device,
            }
            for a, b in d.changed
        ],
        "reshard": [{"kind": k, "axes": list(ax), "bytes_per_device": v} for (k, ax), v in reshard],
    }


def print_explain(console: Console, e) -> None:
    d = e.decision
    console.print(f"[bold]{escape(e.path)}[/] ({e.role}) {fmt_shape(d.shape)} {d.dtype}")
    kind = "opt" if e.role == "opt" else "param"
    if not e.trials:
        console.print(f"  no {kind} rules in the plan")
    for i, t in enumerate(e.trials, 1):
        r = t.rule
        verdict = (
            "[green]matches, decides[/]"
            if t.decided
            else "[yellow]matches, but an earlier rule decided[/]"
            if t.matched
            else "no match"
        )
        console.print(f'  {i}. {escape(_short(r.origin))}  {kind} "{escape(r.pattern)}" {r.spec}: {verdict}')
        if t.near:
            console.print(f"       near miss: {escape(t.near)}", style="dim")
    if e.annotation:
        mapped = ", ".join(f"{n} -> {m}" for n, m in e.axis_rules) or "no axis rules"
        console.print(f"  annotation {tuple(e.annotation)}: {escape(mapped)}")
    elif e.role != "opt":
        console.print("  annotation: none")
    if e.role != "opt":
        console.print(f"  default: {e.default if e.default is not None else 'none'}")
    how = {
        "rule": f"the rule at {_short(d.origin)}",
        "axes": "its annotation via the axis rules",
        "default": f"the default at {_short(d.origin)}",
        "mirror": f"mirroring param {d.origin}",
        "scalar": "a scalar: replicated",
        "replicated": "mirrors no param: replicated",
        "state": f"{d.origin}: replicated",
    }.get(d.how, d.how)
    console.print(
        f"  [bold]decided[/]: {d.spec} by {escape(how)}; {fmt_shape(d.shard_shape)} per device "
        f"({fmt_bytes(d.bytes_per_device)})"
    )


def explain_json(e) -> dict:
    d = e.decision
    return {
        "path": e.path,
        "role": e.role,
        "trials": [
            {
                "origin": t.rule.origin,
                "pattern": t.rule.pattern,
                "spec": str(t.rule.spec),
                "matched": t.matched,
                "decided": t.decided,
                "near_miss": t.near,
            }
            for t in e.trials
        ],
        "annotation": list(e.annotation) if e.annotation else None,
        "default": e.default,
        "decision": {"spec": str(d.spec), "how": d.how, "origin": d.origin, "shard_shape": list(d.shard_shape)},
    }


def layout_text(dims: Sequence[Sequence[str]]) -> str:
    """A layout as a plan writes it: ``(data, _, (model, seq))``."""
    return "(" + ", ".join("_" if not d else d[0] if len(d) == 1 else "(" + ", ".join(d) + ")" for d in dims) + ")"


def _grouped(rows: Sequence, mesh: dict[str, int]) -> list[tuple[Any, int, int]]:
    """Equal values (source, op, shape, layout, pass: a layer's repeats) once, with their count,
    largest per device first: (value, count, bytes per device)."""
    counts: dict[tuple, list] = {}
    for v in rows:
        key = (v.source, v.op, v.shape, v.dims, v.backward, v.activation)
        counts.setdefault(key, [v, 0])[1] += 1
    out = [(v, n, v.local_bytes(mesh)) for v, n in counts.values()]
    out.sort(key=lambda x: (-x[2], -x[1], x[0].source, x[0].op))
    return out


def print_layouts(console: Console, rows: Sequence, mesh: dict[str, int], limit: int) -> None:
    """``check --layouts``: the step's largest values as XLA lays them out, and which of them
    every device holds whole."""
    grouped = _grouped(rows, mesh)
    shape = ",".join(f"{k}={v}" for k, v in mesh.items())
    t = Table(
        title=f"the step's largest values as XLA lays them out (Shardy's propagation, run offline; mesh {shape}; "
        f"{len(grouped)} distinct of {len(rows)} values)",
        header_style="bold",
    )
    right = ("per device", "of the whole", "times")
    for col in ("where", "op", "shape", "layout", *right):
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    for v, n, local in grouped[:limit]:
        whole = v.itemsize
        for s in v.shape:
            whole *= s
        share = "all (whole)" if local >= whole else f"1/{round(whole / local)}"
        where = os.path.basename(v.source) if v.source else "library code"
        t.add_row(
            where,
            fmt_op(v.op) + (" (backward)" if v.backward else ""),
            fmt_shape(v.shape),
            layout_text(v.dims),
            fmt_bytes(local),
            share,
            f"x{n}",
        )
    console.print(t)
    # whole values worth an act rule: at least an eighth of the largest value's bytes per device
    floor = grouped[0][2] / 8 if grouped else 0
    whole = [(v, local) for v, _, local in grouped if not any(v.dims) and v.activation and local >= floor]
    if whole:
        v, local = whole[0]
        console.print(
            f"{len(whole)} of the forward pass's activations are whole on every device, each at least an eighth "
            f"of the largest value's size; the largest: "
            f"{fmt_op(v.op)} {fmt_shape(v.shape)} at {os.path.basename(v.source) or 'library code'} "
            f"({fmt_bytes(local)}). An act rule on the module that makes it splits it (docs/language.md).",
            markup=False,
            highlight=False,
        )


def layouts_json(rows: Sequence, mesh: dict[str, int]) -> list[dict]:
    """``--format json``'s ``layouts``: every distinct value, largest per device first."""
    return [
        {
            "source": v.source,
            "op": v.op,
            "shape": list(v.shape),
            "layout": [list(d) for d in v.dims],
            "bytes_per_device": local,
            "backward": v.backward,
            "count": n,
        }
        for v, n, local in _grouped(rows, mesh)
    ]
