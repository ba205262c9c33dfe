"""Grammar-driven fuzzing: the parser and checker raise nothing but ShardPlanError, every
reported position lies inside the source, plans built only from valid parts load, and
plans with a known mistake are rejected with that mistake's code."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan import Leaf, resolve_leaves

GOOD_AXES = ["data", "model", "fsdp", "expert"]
BAD_AXES = ["modle", "None"]  # never declared by the valid generator
GOOD_REGEXES = [".*", "blocks/\\d+/attn/(query|key|value)/kernel", ".*/kernel", "embed/embedding", "(a+)+$",
                "", "blocks/[0-9]+/.*", "((((((((blocks))))))))/.*"]
# A regex mistake -> the code it must be reported with.
BAD_REGEXES = {"(": "invalid-regex", "[z-a]": "invalid-regex", "\\": "invalid-regex",
               "(a)\\1": "unsupported-regex", "a(?=b)": "unsupported-regex", "x{2000}": "unsupported-regex",
               "(" * 500 + "a" + ")" * 500: "unsupported-regex"}
PATHS = ["blocks/0/attn/query/kernel", "blocks/1/mlp/up/kernel", "embed/embedding", "ln_f/scale", "a"]


def dims_of(names):
    return st.lists(st.one_of(st.sampled_from(names + ["_"]),
                              st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)
                              .map(lambda xs: "(" + ", ".join(xs) + ")")),
                    max_size=3)


def spec_of(names):
    # Distinct axes per spec (reuse is its own error): one axis per dim, drawn without repeats.
    return st.one_of(st.just("replicated"),
                     st.lists(st.sampled_from(names + ["_"]), max_size=3).filter(
                         lambda xs: len([x for x in xs if x != "_"]) == len({x for x in xs if x != "_"}))
                     .map(lambda xs: "(" + ", ".join(xs) + ")"))


@st.composite
def valid_plans(draw):
    """A plan made only of valid parts: one mesh (positive sizes, at most one '*'), and rules,
    batch, default and axis statements that name only its axes."""
    names = draw(st.lists(st.sampled_from(GOOD_AXES), min_size=1, max_size=3, unique=True))
    star = draw(st.sampled_from([None] + names))
    sizes = {n: ("*" if n == star else str(draw(st.integers(1, 4)))) for n in names}
    lines = ['plan "fuzz"', "mesh " + ", ".join(f"{n} = {s}" for n, s in sizes.items())]
    spec = spec_of(names)
    seen_axis: set[str] = set()
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["param", "opt", "input", "axis", "comment"]))
        if kind == "axis":
            logical = draw(st.sampled_from(["embed", "mlp", "heads"]))
            if logical in seen_axis:
                continue
            seen_axis.add(logical)
            lines.append(f"axis {logical} -> {draw(st.sampled_from(names + ['_']))}")
        elif kind == "comment":
            lines.append("# a comment")
        else:
            lines.append(f'{kind} "{draw(st.sampled_from(GOOD_REGEXES))}" {draw(spec)}')
    if draw(st.booleans()):
        lines.append(f"batch {draw(spec)}")
    if draw(st.booleans()):
        lines.append(f"default {draw(spec)}")
    if draw(st.booleans()):
        lines.append(f"backend {draw(st.sampled_from(['auto', 'shard_map']))}")
    return "\n".join(draw(st.permutations(lines)))


@st.composite
def broken_plans(draw):
    """A valid plan with one known mistake added: (text, the code it must be reported with)."""
    text = draw(valid_plans())
    mesh_axes = re.search(r"^mesh (.*)$", text, re.M).group(1)
    mistake = draw(st.sampled_from(["regex", "axis", "backend", "size", "duplicate-mesh"]))
    if mistake == "regex":
        bad = draw(st.sampled_from(sorted(BAD_REGEXES)))
        return text + f'\nparam "{bad}" replicated', BAD_REGEXES[bad]
    if mistake == "axis":
        return text + f'\nparam "x" ({draw(st.sampled_from(BAD_AXES))})', "unknown-axis"
    if mistake == "backend":
        has_backend = re.search(r"^backend ", text, re.M) is not None
        return text + "\nbackend nope", "duplicate-statement" if has_backend else "unknown-backend"
    if mistake == "size":
        return text.replace("mesh " + mesh_axes, "mesh " + mesh_axes + ", extra = 0"), "axis-size"
    return text + "\nmesh data = 2", "duplicate-statement"


# What the first fuzzers' alphabets lacked: digits Python's str.isdigit accepts and int() may not,
# other scripts' letters, and nesting deep enough to exhaust a recursive parser.
NASTY = ["²", "٣", "８", "ⅷ", "Ω", "ß", "\u200b", "(" * 600, "(?:" * 400, ")" * 600, "[" * 300, "9" * 30]


def mutate(text: str, data) -> str:
    if not text:
        return data.draw(st.text(max_size=20))
    i = data.draw(st.integers(0, len(text)))
    op = data.draw(st.sampled_from(["delete", "insert", "replace", "truncate"]))
    junk = data.draw(st.sampled_from(list('()",=*#\n_-> \\') + ["param", "mesh", "é", "\x00", "\t"] + NASTY))
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


def load_or_error(text: str) -> shardplan.Plan | shardplan.ShardPlanError:
    """The plan, or the ShardPlanError it is rejected with; any other exception fails the test."""
    try:
        return shardplan.loads(text, "fuzz.splan")
    except shardplan.ShardPlanError as e:
        return e


def resolve_some(plan: shardplan.Plan):
    mesh = plan.mesh_shape(8)
    leaves = [Leaf(p, (8, 16), "float32", 4) for p in PATHS]
    return resolve_leaves(plan, mesh, leaves, [Leaf("opt_state/0/mu/" + p, (8, 16), "float32", 4) for p in PATHS])


def exercise(text: str):
    """Any text: either a plan whose warnings are located, or located errors; same for resolving it."""
    result = load_or_error(text)
    if isinstance(result, shardplan.ShardPlanError):
        assert_located(text, result)
        return
    for w in result.warnings:
        assert w.span is not None
    try:
        resolve_some(result)
    except shardplan.ShardPlanError as e:
        assert_located(text, e)


FUZZ = settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(valid_plans())
def test_plans_made_of_valid_parts_load(text):
    plan = shardplan.loads(text, "fuzz.splan")  # must not raise
    assert plan.name == "fuzz" and plan.mesh
    for w in plan.warnings:
        assert_located(text, shardplan.ShardPlanError([w]))


@FUZZ
@given(broken_plans())
def test_plans_with_a_known_mistake_are_rejected_with_its_code(case):
    text, code = case
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.loads(text, "fuzz.splan")
    assert code in {d.code for d in info.value.errors}, (text, info.value)
    assert_located(text, info.value)


@FUZZ
@given(valid_plans(), st.data())
def test_mutated_plans(text, data):
    for _ in range(data.draw(st.integers(1, 3))):
        text = mutate(text, data)
    exercise(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    exercise(text)


def test_positions_inside_source_for_a_multiline_case():
    text = 'mesh data = *\nparam "ok" (data)\nparam "bad(" (data)\n'
    with pytest.raises(shardplan.ShardPlanError) as info:
        shardplan.loads(text)
    assert_located(text, info.value)
    assert re.search(r":3:\d+:", str(info.value))


# -- the fuzz can fail: what it guards, broken on purpose -----------------------------------

def test_exercise_fails_when_a_position_falls_outside_the_source(monkeypatch):
    from shardplan.errors import Span, error

    def bad_loads(text, file="<string>", **kw):
        raise shardplan.PlanCheckError([error("unknown-axis", "x", span=Span(file, 99, 1, 99, 2))])

    monkeypatch.setattr(shardplan, "loads", bad_loads)
    with pytest.raises(AssertionError):
        exercise('mesh data = *\n')


def test_exercise_fails_when_anything_but_shardplan_error_escapes(monkeypatch):
    def crashing_loads(text, file="<string>", **kw):
        raise ValueError("a crash inside the checker")

    monkeypatch.setattr(shardplan, "loads", crashing_loads)
    with pytest.raises(ValueError):
        exercise('mesh data = *\n')


def test_the_valid_generator_fails_when_the_checker_rejects_valid_plans(monkeypatch):
    real = shardplan.loads

    def picky_loads(text, file="<string>", **kw):
        if "axis " in text:  # pretend axis statements broke
            raise shardplan.PlanCheckError([shardplan.errors.error("syntax", "broken")])
        return real(text, file, **kw)

    monkeypatch.setattr(shardplan, "loads", picky_loads)
    with pytest.raises(shardplan.ShardPlanError):
        test_plans_made_of_valid_parts_load()
