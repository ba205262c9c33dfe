"""Notes are data: a registered code, the words printed, the op and line. The source makes notes
only with registered codes, every code is made somewhere, docs/stepcost.md lists exactly the
registry, and a note survives the JSON round trip the compile worker's reply takes."""

import re

import pytest

from shardplan.core.notes import NOTE_CODES, Note
from shardplan.core.stepcost import Memory, StepCost
from tests.helpers import ROOT

SOURCE = {p: p.read_text() for p in (ROOT / "shardplan").rglob("*.py") if p.name != "notes.py"}
MADE = re.compile(r"\bNote\(\s*\"([a-z0-9-]+)\"")


def made_codes() -> set[str]:
    return {code for text in SOURCE.values() for code in MADE.findall(text)}


def test_the_source_makes_notes_only_with_registered_codes_and_every_code_is_made():
    made = made_codes()
    assert made, "the scan found no notes: the pattern is stale"
    assert made <= set(NOTE_CODES), sorted(made - set(NOTE_CODES))
    assert set(NOTE_CODES) <= made, f"registered but never made: {sorted(set(NOTE_CODES) - made)}"


def test_stepcost_md_lists_exactly_the_registry():
    doc = (ROOT / "docs" / "stepcost.md").read_text()
    section = doc.split("\n### Notes\n", 1)[1].split("\n#", 1)[0]
    listed = dict(re.findall(r"^\| `([a-z0-9-]+)` \| (.*) \|$", section, re.M))
    expected = {c.name: c.doc for c in NOTE_CODES.values()}
    table = "\n".join(f"| `{n}` | {t} |" for n, t in expected.items())
    assert listed == expected, f"docs/stepcost.md's table of note codes should be:\n{table}"


def test_an_unregistered_note_cannot_be_made():
    with pytest.raises(ValueError, match="not in shardplan.core.notes.NOTE_CODES"):
        Note("no-such-note", "x")


def test_notes_survive_the_json_round_trip():
    notes = (
        Note("fast-not-modelled", "not modelled: foo x2", "foo", "model.py:3"),
        Note("exact-cpu-reduce-scatter", "all-reduces read as reduce-scatters"),
    )
    cost = StepCost("fast", "auto", {"data": 2}, 1.0, Memory(1, 1, 1, 1, 0, 1, 5), (), notes=notes)
    doc = cost.to_json()
    assert doc["notes"][0] == {
        "code": "fast-not-modelled",
        "text": "not modelled: foo x2",
        "op": "foo",
        "source": "model.py:3",
    }
    assert doc["notes"][1] == {"code": "exact-cpu-reduce-scatter", "text": "all-reduces read as reduce-scatters"}
    assert StepCost.from_json(doc).notes == notes
    assert str(notes[0]) == "not modelled: foo x2"  # what the CLI prints
