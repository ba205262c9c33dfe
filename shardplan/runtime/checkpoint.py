"""Orbax checkpoints that follow the plan.

A step directory holds three items: ``model`` and ``optimizer`` (the NNX states as pure
dicts of arrays) and ``meta`` (JSON: the text of the plan and of every base it extends,
its name and files, the mesh, the shardplan version). Saves are async: ``save`` returns
once the arrays are copied off the devices, and Orbax writes to a temporary directory that
is renamed into place only when complete, so a crash mid-save never leaves a half-written step as the latest.

Restore targets the shardings of the *current* placement (any plan, any mesh): the
target is a tree of ``ShapeDtypeStruct``s carrying the new ``NamedSharding``s, so each
device reads only its own shards and no host gathers a whole array.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from shardplan.errors import Diagnostic, PlanApplyError, ShardPlanError, as_error, error
from shardplan.runtime.placement import Placement
from shardplan.version import version

MAX_DIFFS = 20


@dataclass(frozen=True)
class StepInfo:
    """What ``shardplan ckpt info`` shows for one complete step."""

    step: int
    meta: dict
    leaves: dict[str, list[tuple[str, tuple[int, ...], str]]]  # item -> [(path, shape, dtype)]


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """'/'-joined path -> leaf, for pure dicts and metadata trees alike."""
    out: dict[str, Any] = {}
    if hasattr(tree, "tree") and not isinstance(tree, dict):  # orbax TreeMetadata
        tree = tree.tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "shape"):
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}/"))
    else:
        out[prefix[:-1]] = tree
    return out


def _not_a_checkpoint(directory: Path, why: str) -> ShardPlanError:
    return PlanApplyError(
        [
            error(
                "not-a-checkpoint",
                f"{directory} is not a shardplan checkpoint directory: {why}",
                "pass the directory given to --checkpoint-dir / Checkpointer",
                path=str(directory),
            )
        ]
    )


META_KEYS = {"plan_text": str, "plan_files": list, "mesh": dict, "shardplan_version": str}
MAX_META_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StepProblem:
    """Why one step folder cannot be read: ``corrupt`` (written by shardplan, now damaged) or
    ``foreign`` (not a shardplan step: another tool's checkpoint, or a stray folder)."""

    step: int
    kind: str  # "corrupt" | "foreign"
    file: str  # the file or folder at fault
    why: str

    def diagnostic(self) -> Diagnostic:
        message = f"step {self.step} is {self.kind}: {self.why}"
        if self.kind == "corrupt":
            hint = "restore another step (--step), or delete the damaged step folder"
            return error("corrupt-checkpoint", message, hint, path=self.file)
        hint = "point at a directory written by shardplan's Checkpointer, or move the folder away"
        return error("foreign-checkpoint", message, hint, path=self.file)

    def as_error(self) -> ShardPlanError:
        return as_error([self.diagnostic()])


def _json_file(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, why it cannot be read)."""
    try:
        if not path.is_file():
            return None, "missing"
        if path.stat().st_size > MAX_META_BYTES:
            return None, f"{path.stat().st_size:,} bytes, too large for metadata"
        return json.loads(path.read_bytes().decode("utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"unreadable ({type(e).__name__}: {str(e)[:120]})"


def read_meta(step_dir: Path) -> dict:
    """The ``meta`` item of a step folder, validated; the error names the file."""
    problem = inspect_step(step_dir)
    if problem is not None:
        raise problem.as_error()
    meta, _ = _json_file(step_dir / "meta" / "metadata")
    return meta


def inspect_step(step_dir: Path) -> StepProblem | None:
    """Read a step folder's files without Orbax: None when it is a readable shardplan step."""
    try:
        step = int(step_dir.name)
    except ValueError:
        step = -1
    items = sorted(p.name for p in step_dir.iterdir() if p.is_dir()) if step_dir.is_dir() else []
    meta_file = step_dir / "meta" / "metadata"
    if "meta" not in items:
        held = f"it holds {', '.join(items[:6])}" if items else "it holds no checkpoint items"
        return StepProblem(step, "foreign", str(step_dir), f"no shardplan 'meta' item ({held})")
    meta, why = _json_file(meta_file)
    if why is not None:
        return StepProblem(step, "corrupt", str(meta_file), f"the plan metadata is {why}")
    if not isinstance(meta, dict) or not any(k in meta for k in META_KEYS):
        return StepProblem(step, "foreign", str(meta_file), "its 'meta' item was not written by shardplan")
    for key, typ in META_KEYS.items():
        if not isinstance(meta.get(key), typ):
            return StepProblem(step, "corrupt", str(meta_file), f"the plan metadata lacks a valid '{key}'")
    sources = meta.get("plan_sources")
    if sources is not None and not (
        isinstance(sources, list)
        and all(isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in sources)
    ):
        return StepProblem(step, "corrupt", str(meta_file), "the plan metadata has malformed 'plan_sources'")
    top, why = _json_file(step_dir / "_CHECKPOINT_METADATA")
    if why is not None and why != "missing":
        return StepProblem(step, "corrupt", str(step_dir / "_CHECKPOINT_METADATA"), f"the step metadata is {why}")
    if "model" not in items:
        return StepProblem(step, "corrupt", str(step_dir), "it has no 'model' item")
    for item in ("model", "optimizer"):
        if item not in items:
            continue
        tree, why = _json_file(step_dir / item / "_METADATA")
        if why is not None or not isinstance(tree, dict) or "tree_metadata" not in tree:
            return StepProblem(
                step, "corrupt", str(step_dir / item / "_METADATA"), f"the {item} tree metadata is {why or 'malformed'}"
            )
        if not (step_dir / item / "manifest.ocdbt").is_file():
            return StepProblem(step, "corrupt", str(step_dir / item), f"the {item} array data is missing (no manifest)")
    return None


def problems(directory: Path, steps: list[int]) -> list[StepProblem]:
    return [p for s in steps if (p := inspect_step(directory / str(s))) is not None]


class Checkpointer:
    """Step-numbered Orbax checkpoints of a model (and optimizer) under a placement.

    Args:
        directory: where steps are written (created on the first save).
        placement: the plan and mesh that restores target, and that saves record.
        max_to_keep: keep this many most recent steps (None: all).
        async_save: return from ``save`` before the files are written.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        placement: Placement,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        create: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.placement = placement
        if not create:
            check_directory(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=create
        )
        self.manager = ocp.CheckpointManager(self.directory, item_handlers=_handlers(), options=options)

    # -- steps --------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete steps only (an interrupted save is never listed)."""
        return sorted((self.manager.reload(), self.manager.all_steps())[1])

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # -- save ---------------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        plan = self.placement.plan
        return {
            "step": step,
            "plan_name": plan.name,
            "plan_files": list(plan.files),
            "plan_text": plan.text,
            "plan_sources": [[f, t] for f, t in plan.sources],
            "mesh": self.placement.mesh_shape,
            "backend": plan.backend,
            "shardplan_version": version(),
            "process_count": jax.process_count(),
        }

    def save(self, step: int, model: Any, optimizer: Any = None, *, force: bool = True) -> bool:
        """Start saving ``step`` (async); returns once arrays are off the devices."""
        items = {
            "model": ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))),
            "meta": ocp.args.JsonSave(self.meta(step)),
        }
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(optimizer)))
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def wait(self) -> None:
        """Block until every pending save is written and committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    # -- restore ------------------------------------------------------------------------
    def _step_or_raise(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise _not_a_checkpoint(self.directory, "it holds no complete step")
        if step is None:
            step = steps[-1]
        if step in steps:
            problem = inspect_step(self.directory / str(step))
            if problem is not None:
                good = [s for s in steps if inspect_step(self.directory / str(s)) is None]
                d = problem.diagnostic()
                hint = f"readable steps: {', '.join(map(str, good))}; {d.hint}" if good else d.hint
                raise as_error([error(d.code, d.message, hint, path=d.path)])
            return step
        if step not in steps:
            raise PlanApplyError(
                [
                    error(
                        "no-such-step",
                        f"step {step} is not in {self.directory}",
                        f"complete steps: {', '.join(map(str, steps))}",
                        path=str(self.directory),
                    )
                ]
            )
        return step

    def _target(self, obj: Any, resolution) -> dict:
        """Abstract pure dict with the current plan's NamedShardings: each device reads its shards."""
        state = nnx.state(obj)
        pure = nnx.to_pure_dict(state)
        shardings = _pure_shardings(state, resolution, self.placement.mesh)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), pure, shardings)

    def _check_tree(self, step: int, item: str, target: dict) -> None:
        try:  # the tree's metadata is read from the step's OCDBT files: damage shows here first
            saved_meta = self.manager.item_metadata(step)
        except Exception as e:  # Orbax/TensorStore errors of many kinds
            raise _restore_error(step, self.directory / str(step), e) from None
        saved = saved_meta[item] if item in saved_meta else None
        if saved is None:
            raise PlanApplyError(
                [
                    error(
                        "checkpoint-mismatch",
                        f"step {step} in {self.directory} has no {item} state",
                        f"restore without the {item} (e.g. model only)",
                        path=item,
                    )
                ]
            )
        have = _flat(saved)
        want = _flat(target)
        diags: list[Diagnostic] = []
        for path in sorted(set(want) - set(have)):
            diags.append(
                error(
                    "checkpoint-mismatch",
                    f"{item}/{path} is missing from the checkpoint (step {step})",
                    "restore into the model the checkpoint was saved from, or add the param there",
                    path=f"{item}/{path}",
                )
            )
        for path in sorted(set(have) - set(want)):
            diags.append(
                error(
                    "checkpoint-mismatch",
                    f"{item}/{path} is in the checkpoint but not in the model",
                    "restore into the model the checkpoint was saved from",
                    path=f"{item}/{path}",
                )
            )
        for path in sorted(set(have) & set(want)):
            h, w = have[path], want[path]
            hs, hd = tuple(getattr(h, "shape", ()) or ()), str(getattr(h, "dtype", ""))
            if hs != tuple(w.shape) or (hd and hd != str(w.dtype)):
                diags.append(
                    error(
                        "checkpoint-mismatch",
                        f"{item}/{path}: checkpoint has {hd}{list(hs)}, the model has {w.dtype}{list(w.shape)}",
                        "restore into a model of the same shapes and dtypes",
                        path=f"{item}/{path}",
                    )
                )
        if diags:
            raise PlanApplyError(diags)

    def restore(self, model: Any, optimizer: Any = None, *, step: int | None = None) -> int:
        """Restore ``step`` (default: the latest complete one) into ``model`` (and ``optimizer``)
        in place, placed per the current plan and mesh. Returns the step.

        Raises:
            PlanApplyError: no such step, not a checkpoint, or trees that differ (naming each path).
        """
        step = self._step_or_raise(step)
        items = {"model": (model, self.placement.params)}
        if optimizer is not None:
            if self.placement.opt is None:
                raise PlanApplyError(
                    [
                        error(
                            "no-optimizer",
                            "the placement has no optimizer state",
                            "make the placement with the optimizer",
                            path="optimizer",
                        )
                    ]
                )
            items["optimizer"] = (optimizer, self.placement.opt)
        targets = {name: self._target(obj, res) for name, (obj, res) in items.items()}
        for name, target in targets.items():
            self._check_tree(step, name, target)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(t) for name, t in targets.items()})
            )
        except Exception as e:  # Orbax/TensorStore errors of many kinds
            raise _restore_error(step, self.directory / str(step), e) from None
        for name, (obj, _) in items.items():
            state = nnx.state(obj)
            nnx.replace_by_pure_dict(state, restored[name])
            nnx.update(obj, state)
        return step

    def info(self, step: int) -> StepInfo:
        return step_info(self.manager, step)


_DATA_ERRORS = re.compile(
    r"DATA_LOSS|OUT_OF_RANGE|byte range|decod|corrupt|checksum|truncat|NOT_FOUND|No such file|reading array", re.I
)


def _chain_text(e: BaseException) -> str:
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return " <- ".join(parts)


def _restore_error(step: int, folder: Path, e: BaseException) -> ShardPlanError:
    """Damaged data is a corrupt step; anything else (memory, permissions, network, timeouts)
    is a failed restore, never a reason to delete the step."""
    text = _chain_text(e)
    if _DATA_ERRORS.search(text):
        return StepProblem(step, "corrupt", str(folder), f"reading its arrays failed ({text[:300]})").as_error()
    return as_error(
        [
            error(
                "restore-failed",
                f"restoring step {step} failed: {text[:400]}",
                "the files look whole: check device memory, permissions and the storage (the step is not "
                "known to be damaged)",
                path=str(folder),
            )
        ]
    )


def _handlers() -> dict:
    # Registered up front so a fresh manager can read item metadata before any restore.
    return {
        "model": ocp.StandardCheckpointHandler(),
        "optimizer": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _pure_shardings(state, resolution, mesh) -> dict:
    """The NamedSharding tree as a pure dict shaped like ``nnx.to_pure_dict(state)``."""
    specs = resolution.shardings(mesh)
    flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    leaves, vtreedef = jax.tree_util.tree_flatten(state)
    assert len(flat) == len(leaves)
    return nnx.to_pure_dict(jax.tree_util.tree_unflatten(vtreedef, flat))


def check_directory(directory: Path) -> None:
    if not directory.exists():
        raise _not_a_checkpoint(directory, "it does not exist")
    if not directory.is_dir():
        raise _not_a_checkpoint(directory, "it is not a directory")


def step_info(manager: ocp.CheckpointManager, step: int) -> StepInfo:
    """Meta and leaf shapes of a step; raises corrupt-/foreign-checkpoint for an unreadable one."""
    meta = read_meta(Path(manager.directory) / str(step))
    leaves = {}
    try:
        item_meta = manager.item_metadata(step)
    except Exception as e:
        raise _restore_error(step, Path(manager.directory) / str(step), e) from None
    for item in ("model", "optimizer"):
        tree = item_meta[item] if item in item_meta else None
        if tree is None:
            continue
        leaves[item] = [
            (p, tuple(getattr(m, "shape", ()) or ()), str(getattr(m, "dtype", "")))
            for p, m in sorted(_flat(tree).items())
        ]
    return StepInfo(step, meta, leaves)


def open_readonly(directory: str | os.PathLike) -> ocp.CheckpointManager:
    """A manager for reading an existing directory (``shardplan ckpt info``)."""
    path = Path(directory).absolute()
    check_directory(path)
    manager = ocp.CheckpointManager(
        path, item_handlers=_handlers(), options=ocp.CheckpointManagerOptions(read_only=True, create=False)
    )
    if not manager.all_steps():
        raise _not_a_checkpoint(path, "it holds no complete step")
    return manager
