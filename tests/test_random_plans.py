"""Fast mode against exact mode on random plans x models nobody tuned the engine for (issue 29).

What holds today for every pair is asserted: the drawn plan loads and fits its model, both
modes run, the state bytes agree exactly, and the modes agree within loose bounds. The per-kind
collective bytes, peak and FLOPs are reported by ``python -m benchmarks.random_plans`` as a
distribution with its targets (p90 per kind within 10% of the step's bytes, peak 15%, FLOPs 2%);
those not met today (issue 44) are bounded by their measured values and the quick benchmark's
test shows as xfail while any is unmet.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardplan
from benchmarks import random_plans as rp

# The width each pool model has, which the generator must find from shapes alone.
D_MODEL = {"decoder": 64, "moe": 48, "kv_decoder": 64, "gpt_tiny": 32, "llama_tiny": 32, "llama_tiny_scan": 32,
           "gpt2": 48, "parallel": 64}


@pytest.mark.parametrize("model", sorted(rp.POOL))
def test_families_from_shapes_cover_every_leaf_once(model):
    leaves = rp.leaves_of(model)
    assert rp.d_model_of(leaves) == D_MODEL[model]
    fams = rp.families(leaves)
    paths = [p for f in fams for p in f.paths]
    assert sorted(paths) == sorted(p for p, _ in leaves)
    shapes = dict(leaves)
    for f in fams:
        assert {shapes[p] for p in f.paths} == {f.shape}
        # Each family's regex full-matches its own leaves and no other.
        rx = rp.regex_for(f.paths, list(shapes))
        assert {p for p in shapes if re.fullmatch(rx, p)} == set(f.paths)


def test_families_ignore_names():
    leaves = rp.leaves_of("decoder")
    renamed = [(f"x{i}/w", s) for i, (_, s) in enumerate(leaves)]
    assert [f.dims for f in rp.families(renamed)] == [f.dims for f in rp.families(leaves)]


def test_moe_experts_are_a_stacked_family():
    dims = {f.dims: f.paths for f in rp.families(rp.leaves_of("moe"))}
    assert dims[("L", "d", "96")] == ("blocks/0/moe/w_in", "blocks/1/moe/w_in")


def test_draws_are_seeded():
    a = [rp.draw_pair(7, i, rp.leaves_of) for i in range(5)]
    assert a == [rp.draw_pair(7, i, rp.leaves_of) for i in range(5)]
    assert len({t for _, t in a}) == 5


@pytest.mark.parametrize("seed", [0, 1])
def test_drawn_plans_load_and_fit_their_model(seed):
    """40 draws: every plan parses and checks against its model on 8 devices (every split dim
    divisible), with 2 and 3 axes in several orders, and both split and replicated params."""
    meshes, specs = set(), set()
    for i in range(20):
        model, text = rp.draw_pair(seed, i, rp.leaves_of)
        plan = shardplan.loads(text, "random.splan")
        res = shardplan.api.check(plan, model=rp.POOL[model][0], devices=8)  # raises on any error
        assert res.resolution is not None
        meshes.add(tuple(a.name for a in plan.mesh))
        specs |= {d.spec for d in res.resolution.decisions}
    assert {len(m) for m in meshes} == {2, 3}
    assert len(meshes) >= 6
    assert len(specs) >= 10


def test_pod_draws_fit_the_70b_shapes_on_every_chip_of_the_slice():
    """``--pod``: meshes over all 64 chips (2 and 3 axes, each at least 2), one sequence per chip,
    plans that check against the 70B shapes (no compile); the 8-device draws are as before."""
    scale = rp.pod_scale(64)
    assert all(math.prod(m) == 64 and min(m) >= 2 for m in scale.meshes)
    assert {len(m) for m in scale.meshes} == {2, 3} and len(scale.meshes) == len(set(scale.meshes))
    model = "llama2_70b_scan"
    meshes = set()
    for i in range(6):
        name, text = rp.draw_pair(0, i, rp.leaves_of, scale=scale)
        assert name == model
        plan = shardplan.loads(text, "random.splan")
        shardplan.api.check(plan, model=rp.POD_POOL[model][0], devices=64)  # raises on any error
        meshes.add(tuple(a.size for a in plan.mesh))
    assert len(meshes) >= 3
    assert rp.draw_pair(0, 0, rp.leaves_of)[0] in rp.POOL


@settings(max_examples=1, deadline=None, derandomize=True, database=None)  # more pairs: the quick benchmark below
@given(index=st.integers(0, 10_000))
def test_random_pair_runs_both_modes_and_state_agrees(index):
    row, _, crash = rp.measure_pair(29, index)
    assert crash is None
    assert row is not None and "exact_error" not in row, row
    assert row["state_fast"] == row["state_exact"] > 0
    assert row["total_exact"] > 0 and row["peak_exact"] > 0 and row["flops_exact"] > 0
    assert set(row["comm"]) == set(rp.KINDS)
    # The two modes compared, within bounds that today's engine meets on every pair measured (200
    # pairs: worst kind error 50% of the step's bytes, peak 30% and FLOPs 33% at p90) and that a fault
    # in either mode (a kind's bytes off by its own size, a doubled peak) does not.
    assert all(row["comm"][k]["error"] <= 0.75 for k in rp.KINDS), {k: row["comm"][k]["error"] for k in rp.KINDS}
    assert row["peak_error"] <= 0.6 and row["flops_error"] <= 0.6, (row["peak_error"], row["flops_error"])


def test_quick_benchmark_reports_each_target_honestly():
    res = rp.run(quick=True)
    assert res["pairs"] == 2 and res["measured"] == 2 and not res["state_mismatch"]
    rows = rp.checks(res)
    by_name = {r["measurement"]: r for r in rows}
    assert len(rows) == len(rp.KINDS) + 2 + 2
    for name, d in res["distribution"].items():
        target = rp.TARGETS["comm"] if name.startswith("comm/") else rp.TARGETS[name]
        (row,) = [r for n, r in by_name.items() if f" {name.removeprefix('comm/')} " in n]
        assert (row["met"] == "yes") == (d["p90"] <= target)
        assert d["median"] <= d["p90"] <= d["worst"]
    assert len(res["worst"]) == 2
    table = {
        line.split()[0]: line for line in rp.report(res).splitlines() if line.startswith(("comm/", "peak", "flops"))
    }
    assert set(table) == set(res["distribution"])
    for name, d in res["distribution"].items():
        assert (not table[name].endswith("NOT met")) == (
            d["p90"] <= (rp.TARGETS["comm"] if "/" in name else rp.TARGETS[name])
        )
    assert res["worst"][0]["key_lines"][0].startswith("mesh ")
    # The targets: met, or known unmet (issue 44, the engine's accuracy on plans nobody tuned it
    # for) and no worse than measured on these two pairs (2026-12-03); the test then shows as xfail.
    for name, d in res["distribution"].items():
        assert d["p90"] <= RANDOM_KNOWN.get(name, rp.TARGETS["comm"] if "/" in name else rp.TARGETS[name]), (name, d)
    assert [r["measurement"] for r in rows if "pairs whose" in r["measurement"] and r["met"] != "yes"] == []
    missed = sorted(name for name, d in res["distribution"].items()
                    if d["p90"] > (rp.TARGETS["comm"] if "/" in name else rp.TARGETS[name]))
    # fast mode on XLA's propagation, costed beside it on the same pairs (``--xla-propagation``)
    on_xla = res["distribution_xla"]
    assert set(on_xla) == set(res["distribution"]) and all(d["pairs"] == 2 for d in on_xla.values())
    assert all(0 <= d["median"] <= d["p90"] <= d["worst"] for d in on_xla.values())
    assert "fast mode on XLA's own propagation" in rp.report(res)
    if missed:
        pytest.xfail(f"issue 44: p90 targets not met yet on random plans: {', '.join(missed)}")


# p90 over the quick run's two pairs (both llama_tiny since the pool gained gpt2 and parallel),
# measured 2026-12-07: all-reduce 13.9%, all-gather 34.2%, all-to-all 2.4%, peak 31.9%, FLOPs 16.4%
# (targets 10%, 10%, 10%, 15%, 2%); bounds a little above. Until the two matmul rules of 2026-12-07
# (a result its readers split computed split; a whole weight that is a step input weighed against
# gathering the other side) the all-reduces were 32.1% and the FLOPs 4.3%: the second pair's MLP
# FLOPs were 0.80x XLA's and its attention's 4x, cancelling; its MLP's are now XLA's, its
# attention's (models.py:284, 288) are not yet, and the first pair's MLP went from XLA's to 1.17x.
# Over 80 pairs of seed 7 the same rules took the FLOPs p90 from 28.2% to 21.9% and the peak's from
# 24.8% to 22.7% (docs/stepcost.md).
RANDOM_KNOWN = {"comm/all-reduce": 0.16, "comm/all-gather": 0.37, "comm/all-to-all": 0.05, "peak": 0.34,
                "flops": 0.18}


def test_layouts_flag_lists_where_xla_lays_values_out_otherwise(tmp_path):
    # One pair, its compile dumping XLA's propagated module (the flags must be set before jax
    # starts: a child process). Each listed value is one XLA lays out otherwise than fast mode, at
    # a line of the model's code.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "run.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.random_plans", "--pairs", "1", "--seed", "0",
                          "--layouts", "--json", str(out)], capture_output=True, text=True, env=env,
                         cwd=rp.ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layouts"], "pair 0 of seed 0: fast mode's layouts and XLA's part somewhere"
    for d in row["layouts"]:
        assert d["xla"] != d["fast"] and d["source"].startswith("models.py:")
        assert all(x.startswith("(") and x.endswith(")") for x in d["xla"] + d["fast"])
    first = row["layouts"][0]
    assert f"XLA lays out {first['op']} {tuple(first['shape'])} at {first['source']}" in run.stdout
