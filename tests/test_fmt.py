"""`shardplan fmt`: idempotent, meaning-preserving, comments kept; plans/ is kept formatted."""

import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.lang.fmt import format_text
from tests.helpers import PLANS, ROOT
from tests.test_fuzz import valid_plans

DOCS = re.findall(r"```splan\n(.*?)```", (ROOT / "docs" / "language.md").read_text(), re.S)


def meaning(text: str):
    """What a plan means, without where it was written."""
    p = shardplan.loads(text, "f.splan", base_dir=PLANS)
    return (p.name, p.backend, [(a.name, a.size, a.link) for a in p.mesh], p.batch, p.default,
            [(r.kind, r.pattern, r.spec) for r in p.params + p.opts + p.inputs], [(a.logical, a.axes) for a in p.axes])


def comments(text: str) -> list[str]:
    return [ln[ln.index("#"):].strip() for ln in text.splitlines() if "#" in ln and '"' not in ln]


def assert_good(text: str):
    once = format_text(text)
    assert format_text(once) == once  # idempotent
    assert meaning(once) == meaning(text)  # the same plan
    assert comments(once) == comments(text)  # comments kept, in order


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.splan")), ids=lambda p: p.name)
def test_every_plan_in_plans_is_formatted_and_formatting_keeps_it(path):
    text = path.read_text()
    assert format_text(text) == text, "run: shardplan fmt plans/*.splan"
    assert_good(text)


@pytest.mark.parametrize("index", range(len(DOCS)))
def test_doc_examples(index):
    assert_good(DOCS[index])


@st.composite
def messy(draw):
    """A valid plan with its whitespace disturbed and comments sprinkled in."""
    lines = draw(valid_plans()).splitlines()
    out = []
    for line in lines:
        if draw(st.booleans()):
            line = re.sub(r"\s*([=,()]|->)\s*", lambda m: draw(st.sampled_from(["", " ", "  "])) + m.group(1)
                          + draw(st.sampled_from(["", " ", "   "])), line)
        if draw(st.integers(0, 4)) == 0:
            line += "   # note"
        out.append(draw(st.sampled_from(["", "  ", "\t"])) + line)
        if draw(st.integers(0, 5)) == 0:
            out.append(draw(st.sampled_from(["", "# a comment", "", "   "])))
    return "\n".join(out)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(messy())
def test_formatting_fuzzed_plans_is_idempotent_and_keeps_their_meaning(text):
    assert_good(text)


def test_canonical_layout():
    text = 'mesh  data=*,model = 2 @dcn # m\n\n\n# c\nparam "a#b"   (data,_)   # t\nopt "x" ()\n  axis embed->_\n' \
           'axis "kv.h" -> (data,model)\ndefault  replicated'
    assert format_text(text) == (
        'mesh data = *, model = 2 @dcn  # m\n\n# c\nparam "a#b"  (data, _)  # t\nopt "x"      replicated\n'
        'axis embed  -> _\naxis "kv.h" -> (data, model)\ndefault replicated\n')


def test_fmt_cli_check_and_rewrite(tmp_path):
    f = tmp_path / "p.splan"
    f.write_text('mesh d=*\nparam "x"(d)\n')
    run = lambda *a: subprocess.run([sys.executable, "-m", "shardplan", "fmt", *map(str, a)], capture_output=True,
                                    text=True, timeout=60)
    r = run("--check", f)
    assert r.returncode == 1 and '+param "x" (d)' in r.stdout and f.read_text() == 'mesh d=*\nparam "x"(d)\n'
    assert run(f).returncode == 0 and f.read_text() == 'mesh d = *\nparam "x" (d)\n'
    assert run("--check", f).returncode == 0
    bad = tmp_path / "bad.splan"
    bad.write_text("mesh d = *\nparam (d)\n")
    r = run(bad)
    assert r.returncode == 1 and "bad.splan:2:" in r.stderr and bad.read_text() == "mesh d = *\nparam (d)\n"
