"""Shared resolution (each distinct subtree decided once) against the leaf-by-leaf resolver,
and the prefix automaton against RE2."""

import jax
import numpy as np
import optax
import pytest
import re2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from examples import models
from shardplan.core.automaton import Automaton
from shardplan.core.leaves import Decisions, leaves_of
from shardplan.core.shared import _shared, resolve_tree
from shardplan.errors import PlanCheckError
from shardplan.runtime import tree as sp_tree
from shardplan.runtime.model import abstract_model_and_optimizer
from tests.helpers import PLANS

# Regex pieces for random rules: literal keys, numbered components, classes, alternations.
PIECES = [
    "blocks", "layers", "attn", "mlp", "kernel", "bias", "scale", "embed", "mu", "nu", "opt_state", "0", "1", "12",
    r"\d+", r"\d", "[0-3]", "[^/]+", ".*", "(query|key)", "(0|1|2)", "(mu|nu)", "k", "v", "_", "[a-z]+", "x?", "(ab)*",
]  # fmt: skip
KEYS = ["blocks", "layers", "attn", "mlp", "kernel", "bias", "scale", "embed", "k", "v", "ab", "query", "key"]


def rule_patterns():
    part = st.sampled_from(PIECES)
    return st.lists(part, min_size=1, max_size=5).map("/".join)


def subtree(depth: int):
    """A random state subtree: dicts with word and numeric keys, lists, repeated layers."""
    leaf = st.sampled_from([(8,), (8, 16), (16, 8), (4, 8, 16), (), (3,)]).map(
        lambda s: jax.ShapeDtypeStruct(s, np.float32)
    )
    if depth == 0:
        return leaf
    child = subtree(depth - 1)
    words = st.dictionaries(st.sampled_from(KEYS), st.one_of(leaf, child), min_size=1, max_size=3)
    # Repetition is the point: n copies of one subtree under numbered keys (layers, experts).
    layers = st.tuples(st.integers(1, 13), child).map(lambda t: {str(i): t[1] for i in range(t[0])})
    return st.one_of(words, layers, st.lists(child, min_size=1, max_size=3))


SPECS = ["(model, _)", "(_, model)", "(data, _)", "replicated", "(..., model)", "(model)", "(data, model)"]


def plan_from(rules: list[tuple[str, str]], opt_rules: list[tuple[str, str]], default: bool, acts=()) -> str:
    lines = ['plan "p"', "mesh data = 2, model = 4", "batch (data, _)"]
    lines += [f'param "{p}" {s}' for p, s in rules]
    lines += [f'opt "{p}" {s}' for p, s in opt_rules]
    lines += [f'act "{p}" {s}' for p, s in acts]
    if default:
        lines.append("default replicated")
    return "\n".join(lines) + "\n"


def outcome(fn):
    try:
        res = fn()
    except PlanCheckError as e:
        return "error", tuple(str(d) for d in e.diagnostics)
    return tuple(res.decisions), res.warnings


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    state=subtree(3),
    rules=st.lists(st.tuples(rule_patterns(), st.sampled_from(SPECS)), max_size=6),
    opt_rules=st.lists(st.tuples(rule_patterns(), st.sampled_from(SPECS)), max_size=2),
    default=st.booleans(),
    threshold=st.sampled_from([0, 10**9]),
    acts=st.lists(st.tuples(rule_patterns(), st.sampled_from(SPECS)), max_size=2),
)
def test_shared_resolution_equals_leaf_by_leaf(state, rules, opt_rules, default, threshold, acts):
    try:
        plan = shardplan.loads(plan_from(rules, opt_rules, default, acts), "p.splan")
    except shardplan.ShardPlanError:
        return
    params = {"model": state}
    opt = {"opt_state": {"0": {"mu": params, "nu": params, "count": jax.ShapeDtypeStruct((), np.int32)}}}
    mesh = {"data": 2, "model": 4}
    p, o = sp_tree.shared(params), sp_tree.shared(opt)
    assert p is not None and o is not None
    pl, _ = sp_tree.flatten(params)
    ol, _ = sp_tree.flatten(opt)
    assert leaves_of(p) == pl and leaves_of(o) == ol
    want = outcome(lambda: shardplan.resolve_leaves(plan, mesh, pl, ol, threshold))
    got = outcome(lambda: resolve_tree(plan, mesh, p, o, threshold))
    assert got == want
    if want[0] != "error":  # and the shared pass itself gave it, not the hand-over to leaf by leaf
        assert _shared(plan, mesh, p, o, threshold, True) is not None
    # An optimizer state resolved alone (params given) too.
    want = outcome(lambda: shardplan.resolve_leaves(plan, mesh, pl, ol, threshold, report_params=False))
    got = outcome(lambda: resolve_tree(plan, mesh, p, o, threshold, report_params=False))
    assert got == want


def test_moe_shaped_state_is_decided_per_distinct_subtree():
    """64 experts x 24 layers with per-expert-pair rules: the shared pass runs (no hand-over to
    leaf by leaf), keeps a few dozen distinct records, and equals the leaf-by-leaf answer."""
    from benchmarks.resolution import moe_state, plan_text

    params, opt = moe_state(24, 64)
    plan = shardplan.loads(plan_text(), "moe.splan")
    mesh = {"data": 4, "model": 8}
    p, o = sp_tree.shared(params), sp_tree.shared(opt)
    res = _shared(plan, mesh, p, o, 64 * 2**20, True)
    assert res is not None and isinstance(res.decisions, Decisions)
    assert len({id(r) for r in res.decisions.records}) < 100 < len(res.decisions)
    pl, _ = sp_tree.flatten(params)
    ol, _ = sp_tree.flatten(opt)
    ref = shardplan.resolve_leaves(plan, mesh, pl, ol)
    assert res.decisions == ref.decisions and res.warnings == ref.warnings
    # Experts 2 and 3 share a rule, 4 does not: the automaton tells them apart.
    by = res.decisions.records
    paths = [leaf.path for leaf in pl]
    at = {path: by[i] for i, path in enumerate(paths)}
    assert at["blocks/5/experts/2/up/kernel"] is at["blocks/17/experts/3/up/kernel"]
    assert at["blocks/5/experts/2/up/kernel"].origin != at["blocks/5/experts/4/up/kernel"].origin


@pytest.mark.parametrize(
    "factory, plan_file",
    [
        (models.gpt_tiny, "gpt_2d.splan"),
        (models.gpt_tiny_annotated, "gpt_logical.splan"),
        (models.llama_tiny, "llama_tp.splan"),
        (models.llama_tiny_scan, "llama_scan_2d.splan"),
        (models.gpt_tiny, "fsdp.splan"),
    ],
)
def test_nnx_models_and_optimizers_resolve_the_same_either_way(factory, plan_file):
    plan = shardplan.load(PLANS / plan_file)
    model, opt = abstract_model_and_optimizer(factory, optax.adamw(1e-3))
    for obj in (model, opt):
        shared = sp_tree.shared(obj)
        assert shared is not None, "NNX states take the shared path"
        assert leaves_of(shared) == sp_tree.flatten(obj)[0]
    sizes = plan.mesh_shape(8)
    a, b = shardplan.resolve_model(plan, model, opt, mesh=sizes)
    ref = shardplan.resolve_leaves(plan, sizes, sp_tree.flatten(model)[0], sp_tree.flatten(opt)[0])
    assert tuple(a.decisions) + tuple(b.decisions) == ref.decisions
    assert a.warnings == ref.warnings
    specs = jax.tree.leaves(a.specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert specs == [shardplan.pspec(d.spec) for d in ref.decisions[: len(specs)]]
    assert len(specs) == len(a.decisions)


def test_an_error_is_reported_exactly_as_leaf_by_leaf():
    params = {"blocks": {str(i): {"w": jax.ShapeDtypeStruct((6, 8), np.float32)} for i in range(10)}}
    plan = shardplan.loads('plan "p"\nmesh data = 4\nparam "blocks/.*/w" (data, _)\n', "p.splan")
    with pytest.raises(PlanCheckError) as shared_err:
        resolve_tree(plan, {"data": 4}, sp_tree.shared(params))
    with pytest.raises(PlanCheckError) as leaf_err:
        shardplan.resolve_leaves(plan, {"data": 4}, sp_tree.flatten(params)[0])
    assert [str(d) for d in shared_err.value.diagnostics] == [str(d) for d in leaf_err.value.diagnostics]
    assert len(shared_err.value.diagnostics) == 10  # one per array, named by its own path


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(rule_patterns(), min_size=1, max_size=5),
    texts=st.lists(st.lists(st.sampled_from(KEYS + ["0", "1", "3", "12", "mu", "x", ""]), max_size=5), max_size=8),
)
def test_automaton_hits_equal_re2_full_matches(patterns, texts):
    auto = Automaton.build(patterns)
    assert auto is not None
    compiled = [re2.compile(p) for p in patterns]
    for parts in texts:
        text = "/".join(parts)
        state = auto.start
        for i, part in enumerate(parts):
            state = auto.step(state, f"/{part}" if i else part)
        assert auto.hits(state) == tuple(i for i, c in enumerate(compiled) if c.fullmatch(text))


@pytest.mark.parametrize(
    "pattern", [r"(?i)blocks", r"^blocks$", r"\bblocks", "[[:alpha:]]+", "a{,3}", r"\pL+", r"(?s).*", r"(?U)a+"]
)
def test_regex_features_the_automaton_does_not_model_are_refused(pattern):
    assert Automaton.build([pattern]) is None


def _both(plan_text, params, opt=None, **kw):
    """(shared, leaf by leaf) outcomes for one plan and state; asserts the shared pass ran."""
    plan = shardplan.loads(plan_text, "p.splan")
    mesh = {"data": 2, "model": 4}
    p, o = sp_tree.shared(params), sp_tree.shared(opt) if opt is not None else None
    assert p is not None and (opt is None or o is not None)
    assert leaves_of(p) == sp_tree.flatten(params)[0]
    ol = sp_tree.flatten(opt)[0] if opt is not None else ()
    got = outcome(lambda: resolve_tree(plan, mesh, p, o, **kw))
    want = outcome(lambda: shardplan.resolve_leaves(plan, mesh, sp_tree.flatten(params)[0], ol, **kw))
    return got, want


X = jax.ShapeDtypeStruct((8, 16), np.float32)


@pytest.mark.parametrize(
    "text, params, opt",
    [
        # One optimizer subtree at two depths: each copy mirrors the param its own suffix names.
        ('mesh data = 2, model = 4\nparam "w" (data, _)\ndefault replicated\n', {"w": X},
         {"a": {"w": X}, "b": {"c": {"w": X}}}),
        # A leading empty key adds nothing to the path ('w', not '/w').
        ('mesh data = 2, model = 4\nparam "w" (_, model)\ndefault replicated\n', {"": {"w": X}}, None),
        # An empty optimizer state (optax's EmptyState): no opt rule is 'unused'.
        ('mesh data = 2, model = 4\nopt "x" replicated\ndefault replicated\n', {"w": X}, {"s": ()}),
        # An act rule that matches only a subtree without arrays is unused, as leaf by leaf.
        ('mesh data = 2, model = 4\nact "cache" (data, _)\ndefault replicated\n', {"m": {"w": X}, "cache": None},
         None),
    ],
    ids=["subtree-at-two-depths", "empty-key", "empty-opt-state", "act-on-empty-subtree"],
)
def test_corner_cases_resolve_as_leaf_by_leaf(text, params, opt):
    got, want = _both(text, params, opt)
    assert got == want


def test_defaultdict_paths_are_its_keys():
    from collections import defaultdict

    tree = {"x": defaultdict(list, a=X, b=X)}
    shared = sp_tree.shared(tree)
    assert shared is not None and [leaf.path for leaf in leaves_of(shared)] == ["x/a", "x/b"]
