"""One registry of diagnostic codes: the source uses only registered codes, every registered
code is used, docs/language.md lists exactly the registry, and the stage picks the class."""

import re

import pytest

import shardplan
from shardplan.codes import CODES
from shardplan.errors import as_error, error, warning
from tests.helpers import ROOT

SOURCE = {p: p.read_text() for p in (ROOT / "shardplan").rglob("*.py")}
# Every way a diagnostic is made: error("code", ...), warning(...), and the checker's err/warn.
USE = re.compile(r"\b(error|warning|err|warn)\(\s*\"([a-z0-9-]+)\"")


def used_codes() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path, text in SOURCE.items():
        for fn, code in USE.findall(text):
            kind = "warning" if fn in ("warning", "warn") else "error"
            out.setdefault(code, set()).add(kind)
    return out


def test_the_source_uses_only_registered_codes_of_the_right_kind():
    used = used_codes()
    assert used, "the scan found no diagnostics: the pattern is stale"
    for code, kinds in used.items():
        assert code in CODES, f"{code} is used but not in shardplan/codes.py"
        assert kinds == {CODES[code].severity}, (code, kinds)


def test_every_registered_code_is_used():
    unused = set(CODES) - set(used_codes())
    assert not unused, f"registered but never reported: {sorted(unused)}"


def test_the_language_reference_lists_exactly_the_registry():
    doc = (ROOT / "docs" / "language.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (error|warning) \| (\w+) \| (.*) \|$", doc, re.M)
    listed = {name: (kind, stage, text) for name, kind, stage, text in rows}
    expected = {c.name: (c.severity, c.stage, c.doc) for c in CODES.values()}
    table = "\n".join(f"| `{n}` | {k} | {s} | {t} |" for n, (k, s, t) in expected.items())
    assert listed == expected, f"docs/language.md's table should be:\n{table}"


def test_an_unregistered_code_cannot_be_made():
    with pytest.raises(KeyError, match="not registered"):
        error("no-such-code", "x")
    with pytest.raises(KeyError, match="not registered as an warning"):
        warning("indivisible", "x")  # registered, but as an error


@pytest.mark.parametrize(
    "code, cls",
    [
        ("syntax", shardplan.PlanSyntaxError),
        ("indivisible", shardplan.PlanCheckError),
        ("not-a-checkpoint", shardplan.PlanApplyError),
        ("bad-mesh-arg", shardplan.ArgumentError),
        ("cannot-launch", shardplan.PlanApplyError),
    ],
)
def test_the_stage_of_the_first_error_picks_the_class(code, cls):
    err = as_error([warning("unused-rule", "w"), error(code, "e")])
    assert type(err) is cls and isinstance(err, shardplan.ShardPlanError)
    assert [d.code for d in err.diagnostics] == ["unused-rule", code]


def test_launch_error_is_a_shardplan_error():
    assert issubclass(shardplan.LaunchError, shardplan.ShardPlanError)
