"""Goldens for the cost engine's redesign (issue 44, step 1): for a few (model, plan, backend)
pairs, fast mode's whole StepCost (for the shard_map backend: the partitioner's predicted record,
its collectives and fallbacks), and for a few models the roles `suggest` reads, stored as JSON in
tests/goldens/ and kept byte-equal. Nothing here compiles.

A refactor keeps every golden as it is. A change that means to move a figure regenerates them on
purpose, in a commit that says which figures moved and why:

    SHARDPLAN_WRITE_GOLDENS=1 python -m pytest tests/test_goldens.py -n 0
"""

from __future__ import annotations

import json
import os

import pytest

import shardplan
from tests.helpers import PLANS, ROOT

GOLDENS = ROOT / "tests" / "goldens"
MODELS = ROOT / "examples" / "models.py"
TRAIN = ROOT / "examples" / "train.py"
BATCH = ["tokens=int32[16,16],labels=int32[16,16]"]

# (model, plan, backend): both backends, a scanned model, a pipeline, experts, act rules, explicit axes.
PAIRS = [
    ("gpt_tiny", "gpt_tp.splan", "auto"),
    ("gpt_tiny", "gpt_tp.splan", "shard_map"),
    ("gpt_tiny", "fsdp.splan", "shard_map"),
    ("llama_tiny_scan", "llama_scan_2d.splan", "auto"),
    ("llama_tiny", "llama_sp.splan", "auto"),
    ("llama_deep_scan", "llama_pp.splan", "auto"),
    ("moe_tiny", "moe_ep.splan", "auto"),
    ("typed_tiny", "typed_tp.splan", "shard_map"),
]
ROLE_MODELS = ["gpt_tiny", "llama_tiny_scan", "moe_tiny"]


def _loss(model: str) -> str:
    return f"{TRAIN}:{'moe_lm_loss' if model.startswith('moe') else 'lm_loss'}"


def _portable(value):
    """Paths under the checkout written relative to it (goldens are the same in any clone)."""
    if isinstance(value, str):
        return value.replace(str(ROOT) + os.sep, "")
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_portable(v) for v in value)
    return value


def _text(doc) -> str:
    return json.dumps(_portable(doc), indent=1, sort_keys=True) + "\n"


def _check(name: str, doc) -> None:
    path = GOLDENS / f"{name}.json"
    text = _text(doc)
    if os.environ.get("SHARDPLAN_WRITE_GOLDENS"):
        GOLDENS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden {path.name}: write it with SHARDPLAN_WRITE_GOLDENS=1"
    want = path.read_text()
    if text != want:
        got, old = json.loads(text), json.loads(want)
        moved = sorted(k for k in set(got) | set(old) if got.get(k) != old.get(k))
        raise AssertionError(f"{path.name} moved in {moved}: a refactor keeps goldens byte-equal; regenerate "
                             "them only on purpose (SHARDPLAN_WRITE_GOLDENS=1) and say in the commit what moved")


@pytest.mark.parametrize("model, plan, backend", PAIRS, ids=[f"{m}-{p.removesuffix('.splan')}-{b}" for m, p, b in PAIRS])
def test_fast_mode_step_cost_is_its_golden(model, plan, backend):
    cost = shardplan.api.analyze(PLANS / plan, model=f"{MODELS}:{model}", step=_loss(model), batch=BATCH,
                                 mode="fast", backend=backend, devices=8)
    doc = cost.to_json()
    doc["analysis_seconds"] = 0.0  # how long it took: not a figure of the step
    _check(f"stepcost-{model}-{plan.removesuffix('.splan')}-{backend}", doc)


@pytest.mark.parametrize("model", ROLE_MODELS)
def test_roles_are_their_golden(model):
    roles = shardplan.api.step_coster(f"{MODELS}:{model}", _loss(model), BATCH).roles(8)
    # Classes numbered by first appearance (params, then inputs): the walk's own numbers are
    # internal, and a walker that makes its nodes in another order must not move the golden.
    number: dict[int, int] = {}
    for c in [c for p in roles.params for c in p.classes + p.units] + [c for *_, cs in roles.inputs for c in cs]:
        number.setdefault(c, len(number))
    doc = {
        "params": [
            {"path": p.path, "shape": list(p.shape), "classes": [number[c] for c in p.classes],
             "units": [number[c] for c in p.units], "tags": [sorted(t) for t in p.tags]}
            for p in roles.params
        ],
        "sizes": {str(number[k]): v for k, v in sorted(roles.sizes.items(), key=lambda kv: number[kv[0]])},
        "inputs": [[path, list(shape), [number[c] for c in classes]] for path, shape, classes in roles.inputs],
        "opt_prefixes": list(roles.opt_prefixes),
    }
    _check(f"roles-{model}", doc)


def test_a_moved_figure_fails_and_names_what_moved(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.GOLDENS", tmp_path)
    monkeypatch.delenv("SHARDPLAN_WRITE_GOLDENS", raising=False)
    (tmp_path / "x.json").write_text(_text({"flops_per_device": 1.0, "mode": "fast"}))
    _check("x", {"flops_per_device": 1.0, "mode": "fast"})
    with pytest.raises(AssertionError, match=r"moved in \['flops_per_device'\]"):
        _check("x", {"flops_per_device": 1.5, "mode": "fast"})
