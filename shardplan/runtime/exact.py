"""Exact mode: compile the real training step of a backend for the plan's whole mesh and read
what XLA made of it (memory analysis, cost analysis, every collective).

Nothing is allocated: params, optimizer state and batch are ``ShapeDtypeStruct``s carrying
the plan's shardings. The mesh needs as many devices as it has; ``shardplan.api.analyze``
runs the compile in a child process with that many simulated CPU devices, so a
data=32,model=8 plan compiles on a laptop. On CPU, XLA never emits reduce-scatters for GSPMD (it
all-reduces and slices); those all-reduces are reported as the reduce-scatters an
accelerator runs (see ``shardplan.core.hlo``).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from shardplan.core import hlo, targets
from shardplan.core.leaves import Resolution
from shardplan.core.notes import Note
from shardplan.core.stepcost import Communication, Memory, StepCost
from shardplan.errors import as_error, error
from shardplan.ledger import merged
from shardplan.runtime import compile_cache
from shardplan.runtime.kernels import FUSED_ATTENTION, cudnn_traceable
from shardplan.runtime.step import check_loss, pipelined


def abstract_state(state: Any, shardings: Any) -> Any:
    """``state`` (arrays or ShapeDtypeStructs in Variables) as ShapeDtypeStructs carrying ``shardings``."""
    import jax
    from jax.sharding import Sharding

    def one(sh: Any, sub: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sub)

    return jax.tree.map(one, shardings, state, is_leaf=lambda x: isinstance(x, Sharding))


def devices_here(n: int) -> bool:
    """Whether exact mode can compile for an ``n``-device CPU mesh in this process, seeing what its
    child process would see: jax imported, exactly ``n`` CPU devices in one process, no mesh in
    context, and jax's default float width. Backends not started yet are started only where they
    can be nothing but the ``n`` CPU devices (jax told to use the CPU alone, XLA's flags asking for
    ``n``): elsewhere asking would start them, and take an accelerator, in a process that only
    imported jax. (A child costs a jax import and a trace of the step: 3-4 s more per compile of
    examples/models.py's gpt_tiny on this project's 2-core machine, 1 s here.)"""
    if "jax" not in sys.modules:
        return False
    import os

    import jax
    from jax._src import xla_bridge

    from shardplan.runtime.devices import FLAG

    if getattr(jax.config, "jax_enable_x64", False):
        return False
    if not xla_bridge.backends_are_initialized():
        asked = [f.split("=", 1)[-1] for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(f"{FLAG}=")]
        if getattr(jax.config, "jax_platforms", None) != "cpu" or asked[-1:] != [str(n)]:
            return False
    if not jax.sharding.get_abstract_mesh().empty:
        return False
    devices = jax.devices()
    return jax.process_count() == 1 and len(devices) == n and all(d.platform == "cpu" for d in devices)


def compile_step(
    plan: Any,
    factory: Any,
    loss_fn: Any,
    batch: dict[str, tuple[tuple[int, ...], str]],
    optimizer: str,
    backend: str,
    mesh: Any = None,
    target: targets.Target = targets.CPU,
) -> StepCost:
    """Compile the step in this process (which needs the mesh's devices, or ``mesh`` over a
    target's abstract devices: :func:`target_mesh`) and read it."""
    import jax
    import numpy as np
    from flax import nnx

    from shardplan.runtime import backends, specs
    from shardplan.runtime import model as model_mod
    from shardplan.runtime.activations import Activations
    from shardplan.runtime.mesh import make_mesh, mesh_shape_of
    from shardplan.runtime.placement import Placement

    t0 = time.perf_counter()
    mesh = mesh if mesh is not None else make_mesh(plan, devices=jax.devices()[: math.prod(plan.mesh_shape().values())])
    sizes = mesh_shape_of(mesh)
    tx = model_mod.make_tx(optimizer)
    if tx is None:
        raise as_error(
            [
                error(
                    "unknown-optimizer",
                    "a training step needs an optimizer, not 'none'",
                    "use adam, adamw or sgd",
                    path="--optimizer",
                )
            ]
        )
    abs_model, abs_opt = model_mod.abstract_model_and_optimizer(factory, tx)
    params, opt = specs.resolve_model(plan, abs_model, abs_opt, mesh=sizes)
    assert opt is not None
    placement = Placement(plan, mesh, params, opt)
    batch_abs = {name: jax.ShapeDtypeStruct(shape, np.dtype(dtype)) for name, (shape, dtype) in batch.items()}
    inputs = specs.resolve_batch(plan, batch_abs, mesh=sizes)
    batch_in = abstract_state(batch_abs, inputs.shardings(mesh))
    sm = abstract_state(nnx.state(abs_model), params.shardings(mesh))
    so = abstract_state(nnx.state(abs_opt), opt.shardings(mesh))
    acts = Activations(plan, mesh, backend)
    with cudnn_traceable(), nnx.use_eager_sharding(False):  # a cuDNN kernel traces; XLA:CPU refuses it below
        check_loss(acts.wrap(loss_fn, mesh_context=True), abs_model, batch_abs, where="--step", plan=plan)
        piped = pipelined(placement, loss_fn, backend)
        step = backends.get(backend).build(placement, acts.wrap(piped, mesh_context=True), abs_model, abs_opt)
        try:
            gpu = targets.gpu_target_config(target.chip or "") if target.platform == "cuda" else ""
            program = compile_cache.compiled(
                step.lower(sm, so, batch_in), target.name, [int(d.id) for d in mesh.devices.flat], gpu
            )
        except Exception as e:
            oom = _out_of_memory(e)
            if oom:
                raise as_error(
                    [
                        error(
                            "step-out-of-memory",
                            f"{target.compiler} refuses the step for {target.name}: {oom}",
                            "split more of what the step holds (FSDP over more devices, tensor parallel, "
                            "an act rule on the residual stream, remat), or a smaller batch per device; "
                            "fast mode's memory table says what dominates",
                            path="--compile",
                        )
                    ]
                ) from None
            if _in_kernel(e):
                raise as_error(
                    [
                        error(
                            "kernel-not-compilable",
                            f"the step calls a custom kernel (Pallas, cuDNN), which {target.compiler} cannot compile "
                            f"({_kernel_error(e)}); exact mode compiles the step for simulated CPU devices",
                            "cost this step in fast mode (drop --compile): it costs a Pallas kernel from its "
                            "block specs and body, and cuDNN's attention as one kernel",
                            path="--compile",
                        )
                    ]
                ) from None
            raise
    text, costs = program.text, program.costs
    ops = hlo.with_axes(hlo.parse(text, mesh.devices.size), sizes)
    batch_bytes = inputs.bytes_per_device()
    held = program.argument_bytes + program.output_bytes - program.alias_bytes
    if target.platform == "cpu":
        # XLA:CPU's peak_memory_in_bytes leaves temporaries out: arguments + outputs - aliased + temps.
        temporaries = program.temp_bytes
        peak = held + temporaries
    else:
        # XLA:TPU and XLA:GPU report the peak of their own buffer assignment, which is the figure
        # here; their temp_size is not comparable (XLA:TPU v5e/v6e report 0 with a peak above the
        # arguments and outputs; v5p at times more than the peak): the temporaries are what the
        # peak holds beyond arguments and outputs.
        peak = program.peak_bytes
        temporaries = max(0, peak - held)
    memory = Memory(
        params=params.bytes_per_device(),
        opt_state=opt.bytes_per_device(),
        batch=batch_bytes,
        temporaries=temporaries,
        outputs=program.output_bytes,
        aliased=program.alias_bytes,
        peak=peak,
    )
    # XLA's cost analysis counts a while body (a scan over layers) once; add the other iterations.
    loops = hlo.loop_flops(text)
    if target.platform == "tpu" and loops and "flops" in costs:
        # XLA:TPU's matmuls are convolutions (windowed, padded in its loops) that the HLO count
        # over-counts against XLA's own cost analysis: scale the loops' extra iterations by how
        # XLA counts one pass of the whole program against the HLO count of that same pass.
        once = hlo.program_flops(text) - loops
        loops *= float(costs["flops"]) / once if once > 0 else 1.0
    notes = (
        [
            Note(
                "exact-cpu-reduce-scatter",
                "all-reduces whose every use is a per-device slice are counted as the reduce-scatters an "
                "accelerator runs (XLA:CPU emits no reduce-scatter for GSPMD)",
            )
        ]
        if target.platform == "cpu"
        else [
            Note(
                "exact-offline",
                f"compiled offline by {target.compiler} for {target.name} ({mesh.devices.size} devices, none present)",
            )
        ]
    )
    if program.cached:
        notes.append(
            Note(
                "exact-cached",
                f"the compiled program read from shardplan's compile cache ({compile_cache.cache_dir()}): the same "
                "program, target and compiler versions were compiled before (--no-cache compiles again)",
            )
        )
    if "flops" not in costs:  # XLA:GPU gives no cost analysis: the FLOPs are counted from its HLO
        notes.append(
            Note(
                "exact-flops-from-hlo",
                f"{target.compiler} gives no cost analysis: FLOPs counted from its program's HLO (matmuls 2*M*N*K, "
                "elementwise ops one per element, reductions their reducer's per element reduced, transcendentals "
                "apart, as XLA's cost analysis counts them; loop bodies times their trips)",
            )
        )
    optimal = costs.get("optimal_seconds")
    # XLA:TPU's own estimate: negative on every v5e compile measured, plausible on v5p (FACTS.md).
    compiler_seconds = float(optimal) if optimal is not None and optimal > 0 and target.chip == "tpu-v5p" else None
    if loops and compiler_seconds is not None:  # its estimate, like its FLOPs, counts a loop body once
        notes.append(
            Note(
                "exact-estimate-loops",
                f"{target.compiler}'s own estimate ({compiler_seconds * 1e3:,.1f} ms) counts each loop body once, as "
                "its cost analysis does: not shown as the step's time",
            )
        )
        compiler_seconds = None
    if loops:
        notes.append(
            Note(
                "exact-loop-flops",
                f"FLOPs include {loops / 1e9:,.3f} GFLOP of loop iterations XLA's cost analysis leaves out "
                "(it counts a while body once), counted from the loop bodies' HLO",
            )
        )
    rings = hlo.matmul_rings(text)
    if rings:
        notes.append(
            Note(
                "exact-matmul-rings",
                f"{rings} matmul loop(s) pass partial results around a ring of collective-permutes (windowed "
                f"einsums), which {target.compiler} overlaps with the matmul's chunks: the step time (--chip) runs "
                "each permute after the matmul, an upper bound",
            )
        )
    notes += acts.notes()
    return StepCost(
        "exact",
        backend,
        sizes,
        float(costs["flops"]) + loops if "flops" in costs else hlo.program_flops(text),
        memory,
        communications(ops, params, opt, inputs),
        float(costs.get("transcendentals", 0.0)),
        time.perf_counter() - t0,
        tuple(notes),
        logical_names=tuple(sorted(acts.used)),
        hbm_bytes=hlo.memory_bytes(text),
        kernels=hlo.kernel_count(text),
        compiler=target.compiler + ("" if target.platform == "cpu" else f" {target.name}"),
        compiler_seconds=compiler_seconds,
        schedule=_schedule(text, ops, target),
        matmul_flops=tuple(sorted(hlo.matmul_by_source(text).items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def _schedule(text: str, ops: list[hlo.CollectiveOp], target: targets.Target) -> tuple[hlo.Step, ...]:
    """The program's schedule where it runs collectives asynchronously (XLA:GPU's start/done pairs),
    for the step time; none for XLA:CPU (every collective synchronous: the serial time is its own)
    or XLA:TPU (its collectives run inside fusions: not read)."""
    if target.platform != "cuda":
        return ()
    return hlo.schedule(text, ops)


def target_mesh(plan: Any, target: targets.Target) -> Any:
    """The plan's mesh over ``target``'s devices as its compiler describes them (jax's topology
    API; nothing is allocated and no accelerator is needed).

    Raises:
        ArgumentError: the target's compiler is not installed (``target-compiler-missing``, with
            the ``pip install`` line), or its topology is refused.
    """
    from shardplan.runtime.mesh import make_mesh

    devices = _topology_devices(target)
    if len(devices) != math.prod(plan.mesh_shape(len(devices)).values()):
        raise as_error(
            [
                error(
                    "bad-target",
                    f"--target {target.name} has {len(devices)} devices; the plan's mesh has "
                    f"{math.prod(plan.mesh_shape(len(devices)).values())}",
                    "give a mesh of as many devices as the target",
                    path="--target",
                )
            ]
        )
    return make_mesh(plan, devices=devices)


def _topology_devices(target: targets.Target) -> list:
    targets.require_compiler(target)
    try:
        from jax.experimental import topologies

        if target.platform == "tpu":
            topo = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
        else:
            topo = topologies.get_topology_desc(
                platform="cuda",
                topology_name="",
                topology=target.topology,
                target_config=targets.gpu_target_config(target.chip or ""),
            )
    except Exception as e:  # the plugin missing surfaces as an ImportError or a backend error
        text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        missing = isinstance(e, ImportError) or any(
            w in text.lower() for w in ("no module", "not found", "unknown backend", "plugin", "libtpu")
        )
        if missing:
            raise as_error(
                [
                    error(
                        "target-compiler-missing",
                        f"{target.compiler} is not installed here ({text})",
                        targets.INSTALL[target.platform],
                        path="--target",
                    )
                ]
            ) from None
        raise as_error(
            [
                error(
                    "bad-target",
                    f"{target.compiler} refused the topology {target.topology}: {text}",
                    targets.EXAMPLES,
                    path="--target",
                )
            ]
        ) from None
    return list(topo.devices)


def communications(
    ops: list[hlo.CollectiveOp], params: Resolution, opt: Resolution, inputs: Resolution
) -> tuple[Communication, ...]:
    """Collectives grouped by (kind, axes, op, source, moved leaf), each moved leaf with its rule."""
    origin = {f"sm/{d.path}": d for d in params.decisions}
    origin.update({f"so/{d.path}": d for d in opt.decisions})
    origin.update({f"batch/{d.path}": d for d in inputs.decisions})
    rows = []
    for op in ops:
        kind = "reduce-scatter" if op.as_reduce_scatter else op.kind
        op_name = op.op_name.split("/", 1)[-1] if op.op_name.startswith("jit(") else op.op_name
        # count: launches (a combined all-reduce's further arrays ride on its first one's)
        count = op.runs if op.launch else 0
        rows.append(Communication(kind, op.axes, op.bytes_per_step, count, op_name, op.source, op.moves))

    def named(moves: str) -> tuple[str, str]:
        d = origin.get(moves)
        if d is None:
            return moves, ""
        return moves.split("/", 1)[1], d.origin if d.how in ("rule", "default", "batch") else ""

    return merged(rows, named)


def _out_of_memory(e: BaseException) -> str:
    """XLA's own words when it refused to compile for lack of device memory ('' otherwise):
    XLA:TPU checks its buffer assignment against the chip's HBM at compile time."""
    import re

    text = str(e)
    m = re.search(r"(Ran out of memory in memory space \w+\.[^\n]*|Ran out of memory on HBM[^\n]*)", text)
    if "RESOURCE_EXHAUSTED" not in text and m is None:
        return ""
    return (m.group(1) if m else text.splitlines()[0]).strip()[:400]


def _in_kernel(e: BaseException) -> bool:
    """Whether ``e`` was raised lowering a custom kernel: jax's pallas package on the stack, or XLA's
    partitioner reporting that cuDNN's attention has no CPU lowering."""
    import traceback

    files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(e.__traceback__)]
    return any("/pallas/" in f or "/cudnn/" in f for f in files) or any(
        f"'{name.removesuffix('_wrapper')}'" in str(e) for name in FUSED_ATTENTION
    )


def _kernel_error(e: BaseException) -> str:
    """The line of ``e`` that says what failed (XLA wraps the Python error of a partitioner callback),
    and the user's line XLA suspects."""
    import re

    lines = str(e).splitlines() or [""]
    what = next((x.strip() for x in lines if re.match(r"\s*\w+(Error|Exception): ", x)), "")
    what = what or f"{type(e).__name__}: {lines[0].strip()}"
    at = next((lines[i + 1].strip().split(" [")[0] for i, x in enumerate(lines[:-1]) if "Suspected Python" in x), "")
    return f"{what}{' at ' + at if at else ''}"
