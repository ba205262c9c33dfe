"""The benchmark runner's quick mode runs every measurement, and its figures hold what the
full run relies on (the timings themselves come from full runs, never from tests)."""

import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_benchmarks_quick_mode_measures_what_it_claims(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    res, checks = doc["results"], doc["checks"]
    # Resolution: shardplan decides every param exactly as the naive first-match loop does.
    assert res["resolution"]["agree_with_naive"] == 1.0
    assert res["resolution"]["leaves"] > res["resolution"]["params"] > 0
    for key in ("shardplan_s", "naive_s", "floor_s"):
        assert 0 < res["resolution"][key] < 60
    # Placement moved every byte it says it did.
    assert res["apply"]["bytes"] == res["apply"]["leaves"] * 64 * 256 * 4 and res["apply"]["ratio"] > 0
    # Steps: every plan timed on every variant.
    plans = {(row["plan"], row["model"]) for row in res["steps"]["plans"]}
    assert {p for p, m in plans if m == "gpt"} == {"dp.splan", "gpt_2d.splan"}
    assert {m for _, m in plans} == {"gpt", "llama", "llama scanned"}
    for row in res["steps"]["plans"]:
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("auto_ms", "hand_ms", "shard_map_ms"))
        if "fsdp" in row["plan"] or "2d" in row["plan"]:  # the rows whose peaks are checked
            assert row["auto_peak"] > 0 and row["shard_map_peak"] > 0
    fl = res["steps"]["fsdp_llama"]
    assert set(fl) == {"8"} and all(0 < x["ratio"] for x in fl.values())
    # Both lowerings' communication is exact against the compiled HLO, on every plan: the
    # gather-whole module's (specs only) and the partitioned step's (its record).
    assert len(res["cost"]) == 5
    for row in res["cost"]:
        assert row["measured_comm"] == row["predicted_comm"], row
        assert row["partitioned_predicted"] == row["partitioned_compiled"], row
        assert row["state_error"] < 0.05, row
    # Generation: one prefill compile (both quick prompt lengths fall in one bucket), one decode compile.
    g = res["generation"]
    steps = {k: v for k, v in g["compiles"].items() if "shardplan_" in k}
    assert steps == {"jit(shardplan_prefill)": 1, "jit(shardplan_decode)": 1}, g["compiles"]
    assert g["tokens"] == len(g["prompt_lengths"]) * 8 * 8
    assert g["llama"]["compiles"] == {"plain": {"jit(shardplan_forward)": 1},
                                      "cache": {"jit(shardplan_prefill)": 1, "jit(shardplan_decode)": 1}}
    # Step cost: fast vs exact for each plan x model family, with the ratios the checks report.
    rows = res["step_cost"]["rows"]
    assert {(r["plan"], r["model"].split("_")[0]) for r in rows} == {
        (p, f) for p in ("dp.splan", "gpt_tp.splan") for f in ("gpt", "llama")}
    for r in rows:
        assert r["flops_exact"] > 0 and r["peak_exact"] > 0
        assert r["flops_error"] == abs(r["flops_fast"] - r["flops_exact"]) / r["flops_exact"]
        assert r["comm"]["all-reduce"]["exact"] > 0  # every one of these plans reduces gradients
    scale = res["step_cost_scale"]
    assert scale["eval_shape_s"] > 0 and scale["ratio"] == scale["fast_s"] / scale["eval_shape_s"]
    # The table's verdicts are computed from these figures, one per check.
    step_checks = sum(len(r["comm"]) + 2 for r in rows) + 1
    # Reshard: every pair's prediction against its compiled reshard, and the 70B diff's timing.
    reshard = res["reshard"]
    assert len(reshard["rows"]) == 3 and reshard["diff_70b"]["seconds"] > 0
    for row in reshard["rows"]:
        assert row["error"] == 0.0, row  # the quick pairs are exact (the full run reports every row)
    assert any(sum(row["compiled"].values()) > 0 for row in reshard["rows"])
    assert res["shape_cache"]["cached_s"] > 0
    # The language server: every edit answered with its diagnostics (the benchmark asserts which).
    assert res["lsp"]["edits"] == 12 and 0 < res["lsp"]["edit_median_s"] <= res["lsp"]["edit_max_s"] < 60
    # steps: auto/hand and shard_map/auto per row, peak for FSDP and 2-D rows, the Llama FSDP peak;
    # cost model: 3 per plan.
    rows_ = res["steps"]["plans"]
    peaks = sum("fsdp" in r["plan"] or "2d" in r["plan"] for r in rows_)
    assert len(rows_) == 4 and peaks == 2
    assert len(checks) == 3 + 2 * len(rows_) + peaks + 1 + 3 * 5 + 1 + 2 + step_checks + 1 + len(reshard["rows"]) + 1 + 1
    assert all(c["met"] in ("yes", "NO (missed)") for c in checks)


def test_device_benchmark_quick_mode_measures_and_predicts_side_by_side(tmp_path):
    """`python -m benchmarks.device` (the step measured on the local accelerator beside fast mode's
    prediction for its chip) runs here on one CPU device; its times say nothing about a chip."""
    out = tmp_path / "device.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.device", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["on_chip"] is False and "says nothing" in r.stdout
    (row,) = doc["rows"]
    assert row["measured_s"] > 0 and row["loss_first"] > 0
    # Fast mode's FLOPs and memory traffic against the compiled program of the same step (XLA:CPU
    # computes this bf16 model in f32, storing more: measured 0.46x; a GPU's program, 0.88..1.02x).
    assert abs(row["fast"]["flops"] / row["xla"]["flops"] - 1) < 0.1
    assert 0.25 < row["fast"]["hbm_bytes"] / row["xla"]["memory_bytes"] < 1.5
    assert row["predicted"]["serial_s"] == row["predicted"]["compute_s"] + row["predicted"]["memory_s"]


def test_published_runs_benchmark_costs_each_run_with_both_attentions():
    """`python -m benchmarks.published` (fast mode on the Llama 2 70B and Llama 3.1 8B shapes, 256
    devices, scanned layers: seconds) runs, and flash attention moves less than naive attention."""
    from benchmarks import published

    rows = published.run()
    assert [(r["run"], r["attention"]) for r in rows] == [
        (run, attention) for run, *_ in published.RUNS for attention in ("flash", "naive")]
    for flash, naive in zip(rows[::2], rows[1::2], strict=True):
        assert 0 < flash["hbm_bytes"] < naive["hbm_bytes"]
        assert all(0 < x < 10 for x in flash["ratio_tokens_s"] + naive["ratio_tokens_s"])
