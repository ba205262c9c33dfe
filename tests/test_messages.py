"""What shardplan's messages say: the figures a user reads name a real op and line, say what
they count, and never say one number twice."""

from __future__ import annotations

import pytest

import shardplan
from shardplan import api
from shardplan.core.leaves import Leaf
from tests.helpers import PLANS, ROOT

MODELS = ROOT / "examples" / "models.py"
STEP = f"{ROOT / 'examples' / 'train.py'}:lm_loss"
BATCH = ["tokens=int32[8,16],labels=int32[8,16]"]
# Primitives the optimizer applies to a gradient: a collective labelled with one of them is the
# reader's, not the op that made the sum.
OPTIMIZER_OPS = {"integer_pow", "mul", "add", "sqrt", "div", "sub", "square"}


@pytest.mark.parametrize("plan", ["dp.splan", "gpt_tp.splan"])
def test_gradient_all_reduces_name_the_model_op_and_line(plan):
    cost = api.analyze(PLANS / plan, model=f"{MODELS}:gpt_tiny", step=STEP, batch=BATCH, mode="fast", devices=8)
    sums = [c for c in cost.communication if c.kind == "all-reduce"]
    assert sums
    for c in sums:
        assert c.op not in OPTIMIZER_OPS, c
        assert c.source.startswith(str(ROOT / "examples")), c
    assert {c.op for c in sums} >= {"dot_general"}


def test_indivisible_names_each_axis_and_the_product_once():
    plan = shardplan.loads('mesh data = 2, model = 4\nparam "w" ((data, model), _)\n', "p.splan")
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.resolve_leaves(plan, plan.mesh_shape(8), [Leaf("w", (12, 8), "float32", 4)])
    msg = info.value.errors[0].message
    assert "not divisible by data=2 x model=4 = 8 from" in msg, msg
    plan = shardplan.loads('mesh fsdp = 4\nparam "w" (fsdp, _)\n', "p.splan")
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.resolve_leaves(plan, plan.mesh_shape(4), [Leaf("w", (6, 8), "float32", 4)])
    msg = info.value.errors[0].message
    assert "not divisible by fsdp=4 from" in msg and "(4)" not in msg, msg
