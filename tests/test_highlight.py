"""Highlighting: the Pygments lexer (registered by the package's entry point) and the TextMate
grammar for editors tokenise every plan in plans/ and every example in docs/language.md with no
error token, and flag text that is not in the language."""

import json
import re

import pytest
from pygments.lexers import get_lexer_by_name, get_lexer_for_filename
from pygments.token import Error, Keyword, String

from tests.helpers import PLANS, ROOT

TEXTS = {p.name: p.read_text() for p in sorted(PLANS.glob("*.splan"))}
TEXTS.update({f"language.md#{i}": t for i, t in
              enumerate(re.findall(r"```splan\n(.*?)```", (ROOT / "docs" / "language.md").read_text(), re.S))})
GRAMMAR = json.loads((ROOT / "editors" / "vscode" / "syntaxes" / "splan.tmLanguage.json").read_text())


def textmate_tokens(text: str) -> list[tuple[str, str]]:
    """(scope, text) per token, as a TextMate engine scans a line: at each position the pattern
    whose match starts first wins (the first listed on a tie); unmatched text gets no scope."""
    rules = [(re.compile(p["match"]), p["name"]) for p in GRAMMAR["patterns"]]
    out = []
    for line in text.split("\n"):
        pos = 0
        while pos < len(line):
            best = None
            for rx, scope in rules:
                m = rx.search(line, pos)
                if m and m.end() > m.start() and (best is None or m.start() < best[0].start()):
                    best = (m, scope)
            if best is None:
                out.append(("", line[pos:]))
                break
            m, scope = best
            if m.start() > pos:
                out.append(("", line[pos:m.start()]))
            out.append((scope, m.group()))
            pos = m.end()
    return out


@pytest.mark.parametrize("name", list(TEXTS))
def test_pygments_lexes_every_plan_without_errors(name):
    lexer = get_lexer_by_name("splan")
    tokens = list(lexer.get_tokens(TEXTS[name]))
    assert [v for t, v in tokens if t is Error] == []
    assert any(t in Keyword for t, _ in tokens) and "".join(v for _, v in tokens).strip() == TEXTS[name].strip()


@pytest.mark.parametrize("name", list(TEXTS))
def test_textmate_grammar_scopes_every_character(name):
    tokens = textmate_tokens(TEXTS[name])
    assert [v for s, v in tokens if s.startswith("invalid") or (not s and v.strip())] == []
    assert any(s.startswith("keyword.control") for s, _ in tokens)


def test_both_flag_what_is_not_the_language_and_agree_on_strings():
    text = 'param "a{b}" (data, _) { ; }'
    assert [v for t, v in get_lexer_by_name("splan").get_tokens(text) if t is Error] == ["{", ";", "}"]
    assert [v for s, v in textmate_tokens(text) if s.startswith("invalid")] == ["{", ";", "}"]
    assert [v for t, v in get_lexer_by_name("splan").get_tokens(text) if t in String] == ['"a{b}"']
    assert [v for s, v in textmate_tokens(text) if s.startswith("string")] == ['"a{b}"']
    assert get_lexer_for_filename("model.splan").name == "splan"


def test_the_vscode_manifest_points_at_the_grammar():
    manifest = json.loads((ROOT / "editors" / "vscode" / "package.json").read_text())
    (grammar,) = manifest["contributes"]["grammars"]
    assert grammar["scopeName"] == GRAMMAR["scopeName"]
    assert (ROOT / "editors" / "vscode" / grammar["path"]).exists()
    assert manifest["contributes"]["languages"][0]["extensions"] == [".splan"]
