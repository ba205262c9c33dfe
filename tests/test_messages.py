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


def test_check_strict_fails_on_a_shard_map_fallback(tmp_path):
    """`check --step --backend shard_map` warns for each op the partitioner runs on whole operands,
    naming the op and the user's line; `--strict` makes it exit 1."""
    import subprocess
    import sys

    (tmp_path / "loss.py").write_text(
        "import jax\n\n\ndef loss(model, batch):\n    y = model(batch['x']).sum(-1)\n"
        "    return jax.lax.top_k(y, 4)[0].sum()\n"
    )
    plan = tmp_path / "p.splan"
    plan.write_text("mesh data = *\nbatch (data, _)\ndefault replicated\n")
    args = [sys.executable, "-m", "shardplan", "check", str(plan), "--model", f"{MODELS}:mlp_small", "--devices", "8",
            "--step", f"{tmp_path / 'loss.py'}:loss", "--batch", "x=float32[16,64]", "--backend", "shard_map"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning[shard-map-fallback]" in r.stderr and f"{tmp_path / 'loss.py'}:6" in r.stderr, r.stderr
    assert "top_k on whole operands" in r.stderr
    r = subprocess.run(args + ["--strict"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
