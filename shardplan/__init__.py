"""shardplan: sharding plans for Flax NNX models, written as .splan files.

The layers, in the order imports go: ``errors``/``codes`` -> ``core`` (jax-free data and
stages) -> ``lang`` (the .splan front end) and ``runtime`` (everything that imports jax) ->
``api`` -> ``tools`` (CLI, rendering, emission, launcher). Names whose modules import jax
load on first use, so ``import shardplan`` (and ``shardplan check --shapes``) stays fast
and device-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardplan.api import CheckResult as CheckResult
from shardplan.api import check as check
from shardplan.api import stored_plan as stored_plan
from shardplan.core.leaves import Decision as Decision
from shardplan.core.leaves import Leaf as Leaf
from shardplan.core.leaves import Resolution as Resolution
from shardplan.core.meshes import parse_mesh_arg as parse_mesh_arg
from shardplan.core.meshes import with_mesh as with_mesh
from shardplan.core.plan import Plan as Plan
from shardplan.core.resolve import resolve_leaves as resolve_leaves
from shardplan.core.shapes import load_shapes as load_shapes
from shardplan.core.spec import Spec as Spec
from shardplan.errors import ArgumentError as ArgumentError
from shardplan.errors import Diagnostic as Diagnostic
from shardplan.errors import LaunchError as LaunchError
from shardplan.errors import PlanApplyError as PlanApplyError
from shardplan.errors import PlanCheckError as PlanCheckError
from shardplan.errors import PlanSyntaxError as PlanSyntaxError
from shardplan.errors import ShardMapFallbackWarning as ShardMapFallbackWarning
from shardplan.errors import ShardPlanError as ShardPlanError
from shardplan.errors import Span as Span
from shardplan.lang.loader import load as load
from shardplan.lang.loader import loads as loads
from shardplan.planner import Suggestion as Suggestion
from shardplan.planner import suggest as suggest
from shardplan.version import version as _version

if TYPE_CHECKING:  # what the lazy names below resolve to, for IDEs and type checkers
    from shardplan.runtime import checkpoint as checkpoint
    from shardplan.runtime import distributed as distributed
    from shardplan.runtime import generate as generate
    from shardplan.runtime.checkpoint import Checkpointer as Checkpointer
    from shardplan.runtime.devices import simulate as simulate_devices
    from shardplan.runtime.generate import GenerationAdapter as GenerationAdapter
    from shardplan.runtime.generate import GenerationConfig as GenerationConfig
    from shardplan.runtime.generate import Generator as Generator
    from shardplan.runtime.live import live_leaves as live_leaves
    from shardplan.runtime.live import show as show
    from shardplan.runtime.live import verify as verify
    from shardplan.runtime.mesh import make_mesh as make_mesh
    from shardplan.runtime.model import dump_shapes as dump_shapes
    from shardplan.runtime.placement import Placement as Placement
    from shardplan.runtime.placement import init_sharded as init_sharded
    from shardplan.runtime.placement import place as place
    from shardplan.runtime.placement import shard_batch as shard_batch
    from shardplan.runtime.placement import shard_model as shard_model
    from shardplan.runtime.specs import Resolved as Resolved
    from shardplan.runtime.specs import pspec as pspec
    from shardplan.runtime.specs import resolve as resolve
    from shardplan.runtime.specs import resolve_batch as resolve_batch
    from shardplan.runtime.specs import resolve_model as resolve_model
    from shardplan.runtime.step import TrainStep as TrainStep
    from shardplan.runtime.step import train_step as train_step
    from shardplan.tools.report import print_diagnostics as print_diagnostics

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("shardplan.runtime.checkpoint", None),
    "distributed": ("shardplan.runtime.distributed", None),
    "generate": ("shardplan.runtime.generate", None),
    "Checkpointer": ("shardplan.runtime.checkpoint", "Checkpointer"),
    "simulate_devices": ("shardplan.runtime.devices", "simulate"),
    "GenerationAdapter": ("shardplan.runtime.generate", "GenerationAdapter"),
    "GenerationConfig": ("shardplan.runtime.generate", "GenerationConfig"),
    "Generator": ("shardplan.runtime.generate", "Generator"),
    "live_leaves": ("shardplan.runtime.live", "live_leaves"),
    "show": ("shardplan.runtime.live", "show"),
    "verify": ("shardplan.runtime.live", "verify"),
    "make_mesh": ("shardplan.runtime.mesh", "make_mesh"),
    "dump_shapes": ("shardplan.runtime.model", "dump_shapes"),
    "Placement": ("shardplan.runtime.placement", "Placement"),
    "init_sharded": ("shardplan.runtime.placement", "init_sharded"),
    "place": ("shardplan.runtime.placement", "place"),
    "shard_batch": ("shardplan.runtime.placement", "shard_batch"),
    "shard_model": ("shardplan.runtime.placement", "shard_model"),
    "Resolved": ("shardplan.runtime.specs", "Resolved"),
    "pspec": ("shardplan.runtime.specs", "pspec"),
    "resolve": ("shardplan.runtime.specs", "resolve"),
    "resolve_batch": ("shardplan.runtime.specs", "resolve_batch"),
    "resolve_model": ("shardplan.runtime.specs", "resolve_model"),
    "TrainStep": ("shardplan.runtime.step", "TrainStep"),
    "train_step": ("shardplan.runtime.step", "train_step"),
    "print_diagnostics": ("shardplan.tools.report", "print_diagnostics"),
}

__version__ = _version()


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'shardplan' has no attribute '{name}'")
    module = importlib.import_module(target[0])
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArgumentError",
    "CheckResult",
    "Checkpointer",
    "Decision",
    "Diagnostic",
    "GenerationAdapter",
    "GenerationConfig",
    "Generator",
    "LaunchError",
    "Leaf",
    "Placement",
    "Plan",
    "PlanApplyError",
    "PlanCheckError",
    "PlanSyntaxError",
    "Resolution",
    "Resolved",
    "ShardMapFallbackWarning",
    "ShardPlanError",
    "Span",
    "Spec",
    "Suggestion",
    "TrainStep",
    "__version__",
    "check",
    "checkpoint",
    "distributed",
    "dump_shapes",
    "generate",
    "init_sharded",
    "live_leaves",
    "load",
    "load_shapes",
    "loads",
    "make_mesh",
    "parse_mesh_arg",
    "place",
    "print_diagnostics",
    "pspec",
    "resolve",
    "resolve_batch",
    "resolve_leaves",
    "resolve_model",
    "shard_batch",
    "shard_model",
    "show",
    "simulate_devices",
    "stored_plan",
    "suggest",
    "train_step",
    "verify",
    "with_mesh",
]
