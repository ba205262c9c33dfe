"""The operations behind the command line, as functions: check, lower, show, a checkpoint's plan.

The CLI parses arguments, calls these and prints their results; a Python user calls the
same functions. ``check`` with a shapes file stays jax-free: the runtime (jax) is imported
inside the functions that need devices or models, never at module import.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardplan.core import cost, lock, optimizers, reshard, shapecache
from shardplan.core import explain as explain_mod
from shardplan.core.leaves import Decision, Leaf, Node, Resolution, share
from shardplan.core.lowering import Lowering
from shardplan.core.notes import Note
from shardplan.core.pipeline import with_pipeline
from shardplan.core.plan import Plan
from shardplan.core.resolve import DEFAULT_REPLICATED_THRESHOLD, resolve_inputs, resolve_leaves
from shardplan.core.shapes import ITEMSIZE, load_shapes, parse_batch_arg
from shardplan.core.shared import resolve_tree
from shardplan.core.stepcost import StepCost
from shardplan.errors import Diagnostic, ShardPlanError, as_error, error
from shardplan.lang.loader import load, load_sources, read_file

MAX_SIMULATED_DEVICES = 1024  # XLA:CPU compiles for more; time and memory grow with the device count

if TYPE_CHECKING:
    from shardplan.runtime.placement import Placement

ModelLeaves = tuple[list[Leaf], list[Leaf]]


def _plan(plan: str | os.PathLike | Plan, mesh: dict[str, int | None] | None) -> Plan:
    if isinstance(plan, Plan):
        if mesh is None:
            return plan
        from shardplan.core.meshes import with_mesh

        return with_mesh(plan, mesh)
    return load(plan, mesh=mesh)


# -- check ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    """A plan checked alone, or resolved against a model's shapes."""

    plan: Plan
    resolution: Resolution | None  # None: checked without a model
    leaves: ModelLeaves | None
    notes: tuple[Note, ...] = ()  # e.g. how a '*' axis was sized

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return self.resolution.warnings if self.resolution is not None else self.plan.warnings

    def summary(self) -> dict:
        """Per-device bytes of params and optimizer state (requires a model)."""
        assert self.resolution is not None, "checked without a model"
        return cost.summary(self.resolution)

    def communication(self) -> dict:
        """The shard_map lowering's bytes per step, by kind and mesh axes (requires a model)."""
        assert self.resolution is not None, "checked without a model"
        return cost.communication(self.plan, self.resolution)

    def fits(self, budget: int) -> bool:
        return self.resolution is None or self.summary()["total_bytes_per_device"] <= budget


def model_leaves(
    *,
    model: str | None = None,
    shapes: str | os.PathLike | None = None,
    optimizer: str = "adam",
    cache: bool = True,
) -> ModelLeaves:
    """(param leaves, optimizer-state leaves) from a model factory or a shapes file.

    Args:
        model: ``FILE.py:FACTORY`` or ``package.module:FACTORY``, built with ``nnx.eval_shape``
            (or read from the shapes cache, ``shardplan.core.shapecache``, when ``cache``).
        cache: use the shapes cache (read, and write after a build); False bypasses it.
        shapes: a shapes JSON from ``shardplan.dump_shapes``.
        optimizer: a name in ``shardplan.core.optimizers`` (state derived from param shapes),
            or ``recorded`` for the optimizer state a shapes file records.
    """
    if (model is None) == (shapes is None):
        raise as_error(
            [
                error(
                    "bad-argument",
                    "give a model or a shapes file, not both" if model else "give a model or a shapes file",
                    "--model FILE.py:FACTORY or --shapes FILE.json",
                    path="--model",
                )
            ]
        )
    opt: list[Leaf] | None = None
    if shapes is not None:
        params, opt = load_shapes(shapes)
    else:
        assert model is not None
        cached = shapecache.read(model) if cache else None
        if cached is not None:  # a hit: no jax import, no eval_shape
            params = cached
        else:
            from shardplan.runtime import model as model_mod
            from shardplan.runtime import tree

            params = tree.flatten(model_mod.abstract_model(model_mod.load_factory(model)))[0]
            if cache:
                shapecache.write(model, params)
    if optimizer == "recorded":
        if opt is None:
            raise as_error(
                [
                    error(
                        "bad-argument",
                        "--optimizer recorded: no optimizer state is recorded",
                        "write the shapes file with dump_shapes(model, path, optimizer), or name an "
                        f"optimizer: {', '.join(optimizers.NAMES)}",
                        path="--optimizer",
                    )
                ]
            )
        return params, opt
    return params, optimizers.optimizer_leaves(params, optimizer)


def check(
    plan: str | os.PathLike | Plan,
    *,
    model: str | None = None,
    shapes: str | os.PathLike | None = None,
    optimizer: str = "adam",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
    replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
    leaves: ModelLeaves | None = None,
    cache: bool = True,
) -> CheckResult:
    """Check a plan offline: alone, or resolved against a model's abstract shapes.

    Args:
        plan: a ``.splan`` path or a loaded plan.
        model, shapes, optimizer: where the leaves come from (see :func:`model_leaves`).
        mesh: axis sizes replacing the plan's mesh.
        devices: the device count for a ``*`` axis (default: this machine's devices).
        replicated_threshold: warn for replicated tensors above this many bytes.
        leaves: leaves already read (to compare several plans against one model).

    Raises:
        ShardPlanError: every problem found, located.
    """
    p = _plan(plan, mesh)
    if leaves is None and model is None and shapes is None:
        if devices is not None:
            p.mesh_shape(devices)
        return CheckResult(p, None, None)
    notes: list[Note] = []
    if devices is None and any(a.size is None for a in p.mesh):
        from shardplan.runtime.tree import device_count

        devices = device_count()
        notes.append(
            Note(
                "mesh-star-resolved",
                f"mesh '*' of {p.files[0]} resolved with {devices} local device(s); pass --devices N "
                "or --mesh to check another size",
            )
        )
    if leaves is None:
        leaves = model_leaves(model=model, shapes=shapes, optimizer=optimizer, cache=cache)
    res = resolve_model_leaves(p, p.mesh_shape(devices), leaves, replicated_threshold)
    if model is not None:
        res = _activation_names(p, res, model)
    return CheckResult(p, res, leaves, tuple(notes))


def _activation_names(plan: Plan, res: Resolution, model: str) -> Resolution:
    """An ``axis`` rule no param is annotated with may still be used: by activations the model
    constrains with that logical name (``with_logical_constraint``), which only a traced step
    shows (``check --step``). Without one, a name written as a string in the model's source
    files is taken as used; one written nowhere there stays a warning."""
    text = shapecache.sources(model)
    if text is None:
        return res
    used = {a.span for a in plan.axes if re.search(f"[\"']{re.escape(a.logical)}[\"']", text)}
    keep = tuple(w for w in res.warnings if not (w.code == "unused-axis-rule" and w.span in used))
    return dataclasses.replace(res, warnings=keep) if len(keep) != len(res.warnings) else res


_SHARED: list[tuple[ModelLeaves, Node, Node]] = []  # the last few leaf lists' shared trees
_SHARED_KEEP = 4


def resolve_model_leaves(
    plan: Plan, mesh: dict[str, int], leaves: ModelLeaves, replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD
) -> Resolution:
    """``resolve_leaves`` of (params, optimizer state), each distinct subtree decided once
    (``shardplan.core.shared``). The shared trees of the last few leaf lists are kept, so
    checking several plans (or every edit of one, in the language server) against one model
    builds them once."""
    trees = next(((p, o) for known, p, o in _SHARED if known[0] is leaves[0] and known[1] is leaves[1]), None)
    if trees is None:
        p, o = share(leaves[0]), share(leaves[1])
        if p is None or o is None:
            return resolve_leaves(plan, mesh, leaves[0], leaves[1], replicated_threshold)
        trees = (p, o)
        _SHARED.insert(0, (leaves, p, o))
        del _SHARED[_SHARED_KEEP:]
    return resolve_tree(plan, mesh, trees[0], trees[1], replicated_threshold)


# -- models, batches, losses ---------------------------------------------------------------
def zeros_batch(items: list[str]) -> dict:
    """``["tokens=8x16:int32"]`` -> {"tokens": zeros((8, 16), int32)}."""
    import numpy as np

    return {name: np.zeros(shape, np.dtype(dtype)) for name, (shape, dtype) in parse_batch_arg(items).items()}


def default_loss(batch: dict) -> Callable[[Any, Any], Any]:
    """The loss ``lower --report`` compiles when none is given: next-token cross-entropy when
    the batch has ``tokens`` (and ``labels``, else the tokens themselves), else the mean
    square of the model's output on the batch's first leaf."""
    import optax

    if "tokens" in batch:

        def lm(model, b):
            logits = model(b["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b.get("labels", b["tokens"])).mean()

        return lm

    def mse(model, b):
        return (model(next(iter(b.values()))) ** 2).mean()

    return mse


# -- lower -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lowered:
    """A plan lowered for a model: the specs and the shard_map collectives
    (``shardplan.tools.emit.emit`` writes them out as a module)."""

    plan: Plan
    params: Resolution
    opt: Resolution
    lowering: Lowering
    batch: dict
    factory: Callable[[], Any]


def lower(
    plan: str | os.PathLike | Plan,
    model: str,
    *,
    optimizer: str = "adamw",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
    batch: dict | None = None,
) -> Lowered:
    """Lower a plan for a model to a standalone step module (``shardplan lower``)."""
    from shardplan.core.lowering import lower as lower_plan
    from shardplan.runtime import model as model_mod
    from shardplan.runtime import specs, tree
    from shardplan.runtime.backends.shard_map import params_only

    p = _plan(plan, mesh)
    factory = model_mod.load_factory(model)
    tx = model_mod.make_tx(optimizer)
    if devices is None and any(a.size is None for a in p.mesh):
        devices = tree.device_count()
    sizes = p.mesh_shape(devices)
    abs_model, abs_opt = model_mod.abstract_model_and_optimizer(factory, tx)
    params_only(abs_model)  # the runtime backend refuses these: never emit a module that fails when run
    params, opt = specs.resolve_model(p, abs_model, abs_opt, mesh=sizes)
    assert opt is not None
    if not batch:  # the batch axes are all the lowering needs: one leaf under the batch spec
        import numpy as np

        n = math.prod(sizes[a] for a in p.batch_dim0_axes)
        batch = {"inputs": np.zeros((n, 1), np.int32)}
    inputs = specs.resolve_batch(p, batch, mesh=sizes)
    low = lower_plan(p, params, inputs)
    return Lowered(p, params, opt, low, batch, factory)


def compiled_collectives(
    lowered: Lowered, *, optimizer: str = "adamw", loss: str | None = None, records: dict | None = None
) -> dict:
    """Compile each backend's real step on this machine's devices and read its collectives:
    {backend: {kind: {"count", "bytes"}}}. ``records``, when given, gets the shard_map step's
    record (``shardplan.runtime.partition.Record``: what its per-device code issues, and which
    ops fell back to whole operands) under "shard_map"."""
    from shardplan.core import hlo
    from shardplan.core.backends import NAMES
    from shardplan.runtime import model as model_mod
    from shardplan.runtime import placement as placement_mod
    from shardplan.runtime import step as step_mod
    from shardplan.runtime.mesh import make_mesh

    mesh = make_mesh(lowered.plan)
    loss_fn = model_mod.load_factory(loss) if loss else default_loss(lowered.batch)
    out = {}
    for backend in NAMES:
        m, o, placement = placement_mod.init_sharded(
            lowered.plan, lowered.factory, model_mod.make_tx(optimizer), mesh=mesh
        )
        st = step_mod.train_step(placement, loss_fn, m, o, backend=backend)
        out[backend] = hlo.report(st.lower(m, o, lowered.batch).compile())
        if records is not None and backend == "shard_map":
            records[backend] = st.fn.record(st.place(lowered.batch))
    return out


# -- show ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shown:
    model: Any
    optimizer: Any
    placement: Placement
    batch: Any  # the placed batch, or None


def show(
    plan: str | os.PathLike | Plan,
    model: str,
    *,
    mesh: dict[str, int | None] | None = None,
    optimizer: str = "adam",
    axis_types: str | None = None,
    batch: dict | None = None,
) -> Shown:
    """Build a model directly sharded per the plan, place a batch, and verify every array
    lives where the plan says (``shardplan show``).

    Raises:
        ShardPlanError: the plan does not fit, or a live array is off-plan.
    """
    from shardplan.runtime import live
    from shardplan.runtime import model as model_mod
    from shardplan.runtime import placement as placement_mod
    from shardplan.runtime.mesh import make_mesh

    p = _plan(plan, mesh)
    factory = model_mod.load_factory(model)
    m = make_mesh(p, axis_types=axis_types)  # type: ignore[arg-type]
    built, opt, placement = placement_mod.init_sharded(p, factory, model_mod.make_tx(optimizer), mesh=m)
    placed = placement.shard_batch(batch) if batch else None
    live.verify(placement, built, opt, placed)
    return Shown(built, opt, placement, placed)


# -- checkpoints -----------------------------------------------------------------------------
def stored_plan(directory: str | os.PathLike, step: int | None = None) -> Plan:
    """The plan a checkpoint step was saved under, rebuilt from the texts stored with it
    (the plan's file and every base it extends), on the mesh it was saved on."""
    from shardplan.runtime import checkpoint

    manager = checkpoint.open_readonly(directory)
    steps = sorted(manager.all_steps())
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise as_error(
            [
                error(
                    "no-such-step",
                    f"step {step} is not in {directory}",
                    f"complete steps: {', '.join(map(str, steps))}",
                    path=str(directory),
                )
            ]
        )
    meta = checkpoint.read_meta(Path(manager.directory) / str(chosen))
    sources = meta.get("plan_sources") or [[(meta.get("plan_files") or ["<checkpoint>"])[0], meta.get("plan_text", "")]]
    mesh = meta.get("mesh") or None
    return load_sources(tuple((str(f), str(t)) for f, t in sources), mesh=mesh)


# -- reviewing a change: diff, explain, lock ---------------------------------------------------
@dataclass(frozen=True)
class PlanDiff:
    """Two plans' layouts for one model, and what moving state from the first to the second costs."""

    before: CheckResult
    after: CheckResult
    changed: tuple[tuple[Decision, Decision], ...]  # (before, after) for each leaf whose spec changes
    moves: tuple[reshard.Move, ...]

    def reshard_bytes(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Per-device bytes of the reshard, by (collective kind, mesh axes)."""
        return reshard.totals(list(self.moves))


def _plan_or_checkpoint(plan: str | os.PathLike | Plan, mesh) -> Plan:
    if not isinstance(plan, Plan) and Path(plan).is_dir():
        stored = stored_plan(plan)
        return _plan(stored, mesh) if mesh else stored
    return _plan(plan, mesh)


def diff(
    before: str | os.PathLike | Plan,
    after: str | os.PathLike | Plan,
    *,
    model: str | None = None,
    shapes: str | os.PathLike | None = None,
    optimizer: str = "adam",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
    leaves: ModelLeaves | None = None,
    cache: bool = True,
) -> PlanDiff:
    """Compare two plans (or a checkpoint directory's stored plan and a plan) on one model.

    Both are resolved on the same device count (``devices``; else a concrete mesh's size, the
    checkpoint's, or this machine's); ``mesh`` replaces both plans' meshes.

    Raises:
        ShardPlanError: a plan does not fit the model, or the meshes have no common refinement.
    """
    pa, pb = _plan_or_checkpoint(before, mesh), _plan_or_checkpoint(after, mesh)
    if devices is None:
        for p in (pa, pb):
            if all(a.size is not None for a in p.mesh):
                devices = math.prod(a.size for a in p.mesh if a.size is not None)
                break
    if leaves is None:
        leaves = model_leaves(model=model, shapes=shapes, optimizer=optimizer, cache=cache)
    ra = check(pa, leaves=leaves, devices=devices)
    rb = check(pb, leaves=leaves, devices=devices)
    assert ra.resolution is not None and rb.resolution is not None
    ref = reshard.refinement_or_error(ra.resolution.mesh, rb.resolution.mesh)
    by_path = {d.path: d for d in rb.resolution.decisions}
    changed = tuple(
        (d, by_path[d.path])
        for d in ra.resolution.decisions
        if d.path in by_path and not reshard.same_layout(d, by_path[d.path], ref)
    )
    moves = reshard.reshard_moves(
        tuple(x for x, _ in changed), tuple(y for _, y in changed), ra.resolution.mesh, rb.resolution.mesh
    )
    return PlanDiff(ra, rb, changed, tuple(moves))


def explain(
    plan: str | os.PathLike | Plan,
    path: str,
    *,
    model: str | None = None,
    shapes: str | os.PathLike | None = None,
    optimizer: str = "adam",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
    leaves: ModelLeaves | None = None,
    cache: bool = True,
) -> explain_mod.Explanation:
    """Every rule tried for ``path`` (a param, state or optimizer-state path), which decided,
    and near misses. The decision is the one ``check`` makes.

    Raises:
        ShardPlanError: ``no-such-path`` (with the closest paths), or the plan does not fit.
    """
    if leaves is None:
        leaves = model_leaves(model=model, shapes=shapes, optimizer=optimizer, cache=cache)
    result = check(plan, leaves=leaves, mesh=mesh, devices=devices)
    assert result.resolution is not None
    decisions = {d.path: d for d in result.resolution.decisions}
    all_leaves = {leaf.path: leaf for leaf in leaves[0] + leaves[1]}
    if path not in decisions:
        near = difflib.get_close_matches(path, list(decisions), n=3, cutoff=0.4)
        raise as_error(
            [
                error(
                    "no-such-path",
                    f"the model has no array at '{path}'",
                    ("closest: " + ", ".join(near)) if near else "list the paths with shardplan check --expand",
                    path=path,
                )
            ]
        )
    return explain_mod.explain(result.plan, all_leaves[path], decisions[path])


def lock_text(result: CheckResult, command: str) -> str:
    """The lock file for a checked plan (see :mod:`shardplan.core.lock`)."""
    assert result.resolution is not None, "lock needs a model"
    return lock.text(result.plan.name or result.plan.files[0], result.resolution.mesh, result.resolution, command)


def check_lock(result: CheckResult, lock_file: str | os.PathLike) -> list[Diagnostic]:
    """``lock-drift`` errors for every line where the resolved layout differs from the lock."""
    assert result.resolution is not None, "a lock needs a model"
    text = read_file(Path(lock_file))
    return lock.drift(str(lock_file), text, result.resolution.mesh, result.resolution)


# -- step cost ---------------------------------------------------------------------------------
COMPILE_TIMEOUT_S = 1800


def _failure(lines: list[str]) -> str:
    """A failed compile in one line: XLA's own reason (INVALID_ARGUMENT: [hlo verifier] ...), which
    sits above a traceback's last lines, then those lines."""
    reasons = [ln.strip() for ln in lines if _XLA_STATUS.search(ln)][-2:]
    return " | ".join(dict.fromkeys(reasons + [ln.strip() for ln in lines[-3:]]))


def _compile_here(plan: Plan, model: str, step: str, shapes: dict, optimizer: str, backend: str) -> StepCost:
    """Exact mode in this process (what ``shardplan.tools.compile_worker`` does in a child): the
    model and step loaded (a module this process imported already is reused, not read again), the
    step compiled on this process's devices, with no timeout. A failure that is not a
    ShardPlanError is reported as the child's would be, with XLA's reason kept."""
    from shardplan.runtime.exact import compile_step
    from shardplan.runtime.model import load_factory

    try:
        return compile_step(plan, load_factory(model), load_factory(step, what="--step"), shapes, optimizer, backend)
    except ShardPlanError:
        raise
    except Exception as e:  # the user's model or XLA, as the child process would report it
        from shardplan.core.targets import CPU

        reason = _failure(f"{type(e).__name__}: {e}".strip().splitlines())
        raise as_error([_compile_failure(f"compiling the step failed: {reason}", CPU.compiler)]) from None


_XLA_STATUS = re.compile(
    r"\b(INVALID_ARGUMENT|UNIMPLEMENTED|INTERNAL|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|OUT_OF_RANGE):"
)


def _batch_shapes(batch: dict | list[str], path: str) -> dict:
    """The step's input shapes from ``batch`` (command-line items or a dict); none is an error at
    ``path`` (``--batch`` on the command line, ``batch`` from Python)."""
    shapes = parse_batch_arg(batch) if isinstance(batch, list) else dict(batch)
    if not shapes:
        how = (
            "pass --batch 'tokens=int32[256,4096],labels=int32[256,4096]'"
            if path.startswith("--")
            else "pass batch=['tokens=int32[8,16]']"
        )
        raise as_error([error("bad-argument", "the step needs the batch's shapes", how, path=path)])
    return shapes


def _fast_cost(name: str) -> Callable[..., StepCost]:
    """A backend's fast-mode cost, from the backend registry: ``fn(tracer, plan, mesh, delta=...)``."""
    import importlib

    from shardplan.core import backends

    module, function = backends.lookup(name, "--backend").fast_cost.split(":")
    return getattr(importlib.import_module(module), function)


COST_MEMO = 512  # plans' costs a StepCoster keeps (a StepCost pickles to 3-8 KiB; a search costs up to ~250)
COSTERS = 4  # StepCosters kept (the last models, steps and batches costed): at most tens of MiB with their costs


class StepCoster:
    """One model, step and batch, costed under many plans in fast mode, on either backend: each
    plan resolved once per costing and the step traced once per distinct set of what tracing
    applies (``act``/``axis`` rules, mesh, axis types, a pipeline's stage split): every other plan
    re-costs on that trace (``runtime.tracing.Tracer``), as a plan search needs.

    Made by :func:`step_coster`; ``traces`` counts the traces made so far, ``resolutions`` the
    plans resolved against the model.
    """

    def __init__(self, model: str, step: str, batch: dict | list[str], optimizer: str = "adamw"):
        from shardplan.runtime import model as model_mod

        optimizers.lookup(optimizer)
        shapes = _batch_shapes(batch, "batch")
        from shardplan.runtime.tracing import Tracer

        self.shapes = shapes
        self.optimizer = optimizer
        self.factory = model_mod.load_factory(model)
        self.loss_fn = model_mod.load_factory(step, what="--step")
        self.tracer = Tracer(self.factory, self.loss_fn, shapes, optimizer)  # the model built abstractly
        # the costs made so far, by plan, mesh and how it was costed (a search, or a second search
        # under another budget, asks for the same plan again): the last COST_MEMO kept
        self._costs: collections.OrderedDict[tuple, StepCost] = collections.OrderedDict()
        self.memo_hits = 0

    def forget(self) -> None:
        """Drop the costs kept so far (the trace stays): the next cost of each plan is computed
        again, as a search's first look at a plan is (what ``benchmarks.recost`` times)."""
        self._costs.clear()

    @property
    def built(self) -> tuple[Any, Any]:
        return self.tracer.built

    @property
    def traces(self) -> int:
        return self.tracer.traces

    @property
    def resolutions(self) -> int:
        return self.tracer.resolutions

    def cost(
        self,
        plan: str | os.PathLike | Plan,
        *,
        mesh: dict[str, int | None] | None = None,
        devices: int | None = None,
        delta: bool = True,
        backend: str | None = None,
        compiler: str = "cpu",
        propagation: str = "shardplan",
    ) -> StepCost:
        """The plan's step cost, as ``analyze(..., mode="fast")`` gives it, on a shared trace.

        Args:
            delta: also what the plan's constraints change (one more propagation; off for a search).
            backend: the backend to cost (default: the plan's).
            compiler: whose compiler's program is predicted: ``cpu``, ``cuda``, ``tpu`` or a chip
                with rules of its own (``tpu-v6e``, ``a100-80gb``, ``b200``: ``runtime.fast.COMPILERS``;
                a target's ``book``, ``core.targets``).
            propagation: whose layouts fast mode partitions: ``shardplan`` (its own propagation),
                ``xla`` (Shardy's, XLA's own pass, run offline; the auto backend only) or ``auto``
                (``xla`` where Shardy's propagation runs over the auto backend's step on a mesh of
                automatic axes, else ``shardplan``, a note saying why where Shardy failed).

        Raises:
            ShardPlanError: the plan does not fit the model, batch or devices; the step fails to
                trace; Shardy's propagation cannot run over it.
        """
        p = _plan(plan, mesh)
        name = backend or p.backend
        run = _fast_cost(name)
        _propagation(propagation, name)
        sizes = p.mesh_shape(devices)
        resolve_inputs(p, sizes, [Leaf(k, tuple(s), d, ITEMSIZE[d]) for k, (s, d) in self.shapes.items()])
        from shardplan.core.targets import BOOKS, COMPILER_NAMES

        if compiler not in COMPILER_NAMES and compiler not in BOOKS:
            raise as_error(
                [
                    error(
                        "bad-argument",
                        f"unknown compiler '{compiler}'",
                        f"use one of {', '.join([*COMPILER_NAMES, *sorted(BOOKS)])} (a target's platform, or a chip "
                        "whose compiler fast mode has rules of its own for)",
                        path="compiler",
                    )
                ]
            )
        if propagation == "auto" and name != "auto":
            propagation = "shardplan"  # Shardy lays out the auto backend's step, not the partitioner's
        from shardplan.runtime.fast import COMPILERS

        # (the compiler's rules themselves in the key: a book replaced since is another costing)
        key = (p, tuple(sizes.items()), delta, name, compiler, COMPILERS.get(compiler), propagation)
        hit = self._costs.get(key)
        if hit is not None:
            self._costs.move_to_end(key)
            self.memo_hits += 1
            return hit
        got = self._cost(run, p, sizes, delta, compiler, propagation)
        self._costs[key] = got
        if len(self._costs) > COST_MEMO:
            self._costs.popitem(last=False)
        return got

    def _cost(
        self, run: Callable, p: Plan, sizes: dict[str, int], delta: bool, compiler: str, propagation: str
    ) -> StepCost:
        if propagation == "shardplan":
            return with_pipeline(run(self.tracer, p, sizes, delta=delta, compiler=compiler), p)
        from shardplan.runtime import shardy

        try:
            got = run(self.tracer, p, sizes, delta=delta, compiler=compiler, propagation=propagation)
        except shardy.Failed as err:
            raise as_error(
                [
                    error(
                        "layouts-failed",
                        f"Shardy's propagation could not run over the step: {err}",
                        "cost it with fast mode's own propagation (--propagation shardplan) or --compile",
                        path="--propagation",
                    )
                ]
            ) from None
        return with_pipeline(got, p)

    def roles(self, devices: int) -> Any:
        """What each param dim is, read from the step traced on ``devices`` (``runtime.roles``)."""
        from shardplan.lang.loader import loads
        from shardplan.runtime import roles

        p = loads(f"mesh data = {devices}\ndefault replicated\n", "<roles>")
        sizes = p.mesh_shape(devices)
        res = self.tracer.resolve(p, sizes)
        traced = self.tracer.step(p, sizes, res)
        paths = [d.path for d in res.params.decisions]
        opt_paths = [d.path for d in res.opt.decisions] if res.opt is not None else []
        return roles.roles(traced.closed, paths, len(paths), [d.path for d in res.inputs.decisions], opt_paths)

    def capacities(self, devices: int = 1) -> tuple[Any, ...]:
        """The step's capacity-style expert dispatches (``core.routing.Capacity``), read from its
        computation (``runtime.roles``): each matmul batched over stacked experts' weights against
        a buffer of dispatched tokens, with the top-k (or chain of argmaxes, GShard's) over as many
        experts that routes them (none found: ``k`` 0, the slots alone)."""
        from shardplan.core.routing import Capacity

        r = self.roles(devices)
        out = []
        for experts, slots in r.expert_slots:
            routed = [(k, tokens) for e, k, tokens in r.routers if e == experts]
            out += [Capacity(experts, k, tokens, slots) for k, tokens in routed] or [Capacity(experts, 0, 0, slots)]
        return tuple(out)


def expert_capacity(
    model: str, step: str, batch: dict | list[str], optimizer: str = "adamw", devices: int = 1
) -> tuple[Any, ...]:
    """The capacity-style expert dispatches of ``model``'s step (:meth:`StepCoster.capacities`):
    what a stated routing drops (``core.routing.dropped``). Empty for a dropless step.

    Raises:
        ShardPlanError: the model, step or batch cannot be loaded or traced.
    """
    return _coster(model, step, _batch_shapes(batch, "batch"), optimizer).capacities(devices)


def _coster(model: str, step: str, shapes: dict, optimizer: str) -> StepCoster:
    """A :class:`StepCoster` for ``model``, ``step``, ``shapes`` and ``optimizer``: one of the last
    :data:`COSTERS` made (by ``analyze``, ``expert_capacity``, ``suggest``) where all four are the
    same and neither file has changed since, else a new one: a command that costs several plans of
    one model (``check --vs``), costs a plan and then reads its experts (``check --expert-load``),
    or a process that searches again builds and traces the model once."""

    def stamp(ref: str) -> int | None:
        where = ref.rsplit(":", 1)[0]
        return os.stat(where).st_mtime_ns if os.path.isfile(where) else None

    key = tuple((k, tuple(s), d) for k, (s, d) in shapes.items())
    return _last_coster(model, step, key, optimizer, stamp(model), stamp(step))


@functools.lru_cache(maxsize=COSTERS)
def _last_coster(model: str, step: str, shapes: tuple, optimizer: str, *stamps: int | None) -> StepCoster:
    return StepCoster(model, step, {k: (s, d) for k, s, d in shapes}, optimizer)


PROPAGATIONS = ("auto", "shardplan", "xla")  # whose layouts fast mode partitions (``StepCoster.cost``)


def _propagation(propagation: str, backend: str) -> None:
    """Refuse a propagation that is not one of :data:`PROPAGATIONS`, or ``xla`` beside a backend
    other than auto (the shard_map backend lays its regions out by hand)."""
    if propagation not in PROPAGATIONS:
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"unknown propagation '{propagation}'",
                    f"use one of {', '.join(PROPAGATIONS)}",
                    path="--propagation",
                )
            ]
        )
    if propagation == "xla" and backend != "auto":
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"--propagation xla costs the auto backend's step; the plan's backend is {backend}",
                    "drop --propagation, or cost the auto backend (--backend auto)",
                    path="--propagation",
                )
            ]
        )


def step_coster(model: str, step: str, batch: dict | list[str], optimizer: str = "adamw") -> StepCoster:
    """A :class:`StepCoster`: cost many plans for one model, step and batch without retracing.

    Raises:
        ShardPlanError: bad arguments, or the model fails to import or build.
    """
    return StepCoster(model, step, batch, optimizer)


def analyze(
    plan: str | os.PathLike | Plan,
    *,
    model: str,
    step: str,
    batch: dict | list[str],
    optimizer: str = "adamw",
    backend: str | None = None,
    mode: str = "exact",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
    timeout_s: float = COMPILE_TIMEOUT_S,
    target: str = "cpu",
    propagation: str = "shardplan",
) -> StepCost:
    """What one training step costs per device on the plan's whole mesh (``check --step``).

    Args:
        plan: a ``.splan`` path or a loaded plan.
        model: ``FILE.py:FACTORY`` (built abstractly; nothing is allocated).
        step: ``FILE.py:LOSS_FN``, ``loss_fn(model, batch) -> scalar`` as for ``train_step``.
        batch: input shapes, ``{"tokens": ((256, 4096), "int32")}`` or command-line items
            (``["tokens=int32[256,4096]"]``).
        optimizer: an optimizer name (``shardplan.core.optimizers``).
        backend: the backend to cost (default: the plan's).
        mode: ``exact``: compile the real step for the mesh in a child process with that many
            simulated CPU devices and read XLA's program (in this process instead, with no
            timeout, when it has exactly those CPU devices started, no mesh in context and the
            default float width); ``fast``: propagate the plan's shardings through the step's
            jaxpr (auto backend; no compile, any mesh size).
        mesh, devices: the mesh, as for :func:`check` (a ``*`` axis needs ``devices``).
        timeout_s: how long the child process may compile (a value other than the default
            always uses a child).
        target: the compiler whose program is costed (``shardplan.core.targets``): ``cpu`` (XLA:CPU
            on simulated devices), a TPU slice (``tpu-v5p:2x2x2``) or GPUs (``h100:8``); exact mode
            compiles for it offline, fast mode predicts that compiler's program
            (``runtime.fast.COMPILERS``); the mesh must have as many devices as the target.
        propagation: fast mode only: ``shardplan``, its own propagation of the plan's layouts
            through the step; ``xla``, every value laid out by Shardy's propagation (the pass XLA
            runs before it partitions the step), run offline, and fast mode's rules saying what
            XLA's partitioner moves for those layouts (auto backend; docs/stepcost.md has how the
            two compare on random plans); ``auto``: ``xla`` where Shardy's
            propagation runs over the auto backend's step on automatic axes, else ``shardplan``
            (a Pallas kernel's call, the shard_map backend, explicit axes), the step's notes
            saying which.

    Raises:
        ShardPlanError: bad arguments, a plan that does not fit, a step that fails to trace,
            a loss that is not a scalar, or a mesh too large to simulate.
    """
    p = _plan(plan, mesh)
    _propagation(propagation, backend or p.backend)
    if propagation not in ("auto", "shardplan") and mode != "fast":
        raise as_error(
            [
                error(
                    "bad-argument",
                    "--propagation says how fast mode lays the step out; exact mode reads XLA's own program",
                    "drop --propagation, or cost in fast mode",
                    path="--propagation",
                )
            ]
        )
    cost = _step_cost(p, model, step, batch, optimizer, backend, mode, devices, timeout_s, target, propagation)
    return with_pipeline(cost, p)


def _step_cost(
    p: Plan,
    model: str,
    step: str,
    batch: dict | list[str],
    optimizer: str,
    backend: str | None,
    mode: str,
    devices: int | None,
    timeout_s: float,
    target: str = "cpu",
    propagation: str = "shardplan",
) -> StepCost:
    from shardplan.core import backends, targets
    from shardplan.errors import Diagnostic, Span

    name = backend or p.backend
    backends.lookup(name, "--backend")
    if mode not in ("exact", "fast"):
        raise as_error([error("bad-argument", f"unknown mode '{mode}'", "use 'fast' or 'exact'", path="mode")])
    optimizers.lookup(optimizer)
    shapes = _batch_shapes(batch, "--batch")
    aim = targets.parse(target, "target")
    sizes = p.mesh_shape(devices if devices is not None or aim.devices is None else aim.devices)
    n = math.prod(sizes.values())
    if aim.devices is not None and n != aim.devices:
        raise as_error(
            [
                error(
                    "bad-target",
                    f"the mesh {sizes} has {n} devices; --target {aim.name} has {aim.devices}",
                    f"give a mesh of {aim.devices} devices (--mesh / --devices {aim.devices}) or a target of {n}",
                    path="--target",
                )
            ]
        )
    if mode == "exact":
        targets.require_compiler(aim)
    # Fail early, in this process, on what needs no devices: the batch must divide over its axes.
    resolve_inputs(p, sizes, [Leaf(k, tuple(s), d, ITEMSIZE[d]) for k, (s, d) in shapes.items()])
    if mode == "fast":
        coster = _coster(model, step, shapes, optimizer)
        cost = coster.cost(p, mesh=None, devices=devices, backend=name, compiler=aim.book, propagation=propagation)
        # named for the target ("XLA:TPU tpu-v5e:2x4"): the report sets its peak against the chip's memory
        return dataclasses.replace(cost, compiler=f"{cost.compiler} {aim.name}") if aim.platform != "cpu" else cost
    if aim.platform == "cpu" and n > MAX_SIMULATED_DEVICES:
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"the mesh {sizes} has {n} devices; exact mode simulates at most "
                    f"{MAX_SIMULATED_DEVICES} CPU devices",
                    "check a smaller mesh with --compile",
                    path="--compile",
                )
            ]
        )
    from shardplan.runtime.exact import devices_here

    if aim.platform == "cpu" and timeout_s == COMPILE_TIMEOUT_S and devices_here(n):  # the mesh's devices: no child
        return _compile_here(load_sources(p.sources, mesh=sizes), model, step, shapes, optimizer, name)
    from shardplan.runtime.devices import simulate

    env = simulate(n if aim.platform == "cpu" else 1, dict(os.environ))
    env["JAX_PLATFORMS"] = "cpu"  # a target's compiler is reached through its topology, never a device
    if aim.platform == "tpu":  # compile-only: libtpu's one-process lock (held by any jax here that
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # started its backends, or a parallel compile) does not apply
    request = {
        "sources": [list(x) for x in p.sources],
        "mesh": sizes,
        "model": model,
        "step": step,
        "batch": {k: [list(s), d] for k, (s, d) in shapes.items()},
        "optimizer": optimizer,
        "backend": name,
        "target": aim.name,
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shardplan.tools.compile_worker"],
            input=json.dumps(request),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"compiling the step for {n} {'simulated' if aim.platform == 'cpu' else aim.compiler} devices "
                    f"took over {timeout_s:.0f} s",
                    "check a smaller mesh or model",
                    path="--compile",
                )
            ]
        ) from None
    lines = proc.stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        reply = {}
    if "cost" in reply:
        return StepCost.from_json(reply["cost"])
    if "error" in reply:
        raise as_error(
            [Diagnostic(**dict(d, span=Span(**d["span"]) if d.get("span") else None)) for d in reply["error"]]
        )
    tail = _failure((proc.stderr or proc.stdout).strip().splitlines())
    raise as_error([_compile_failure(f"the compile process failed (exit {proc.returncode}): {tail}", aim.compiler)])


def _compile_failure(message: str, compiler: str) -> Diagnostic:
    """A failed compile: the compiler's own internal error (XLA's ``INTERNAL:`` status: a bug of
    the compiler, such as XLA:GPU finding no tiling for a small matmul offline) said as such;
    anything else the model's or loss's failure."""
    if re.search(r"\bINTERNAL:", message):
        return error(
            "compiler-failed",
            f"{compiler} failed to compile the step with an internal error (a bug of the compiler, not of the "
            f"model or the plan): {message}",
            "cost the step in fast mode (without --compile), or compile it for another target",
            path="--compile",
        )
    hint = "run the step on a small mesh in Python to see the full error"
    return error("loss-failed", message, hint, path="--compile")


def layouts(
    plan: str | os.PathLike | Plan,
    *,
    model: str,
    step: str,
    batch: dict | list[str],
    optimizer: str = "adamw",
    mesh: dict[str, int | None] | None = None,
    devices: int | None = None,
) -> tuple[Any, ...]:
    """Every value of the training step as XLA lays it out under ``plan`` (``check --layouts``):
    Shardy's propagation, the pass XLA runs before it partitions the step, run offline over the
    step traced once (``runtime.shardy``: no compile, no devices, any mesh size). The auto
    backend's step; arguments as for :func:`analyze`. Returns ``runtime.shardy.Value`` rows
    (source line, primitive, shape, element size, layout, backward pass, computed from literals
    alone, a forward activation), in program order.

    Raises:
        ShardPlanError: bad arguments, a plan that does not fit, a step that fails to trace, or a
            step whose lowering the propagation cannot read.
    """
    from shardplan.runtime import shardy
    from shardplan.runtime.tracing import abstract_mesh

    p = _plan(plan, mesh)
    optimizers.lookup(optimizer)
    shapes = _batch_shapes(batch, "--batch")
    sizes = p.mesh_shape(devices)
    resolve_inputs(p, sizes, [Leaf(k, tuple(s), d, ITEMSIZE[d]) for k, (s, d) in shapes.items()])
    tracer = StepCoster(model, step, shapes, optimizer).tracer
    res = tracer.resolve(p, sizes)
    traced = tracer.step(p, sizes, res)
    jaxpr = traced.closed.jaxpr

    kept = [*res.params.decisions, *res.opt.decisions]  # the step's outputs keep the plan's layout
    args, results = shardy.given(jaxpr, [*kept, *res.inputs.decisions], kept)
    try:
        laid_out = shardy.Propagator(traced.closed, abstract_mesh(sizes, p)).layouts(args, results)
    except Exception as err:  # jaxlib's MLIR errors have no common root
        raise as_error(
            [
                error(
                    "layouts-failed",
                    f"Shardy's propagation could not run over the step: {shardy.reason(err)}",
                    "check the step with --compile instead (XLA's own program)",
                    path="--layouts",
                )
            ]
        ) from None
    inputs = frozenset(jaxpr.invars[len(args) - len(res.inputs.decisions) :])
    return tuple(shardy.values(jaxpr, laid_out, inputs))
