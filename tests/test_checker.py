"""Stage 2: AST -> checked Plan. Each static diagnostic, by location and message."""

import pytest

import shardplan
from shardplan import Spec
from tests.helpers import FIXTURES, PLANS
from tests.helpers import diags_of, only


def test_plan_fields():
    plan = shardplan.loads('plan "p"\nmesh data = *, model = 2\nbatch (data, _)\n'
                           'param "a" ((data, model), _)\naxis embed -> model\ndefault replicated\n'
                           'backend shard_map\n')
    assert plan.name == "p" and plan.backend == "shard_map"
    assert plan.axis_names == ("data", "model")
    assert plan.params[0].spec == Spec((("data", "model"), ()))
    from jax.sharding import PartitionSpec as P

    assert shardplan.pspec(plan.params[0].spec) == P(("data", "model"))
    assert plan.batch_axes == ("data",)
    assert plan.mesh_shape(8) == {"data": 4, "model": 2}
    assert plan.default == Spec(())


STATIC_ERRORS = {
    "unknown-axis": ("mesh data = *, model = 2\nparam \"x\" (modle, _)", 2, 12, "unknown mesh axis 'modle'",
                     "did you mean 'model'?"),
    "axis-reused": ("mesh data = 8\nparam \"x\" (data, data)", 2, 18, "used twice in one spec", "(a, b)"),
    "duplicate-axis": ("mesh data = 2, data = 4", 1, 16, "declared twice", "distinct"),
    "axis-size": ("mesh data = 0", 1, 6, "has size 0", "positive"),
    "two-inferred-sizes": ("mesh data = *, model = *", 1, 16, "both '*'", "at most one"),
    "invalid-regex": ("mesh data = 8\nparam \"blocks/(a\" (data)", 2, 15, "invalid regex", "RE2"),
    "unsupported-regex": ("mesh data = 8\nparam \"a(?=b)\" (data)", 2, 9, "not supported", "lookaround"),
    "duplicate-statement": ("mesh data = 8\nmesh data = 4", 2, 1, "'mesh' given twice", "keep one"),
    "unknown-backend": ("mesh data = 8\nbackend shardmap", 2, 1, "unknown backend 'shardmap'", "shard_map"),
    "no-mesh": ("param \"x\" (data)", 1, 1, "declares no mesh", "mesh data"),
    "reserved-axis-name": ("mesh _ = 8", 1, 6, "'_' cannot name a mesh axis", ""),
    "duplicate-axis-rule": ("mesh m = 8\naxis e -> m\naxis e -> _", 3, 1, "mapped twice", "one axis rule"),
}


@pytest.mark.parametrize("code", STATIC_ERRORS)
def test_static_errors(code):
    text, line, col, message, hint = STATIC_ERRORS[code]
    d = only(diags_of(shardplan.loads, text, "p.splan"), code)
    assert (d.span.file, d.span.line, d.span.column) == ("p.splan", line, col), d.render()
    assert message in d.message and hint in d.hint
    assert d.source_line == text.splitlines()[line - 1]


def test_none_instead_of_underscore_gets_a_hint():
    d = only(diags_of(shardplan.loads, "mesh data = 8\nparam \"x\" (None, data)"), "unknown-axis")
    assert "write _" in d.hint


def test_all_errors_are_reported_together():
    diags = diags_of(shardplan.loads, "mesh data = 0, data = *\nparam \"(\" (foo, bar)\nbatch (baz)")
    codes = sorted(d.code for d in diags)
    assert codes == ["axis-size", "duplicate-axis", "invalid-regex", "unknown-axis", "unknown-axis",
                     "unknown-axis"]


def test_invalid_regex_caret_points_into_the_string():
    d = only(diags_of(shardplan.loads, 'mesh d = 8\nparam "ab[" (d)'), "invalid-regex")
    # 'ab[' starts at column 8; the unterminated set begins at offset 2.
    assert d.span.column == 10
    assert d.render().splitlines()[2] == "    " + " " * 9 + "^"


def test_backreference_is_rejected_with_its_position():
    d = only(diags_of(shardplan.loads, 'mesh d = 8\nparam "(a)\\1" (d)'), "unsupported-regex")
    assert d.span.column == 8 + 3 and "\\1" in d.message


def test_static_shadowing_warnings():
    plan = shardplan.loads('mesh d = 8\nparam "a" (d)\nparam "a" replicated\nparam ".*" replicated\n'
                           'param "b" (d)')
    msgs = [(w.code, w.span.line) for w in plan.warnings]
    assert ("shadowed-rule", 3) in msgs  # repeats line 2's regex
    assert ("shadowed-rule", 5) in msgs  # after the catch-all on line 4


def test_catch_all_with_axis_rules_warns():
    plan = shardplan.loads('mesh d = 8\naxis embed -> d\nparam ".*" replicated')
    w = only(plan.warnings, "annotations-unreachable")
    assert w.span.line == 3 and "default replicated" in w.hint


MESH_CASES = [
    ("mesh data = *, model = 2", 8, {"data": 4, "model": 2}),
    ("mesh data = 2, model = 4", 8, {"data": 2, "model": 4}),
    ("mesh a = 1, b = *", 8, {"a": 1, "b": 8}),
]


@pytest.mark.parametrize("text,devices,expected", MESH_CASES)
def test_mesh_shape(text, devices, expected):
    assert shardplan.loads(text).mesh_shape(devices) == expected


def test_mesh_needs_more_devices_than_exist():
    plan = shardplan.loads("mesh data = 4, model = 4", "m.splan")
    d = only(diags_of(plan.mesh_shape, 8), "mesh-devices")
    assert "needs 16 devices; 8 are available" in d.message and d.span.line == 1


def test_star_mesh_indivisible_device_count():
    d = only(diags_of(shardplan.loads("mesh data = *, model = 3").mesh_shape, 8), "mesh-devices")
    assert "groups of 3" in d.message


def test_mesh_override():
    plan = shardplan.load(FIXTURES / "gpt_tp.splan", mesh={"data": 32, "model": 8})
    assert plan.mesh_shape(256) == {"data": 32, "model": 8}
    plan2 = shardplan.with_mesh(plan, {"data": 2, "model": 4})
    assert plan2.mesh_shape(8) == {"data": 2, "model": 4}
    diags = diags_of(shardplan.with_mesh, plan, {"data": 8})
    assert len(diags) == 6 and {d.code for d in diags} == {"unknown-axis"}  # one per rule using 'model'
    assert "'model'" in diags[0].message and diags[0].span.file.endswith("gpt_tp.splan")
    assert diags[0].span.line == 5


def test_parse_mesh_arg():
    assert shardplan.parse_mesh_arg("data=*,model=2") == {"data": None, "model": 2}
    only(diags_of(shardplan.parse_mesh_arg, "data:8"), "bad-mesh-arg")


def test_extends_overrides_and_orders_rules(tmp_path):
    (tmp_path / "base.splan").write_text('plan "base"\nmesh data = *\nbatch (data, _)\n'
                                         'param "a" (data)\ndefault replicated\naxis e -> data\n')
    (tmp_path / "child.splan").write_text('extends "base.splan"\nmesh data = *, model = 2\n'
                                          'param "a" (model)\naxis e -> model\n')
    plan = shardplan.load(tmp_path / "child.splan")
    assert plan.name == "base" and plan.axis_names == ("data", "model")
    assert [r.spec for r in plan.params] == [Spec((("model",),)), Spec((("data",),))]
    assert plan.params[0].span.file.endswith("child.splan")
    assert plan.axes[0].axes == ("model",) and plan.default == Spec(())
    assert plan.batch == Spec((("data",), ()))


def test_extends_cycle_and_missing_base(tmp_path):
    (tmp_path / "a.splan").write_text('extends "b.splan"\n')
    (tmp_path / "b.splan").write_text('extends "a.splan"\nmesh d = 1\n')
    d = only(diags_of(shardplan.load, tmp_path / "a.splan"), "extends-cycle")
    assert d.span.file.endswith("b.splan") and d.span.line == 1
    (tmp_path / "c.splan").write_text('mesh d = 1\nextends "nope.splan"\n')
    d = only(diags_of(shardplan.load, tmp_path / "c.splan"), "cannot-read")
    assert d.span.line == 2 and "nope.splan" in d.message


def test_missing_plan_file():
    d = only(diags_of(shardplan.load, "/nonexistent/x.splan"), "cannot-read")
    assert "x.splan" in d.message


def test_plan_is_immutable():
    plan = shardplan.loads("mesh d = 8")
    with pytest.raises(AttributeError):
        plan.name = "x"
