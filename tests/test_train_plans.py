"""examples/train.py, the main job, under every shipped plan with the model it is written for
(tests/helpers.py PLAN_MODELS): MoE, pipeline and explicit-axes plans included, on both backends
where the plan's model runs on them; the loss is finite and falls, and nothing ends in a traceback."""

import json
import math

import pytest

from examples import train as example
from tests.helpers import PLAN_MODELS, PLANS


@pytest.mark.parametrize("plan", sorted(PLAN_MODELS))
def test_train_example_runs_every_shipped_plan(plan, tmp_path, capsys):
    metrics = tmp_path / "m.json"
    rc = example.main(["--plan", str(PLANS / plan), "--model", PLAN_MODELS[plan], "--steps", "4", "--lr", "1e-2",
                       "--no-show", "--simulate-devices", "0", "--metrics", str(metrics)])
    out = capsys.readouterr()
    assert rc == 0, out.out[-2000:] + out.err[-3000:]
    assert "Traceback" not in out.err
    losses = json.loads(metrics.read_text())["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
