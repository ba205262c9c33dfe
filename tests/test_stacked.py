"""Stacked layers (nnx.vmap + nnx.scan): `...` specs address trailing dims whatever the rank; a
rule written for one layer's array that splits the layer axis is warned about."""

import numpy as np
import optax
import pytest

import shardplan
from examples import models
from examples import train as example
from tests import reference
from tests.helpers import PLANS, ROOT, plan_line

LLAMA_SCAN = f"{ROOT / 'examples' / 'models.py'}:llama_tiny_scan"


TX = optax.adamw(1e-2, eps=1e-5)


def batches():
    rng = np.random.default_rng(3)
    return [example.synthetic_batch(rng, 64, 16, 16) for _ in range(5)]


def test_a_scanned_model_trains_under_an_ellipsis_plan_equal_to_one_device():
    plan = shardplan.load(PLANS / "fsdp_any_rank.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.llama_tiny_scan, TX)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    by = placement.params.by_path()
    assert str(by["layers/mlp/up/kernel"].spec) == "(_, data, _)"  # the layer axis stays whole
    assert str(by["lm_head/kernel"].spec) == "(data, _)"  # the same rule on a 2-D kernel
    # The reference: plain NNX + optax on one device, no shardplan in it (tests/reference.py).
    params = reference.params_of(model)
    one_losses, one_params = reference.train(models.llama_tiny_scan, TX, example.lm_loss, batches())
    assert params.keys() == one_params.keys()
    reference.assert_trains_alike(losses, params, one_losses, one_params)
    assert losses[-1] < losses[0]


def test_a_rule_for_one_layer_that_splits_the_layer_axis_is_warned_at_its_line():
    warnings = shardplan.check(PLANS / "fsdp.splan", model=LLAMA_SCAN, devices=2).warnings
    (w,) = [x for x in warnings if x.code == "stacked-axis-split"]
    assert w.span.line == plan_line("fsdp.splan", 'param ".*/kernel"') and "(..., data, _)" in w.hint
    assert "layers/" in w.message
    assert not [x for x in shardplan.check(PLANS / "fsdp_any_rank.splan", model=LLAMA_SCAN, devices=2).warnings
                if x.code == "stacked-axis-split"]
    # Unstacked layers (a numbered list) are never "stacked", whatever their shapes.
    assert not [x for x in shardplan.check(PLANS / "fsdp.splan", model=LLAMA_SCAN.replace("_scan", ""),
                                           devices=2).warnings if x.code == "stacked-axis-split"]


@pytest.mark.parametrize("text, code", [('param "x" (..., d, ...)', "two-ellipses")])
def test_ellipsis_mistakes(text, code):
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.loads("mesh d = *\n" + text + "\n")
    assert info.value.diagnostics[0].code == code


def test_an_ellipsis_spec_longer_than_the_array_is_located():
    plan = shardplan.loads('mesh d = 2\nparam "w" (d, ..., _, _)\n', "p.splan")
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.resolve_leaves(plan, {"d": 2}, [shardplan.Leaf("w", (4, 4), "float32", 4)])
    d = info.value.diagnostics[0]
    assert d.code == "spec-too-long" and d.span.line == 2 and "names 3 dims" in d.message


@pytest.mark.parametrize("text", ['batch (data, ...)', 'input "x" (..., data)', "axis embed -> ..."])
def test_ellipsis_only_where_trailing_dims_mean_something(text):
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.loads("mesh data = *\n" + text + "\n")
    assert info.value.diagnostics[0].code == "misplaced-ellipsis" and info.value.diagnostics[0].span.line == 2
