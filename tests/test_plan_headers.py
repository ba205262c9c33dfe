"""Every shipped plan's header says which collectives its step issues on the model it is written
for (a "# Collectives (...):" line); `check --step` of that plan must report exactly those kinds
over those axes, so a header cannot promise an all-to-all the step does not issue, nor leave out
one it does."""

import re

import pytest

import shardplan
from tests.helpers import PLAN_MODELS, PLANS, ROOT

BATCH = ["tokens=int32[16,16],labels=int32[16,16]"]


def promised(text: str) -> list[tuple[str, tuple[str, ...]]]:
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    m = re.search(r"Collectives \([^)]*\): (.*?)(?:$|(?<=\w)\. )", header)
    assert m, "the header has no '# Collectives (...):' line"
    out = []
    for item in re.split(r",\s*(?![^()]*\))", m.group(1)):
        kind, axes = re.fullmatch(r"([\w-]+) over \(?([\w, ]+?)\)?", item.strip()).groups()
        out.append((kind, tuple(a.strip() for a in axes.split(","))))
    return out


@pytest.mark.parametrize("plan", sorted(PLAN_MODELS))
def test_the_header_names_the_collectives_the_step_issues(plan):
    model = PLAN_MODELS[plan]
    loss = "moe_lm_loss" if model.startswith("moe") else "lm_loss"
    cost = shardplan.api.analyze(PLANS / plan, model=f"{ROOT / 'examples' / 'models.py'}:{model}",
                                 step=f"{ROOT / 'examples' / 'train.py'}:{loss}", batch=BATCH, mode="fast", devices=8)
    bytes_of: dict = {}
    for c in cost.communication:
        bytes_of[(c.kind, c.axes)] = bytes_of.get((c.kind, c.axes), 0) + c.bytes
    want = promised((PLANS / plan).read_text())
    assert set(want) == set(bytes_of), (sorted(set(want) - set(bytes_of)), sorted(set(bytes_of) - set(want)))
    assert want == sorted(bytes_of, key=lambda k: -bytes_of[k]), "listed largest first"


def test_a_header_that_promises_what_the_step_does_not_issue_fails():
    text = (PLANS / "llama_pp_circular.splan").read_text().replace("collective-permute over stage",
                                                                    "all-to-all over stage")
    assert ("all-to-all", ("stage",)) in promised(text)
