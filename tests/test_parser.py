"""Stage 1: text -> AST, and syntax errors with locations and hints."""

import pytest

import shardplan
from shardplan.lang import syntax as ast
from shardplan.lang.parser import parse
from tests.helpers import diags_of


def test_statements_and_spans():
    m = parse('plan "p"\nmesh data = *, model = 2\nparam "a/\\d+" ((data, model), _)\n', "x.splan")
    plan, mesh, rule = m.statements
    assert plan == ast.PlanName("p", plan.span) and plan.span.line == 1
    assert [(a.name, a.size) for a in mesh.axes] == [("data", None), ("model", 2)]
    assert mesh.axes[1].name_span.column == 16
    assert rule.pattern == "a/\\d+"  # raw strings: the backslash is kept
    assert rule.pattern_span.line == 3 and rule.pattern_span.column == 8
    assert rule.spec.dims[0].axes == ("data", "model") and rule.spec.dims[1].axes == ()


def test_comments_and_newlines_are_whitespace():
    m = parse("# header\nmesh data = 8 # trailing\nparam\n  \"x\"\n  (data)\n")
    assert [type(s).__name__ for s in m.statements] == ["MeshNode", "RuleNode"]


def test_replicated_and_empty_spec_are_the_same():
    a = parse('param "x" replicated').statements[0].spec.dims
    b = parse('param "x" ()').statements[0].spec.dims
    assert a == b == ()


SYNTAX_CASES = {
    "unquoted regex": ("mesh data = 8\nparam blocks/.* (data)", 2, 7, "unexpected 'blocks'", "double quotes"),
    "missing equals": ("mesh data 8", 1, 11, "expected '='", "name = size"),
    "bad size": ("mesh data = two", 1, 13, "unexpected 'two'", "positive integer"),
    "spec without parens": ("mesh data = 8\nbatch data", 2, 7, "expected '(', 'replicated'", "parenthesised"),
    "unclosed paren": ('param "x" (model', 1, 17, "unexpected end of file; expected ')', ','", ""),
    "unterminated string": ('param "x (model)', 1, 7, "unterminated string", "end of the line"),
    "unknown statement": ("mesh data = 8\nshard x", 2, 1, "unexpected 'shard'", "statements"),
    "axis arrow": ("axis embed = model", 1, 12, "expected '->'", "arrow"),
    "bad character": ("mesh data = 8 ;", 1, 15, "unexpected character ';'", ""),
}


@pytest.mark.parametrize("name", SYNTAX_CASES)
def test_syntax_errors_are_located(name):
    text, line, col, message, hint = SYNTAX_CASES[name]
    (d,) = diags_of(shardplan.loads, text, "bad.splan")
    assert d.code == "syntax" and d.span.file == "bad.splan"
    assert (d.span.line, d.span.column) == (line, col), d.render()
    assert message in d.message
    assert hint in d.hint
    rendered = d.render()
    assert rendered.startswith(f"bad.splan:{line}:{col}: error[syntax]")
    assert "^" in rendered  # the caret under the offending text


def test_syntax_error_is_a_plan_syntax_error():
    with pytest.raises(shardplan.PlanSyntaxError):
        shardplan.loads("mesh")
