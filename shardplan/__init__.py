"""shardplan: sharding plans for Flax NNX models, written as .splan files."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from shardplan.errors import Diagnostic as Diagnostic
from shardplan.errors import PlanApplyError as PlanApplyError
from shardplan.errors import PlanCheckError as PlanCheckError
from shardplan.errors import PlanSyntaxError as PlanSyntaxError
from shardplan.errors import ShardPlanError as ShardPlanError
from shardplan.errors import Span as Span
from shardplan.loader import load as load
from shardplan.loader import loads as loads
from shardplan.loader import parse_mesh_arg as parse_mesh_arg
from shardplan.plan import Plan as Plan
from shardplan.plan import Spec as Spec
from shardplan.resolve import Decision as Decision
from shardplan.resolve import Leaf as Leaf
from shardplan.resolve import Resolution as Resolution
from shardplan.resolve import resolve_leaves as resolve_leaves
from shardplan.shapes import dump_shapes as dump_shapes
from shardplan.shapes import load_shapes as load_shapes

# Names whose modules import jax load on first use, so `import shardplan` (and
# `shardplan check --shapes`) stays fast and device-free.
_LAZY = {
    "Placement": "shardplan.apply",
    "init_sharded": "shardplan.apply",
    "place": "shardplan.apply",
    "shard_batch": "shardplan.apply",
    "shard_model": "shardplan.apply",
    "make_mesh": "shardplan.mesh",
    "TrainStep": "shardplan.step",
    "train_step": "shardplan.step",
    "live_leaves": "shardplan.live",
    "show": "shardplan.live",
    "verify": "shardplan.live",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardplan' has no attribute '{name}'")


try:
    __version__ = version("shardplan")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"

__all__ = [
    "Decision",
    "Placement",
    "TrainStep",
    "Diagnostic",
    "Leaf",
    "Plan",
    "PlanApplyError",
    "PlanCheckError",
    "PlanSyntaxError",
    "Resolution",
    "ShardPlanError",
    "Span",
    "Spec",
    "__version__",
    "dump_shapes",
    "init_sharded",
    "live_leaves",
    "load",
    "load_shapes",
    "loads",
    "make_mesh",
    "parse_mesh_arg",
    "place",
    "resolve_leaves",
    "shard_batch",
    "shard_model",
    "show",
    "train_step",
    "verify",
]
