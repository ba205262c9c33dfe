"""The ``shardplan`` command line. Errors print as located diagnostics, never tracebacks.

Exit codes: 0 clean, 1 errors (or warnings with --strict), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from rich.console import Console

from shardplan.errors import ShardPlanError, error

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    pass


def _simulate_devices(n: int | None) -> None:
    """Simulated CPU devices: must run before jax is imported."""
    if n:
        if "jax" in sys.modules:
            raise _UsageError("--simulate-devices must be set before jax is imported")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _quiet_absl() -> None:
    """Orbax logs through absl at WARNING; the CLI reports through diagnostics instead."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def _bytes_arg(text: str | None) -> int | None:
    from shardplan.report import parse_bytes

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def _check_one(path: str, args, err: Console, model_leaves=None):
    """Load a plan and (with a model) resolve it: (plan, resolution or None, diagnostics, model leaves)."""
    from shardplan import loader, shapes
    from shardplan.resolve import resolve_leaves

    mesh = loader.parse_mesh_arg(args.mesh) if args.mesh else None
    plan = loader.load(path, mesh=mesh)
    if not (args.model or args.shapes):
        if args.devices is not None:
            plan.mesh_shape(args.devices)
        return plan, None, list(plan.warnings), None
    if model_leaves is None:
        if args.shapes:
            params, opt = shapes.load_shapes(args.shapes)
        else:
            from shardplan import tree

            model = shapes.abstract_model(shapes.load_factory(args.model))
            params, opt = tree.flatten(model)[0], None
        if args.optimizer == "recorded":
            if opt is None:
                raise _UsageError("--optimizer recorded: the shapes file records no optimizer state")
        else:
            opt = shapes.optimizer_leaves(params, args.optimizer)
        model_leaves = (params, opt)
    devices = args.devices
    if devices is None and any(a.size is None for a in plan.mesh):
        from shardplan import tree

        devices = tree.device_count()
        err.print(f"[dim]note: mesh '*' of {path} resolved with {devices} local device(s); pass --devices N "
                  "or --mesh to check another size[/]")
    threshold = _bytes_arg(args.replicated_threshold) or 64 * 2**20
    res = resolve_leaves(plan, plan.mesh_shape(devices), model_leaves[0], model_leaves[1], threshold)
    return plan, res, list(res.warnings), model_leaves


def cmd_check(args, out: Console, err: Console) -> int:
    from shardplan import report

    budget = _bytes_arg(args.device_memory)
    if args.model and args.shapes:
        raise _UsageError("give --model or --shapes, not both")
    if args.vs and not (args.model or args.shapes):
        raise _UsageError("--vs compares plans against a model: give --model or --shapes")
    plan, res, diagnostics, leaves = _check_one(args.plan, args, err)
    others = [_check_one(p, args, err, leaves) for p in args.vs or []]
    all_diags = diagnostics + [d for _, _, ds, _ in others for d in ds]
    if args.format == "json":
        doc = report.to_json(plan, res, diagnostics, budget)
        if others:
            doc = {"plans": [doc] + [report.to_json(p, r, ds, budget) for p, r, ds, _ in others]}
        out.print_json(json.dumps(doc))
    else:
        if res is not None:
            report.print_text(out, plan, res, expand=args.expand, show_opt=args.show_opt, budget=budget)
            report.print_communication(out, plan, res)
        if others:
            report.print_comparison(out, [(plan, res)] + [(p, r) for p, r, _, _ in others], budget)
        report.print_diagnostics(err, all_diags)
        if res is None:
            axes = ", ".join(f"{a.name}={a.size if a.size is not None else '*'}" for a in plan.mesh)
            out.print(f"plan {plan.name or args.plan}: ok (mesh {axes}; {len(plan.params)} param rules, "
                      f"{len(plan.axes)} axis rules). Pass --model or --shapes to check against a model.")
    results = [res] + [r for _, r, _, _ in others]
    if budget is not None and any(r is not None and report.summary(r)["total_bytes_per_device"] > budget
                                  for r in results):
        return EXIT_ERRORS
    if args.strict and all_diags:
        return EXIT_ERRORS
    return EXIT_OK

def _batch_arg(items: list[str]) -> dict:
    """``tokens=8x16:int32`` -> {"tokens": zeros((8, 16), int32)}."""
    import numpy as np

    out = {}
    for item in items or []:
        name, eq, rest = item.partition("=")
        dims, _, dtype = rest.partition(":")
        try:
            shape = tuple(int(d) for d in dims.split("x"))
            out[name] = np.zeros(shape, np.dtype(dtype or "float32"))
        except (ValueError, TypeError):
            raise _UsageError(f"cannot read --batch '{item}' (write NAME=8x16:int32)") from None
        if not eq or not name:
            raise _UsageError(f"cannot read --batch '{item}' (write NAME=8x16:int32)")
    return out


def cmd_show(args, out: Console, err: Console) -> int:
    import optax

    from shardplan import apply, live, loader, mesh as mesh_mod, shapes

    plan = loader.load(args.plan, mesh=loader.parse_mesh_arg(args.mesh) if args.mesh else None)
    factory = shapes.load_factory(args.model)
    txs = {"adam": optax.adam(1e-3), "adamw": optax.adamw(1e-3), "sgd": optax.sgd(1e-3), "none": None}
    mesh = mesh_mod.make_mesh(plan, axis_types=args.axis_types)
    model, optimizer, placement = apply.init_sharded(plan, factory, txs[args.optimizer], mesh=mesh)
    out.print(f"[bold]{plan.name or args.plan}[/] mesh {placement.mesh_shape} over {mesh.devices.size} "
              f"{mesh.devices.flat[0].platform} devices")
    live.show(model, console=out, title="params", expand=args.expand, max_visualize=args.visualize)
    if optimizer is not None:
        live.show(optimizer, console=out, title="optimizer state", expand=args.expand, visualize=False)
    batch = _batch_arg(args.batch)
    placed = placement.shard_batch(batch) if batch else None
    if placed is not None:
        live.show(placed, console=out, title="batch", expand=True, max_visualize=args.visualize)
    live.verify(placement, model, optimizer, placed)
    out.print("[green]every array lives where the plan says[/]")
    return EXIT_OK


_TXS = ("adam", "adamw", "sgd")


def _tx(name: str):
    import optax

    return {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}[name](1e-3)


def cmd_lower(args, out: Console, err: Console) -> int:
    from pathlib import Path

    from flax import nnx

    from shardplan import apply, collectives, emit, loader, lowering, mesh as mesh_mod, shapes, tree

    plan = loader.load(args.plan, mesh=loader.parse_mesh_arg(args.mesh) if args.mesh else None)
    factory = shapes.load_factory(args.model)
    tx = _tx(args.optimizer)
    devices = args.devices or (None if all(a.size for a in plan.mesh) else tree.device_count())
    mesh_shape = plan.mesh_shape(devices)
    with nnx.use_eager_sharding(False):
        abs_model, abs_opt = shapes.abstract_model(lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(
            factory()))
    params = plan.resolve(abs_model, mesh=mesh_shape)
    opt = plan.resolve(abs_opt, params=abs_model, mesh=mesh_shape)
    batch = _batch_arg(args.batch)
    if not batch:  # the batch axes are all the lowering needs: one leaf under the batch spec
        import numpy as np

        import math

        n = math.prod(mesh_shape[a] for a in lowering.plan_batch_axes(plan))
        batch = {"inputs": np.zeros((n, 1), np.int32)}
    inputs = plan.resolve_batch(batch, mesh=mesh_shape)
    low = lowering.lower(plan, params, inputs)
    source = emit.emit(plan, params, opt, low, args.backend)
    if args.output:
        Path(args.output).write_text(source)
        err.print(f"wrote {args.output} ({len(source.splitlines())} lines, backend {args.backend})")
    elif not args.report:
        out.print(source, markup=False, highlight=False, soft_wrap=True)
    if args.report:
        from rich.table import Table

        from shardplan import step as step_mod

        mesh = mesh_mod.make_mesh(plan)
        table = Table(title=f"collectives per step, per device ({plan.name or args.plan}, mesh {mesh_shape})")
        for col in ("backend", "kind", "count", "bytes"):
            table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
        loss = shapes.load_factory(args.loss) if args.loss else _default_loss(batch)
        for backend in ("auto", "shard_map"):
            model, optimizer, placement = apply.init_sharded(plan, factory, tx, mesh=mesh)
            st = step_mod.train_step(placement, loss, model, optimizer, backend=backend)
            summary = collectives.report(st.lower(model, optimizer, batch).compile())
            for kind, v in summary.items():
                if v["count"]:
                    table.add_row(backend, kind, str(v["count"]), f"{v['bytes']:,}")
        out.print(table)
        predicted = lowering.predict(low)
        out.print("shard_map, predicted from the plan: " + ", ".join(
            f"{k} {v['bytes']:,} B" for k, v in predicted.items() if v["bytes"]))
    return EXIT_OK


def _default_loss(batch):
    if "tokens" in batch:
        def lm(model, b):
            import optax

            logits = model(b["tokens"])
            labels = b.get("labels", b["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return lm
    def mse(model, b):
        x = next(iter(b.values()))
        return (model(x) ** 2).mean()
    return mse


def cmd_ckpt_info(args, out: Console, err: Console) -> int:
    from rich.table import Table

    from shardplan import checkpoint
    from shardplan.report import human_bytes

    manager = checkpoint.open_readonly(args.directory)
    steps = sorted(manager.all_steps())
    if args.step is not None and args.step not in steps:
        raise ShardPlanError([error("no-such-step", f"step {args.step} is not in {args.directory}",
                                    f"complete steps: {', '.join(map(str, steps))}", path=args.directory)])
    out.print(f"[bold]{args.directory}[/]: complete steps {', '.join(map(str, steps))}")
    summary = Table(header_style="bold")
    for col in ("step", "plan", "mesh", "backend", "processes", "shardplan"):
        summary.add_column(col)
    infos = [checkpoint.step_info(manager, s) for s in steps]
    for info in infos:
        m = info.meta
        summary.add_row(str(info.step), f"{m.get('plan_name')} ({', '.join(m.get('plan_files', []))})",
                        ", ".join(f"{k}={v}" for k, v in (m.get("mesh") or {}).items()), str(m.get("backend")),
                        str(m.get("process_count")), str(m.get("shardplan_version")))
    out.print(summary)
    info = next(i for i in infos if i.step == (args.step if args.step is not None else steps[-1]))
    for item, leaves in info.leaves.items():
        table = Table(title=f"step {info.step}: {item}", header_style="bold")
        for col in ("path", "shape", "dtype", "bytes"):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        import numpy as np

        for path, shape, dtype in leaves:
            n = int(np.prod(shape)) * (np.dtype(dtype).itemsize if dtype else 0)
            table.add_row(path, str(shape), dtype, human_bytes(n))
        out.print(table)
    return EXIT_OK


def cmd_launch(args, out: Console, err: Console) -> int:
    from shardplan import launch

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("give the command to run after --, e.g. shardplan launch -n 2 -- python train.py")
    if args.n < 1 or args.devices_per_process < 1:
        raise _UsageError("-n and --devices-per-process must be positive")
    try:
        code, results, summary = launch.launch(command, args.n, args.devices_per_process,
                                               failure_grace_s=args.failure_grace, timeout_s=args.timeout)
    except launch.LaunchError as e:
        raise _UsageError(f"{e} (give an executable, e.g. python script.py)") from None
    (err if code else out).print(f"shardplan launch: {summary}", highlight=False, markup=False)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardplan", description="Sharding plans for Flax NNX models.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")

    c = sub.add_parser("check", help="check a plan offline, alone or against a model's shapes",
                       description="Check a plan offline (no devices, abstract shapes).")
    c.add_argument("plan", help="the .splan file")
    c.add_argument("--mesh", help="axis sizes replacing the plan's mesh, e.g. data=32,model=8")
    c.add_argument("--devices", type=int, help="device count for a '*' mesh axis (default: local devices)")
    src = c.add_argument_group("model (one of)")
    src.add_argument("--model", help="FILE.py:FACTORY or package.module:FACTORY; built with nnx.eval_shape")
    src.add_argument("--shapes", help="a shapes JSON written by shardplan.dump_shapes")
    c.add_argument("--optimizer", choices=("adam", "adamw", "sgd", "none", "recorded"), default="adam",
                   help="optimizer state to account for (default adam; 'recorded': the shapes file's)")
    c.add_argument("--format", choices=("text", "json"), default="text")
    c.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    c.add_argument("--device-memory", help="per-device memory budget, e.g. 80GB or 16GiB")
    c.add_argument("--replicated-threshold", help="warn for replicated tensors above this (default 64MiB)")
    c.add_argument("--expand", action="store_true", help="one row per layer instead of grouping x N")
    c.add_argument("--show-opt", action="store_true", help="list optimizer-state leaves too")
    c.add_argument("--vs", action="append", metavar="PLAN", help="compare with another plan, side by side "
                   "(repeatable)")
    c.set_defaults(func=cmd_check)

    v = sub.add_parser("show", help="build a model sharded per a plan and show where every array lives",
                       description="Initialise a model directly sharded per the plan, print per-device "
                       "shards (and jax.debug.visualize_array_sharding), and check them against the plan.")
    v.add_argument("plan")
    v.add_argument("--model", required=True, help="FILE.py:FACTORY or package.module:FACTORY")
    v.add_argument("--mesh", help="axis sizes replacing the plan's mesh")
    v.add_argument("--optimizer", choices=("adam", "adamw", "sgd", "none"), default="adam")
    v.add_argument("--batch", action="append", help="an input leaf to place, NAME=8x16:int32 (repeatable)")
    v.add_argument("--simulate-devices", type=int, help="simulated CPU devices (e.g. 8)")
    v.add_argument("--axis-types", choices=("auto", "explicit"), default="auto")
    v.add_argument("--expand", action="store_true", help="one row per layer")
    v.add_argument("--visualize", type=int, default=4, help="how many arrays to draw (default 4)")
    v.set_defaults(func=cmd_show)

    lo = sub.add_parser("lower", help="emit a standalone step module for a backend; --report: its collectives",
                        description="Lower a plan to a standalone Python module (jax, flax, optax only) for the "
                        "shard_map or auto backend, and/or report the collectives in each backend's compiled step.")
    lo.add_argument("plan")
    lo.add_argument("--model", required=True, help="FILE.py:FACTORY or package.module:FACTORY")
    lo.add_argument("--backend", choices=("shard_map", "auto"), default="shard_map")
    lo.add_argument("-o", "--output", help="write the module here (default: print it)")
    lo.add_argument("--mesh", help="axis sizes replacing the plan's mesh")
    lo.add_argument("--devices", type=int, help="device count for a '*' axis (default: local devices)")
    lo.add_argument("--optimizer", choices=_TXS, default="adamw")
    lo.add_argument("--batch", action="append", help="an input leaf NAME=16x16:int32 (repeatable)")
    lo.add_argument("--report", action="store_true",
                    help="compile both backends' steps and list their collectives (kind, count, bytes)")
    lo.add_argument("--loss", help="FILE.py:FUNC loss_fn(model, batch) for --report (default: LM loss on "
                    "'tokens', else mean square)")
    lo.add_argument("--simulate-devices", type=int, help="simulated CPU devices (e.g. 8)")
    lo.set_defaults(func=cmd_lower)

    la = sub.add_parser("launch", help="run N ranks of a command under jax.distributed on this machine",
                        description="Run N processes with simulated CPU devices and gloo collectives on "
                        "127.0.0.1 (a free port); prefix output with the rank; fail if any rank fails.")
    la.add_argument("-n", type=int, default=2, help="number of processes (default 2)")
    la.add_argument("--devices-per-process", type=int, default=4)
    la.add_argument("--failure-grace", type=float, default=10.0,
                    help="seconds the other ranks get after one fails, then they are stopped (default 10)")
    la.add_argument("--timeout", type=float, help="stop every rank after this many seconds")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    la.set_defaults(func=cmd_launch)

    ck = sub.add_parser("ckpt", help="inspect checkpoints")
    cks = ck.add_subparsers(dest="ckpt_command", required=True)
    info = cks.add_parser("info", help="complete steps, the plan and mesh each was saved with, leaf shapes")
    info.add_argument("directory")
    info.add_argument("--step", type=int, help="which step's leaves to list (default: the latest)")
    info.set_defaults(func=cmd_ckpt_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Wide tables when piped (rich assumes 80 columns without a terminal).
    out = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from shardplan import __version__

        out.print(f"shardplan {__version__}")
        return EXIT_OK
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        _quiet_absl()
        _simulate_devices(getattr(args, "simulate_devices", None))
        return args.func(args, out, err)
    except _UsageError as e:
        err.print(f"shardplan {args.command}: error: {e}", highlight=False)
        return EXIT_USAGE
    except ShardPlanError as e:
        from shardplan.report import print_diagnostics

        print_diagnostics(err, e.diagnostics)
        n = len(e.errors)
        err.print(f"[red]{n} error{'s' if n != 1 else ''}[/]")
        return EXIT_ERRORS
    except KeyboardInterrupt:
        return 130


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
