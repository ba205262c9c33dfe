"""Stage 3: plans against models: specs per leaf, optimizer mirroring, and model diagnostics."""

import math
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from examples import models
import shardplan
from shardplan import Leaf, Spec, resolve_leaves
from shardplan.runtime import tree as sp_tree
from shardplan.core.optimizers import optimizer_leaves
from shardplan.runtime.model import abstract_model
from tests.helpers import FIXTURES, PLANS
from tests.helpers import diags_of, only

TP_EXPECTED = {
    "embed/embedding": P("model"),
    "pos_embed/embedding": P(),
    "blocks/0/attn/query/kernel": P(None, "model"),
    "blocks/1/attn/key/kernel": P(None, "model"),
    "blocks/0/attn/out/kernel": P("model"),
    "blocks/1/mlp/gate/kernel": P(None, "model"),
    "blocks/0/mlp/down/kernel": P("model"),
    "blocks/0/ln1/scale": P(),
    "head/kernel": P(None, "model"),
}


@pytest.fixture(scope="module")
def gpt():
    return abstract_model(models.gpt_tiny)


def test_tp_plan_specs_and_shard_shapes(gpt):
    plan = shardplan.load(FIXTURES / "gpt_tp.splan")
    res = shardplan.resolve(plan, nnx.state(gpt), devices=8)
    got = res.by_path()
    for path, spec in TP_EXPECTED.items():
        assert shardplan.pspec(got[path].spec) == spec, path
    assert got["blocks/0/attn/query/kernel"].shard_shape == (32, 16)
    assert got["embed/embedding"].shard_shape == (32, 32)
    assert got["embed/embedding"].origin.endswith("gpt_tp.splan:5")
    # The spec tree has the state's structure, a PartitionSpec per Variable.
    assert res.specs["blocks"][0]["attn"]["query"]["kernel"] == P(None, "model")
    assert res.warnings == ()


def test_resolve_accepts_module_state_and_shape_pytrees(gpt):
    plan = shardplan.load(PLANS / "gpt_tp.splan")
    a = shardplan.resolve(plan, gpt, devices=8).by_path()
    tree = {"embed": {"embedding": jax.ShapeDtypeStruct((64, 32), np.float32)}}
    b = shardplan.resolve(plan, tree, devices=8, mesh=None)
    assert b.specs == {"embed": {"embedding": P("model")}}
    assert a["embed/embedding"].spec == b.decisions[0].spec


def test_optimizer_state_mirrors_params(gpt):
    plan = shardplan.load(PLANS / "gpt_2d.splan")
    with nnx.use_eager_sharding(False):
        opt = nnx.eval_shape(lambda: nnx.Optimizer(models.gpt_tiny(), optax.adamw(1e-3), wrt=nnx.Param))
    res = shardplan.resolve(plan, nnx.state(opt), params=nnx.state(gpt), devices=8)
    got = res.by_path()
    assert shardplan.pspec(got["opt_state/0/mu/blocks/0/attn/query/kernel"].spec) == P("data", "model")
    assert shardplan.pspec(got["opt_state/0/nu/embed/embedding"].spec) == P("model", "data")
    assert got["opt_state/0/mu/blocks/0/attn/query/kernel"].how == "mirror"
    assert got["opt_state/0/count"].how == "scalar" and shardplan.pspec(got["step"].spec) == P()
    # The pure (jax-free) optimizer synthesis gives the same paths and specs.
    leaves, _ = sp_tree.flatten(gpt)
    synth = resolve_leaves(plan, res.mesh, leaves, optimizer_leaves(leaves, "adamw")).by_path()
    for path, d in got.items():
        assert synth[path].spec == d.spec, path


def test_explicit_opt_rule_overrides_mirroring(gpt):
    plan = shardplan.loads('mesh data = *\nparam ".*/kernel" (data)\nopt ".*/nu/.*" replicated\n'
                           'default replicated')
    leaves, _ = sp_tree.flatten(gpt)
    res = resolve_leaves(plan, {"data": 8}, leaves, optimizer_leaves(leaves, "adam")).by_path()
    assert res["opt_state/0/mu/head/kernel"].spec == Spec((("data",),))
    assert res["opt_state/0/nu/head/kernel"].spec == Spec(()) and res["opt_state/0/nu/head/kernel"].how == "rule"


def test_mirroring_requires_the_same_shape():
    plan = shardplan.loads('mesh d = *\nparam "w" (d)')
    params = [Leaf("w", (8, 4), "float32", 4)]
    opt = [Leaf("opt/v_row/w", (8,), "float32", 4), Leaf("opt/mu/w", (8, 4), "float32", 4)]
    res = resolve_leaves(plan, {"d": 8}, params, opt).by_path()
    assert res["opt/v_row/w"].how == "replicated" and res["opt/mu/w"].how == "mirror"


def test_logical_axes_resolve_flax_annotations():
    model = abstract_model(models.gpt_tiny_annotated)
    logical = shardplan.resolve(shardplan.load(PLANS / "gpt_logical.splan"), model, devices=8).by_path()
    tp = shardplan.resolve(shardplan.load(PLANS / "gpt_tp.splan"), abstract_model(models.gpt_tiny), devices=8).by_path()
    assert logical.keys() == tp.keys()
    for path in tp:
        assert shardplan.pspec(logical[path].spec) == shardplan.pspec(tp[path].spec), path
    assert logical["blocks/0/attn/query/kernel"].how == "axes"


def test_path_rules_take_precedence_over_annotations():
    model = abstract_model(models.gpt_tiny_annotated)
    plan = shardplan.loads('mesh data = *, model = 2\nparam "head/kernel" replicated\naxis heads -> model\n'
                           'axis mlp -> model\naxis vocab -> model\naxis kv_heads -> model\naxis embed -> _\n'
                           'default replicated')
    got = shardplan.resolve(plan, model, devices=8).by_path()
    assert got["head/kernel"].how == "rule" and got["head/kernel"].spec.is_replicated
    assert got["embed/embedding"].how == "axes" and shardplan.pspec(got["embed/embedding"].spec) == P("model")
    assert got["blocks/0/ln1/scale"].how == "axes"


def test_unmapped_logical_axis_warns():
    model = abstract_model(models.gpt_tiny_annotated)
    plan = shardplan.loads('mesh data = *, model = 2\naxis mlp -> model\ndefault replicated')
    res = shardplan.resolve(plan, model, devices=8)
    names = {w.message.split("'")[1] for w in res.warnings if w.code == "unmapped-logical-axis"}
    assert "heads" in names
    assert shardplan.pspec(res.by_path()["blocks/0/mlp/up/kernel"].spec) == P(None, "model")


def test_full_match_semantics():
    plan = shardplan.loads('mesh d = *\nparam "kernel" (d)\nparam ".*/kernel" (d, _)\ndefault replicated', "f.splan")
    res = resolve_leaves(plan, {"d": 8}, [Leaf("a/kernel", (8, 8), "float32", 4)])
    assert res.decisions[0].origin == "f.splan:3"
    w = only(res.warnings, "unused-rule")
    assert w.span.line == 2 and '"kernel"' in w.message


def test_first_matching_rule_wins_and_shadowed_rules_warn():
    plan = shardplan.loads('mesh d = *\nparam "a/.*" (d)\nparam "a/b" replicated\ndefault replicated', "s.splan")
    res = resolve_leaves(plan, {"d": 8}, [Leaf("a/b", (8,), "float32", 4)])
    assert res.decisions[0].spec == Spec((("d",),))
    w = only(res.warnings, "shadowed-rule")
    assert w.span.line == 3 and "s.splan:2" in w.message


def test_spec_longer_than_rank():
    plan = shardplan.loads('mesh d = *\nparam ".*" (d, _, _)', "r.splan")
    d = only(diags_of(resolve_leaves, plan, {"d": 8}, [Leaf("blocks/0/w", (8, 4), "float32", 4)]), "spec-too-long")
    assert d.path == "blocks/0/w" and d.span.line == 2 and d.span.column == 12
    assert "rank 2" in d.message and "3 dims" in d.message


def test_indivisible_dimension_names_param_shape_and_axes():
    plan = shardplan.loads('mesh data = *, model = 3\nparam ".*" (_, model)', "i.splan")
    d = only(diags_of(resolve_leaves, plan, {"data": 2, "model": 3},
                      [Leaf("blocks/0/mlp/up/kernel", (32, 64), "float32", 4)]), "indivisible")
    assert d.path == "blocks/0/mlp/up/kernel" and d.span.line == 2
    assert "(32, 64)" in d.message and "dim 1 (64)" in d.message and "model=3" in d.message


def test_multi_axis_indivisible():
    plan = shardplan.loads('mesh a = 2, b = 4\nparam ".*" ((a, b))')
    d = only(diags_of(resolve_leaves, plan, {"a": 2, "b": 4}, [Leaf("w", (12,), "float32", 4)]), "indivisible")
    assert "a=2 x b=4 = 8" in d.message


def test_unmatched_param_without_catch_all():
    plan = shardplan.loads('mesh d = *\nparam ".*/kernel" (d)')
    diags = diags_of(resolve_leaves, plan, {"d": 8}, [Leaf("a/kernel", (8,), "float32", 4),
                                                      Leaf("a/bias", (8,), "float32", 4)])
    d = only(diags, "unmatched-param")
    assert d.path == "a/bias" and "default replicated" in d.hint and d.location == "a/bias"


def test_all_model_errors_reported_together():
    plan = shardplan.loads('mesh d = *\nparam "x.*" (d)')
    leaves = [Leaf(f"x{i}", (3,), "float32", 4) for i in range(30)] + [Leaf("y", (8,), "float32", 4)]
    with pytest.raises(shardplan.PlanCheckError) as info:
        resolve_leaves(plan, {"d": 8}, leaves)
    assert len(info.value.errors) == 31
    assert str(info.value).endswith("... and 11 more")


def test_large_replicated_tensor_warns_with_settable_threshold():
    plan = shardplan.loads('mesh d = *\ndefault replicated')
    leaves = [Leaf("big", (1024, 1024), "float32", 4), Leaf("small", (8,), "float32", 4)]
    res = resolve_leaves(plan, {"d": 8}, leaves, replicated_threshold=2**20)
    w = only(res.warnings, "large-replicated")
    assert w.path == "big" and "4.00 MiB" in w.message
    assert not resolve_leaves(plan, {"d": 8}, leaves, replicated_threshold=2**23).warnings


def test_not_an_array_leaf_is_an_error():
    plan = shardplan.loads('mesh d = *\ndefault replicated')
    d = only(diags_of(shardplan.resolve, plan, {"a": "hello"}, devices=8), "not-an-array")
    assert d.path == "a"


def test_batch_resolution():
    plan = shardplan.loads('mesh data = *, model = 2\nbatch (data, _)\ninput "labels" ((data, model))')
    batch = {"tokens": jax.ShapeDtypeStruct((8, 16), np.int32), "labels": jax.ShapeDtypeStruct((8,), np.int32)}
    res = shardplan.resolve_batch(plan, batch, devices=8)
    assert res.specs == {"tokens": P("data"), "labels": P(("data", "model"))}
    d = only(diags_of(shardplan.resolve_batch, plan, {"tokens": jax.ShapeDtypeStruct((6, 16), np.int32)}, devices=8),
             "indivisible")
    assert d.path == "tokens" and "data=4" in d.message


def test_redos_pattern_runs_in_linear_time():
    plan = shardplan.loads('mesh d = *\nparam "(a+)+$" (d)\ndefault replicated')
    t = time.perf_counter()
    res = resolve_leaves(plan, {"d": 1}, [Leaf("a" * 50_000 + "!", (8,), "float32", 4)])
    assert time.perf_counter() - t < 1.0
    assert res.decisions[0].how == "default"


def test_70b_per_device_bytes_match_an_independent_sum():
    """Llama-2-70B shapes on data=32, model=8 under the TP plan."""
    plan = shardplan.load(PLANS / "gpt_tp.splan", mesh={"data": 32, "model": 8})
    model = abstract_model(models.llama2_70b)
    leaves, _ = sp_tree.flatten(model)
    res = resolve_leaves(plan, plan.mesh_shape(256), leaves)
    # Independent: per layer q, o: 8192^2; k, v: 8192*1024; up, gate, down: 8192*28672; two norms.
    d, ff, kv, vocab, layers = 8192, 28672, 1024, 32000, 80
    sharded_per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff  # all split 8 ways over model
    per_device = layers * (sharded_per_layer // 8 + 2 * d) + 2 * vocab * d // 8 + d
    assert res.bytes_per_device("param") == per_device * 4
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    assert 68e9 < total < 70e9  # a 70B model indeed


def test_optimizer_state_resolved_as_params_gets_a_hint():
    plan = shardplan.loads('mesh d = *\nparam ".*/kernel" (d)')
    leaves = [Leaf("opt_state/0/mu/a/bias", (8,), "float32", 4)]
    d = only(diags_of(resolve_leaves, plan, {"d": 8}, leaves), "unmatched-param")
    assert "params=model_state" in d.hint


def test_split_over_size_one_axes_is_still_replicated_for_the_warning():
    plan = shardplan.loads('mesh d = *, m = 1\nparam "big" (m, _)\ndefault replicated')
    leaves = [Leaf("big", (1024, 1024), "float32", 4)]
    res = resolve_leaves(plan, {"d": 8, "m": 1}, leaves, replicated_threshold=2**20)
    assert only(res.warnings, "large-replicated").path == "big"


def _experts(layers: int, experts: int) -> dict:
    x = jax.ShapeDtypeStruct((8, 16), np.float32)
    return {"blocks": {str(i): {"attn": {"kernel": x}, "experts": {str(e): {"up": {"kernel": x}, "up_bias": x}
                                                                      for e in range(experts)}}
                       for i in range(layers)}}


MISSPELT = ('mesh d = *\nparam "blocks/\\d+/experts/(9|10)/up/kernal" (_, d)\n'
            'param "experts/3/up/kernel" (_, d)\nparam "blocks/\\d+/expert/\\d+/up_bias" replicated\n'
            'param "blocks/\\d+/attn/kernel" (_, d)\ndefault replicated\n')


def test_unused_rule_hint_names_the_nearest_path_of_its_own_expert():
    """Three misspelt rules, each told the path it nearly matches: expert 10 (not expert 0) for
    a rule naming experts 9 and 10, the same leaf by leaf and on the shared tree."""
    from shardplan.core.shared import resolve_tree

    plan = shardplan.loads(MISSPELT, "m.splan")
    params = _experts(12, 16)
    leaves = sp_tree.flatten(params)[0]
    for res in (resolve_leaves(plan, {"d": 8}, leaves), resolve_tree(plan, {"d": 8}, sp_tree.shared(params))):
        msgs = [w.message for w in res.warnings if w.code == "unused-rule"]
        assert msgs == [
            'param rule "blocks/\\d+/experts/(9|10)/up/kernal" matches no param; near miss: blocks/0/experts/10/up/'
            "kernel: it would match 'blocks/0/experts/10/up/kernal', the path with 'a' for its 'e' at column 28: "
            "check the rule's spelling",
            'param rule "experts/3/up/kernel" matches no param; near miss: blocks/0/experts/3/up/kernel: it matches '
            "'experts/3/up/kernel', but the path starts with 'blocks/0/': write '.*/experts/3/up/kernel'",
            'param rule "blocks/\\d+/expert/\\d+/up_bias" matches no param; near miss: blocks/0/experts/0/up_bias: it '
            "would match 'blocks/0/expert/0/up_bias', the path with its 's' at column 16 left out: check the rule's "
            "spelling",
        ]


def test_near_miss_work_does_not_grow_with_the_model(monkeypatch):
    """The near-miss search for 30 misspelt rules makes a few RE2 evaluations per rule, the same
    number at 20 and at 200 layers (the sampled search made thousands per rule)."""
    from shardplan.core import explain

    calls = [0]

    class Counting:
        def __init__(self, rx):
            self.rx = rx

        def fullmatch(self, text):
            calls[0] += 1
            return self.rx.fullmatch(text)

        def search(self, text):
            calls[0] += 1
            return self.rx.search(text)

    real = explain._regex
    monkeypatch.setattr(explain, "_regex", lambda p: Counting(real(p)))
    rules = "".join(f'param "blocks/\\d+/experts/{e}/up/kernal" (_, d)\n' for e in range(30))
    plan_text = "mesh d = *\n" + rules + "default replicated\n"
    counts = []
    for layers in (20, 200):
        calls[0] = 0
        res = shardplan.resolve(shardplan.loads(plan_text, "m.splan"), _experts(layers, 32), mesh={"d": 8})
        hints = [w for w in res.warnings if w.code == "unused-rule" and "it would match" in w.message]
        assert len(hints) == 30
        counts.append(calls[0])
    assert counts[0] == counts[1] <= 30 * 8, counts
