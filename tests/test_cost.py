"""The cost model in `shardplan check`: per-device bytes and per-step communication,
against values computed by hand for the example GPT (gpt_tiny) on 8 devices.

gpt_tiny: vocab 64, d_model 32, 4 heads, d_ff 64, 2 layers, max_len 16, no biases, untied.
Per layer: q, k, v, out (32, 32) = 4 x 1024; up, gate (32, 64), down (64, 32) = 3 x 2048;
ln1, ln2 (32,). Then embed (64, 32), pos_embed (16, 32), ln_f (32,), head (32, 64).
"""

import json
import subprocess
import sys

import pytest

from tests.helpers import PLANS, ROOT

F32 = 4
LAYER = 4 * 1024 + 3 * 2048 + 2 * 32
ALL = 2 * LAYER + 2048 + 512 + 32 + 2048  # 25,248 params
NORMS = 2 * 2 * 32 + 32  # replicated in every plan
LOSS = 4  # the scalar loss's all-reduce

# Per plan: (per-device param bytes, all-gather, reduce-scatter, all-reduce), per device and step.
EXPECTED = {
    # Everything replicated over data=8: one all-reduce of every gradient.
    "dp.splan": (ALL * F32, 0, 0, ALL * F32 + LOSS),
    # Kernels and embeddings split 8 ways on dim 0: gathered whole, gradients reduce-scattered;
    # norms (replicated) all-reduced.
    "fsdp.splan": (((ALL - NORMS) // 8 + NORMS) * F32, (ALL - NORMS) * F32, (ALL - NORMS) * F32, NORMS * F32 + LOSS),
    # data=4, model=2: embed, head and every block kernel split over model (2); pos_embed and
    # norms replicated. Gathered over model; gradients sliced over model (no traffic), then
    # all-reduced over data: half of each TP param plus the replicated ones.
    "gpt_tp.splan": ((((ALL - NORMS - 512) // 2) + NORMS + 512) * F32, (ALL - NORMS - 512) * F32, 0,
                     (((ALL - NORMS - 512) // 2) + NORMS + 512) * F32 + LOSS),
}
# 2D (data=4, model=2): (data, model) on q, k, v, up, gate, head (65,536 B whole); (model, data)
# on out, down, embed (32,768 B whole); pos_embed (data, _) (2,048 B); norms replicated.
# Gathers: dim 0 then dim 1: (data, model) moves 1/2 then 1 of the whole = 1.5x; (model, data)
# 1/4 then 1 = 1.25x; pos_embed 1x. Reduce: slice over model first (halves), then
# reduce-scatter over data: 65,536/2 + 32,768/2 + 2,048.
DM, MD, POS = 65536, 32768, 2048
EXPECTED["gpt_2d.splan"] = ((DM // 8 + MD // 8 + POS // 4) + NORMS * F32, DM * 3 // 2 + MD * 5 // 4 + POS,
                            DM // 2 + MD // 2 + POS, NORMS * F32 + LOSS)


def check_json(plan):
    r = subprocess.run([sys.executable, "-m", "shardplan", "check", str(PLANS / plan), "--model",
                        f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", "--devices", "8", "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("plan", sorted(EXPECTED))
def test_cost_model_matches_hand_computed_bytes(plan):
    doc = check_json(plan)
    params, gather, scatter, reduce = EXPECTED[plan]
    assert doc["summary"]["param_bytes_per_device"] == params
    # Adam: mu and nu mirror the params; plus the int32 count and the uint32 step.
    assert doc["summary"]["opt_bytes_per_device"] == 2 * params + 4 + 4
    assert doc["summary"]["total_bytes_per_device"] == 3 * params + 8
    assert doc["communication"]["totals"] == {"all-gather": gather, "reduce-scatter": scatter, "all-reduce": reduce}


def test_communication_by_axis():
    comm = check_json("gpt_2d.splan")["communication"]
    assert comm["batch_axes"] == ["data"]
    by = comm["by_axis"]
    assert set(by["all-gather"]) == {"data", "model"} and set(by["reduce-scatter"]) == {"data"}
    assert sum(by["all-gather"].values()) == EXPECTED["gpt_2d.splan"][1]


def test_vs_compares_plans_side_by_side():
    r = subprocess.run([sys.executable, "-m", "shardplan", "check", str(PLANS / "dp.splan"), "--vs",
                        str(PLANS / "fsdp.splan"), "--model", f"{ROOT / 'examples' / 'models.py'}:gpt_tiny",
                        "--devices", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plans side by side" in r.stdout and "optimizer state" in r.stdout
    assert "/ step" not in r.stdout, "no communication rows without a step (the backend's own need --step)"
    j = subprocess.run([sys.executable, "-m", "shardplan", "check", str(PLANS / "dp.splan"), "--vs",
                        str(PLANS / "fsdp.splan"), "--model", f"{ROOT / 'examples' / 'models.py'}:gpt_tiny",
                        "--devices", "8", "--format", "json"], capture_output=True, text=True, timeout=120)
    plans = json.loads(j.stdout)["plans"]
    assert [p["plan"] for p in plans] == ["dp", "fsdp"]
    assert plans[1]["summary"]["param_bytes_per_device"] < plans[0]["summary"]["param_bytes_per_device"]
