"""Small shared helpers and paths for tests."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardplan
from shardplan.errors import Diagnostic

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
FIXTURES = ROOT / "tests" / "fixtures"


def diags_of(fn, *args, **kwargs) -> tuple[Diagnostic, ...]:
    with pytest.raises(shardplan.ShardPlanError) as info:
        fn(*args, **kwargs)
    return info.value.diagnostics


def only(diags, code: str) -> Diagnostic:
    found = [d for d in diags if d.code == code]
    assert len(found) == 1, [d.render() for d in diags]
    return found[0]
