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

try:
    __version__ = version("shardplan")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"

__all__ = [
    "Decision",
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
    "load",
    "load_shapes",
    "loads",
    "parse_mesh_arg",
    "resolve_leaves",
]
