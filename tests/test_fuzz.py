"""Grammar-driven fuzzing: the parser and checker raise nothing but ShardPlanError, and
every reported position lies inside the source."""

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan import Leaf, resolve_leaves

AXES = ["data", "model", "fsdp", "expert", "_", "modle", "None"]
REGEXES = [".*", "blocks/\\d+/attn/(query|key|value)/kernel", ".*/kernel", "embed/embedding", "(a+)+$",
           "a(?=b)", "(", "[z-a]", "(a)\\1", "x{2000}", "", "\\", "blocks/[0-9]+/.*"]
PATHS = ["blocks/0/attn/query/kernel", "blocks/1/mlp/up/kernel", "embed/embedding", "ln_f/scale", "a"]

name = st.sampled_from(AXES)
dim = st.one_of(name, st.lists(name, min_size=1, max_size=3).map(lambda xs: "(" + ", ".join(xs) + ")"))
spec = st.one_of(st.just("replicated"), st.lists(dim, max_size=4).map(lambda xs: "(" + ", ".join(xs) + ")"))
size = st.one_of(st.just("*"), st.integers(-1, 16).map(str))
mesh = st.lists(st.tuples(name, size), min_size=1, max_size=3).map(
    lambda ax: "mesh " + ", ".join(f"{n} = {s}" for n, s in ax))
regex = st.sampled_from(REGEXES).map(lambda r: f'"{r}"')
statement = st.one_of(
    mesh,
    st.builds(lambda r, s: f"param {r} {s}", regex, spec),
    st.builds(lambda r, s: f"opt {r} {s}", regex, spec),
    st.builds(lambda r, s: f"input {r} {s}", regex, spec),
    spec.map(lambda s: f"batch {s}"),
    spec.map(lambda s: f"default {s}"),
    st.builds(lambda a, d: f"axis {a} -> {d}", st.sampled_from(["embed", "mlp", "heads"]), dim),
    st.sampled_from(['plan "x"', "backend auto", "backend shard_map", "backend nope", "# comment"]),
)
valid_plan = st.lists(statement, min_size=1, max_size=10).map("\n".join)


def mutate(text: str, data) -> str:
    if not text:
        return data.draw(st.text(max_size=20))
    i = data.draw(st.integers(0, len(text)))
    op = data.draw(st.sampled_from(["delete", "insert", "replace", "truncate"]))
    junk = data.draw(st.sampled_from(list('()",=*#\n_-> \\') + ["param", "mesh", "é", "\x00", "\t"]))
    if op == "delete":
        return text[:i] + text[i + 1:]
    if op == "insert":
        return text[:i] + junk + text[i:]
    if op == "replace":
        return text[:i] + junk + text[i + 1:]
    return text[:i]


def assert_located(text: str, err: shardplan.ShardPlanError):
    lines = text.split("\n") or [""]
    assert err.diagnostics
    for d in err.diagnostics:
        assert d.message
        if d.span is None:
            assert d.path
            continue
        assert 1 <= d.span.line <= max(len(lines), 1), (text, d.render())
        line = lines[d.span.line - 1] if d.span.line <= len(lines) else ""
        assert 1 <= d.span.column <= len(line) + 1, (text, d.render())
        assert d.render()


def exercise(text: str):
    try:
        plan = shardplan.loads(text, "fuzz.splan")
    except shardplan.ShardPlanError as e:
        assert_located(text, e)
        return
    for w in plan.warnings:
        assert w.span is not None
    try:
        mesh = plan.mesh_shape(8)
        leaves = [Leaf(p, (8, 16), "float32", 4) for p in PATHS]
        resolve_leaves(plan, mesh, leaves, [Leaf("opt_state/0/mu/" + p, (8, 16), "float32", 4) for p in PATHS])
    except shardplan.ShardPlanError as e:
        assert_located(text, e)


FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(valid_plan)
def test_generated_plans(text):
    exercise(text)


@FUZZ
@given(valid_plan, st.data())
def test_mutated_plans(text, data):
    for _ in range(data.draw(st.integers(1, 3))):
        text = mutate(text, data)
    exercise(text)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    exercise(text)


def test_positions_inside_source_for_a_multiline_case():
    text = 'mesh data = *\nparam "ok" (data)\nparam "bad(" (data)\n'
    try:
        shardplan.loads(text)
    except shardplan.ShardPlanError as e:
        assert_located(text, e)
        assert re.search(r":3:\d+:", str(e))
