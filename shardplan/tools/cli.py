"""The ``shardplan`` command line. Errors print as located diagnostics, never tracebacks.

Exit codes: 0 clean, 1 errors (or warnings with --strict), 2 usage errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from shardplan import api
from shardplan.core import backends, callables, chips, lock, optimizers, routing, targets, timing
from shardplan.core.format import fmt_bytes, fmt_count, parse_bytes
from shardplan.core.meshes import parse_links_arg, parse_mesh_arg, with_links
from shardplan.core.resolve import DEFAULT_REPLICATED_THRESHOLD
from shardplan.core.shapes import ITEMSIZE, parse_batch_arg
from shardplan.errors import LaunchError, ShardPlanError, as_error, error, warning
from shardplan.lang.fmt import format_text
from shardplan.lang.loader import read_file
from shardplan.runtime import devices
from shardplan.tools import launch, report
from shardplan.tools.emit import emit
from shardplan.version import version

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    pass


def _simulate_devices(n: int | None) -> None:
    """Simulated CPU devices: must run before jax is imported."""
    if n:
        try:
            devices.simulate(n)
        except RuntimeError as e:
            raise _UsageError(str(e)) from None


def _quiet_absl() -> None:
    """Orbax logs through absl (a damaged checkpoint file even at ERROR); the CLI reports
    through diagnostics instead, once."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.FATAL)
    except ImportError:
        pass


class _Once(argparse.Action):
    """A single-valued option that may be repeated only with the same value: ``--devices 7
    --mesh-size 8`` (one option, two spellings) is a usage error, not the last one silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, f"_{self.dest}_given", None)
        if seen is not None and seen[1] != values:
            parser.error(f"{option_string} {values}: already given as {seen[0]} {seen[1]}; give it once")
        setattr(namespace, f"_{self.dest}_given", (option_string, values))
        setattr(namespace, self.dest, values)


def _count(text: str) -> int:
    """An argparse type: a positive whole number in ASCII digits (``int`` accepts '٣' and ' 3_0 ')."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive whole number (e.g. 8)")
    return int(text)


def _index(text: str) -> int:
    """An argparse type: a whole number >= 0 in ASCII digits (a checkpoint step)."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number >= 0 (e.g. 100)")
    return int(text)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (not nan, inf or 1e999)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not text.isascii() or not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds (a finite number >= 0, e.g. 30)")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a number between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not text.isascii() or not 0 <= value <= 1:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"'{text}' is not a fraction between 0 and 1 (e.g. 0.1)")
    return value


def _bytes_arg(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise _UsageError(f"{flag}: {e}") from None


def _mesh_arg(args) -> dict[str, int | None] | None:
    return parse_mesh_arg(args.mesh) if args.mesh else None


def cmd_check(args, out: Console, err: Console) -> int:
    budget = _bytes_arg(args.device_memory, "--device-memory")
    if budget == 0:
        raise _UsageError("--device-memory: a budget of 0 bytes fits nothing; give the device's memory, e.g. 80GB")
    threshold = _bytes_arg(args.replicated_threshold, "--replicated-threshold")
    if args.model and args.shapes:
        raise _UsageError("give --model or --shapes, not both")
    if args.vs and not (args.model or args.shapes):
        raise _UsageError("--vs compares plans against a model: give --model or --shapes")
    _check_step_args(args)
    if args.devices is not None and args.devices < 1:
        raise _UsageError(f"--devices {args.devices}: give a positive device count")
    options = dict(
        mesh=_mesh_arg(args),
        devices=args.devices,
        replicated_threshold=threshold if threshold is not None else DEFAULT_REPLICATED_THRESHOLD,
    )
    if (args.locked or args.max_replicated_fraction is not None) and not (args.model or args.shapes):
        raise _UsageError("--locked and --max-replicated-fraction check a layout: give --model or --shapes")
    fraction = args.max_replicated_fraction
    if fraction is not None and not 0 <= fraction <= 1:
        raise _UsageError(f"--max-replicated-fraction {fraction}: give a fraction between 0 and 1")
    first = api.check(
        args.plan, model=args.model, shapes=args.shapes, optimizer=args.optimizer, cache=not args.no_cache, **options
    )
    _guards(args, first)
    if args.locked:  # a guard that passed says so: silence would read as "not checked"
        err.print(f"the layout matches {args.locked}", markup=False, highlight=False)
    others = [api.check(p, leaves=first.leaves, **options) for p in args.vs or []]
    results = [first] + others
    for r in results:
        for note in r.notes:
            err.print(f"note: {note}", style="dim", markup=False, highlight=False)
    costs = _step_costs(args, results) if args.step else None
    shown = [_warnings(r, c) for r, c in zip(results, costs or [None] * len(results), strict=True)]
    times = None
    chip_name = args.chip or targets.parse(args.target).chip
    if chip_name and costs is not None:
        links = parse_links_arg(args.link or [])
        chip = chips.lookup(chip_name)
        times = [
            timing.step_time(c, with_links(r.plan, links), chip, args.expert_load)
            for c, r in zip(costs, results, strict=True)
        ]
    capacities = (
        api.expert_capacity(args.model, args.step, args.batch, _step_optimizer(args))
        if args.expert_load is not None
        else ()
    )
    all_diags = [d for w in shown for d in w]
    laid_out = _layouts(args, first.plan) if args.layouts is not None else None
    if args.format == "json":
        docs = [report.to_json(r.plan, r.resolution, list(w), budget) for r, w in zip(results, shown, strict=True)]
        for i, (doc, cost) in enumerate(zip(docs, costs or [], strict=False)):
            doc["step_cost"] = cost.to_json()
            if times is not None:
                doc["step_cost"]["time"] = times[i].to_json()
            if args.expert_load is not None:
                doc["step_cost"]["expert_capacity"] = report.capacity_json(capacities, args.expert_load)
            if budget is not None:
                doc["step_cost"]["fits"] = cost.memory.peak <= budget
        if laid_out is not None:
            docs[0]["layouts"] = report.layouts_json(laid_out[0], laid_out[1])
        out.print_json(json.dumps(docs[0] if len(docs) == 1 else {"plans": docs}))
    else:
        if first.resolution is not None:
            report.print_text(
                out,
                first.plan,
                first.resolution,
                expand=args.expand,
                show_opt=args.show_opt,
                budget=budget,
                backend=args.backend,
            )
            if costs is None:
                report.print_step_hint(out, first.plan)
        if costs is not None:
            report.print_step_cost(out, first.plan.name or args.plan, costs[0], times[0] if times else None)
            if args.expert_load is not None:
                report.print_expert_load(out, costs[0], times[0] if times else None, args.expert_load, capacities)
        if laid_out is not None:
            report.print_layouts(out, laid_out[0], laid_out[1], args.layouts)
        if others:
            report.print_comparison(out, [(r.plan, r.resolution) for r in results], budget, costs, times)
        report.print_diagnostics(err, all_diags)
        if first.resolution is None:
            plan = first.plan
            axes = ", ".join(f"{a.name}={a.size if a.size is not None else '*'}" for a in plan.mesh)
            out.print(
                f"plan {plan.name or args.plan}: ok (mesh {axes}; {len(plan.params)} param rules, "
                f"{len(plan.axes)} axis rules). Pass --model or --shapes to check against a model.",
                markup=False,
                highlight=False,
            )
    if budget is not None and not all(r.fits(budget) for r in results):
        return EXIT_ERRORS
    if budget is not None and costs is not None and any(c.memory.peak > budget for c in costs):
        err.print(f"a step needs more than --device-memory {fmt_bytes(budget)} per device", markup=False)
        return EXIT_ERRORS
    if args.strict and all_diags:
        return EXIT_ERRORS
    return EXIT_OK


def _guards(args, result) -> None:
    """What a team pins in CI: the layout of a lock file, a cap on replicated parameter bytes."""
    diags = api.check_lock(result, args.locked) if args.locked else []
    if args.max_replicated_fraction is not None:
        fraction, whole = lock.replicated_fraction(result.resolution.decisions)
        if fraction > args.max_replicated_fraction:
            biggest = ", ".join(f"{d.path} ({fmt_bytes(d.nbytes)})" for d in whole[:3])
            diags.append(
                error(
                    "replicated-fraction",
                    f"{100 * fraction:.1f}% of parameter bytes are whole on every device, above the "
                    f"{100 * args.max_replicated_fraction:.1f}% allowed; the largest: {biggest}",
                    "shard those params with rules, or raise --max-replicated-fraction",
                    path="--max-replicated-fraction",
                )
            )
    if diags:
        raise as_error(diags)


def _two_plans_args(args) -> dict:
    if bool(args.model) == bool(args.shapes):
        raise _UsageError("give the model: --model FILE.py:FACTORY or --shapes FILE.json")
    if args.devices is not None and args.devices < 1:
        raise _UsageError(f"--devices {args.devices}: give a positive device count")
    return dict(
        model=args.model,
        shapes=args.shapes,
        optimizer=args.optimizer,
        mesh=_mesh_arg(args),
        devices=args.devices,
        cache=not args.no_cache,
    )


def cmd_diff(args, out: Console, err: Console) -> int:
    d = api.diff(args.before, args.after, **_two_plans_args(args))
    if args.format == "json":
        out.print_json(json.dumps(report.diff_json(d)))
    else:
        report.print_diff(out, d, str(args.before), str(args.after), expand=args.expand)
    return EXIT_OK


def cmd_explain(args, out: Console, err: Console) -> int:
    e = api.explain(args.plan, args.path, **_two_plans_args(args))
    if args.format == "json":
        out.print_json(json.dumps(report.explain_json(e)))
    else:
        report.print_explain(out, e)
    return EXIT_OK


def cmd_lock(args, out: Console, err: Console) -> int:
    options = _two_plans_args(args)
    result = api.check(
        args.plan,
        leaves=api.model_leaves(
            model=options["model"], shapes=options["shapes"], optimizer=options["optimizer"], cache=options["cache"]
        ),
        mesh=options["mesh"],
        devices=options["devices"],
    )
    argv = ["shardplan", "lock", str(args.plan)]
    for flag, value in (
        ("--model", args.model),
        ("--shapes", args.shapes),
        ("--mesh", args.mesh),
        ("--devices", args.devices),
        ("-o", args.output),
    ):
        argv += [flag, str(value)] if value else []
    argv += ["--optimizer", args.optimizer] if args.optimizer != "adam" else []
    for note in result.notes:  # e.g. a '*' axis sized from this machine's devices
        err.print(f"note: {note}", style="dim", markup=False, highlight=False)
    text = api.lock_text(result, " ".join(argv))
    if args.output:
        Path(args.output).write_text(text)
        err.print(f"wrote {args.output}: {len(text.splitlines()) - 2} layout lines", markup=False, highlight=False)
    else:
        out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    return EXIT_OK


def cmd_fmt(args, out: Console, err: Console) -> int:
    """Rewrite plans in the canonical layout; with --check, only say which differ (exit 1)."""
    changed = 0
    errors: list = []
    for name in args.files:
        try:
            text = read_file(Path(name))
            formatted = format_text(text, name)
        except ShardPlanError as e:
            errors += e.diagnostics
            continue
        if formatted == text:
            continue
        changed += 1
        if args.check:
            diff = difflib.unified_diff(text.splitlines(True), formatted.splitlines(True), name, f"{name} (formatted)")
            out.print("".join(diff), end="", markup=False, highlight=False, soft_wrap=True)
        else:
            Path(name).write_text(formatted)
            err.print(f"formatted {name}", markup=False, highlight=False)
    if errors:
        raise as_error(errors)
    if args.check and changed:
        err.print(f"{changed} file(s) would be reformatted (run shardplan fmt FILES)", markup=False)
        return EXIT_ERRORS
    return EXIT_OK


def cmd_lsp(args, out: Console, err: Console) -> int:
    try:
        from shardplan.tools import lsp
    except ImportError:
        raise _UsageError("the language server needs pygls: pip install 'shardplan[lsp]'") from None
    lsp.main()
    return EXIT_OK


def cmd_cache(args, out: Console, err: Console) -> int:
    from shardplan.core import shapecache

    if args.cache_command == "clear":
        out.print(f"removed {shapecache.clear()} cached model shapes from {shapecache.cache_dir()}", markup=False)
    else:
        out.print(str(shapecache.cache_dir()), markup=False)
    return EXIT_OK


def _warnings(result, cost) -> tuple:
    """A check's warnings; with a step, less the axis rules no param uses that the step's
    activations do (the model constrains activations with those names: the rules are used)."""
    if cost is None:
        return result.warnings
    used = set(cost.logical_names)
    fallbacks = tuple(
        warning(
            "shard-map-fallback",
            f"the shard_map step runs {op} on whole operands ({fmt_bytes(n)} per device per step made whole)",
            "the partitioner has no local rule for this layout (docs/backends.md lists the ones it has): split the "
            "operands as a listed rule needs, or use the auto backend for this model",
            path=source or op,
        )
        for op, source, n in cost.fallbacks
    )
    return (
        tuple(
            w
            for w in result.warnings
            if not (
                w.code == "unused-axis-rule" and any(a.span == w.span and a.logical in used for a in result.plan.axes)
            )
        )
        + fallbacks
    )


def _check_step_args(args) -> None:
    if args.step and not args.model:
        raise _UsageError("--step needs the model's code: give --model FILE.py:FACTORY (not --shapes)")
    if args.step and not args.batch:
        raise _UsageError("--step needs the batch's shapes: --batch 'tokens=int32[256,4096],labels=int32[256,4096]'")
    if (args.batch or args.compile) and not args.step:
        raise _UsageError("--batch and --compile describe a step: name it with --step FILE:LOSS_FN")
    if args.propagation != "shardplan" and (args.compile or not args.step):
        raise _UsageError("--propagation says how fast mode lays a step out: name the step, without --compile")
    if args.layouts is not None and not args.step:
        raise _UsageError("--layouts lists a step's values: name the step with --step and --batch")
    if (args.chip or args.link) and not args.step:
        raise _UsageError("--chip and --link estimate a step's time: name the step with --step and --batch")
    if args.expert_load is not None:
        if not args.step:
            raise _UsageError(
                "--expert-load costs a step's experts (tokens over capacity; with --chip, the busiest shard's "
                "time): name the step (--step, --batch)"
            )
        args.expert_load = routing.parse(args.expert_load)
    target = targets.parse(args.target)
    targets.agree(target, args.chip)
    if args.devices is None and target.devices is not None and not args.mesh:
        args.devices = target.devices  # a '*' axis takes the target's devices, not this machine's


def _step_optimizer(args) -> str:
    """The optimizer a step is costed with: ``--optimizer``'s, adamw where it names none."""
    return "adamw" if args.optimizer in ("none", "recorded") else args.optimizer


def _layouts(args, plan) -> tuple[tuple, dict[str, int]]:
    """(the step's values as XLA lays them out, the mesh) for ``--layouts``."""
    rows = api.layouts(
        plan, model=args.model, step=args.step, batch=args.batch, optimizer=_step_optimizer(args), devices=args.devices
    )
    return rows, plan.mesh_shape(args.devices)


def _step_costs(args, results) -> list:
    optimizer = _step_optimizer(args)

    def cost(plan, mode: str):
        return api.analyze(
            plan,
            model=args.model,
            step=args.step,
            batch=args.batch,
            optimizer=optimizer,
            backend=args.backend,
            mode=mode,
            devices=args.devices,
            target=args.target,
            propagation=args.propagation,
        )

    costs = [cost(r.plan, "exact" if args.compile else "fast") for r in results]
    if args.compile and args.expert_load is not None:
        # The compiled program's rows are fixed when it compiles; which of them a device's
        # grouped kernel runs follows the routing: the partitioner's dry run says which (the
        # shard_map backend compiles exactly its program; the auto backend has none).
        costs = [
            dataclasses.replace(c, grouped=cost(r.plan, "fast").grouped) if c.backend == "shard_map" else c
            for c, r in zip(costs, results, strict=True)
        ]
    return costs


def cmd_show(args, out: Console, err: Console) -> int:
    import jax

    from shardplan.runtime import distributed, live

    distributed.initialize()  # under srun / mpirun / launch: one job, not N copies
    if jax.process_index() != 0:  # one report, from process 0; every process still verifies its arrays
        out = Console(quiet=True)

    shown = api.show(
        args.plan,
        args.model,
        mesh=_mesh_arg(args),
        optimizer=args.optimizer,
        axis_types=args.axis_types,
        batch=api.zeros_batch(args.batch),
    )
    mesh = shown.placement.mesh
    out.print(
        f"[bold]{report.escape(shown.placement.plan.name or args.plan)}[/] mesh "
        f"{shown.placement.mesh_shape} over {mesh.devices.size} {mesh.devices.flat[0].platform} devices"
    )
    live.show(shown.model, console=out, title="params", expand=args.expand, max_visualize=args.visualize)
    if shown.optimizer is not None:
        live.show(shown.optimizer, console=out, title="optimizer state", expand=args.expand, visualize=False)
    if shown.batch is not None:
        live.show(shown.batch, console=out, title="batch", expand=True, max_visualize=args.visualize)
    out.print("[green]every array lives where the plan says[/]")
    return EXIT_OK


def cmd_lower(args, out: Console, err: Console) -> int:
    from pathlib import Path

    lowered = api.lower(
        args.plan,
        args.model,
        optimizer=args.optimizer,
        mesh=_mesh_arg(args),
        devices=args.devices,
        batch=api.zeros_batch(args.batch),
    )
    source = emit(lowered.plan, lowered.params, lowered.opt, lowered.lowering, args.backend)
    if args.output:
        Path(args.output).write_text(source)
        err.print(f"wrote {args.output} ({len(source.splitlines())} lines, backend {args.backend})", markup=False)
    elif not args.report:
        out.print(source, markup=False, highlight=False, soft_wrap=True)
    if args.report:
        from shardplan.core.lowering import predict

        records: dict = {}
        measured = api.compiled_collectives(lowered, optimizer=args.optimizer, loss=args.loss, records=records)
        report.print_compiled_collectives(out, lowered.plan.name or args.plan, lowered.params.mesh, measured)
        rec = records.get("shard_map")
        if rec is not None:
            out.print(
                "shard_map (partitioned step), issued by its per-device code: "
                + (
                    ", ".join(f"{k} {v['count']} / {v['bytes']:,} B" for k, v in rec.summary().items() if v["count"])
                    or "nothing"
                ),
                markup=False,
            )
            if rec.fallbacks:
                out.print("ops run on whole (gathered) operands, no local rule for their layout:", markup=False)
                for f in rec.fallbacks:
                    out.print(f"  {f.op} at {f.source or '?'}: {f.why}", markup=False)
            else:
                out.print("no op fell back to gathering its operands", markup=False)
        predicted = predict(lowered.lowering)
        out.print(
            "emitted module (gather-whole lowering), predicted from the plan: "
            + ", ".join(f"{k} {v['bytes']:,} B" for k, v in predicted.items() if v["bytes"]),
            markup=False,
        )
    return EXIT_OK


def cmd_ckpt_info(args, out: Console, err: Console) -> int:
    from rich.table import Table

    from shardplan.runtime import checkpoint

    manager = checkpoint.open_readonly(args.directory)
    all_steps = sorted(manager.all_steps())
    bad = checkpoint.problems(Path(manager.directory), all_steps)
    steps = [s for s in all_steps if s not in {p.step for p in bad}]
    if not steps:
        raise as_error([p.diagnostic() for p in bad])
    if args.step is not None and args.step in {p.step for p in bad}:
        raise as_error([p.diagnostic() for p in bad if p.step == args.step])
    if args.step is not None and args.step not in steps:
        raise as_error(
            [
                error(
                    "no-such-step",
                    f"step {args.step} is not in {args.directory}",
                    f"complete steps: {', '.join(map(str, steps))}",
                    path=args.directory,
                )
            ]
        )
    out.print(f"[bold]{report.escape(str(args.directory))}[/]: complete steps {', '.join(map(str, steps))}")
    summary = Table(header_style="bold")
    for col in ("step", "plan", "mesh", "backend", "processes", "shardplan"):
        summary.add_column(col, overflow="fold")
    infos = [checkpoint.step_info(manager, s) for s in steps]
    for info in infos:
        m = info.meta
        summary.add_row(
            str(info.step),
            report.escape(f"{m.get('plan_name')} ({', '.join(m.get('plan_files', []))})"),
            ", ".join(f"{k}={v}" for k, v in (m.get("mesh") or {}).items()),
            str(m.get("backend")),
            str(m.get("process_count")),
            str(m.get("shardplan_version")),
        )
    out.print(summary)
    info = next(i for i in infos if i.step == (args.step if args.step is not None else steps[-1]))
    for item, leaves in info.leaves.items():
        table = Table(title=f"step {info.step}: {item}", header_style="bold")
        for col in ("path", "shape", "dtype", "bytes"):
            table.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for path, shape, dtype in leaves:
            n = math.prod(shape) * ITEMSIZE.get(dtype, 0)
            table.add_row(report.escape(path), str(shape), dtype, fmt_bytes(n))
        out.print(table)
    if bad:  # the readable steps are shown; the unreadable ones are errors, each named
        raise as_error([p.diagnostic() for p in bad])
    return EXIT_OK


def cmd_launch(args, out: Console, err: Console) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("give the command to run after --, e.g. shardplan launch -n 2 -- python train.py")
    if args.n < 1 or args.devices_per_process < 1:
        raise _UsageError("-n and --devices-per-process must be positive")
    if args.timeout is not None and args.timeout <= 0:
        raise _UsageError(
            f"--timeout {args.timeout:g} would stop every rank at once: give the run's bound in seconds "
            "(e.g. 600), or leave it out for no bound"
        )
    try:
        code, results, summary = launch.launch(
            command, args.n, args.devices_per_process, failure_grace_s=args.failure_grace, timeout_s=args.timeout
        )
    except LaunchError as e:  # the command line names nothing runnable: a usage error
        report.print_diagnostics(err, e.diagnostics)
        return EXIT_USAGE
    (err if code else out).print(f"shardplan launch: {summary}", highlight=False, markup=False)
    return code


# Codes that, located at a flag, mean the command line itself is malformed or contradicts itself.
_USAGE_CODES = frozenset(
    {
        "bad-mesh-arg",
        "bad-model-arg",
        "bad-argument",
        "unknown-optimizer",
        "unknown-chip",
        "bad-target",
        "bad-axis-types",
        "axis-size",
        "two-inferred-sizes",
        "mesh-devices",
        "mesh-needs-devices",
    }
)


def _is_usage(e: ShardPlanError) -> bool:
    """Exit 2, not 1: every error is a malformed or contradictory flag, located at that flag."""
    errors = e.errors
    return bool(errors) and all(d.code in _USAGE_CODES and (d.path or "").startswith("-") for d in errors)


def cmd_suggest(args, out: Console, err: Console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from shardplan import planner

    budget = _bytes_arg(args.device_memory, "--device-memory")
    if budget == 0:
        raise _UsageError("--device-memory: a budget of 0 bytes fits nothing; give the device's memory, e.g. 80GB")
    if not args.batch:
        raise _UsageError(
            "--batch: the step needs the batch's shapes, e.g. --batch 'tokens=int32[8,1024],labels=int32[8,1024]'"
        )
    if args.output and Path(args.output).is_dir():
        raise _UsageError(f"-o {args.output}: is a directory; name the .splan file to write")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise _UsageError(f"-o {args.output}: its folder does not exist; create it or name another file")
    common = dict(
        model=args.model,
        step=args.step,
        batch=args.batch,
        devices=args.devices,
        chip=args.chip,
        device_memory=budget,
        optimizer=args.optimizer,
    )
    if args.start:
        if (
            args.devices_per_host
            or args.top != 5
            or args.confirm != 3
            or args.no_compile
            or args.target is not None
            or args.backend != "auto"
        ):
            raise _UsageError(
                "--from keeps the plan's mesh and backend and proposes rule changes: --devices-per-host, --top, "
                "--confirm, --no-compile, --target and --backend do not apply"
            )
        return _improve(args, out, err, dict(common, chip=args.chip or "h100"))
    if args.devices is None:
        raise _UsageError("--devices: how many devices the plan's mesh has (or --from PLAN.splan)")
    kw = dict(
        common,
        devices_per_host=args.devices_per_host,
        top=args.top,
        confirm=0 if args.no_compile else args.confirm,
        target=args.target,
        backend=args.backend,
    )
    live = err.is_terminal and args.format == "text"
    if live:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True
        ) as bar:
            task = bar.add_task("tracing the step", total=None)
            count = [0]

            def progress(line: str) -> None:
                count[0] += 1
                bar.update(task, description=f"{fmt_count(count[0], 'plan')} costed; {line}")

            result = planner.suggest(**kw, progress=progress)
    else:
        result = planner.suggest(**kw)
    if args.output:
        Path(args.output).write_text(result.text)
    if args.format == "json":
        out.print_json(json.dumps(dict(result.to_json(), ok=True, output=args.output)))
        return EXIT_OK
    if not args.output:  # as written: rich would wrap long comment lines
        out.file.write(result.text)
        out.file.flush()
    for note in result.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    err.print(
        f"{fmt_count(result.searched, 'plan')} costed in {result.search_s:.1f} s "
        f"({fmt_count(result.traces, 'trace')})"
        + (f", the best confirmed in exact mode in {result.confirm_s:.1f} s" if result.best.exact_step_s else "")
        + (f"; written to {args.output}" if args.output else ""),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_OK


def _improve(args, out: Console, err: Console, common: dict) -> int:
    from shardplan import planner

    result = planner.improve(args.start, **common)
    if args.output:
        Path(args.output).write_text(result.text)
    if args.format == "json":
        out.print_json(json.dumps(dict(result.to_json(), ok=True, output=args.output)))
        return EXIT_OK
    if not result.changes:
        err.print(
            f"{args.start}: no single rule change saves {planner.MIN_GAIN:.0%} of its predicted step "
            f"({result.step_s * 1e3:,.3f} ms on {result.chip}); "
            f"{fmt_count(result.searched, 'plan')} costed in {result.search_s:.1f} s",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_OK
    out.file.write(result.diff)
    out.file.flush()
    prev = result.step_s
    for c in result.changes:
        err.print(
            f"+ {c.rule}  (was {c.before}): step {c.step_s * 1e3:,.3f} ms ({c.step_s / prev - 1:+.1%}), "
            f"peak {fmt_bytes(c.peak)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        prev = c.step_s
    err.print(
        f"{len(result.changes)} change(s): predicted step {result.step_s * 1e3:,.3f} -> "
        f"{result.changes[-1].step_s * 1e3:,.3f} ms on {result.chip} ({-result.gain:+.1%}); "
        f"{fmt_count(result.searched, 'plan')} costed in {result.search_s:.1f} s"
        + (f"; written to {args.output}" if args.output else ""),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardplan", description="Sharding plans for Flax NNX models.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")

    c = sub.add_parser(
        "check",
        help="check a plan offline, alone or against a model's shapes",
        description="Check a plan offline (no devices, abstract shapes).",
    )
    c.add_argument("plan", help="the .splan file")
    c.add_argument("--mesh", help="axis sizes replacing the plan's mesh, e.g. data=32,model=8")
    c.add_argument("--devices", type=_count, help="device count for a '*' mesh axis (default: local devices)")
    src = c.add_argument_group("model (one of)")
    src.add_argument("--model", help="FILE.py:FACTORY or package.module:FACTORY; built with nnx.eval_shape")
    src.add_argument("--shapes", help="a shapes JSON written by shardplan.dump_shapes")
    src.add_argument(
        "--no-cache",
        action="store_true",
        help="rebuild the model's shapes and compile again (skip the shapes and compile caches)",
    )
    c.add_argument(
        "--optimizer",
        choices=(*optimizers.NAMES, "recorded"),
        default="adam",
        help="optimizer state to account for (default adam; 'recorded': the shapes file's)",
    )
    c.add_argument(
        "--format", choices=("text", "json"), default="text", help="text tables (default) or one JSON document"
    )
    c.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    c.add_argument("--device-memory", help="per-device memory budget, e.g. 80GB or 16GiB")
    c.add_argument("--replicated-threshold", help="warn for replicated tensors above this (default 64MiB)")
    c.add_argument("--expand", action="store_true", help="one row per layer instead of grouping x N")
    c.add_argument("--show-opt", action="store_true", help="list optimizer-state leaves too")
    st = c.add_argument_group("the training step (what a step costs)")
    st.add_argument("--step", metavar="FILE:LOSS_FN", help="loss_fn(model, batch) -> scalar, as for train_step")
    st.add_argument(
        "--batch",
        action="append",
        help="input shapes: 'tokens=int32[256,4096],labels=int32[256,4096]' (repeatable; NAME=256x4096:int32 "
        "also read)",
    )
    st.add_argument(
        "--compile",
        action="store_true",
        help="exact mode: compile the real step for the whole mesh (simulated CPU devices in a child process) "
        "and read XLA's program",
    )
    st.add_argument(
        "--target",
        default="cpu",
        help="the compiler whose program is costed: cpu (XLA:CPU, default), a TPU slice (tpu-v5e:2x4, "
        "tpu-v5p:2x2x2, tpu-v6e:4x4) or GPUs (h100:8, h200:2x8, a100-80gb:8, b200:8); with --compile, compiled "
        "offline without the devices; without, fast mode predicts that compiler's program",
    )
    st.add_argument("--backend", choices=backends.NAMES, help="the backend to cost (default: the plan's)")
    st.add_argument(
        "--propagation",
        choices=api.PROPAGATIONS,
        default="shardplan",
        help="fast mode: whose layouts it partitions: shardplan (its own propagation, default), xla (Shardy's, the "
        "pass XLA lays the step out with, run offline; auto backend; about 0.2-1 s more) or auto (xla where "
        "Shardy's propagation runs over the auto backend's step on automatic axes, else shardplan)",
    )
    st.add_argument(
        "--layouts",
        nargs="?",
        const=12,
        type=_count,
        metavar="N",
        help="list the step's N largest values (default 12) as XLA lays them out: Shardy's propagation, run "
        "offline (no compile, any mesh size)",
    )
    st.add_argument("--chip", choices=sorted(chips.CHIPS), help="estimate the step time and MFU on this accelerator")
    st.add_argument(
        "--expert-load",
        metavar="LOAD",
        help="how tokens are routed to experts: tokens per expert (a router histogram: 900,100,500,548, or a "
        "JSON file of them) or the busiest expert's tokens over the mean (1.3); prints the tokens a capacity "
        "dispatch drops and, with --chip, the time the busiest expert shard's grouped matmuls add",
    )
    st.add_argument(
        "--link",
        action="append",
        metavar="AXIS=LINK",
        help="which links a mesh axis crosses for the time estimate: ici (default) or dcn; overrides "
        "the plan's @ici/@dcn tags (repeatable)",
    )
    c.add_argument("--vs", action="append", metavar="PLAN", help="compare with another plan, side by side (repeatable)")
    g = c.add_argument_group("guards for CI")
    g.add_argument("--locked", metavar="LOCK", help="fail with a diff when the layout differs from this lock file")
    g.add_argument(
        "--max-replicated-fraction",
        type=_fraction,
        metavar="F",
        help="fail when more than this fraction of parameter bytes is whole on every device",
    )
    c.set_defaults(func=cmd_check)

    def model_args(q) -> None:
        src = q.add_argument_group("model (one of)")
        src.add_argument("--model", help="FILE.py:FACTORY or package.module:FACTORY; built with nnx.eval_shape")
        src.add_argument("--shapes", help="a shapes JSON written by shardplan.dump_shapes")
        src.add_argument("--no-cache", action="store_true", help="rebuild the model's shapes (skip the shapes cache)")
        q.add_argument("--mesh", help="axis sizes replacing the plans' meshes, e.g. data=4,model=2")
        q.add_argument("--devices", type=_count, help="device count for '*' mesh axes (default: local devices)")
        q.add_argument("--optimizer", choices=(*optimizers.NAMES, "recorded"), default="adam")

    df = sub.add_parser(
        "diff",
        help="what changes between two plans' layouts, and what resharding costs",
        description="Every param and optimizer leaf whose placement differs between two plans (or a "
        "checkpoint directory's stored plan and a plan), per-device bytes before and after, and the "
        "collectives a reshard from the first to the second runs, per device.",
    )
    df.add_argument("before", help="a .splan file, or a checkpoint directory (its stored plan and mesh)")
    df.add_argument("after", help="a .splan file")
    model_args(df)
    df.add_argument(
        "--format", choices=("text", "json"), default="text", help="text tables (default) or one JSON document"
    )
    df.add_argument("--expand", action="store_true", help="one row per layer instead of grouping x N")
    df.set_defaults(func=cmd_diff)

    ex = sub.add_parser(
        "explain",
        help="why one path gets its spec: every rule tried, the decision, near misses",
        description="For one param, state or optimizer-state path: every rule tried in order, which "
        "matched and decided, the annotation and default considered, and rules that would match after "
        "a small change.",
    )
    ex.add_argument("plan")
    ex.add_argument("path", help="the array's path, e.g. blocks/0/attn/query/kernel")
    model_args(ex)
    ex.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or one JSON document")
    ex.set_defaults(func=cmd_explain)

    ls = sub.add_parser(
        "lsp",
        help="the language server for editors (stdio)",
        description="Diagnostics as you type, hover on rules, go to extends, completion, formatting. A plan "
        "names its model in a comment: # shardplan: --model FILE.py:FACTORY [--devices N] [--mesh ...].",
    )
    ls.set_defaults(func=cmd_lsp)

    ca = sub.add_parser(
        "cache",
        help="the shapes cache: models' abstract shapes kept between checks",
        description="`check --model` keeps a model's abstract shapes, keyed by its sources and the library "
        "versions, so the next check skips nnx.eval_shape ($SHARDPLAN_CACHE_DIR; --no-cache bypasses it).",
    )
    ca.add_argument("cache_command", choices=("clear", "dir"), help="clear: delete every entry; dir: print where")
    ca.set_defaults(func=cmd_cache)

    fm = sub.add_parser(
        "fmt",
        help="rewrite plans in the canonical layout (--check: exit 1 and show the diff instead)",
        description="One canonical layout: a statement per line, specs of consecutive rules aligned, "
        "comments kept where they were. Idempotent; never changes what a plan means.",
    )
    fm.add_argument("files", nargs="+", help=".splan files")
    fm.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if a file would change")
    fm.set_defaults(func=cmd_fmt)

    lk = sub.add_parser(
        "lock",
        help="write the layout a plan decides as a reviewable lock file",
        description="Write path -> spec for every param and optimizer leaf (grouped by layer) to a text "
        "file; `check --locked FILE` fails with a diff when the layout drifts from it.",
    )
    lk.add_argument("plan")
    model_args(lk)
    lk.add_argument("-o", "--output", help="write the lock here (default: print it)")
    lk.set_defaults(func=cmd_lock)

    v = sub.add_parser(
        "show",
        help="build a model sharded per a plan and show where every array lives",
        description="Initialise a model directly sharded per the plan, print per-device "
        "shards (and jax.debug.visualize_array_sharding), and check them against the plan.",
    )
    v.add_argument("plan")
    v.add_argument("--model", required=True, help="FILE.py:FACTORY or package.module:FACTORY")
    v.add_argument("--mesh", help="axis sizes replacing the plan's mesh")
    v.add_argument("--optimizer", choices=optimizers.NAMES, default="adam")
    v.add_argument(
        "--batch",
        action="append",
        help="input shapes to place: 'tokens=int32[8,16]' (repeatable; NAME=8x16:int32 also read)",
    )
    v.add_argument("--simulate-devices", type=_count, help="simulated CPU devices (e.g. 8)")
    v.add_argument(
        "--axis-types",
        choices=("auto", "explicit"),
        help="every mesh axis of this type (default: the types the plan's mesh statement gives)",
    )
    v.add_argument("--expand", action="store_true", help="one row per layer")
    v.add_argument("--visualize", type=_index, default=4, help="how many arrays to draw (default 4)")
    v.set_defaults(func=cmd_show)

    lo = sub.add_parser(
        "lower",
        help="emit a standalone step module for a backend; --report: its collectives",
        description="Lower a plan to a standalone Python module (jax, flax, optax only) for the "
        "shard_map or auto backend, and/or report the collectives in each backend's compiled step.",
    )
    lo.add_argument("plan")
    lo.add_argument("--model", required=True, help="FILE.py:FACTORY or package.module:FACTORY")
    lo.add_argument("--backend", choices=backends.NAMES, default="shard_map")
    lo.add_argument("-o", "--output", help="write the module here (default: print it)")
    lo.add_argument("--mesh", help="axis sizes replacing the plan's mesh")
    lo.add_argument("--devices", type=_count, help="device count for a '*' axis (default: local devices)")
    lo.add_argument("--optimizer", choices=[n for n in optimizers.NAMES if n != "none"], default="adamw")
    lo.add_argument(
        "--batch", action="append", help="input shapes: 'tokens=int32[16,16]' (repeatable; NAME=16x16:int32 also read)"
    )
    lo.add_argument(
        "--report",
        action="store_true",
        help="compile both backends' steps and list their collectives (kind, count, bytes)",
    )
    lo.add_argument(
        "--loss",
        help="FILE.py:FUNC loss_fn(model, batch) for --report (default: LM loss on 'tokens', else mean square)",
    )
    lo.add_argument("--simulate-devices", type=_count, help="simulated CPU devices (e.g. 8)")
    lo.set_defaults(func=cmd_lower)

    la = sub.add_parser(
        "launch",
        help="run N ranks of a command under jax.distributed on this machine",
        description="Run N processes with simulated CPU devices and gloo collectives on "
        "127.0.0.1 (a free port); prefix output with the rank; fail if any rank fails.",
    )
    la.add_argument("-n", type=_count, default=2, help="number of processes (default 2)")
    la.add_argument("--devices-per-process", type=_count, default=4)
    la.add_argument(
        "--failure-grace",
        type=_seconds,
        default=10.0,
        help="seconds the other ranks get after one fails, then they are stopped (default 10)",
    )
    la.add_argument("--timeout", type=_seconds, help="stop every rank after this many seconds")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    la.set_defaults(func=cmd_launch)

    sg = sub.add_parser(
        "suggest",
        help="search the plans for a model, step and device count; write the best as a .splan",
        description="Read what each param dim is from the step's computation, search meshes (data x expert x "
        "model), tensor parallel splits, FSDP / ZeRO-1 / data parallel and expert splits with fast mode, "
        "rank them by the step time on --chip within the memory budget, confirm the best few in exact mode, "
        "and write the winner with its runners-up as comments (docs/suggest.md).",
    )
    sg.add_argument("--model", required=True, help="FILE.py:FACTORY or package.module:FACTORY")
    sg.add_argument("--step", required=True, metavar="FILE:LOSS_FN", help="loss_fn(model, batch) -> scalar")
    sg.add_argument("--batch", action="append", help="input shapes: 'tokens=int32[8,1024],labels=int32[8,1024]'")
    sg.add_argument(
        "--devices",
        "--mesh-size",
        type=_count,
        action=_Once,
        help="how many devices the plan's mesh has (with --from: for a '*' axis)",
    )
    sg.add_argument(
        "--from",
        dest="start",
        metavar="PLAN",
        help="improve this plan instead: the fewest rule changes that gain the most, as a diff",
    )
    sg.add_argument(
        "--devices-per-host",
        type=_count,
        help="devices per host: the model axis stays inside one; axes crossing hosts are @dcn",
    )
    sg.add_argument(
        "--chip",
        choices=sorted(chips.CHIPS),
        help="rank plans by the step time here, and confirm them with its compiler where it is installed "
        "(default: the --target's chip, else h100, confirmed by XLA:CPU)",
    )
    sg.add_argument(
        "--target",
        help="the compiler that confirms the best plans at the full mesh: cpu (XLA:CPU on simulated devices), "
        "a TPU slice (tpu-v5p:2x2x2) or GPUs (h100:8), compiled offline (default: the --chip's own compiler for "
        "--devices of it where it is installed, else cpu)",
    )
    sg.add_argument(
        "--backend",
        choices=backends.NAMES,
        default="auto",
        help="the backend the plan is for: plans ranked by its step, the best compiled with it (default auto)",
    )
    sg.add_argument("--device-memory", help="per-device memory budget, e.g. 80GB (default: the chip's)")
    sg.add_argument("--optimizer", choices=[n for n in optimizers.NAMES if n != "none"], default="adamw")
    sg.add_argument("--top", type=_count, default=5, help="plans to list: the winner and runners-up (default 5)")
    sg.add_argument("--confirm", type=_index, default=3, help="confirm the best N in exact mode (default 3)")
    sg.add_argument("--no-compile", action="store_true", help="skip the exact-mode confirmation")
    sg.add_argument("-o", "--output", help="write the plan here (default: print it)")
    sg.add_argument(
        "--format", choices=("text", "json"), default="text", help="the plan (default) or one JSON document"
    )
    sg.set_defaults(func=cmd_suggest)

    ck = sub.add_parser("ckpt", help="inspect checkpoints")
    cks = ck.add_subparsers(dest="ckpt_command", required=True)
    info = cks.add_parser("info", help="complete steps, the plan and mesh each was saved with, leaf shapes")
    info.add_argument("directory")
    info.add_argument("--step", type=_index, help="which step's leaves to list (default: the latest)")
    info.set_defaults(func=cmd_ckpt_info)
    return p


def _precheck(args) -> None:
    """Flags read before jax is imported or a model is built, so a mistake is reported at once:
    the files and names ``--model``/``--step``/``--loss`` give, the ``--batch`` shapes, ``--link``."""
    for flag in ("model", "step", "loss"):
        value = getattr(args, flag, None)
        if isinstance(value, str):
            callables.check_ref(value, f"--{flag}")
    batch = getattr(args, "batch", None)
    if isinstance(batch, list) and all(isinstance(b, str) for b in batch):
        parse_batch_arg(batch)
    link = getattr(args, "link", None)
    if isinstance(link, list):
        parse_links_arg(link)


def main(argv: Sequence[str] | None = None) -> int:
    # Wide tables when piped (rich assumes 80 columns without a terminal), unless COLUMNS says.
    out = Console(soft_wrap=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
    err = Console(stderr=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        out.print(f"shardplan {version()}")
        return EXIT_OK
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        _precheck(args)
        _quiet_absl()
        _simulate_devices(getattr(args, "simulate_devices", None))
        if getattr(args, "no_cache", False):  # exact mode's child inherits it (runtime/compile_cache.py)
            os.environ["SHARDPLAN_COMPILE_CACHE"] = "0"
        return args.func(args, out, err)
    except _UsageError as e:
        err.print(f"shardplan {args.command}: error: {e}", highlight=False)
        return EXIT_USAGE
    except ShardPlanError as e:
        if getattr(args, "format", None) == "json":  # machine-readable output carries the errors too
            doc = {"ok": False, "error": type(e).__name__, "diagnostics": [d.to_json() for d in e.diagnostics]}
            out.print_json(json.dumps(doc))
        report.print_diagnostics(err, e.diagnostics)
        n = len(e.errors)
        err.print(f"[red]{n} error{'s' if n != 1 else ''}[/]")
        return EXIT_USAGE if _is_usage(e) else EXIT_ERRORS
    except KeyboardInterrupt:
        return 130


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
