"""Reviewing a plan change: diff (with the reshard's collectives checked against XLA's compiled
reshard), explain (against check's provenance), lock files and CI guards, and the silent layout
bugs of the field reproduced as fixtures."""

import collections
import json
import subprocess
import sys

import jax
import optax
import pytest

import shardplan
from benchmarks import reshard as reshard_bench
from examples import models
from shardplan import api
from shardplan.core import hlo, reshard
from shardplan.runtime import specs
from tests.helpers import PLANS, ROOT

GPT = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"
LLAMA = f"{ROOT / 'examples' / 'models.py'}:llama_tiny"


def cli(*args, timeout=120):
    r = subprocess.run([sys.executable, "-m", "shardplan", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("a, b", [("fsdp.splan", "dp.splan"), ("gpt_2d.splan", "dp.splan"),
                                  ("gpt_2d.splan", "gpt_tp.splan"), ("fsdp.splan", "gpt_tp.splan"),
                                  ("gpt_tp.splan", "fsdp.splan"), ("gpt_2d.splan", "fsdp.splan")])
def test_predicted_reshard_is_the_compiled_reshard(a, b):
    d = api.diff(PLANS / a, PLANS / b, model=GPT, optimizer="adamw", devices=8)
    predicted = collections.Counter()
    for m in d.moves:
        predicted[m.kind] += m.bytes
    assert +predicted == +reshard_bench.compiled(PLANS / a, PLANS / b, models.gpt_tiny), (a, b)


def test_same_plan_changes_nothing_and_dp_to_fsdp_is_a_local_slice():
    same = api.diff(PLANS / "gpt_tp.splan", PLANS / "gpt_tp.splan", model=GPT, devices=8)
    assert same.changed == () and same.moves == ()
    d = api.diff(PLANS / "dp.splan", PLANS / "fsdp.splan", model=GPT, devices=8)
    assert d.changed and d.moves == ()  # replicated -> split: each device keeps its block


def test_meshes_that_do_not_nest_are_refused():
    assert reshard.refine({"a": 2, "b": 3}, {"c": 3, "d": 2}) is None
    r = reshard.refine({"data": 8}, {"data": 2, "model": 4})
    assert r.a == {"data": ("#0", "#1")} and r.b == {"data": ("#0",), "model": ("#1",)}


def test_diff_cli_and_from_a_checkpoint(tmp_path):
    r = cli("diff", PLANS / "fsdp.splan", PLANS / "gpt_tp.splan", "--model", GPT, "--devices", 8, "--format", "json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["after"]["mesh"] == {"data": 4, "model": 2}
    assert {x["kind"] for x in doc["reshard"]} == {"all-gather", "collective-permute"}
    # A checkpoint's stored plan against a plan file.
    from shardplan import checkpoint

    plan = shardplan.load(PLANS / "gpt_tp.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(1e-3))
    ck = checkpoint.Checkpointer(tmp_path / "ck", placement)
    ck.save(1, model, optimizer)
    ck.wait()
    r = cli("diff", tmp_path / "ck", PLANS / "gpt_2d.splan", "--model", GPT)
    assert r.returncode == 0, r.stderr
    assert "before gpt-tp (mesh data=4,model=2)" in r.stdout and "all-gather over data" not in r.stdout


@pytest.mark.parametrize("plan, factory", [("gpt_tp.splan", GPT), ("gpt_2d.splan", GPT), ("fsdp.splan", GPT),
                                           ("llama_tp.splan", LLAMA), ("gpt_logical.splan", LLAMA)])
def test_explain_names_checks_deciding_rule_for_every_path(plan, factory):
    leaves = api.model_leaves(model=factory, optimizer="adam")
    res = api.check(PLANS / plan, leaves=leaves, devices=8).resolution
    for d in res.decisions:
        e = api.explain(PLANS / plan, d.path, leaves=leaves, devices=8)
        assert e.decision == d
        deciding = e.deciding
        if d.how == "rule":
            assert deciding is not None and deciding.rule.origin == d.origin and deciding.matched
        else:
            assert deciding is None


def test_explain_gives_a_near_miss_for_a_one_character_typo(tmp_path):
    p = tmp_path / "typo.splan"
    p.write_text('mesh data = *, model = 2\nparam "blocks/\\d+/atn/(query|key|value)/kernel" (_, model)\n'
                 "default replicated\n")
    r = cli("explain", p, "blocks/1/attn/query/kernel", "--model", GPT, "--devices", 8)
    assert r.returncode == 0, r.stderr
    assert "no match" in r.stdout and "near miss: it would match 'blocks/1/atn/query/kernel'" in r.stdout
    r = cli("explain", p, "blocks/1/attn/qury/kernel", "--model", GPT, "--devices", 8)
    assert r.returncode == 1 and "no-such-path" in r.stderr and "closest: blocks/1/attn/query/kernel" in r.stderr


def test_lock_then_drift(tmp_path):
    lock = tmp_path / "gpt_tp.lock"
    r = cli("lock", PLANS / "gpt_tp.splan", "--model", GPT, "--devices", 8, "-o", lock)
    assert r.returncode == 0 and lock.read_text().startswith("# shardplan lock")
    assert cli("check", PLANS / "gpt_tp.splan", "--model", GPT, "--devices", 8, "--locked", lock).returncode == 0
    # A rename in the plan (a regex that no longer matches the MLP) drifts the layout.
    changed = tmp_path / "gpt_tp.splan"
    changed.write_text((PLANS / "gpt_tp.splan").read_text().replace("mlp/(up|gate)", "ffn/(up|gate)"))
    r = cli("check", changed, "--model", GPT, "--devices", 8, "--locked", lock)
    assert r.returncode == 1 and "error[lock-drift]" in r.stderr
    assert f"{lock}:" in r.stderr and "- param blocks/*/mlp/gate/kernel" in r.stderr


def test_moments_replicated_beside_sharded_params_warn_at_the_opt_rule(tmp_path):
    p = tmp_path / "m.splan"
    p.write_text('mesh data = *\nparam ".*/kernel" (data, _)\nopt "opt_state/.*/(mu|nu)/.*" replicated\n'
                 "default replicated\n")
    w = [x for x in api.check(p, model=GPT, devices=8).warnings if x.code == "opt-less-sharded"]
    assert len(w) == 1 and w[0].span.line == 3 and "split less than the params" in w[0].message


def test_expert_weights_left_replicated_after_a_rename_are_caught(tmp_path):
    """A rule written for `moe/expert/w_in` no longer matches after the model renamed the module `experts`."""
    shapes = tmp_path / "moe.json"
    params = [{"path": f"blocks/{i}/moe/experts/w_in", "shape": [8, 64, 256], "dtype": "float32"} for i in range(4)]
    shapes.write_text(json.dumps({"format": "shardplan-shapes/1", "params": params}))
    p = tmp_path / "moe.splan"
    p.write_text('mesh expert = 8\nparam "blocks/\\d+/moe/expert/w_in" (expert, _, _)\ndefault replicated\n')
    r = cli("check", p, "--shapes", shapes, "--strict")
    assert r.returncode == 1 and "moe.splan:2:8: warning[unused-rule]" in r.stderr
    assert "near miss: blocks/0/moe/experts/w_in: it would match 'blocks/0/moe/expert/w_in'" in r.stderr


def test_search_semantics_regex_is_caught_with_a_full_match_hint(tmp_path):
    p = tmp_path / "s.splan"
    p.write_text('mesh data = *, model = 2\nparam "mlp/up" (_, model)\ndefault replicated\n')
    w = [x for x in api.check(p, model=GPT, devices=8).warnings if x.code == "unused-rule"]
    assert len(w) == 1 and w[0].span.line == 2 and "must match all of it" in w[0].message


def test_max_replicated_fraction_guard():
    r = cli("check", PLANS / "dp.splan", "--model", GPT, "--devices", 8, "--max-replicated-fraction", 0.5)
    assert r.returncode == 1 and "error[replicated-fraction]" in r.stderr and "100.0% of parameter bytes" in r.stderr
    assert cli("check", PLANS / "fsdp.splan", "--model", GPT, "--devices", 8, "--max-replicated-fraction",
               0.5).returncode == 0


def test_size_one_axes_and_pure_permutations():
    from shardplan.core.leaves import Decision
    from shardplan.core.spec import Spec

    def dec(spec):
        return Decision("w", (32, 32), "float32", 4, spec, "rule", "", "param", (32, 32))

    same = reshard.refine({"data": 8, "model": 1}, {"data": 8, "model": 1})
    a, b = dec(Spec((("data",), ("model",)))), dec(Spec((("data",), ())))
    assert reshard.same_layout(a, b, same) and reshard.leaf_moves(a, b, same) == []
    # Three axes of 2: each dim trades its axes for others of the same count: one permute, as XLA does.
    mesh = {"data": 2, "b": 2, "c": 2}
    jm = jax.make_mesh((2, 2, 2), ("data", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    for src, dst in (((("data",), ("b",)), (("b",), ("c",))), ((("data",), ("b",)), (("c",), ("data",)))):
        moves = reshard.leaf_moves(dec(Spec(src)), dec(Spec(dst)), reshard.refine(mesh, mesh))
        f = jax.jit(lambda x: x, in_shardings=jax.NamedSharding(jm, specs.pspec(Spec(src))),
                    out_shardings=jax.NamedSharding(jm, specs.pspec(Spec(dst))))
        ops = hlo.parse(f.lower(jax.ShapeDtypeStruct((32, 32), "float32")).compile().as_text(), 8)
        assert [(m.kind, m.bytes) for m in moves] == [(o.kind, o.bytes) for o in ops], (src, dst)
