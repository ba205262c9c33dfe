"""The compile cache (shardplan/runtime/compile_cache.py): a step checked again with --compile reads
the program compiled before, with the same figures; anything that changes the program compiles."""

import pytest

import shardplan
from tests.helpers import PLANS, ROOT

KW = dict(model=f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
          batch=["tokens=int32[8,16]", "labels=int32[8,16]"], devices=8, mode="exact")


def _cached(cost) -> bool:
    return any(n.code == "exact-cached" and "compile cache" in n.text for n in cost.notes)


def _figures(cost) -> tuple:
    return cost.flops, cost.memory, cost.bytes_by_kind(), cost.hbm_bytes, cost.kernels


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SHARDPLAN_COMPILE_CACHE", raising=False)
    return tmp_path / "compiled"


def test_the_same_step_compiled_again_is_read_from_the_cache_with_the_same_figures(cache):
    first = shardplan.api.analyze(PLANS / "fsdp.splan", **KW)
    again = shardplan.api.analyze(PLANS / "fsdp.splan", **KW)
    assert not _cached(first) and _cached(again)
    assert _figures(again) == _figures(first) and len(list(cache.iterdir())) == 1
    # another plan is another program: compiled, and cached beside it
    other = shardplan.api.analyze(PLANS / "gpt_tp.splan", **KW)
    assert not _cached(other) and _figures(other) != _figures(first) and len(list(cache.iterdir())) == 2


def test_the_cache_can_be_bypassed_and_a_torn_entry_is_a_miss(cache, monkeypatch):
    shardplan.api.analyze(PLANS / "dp.splan", **KW)
    monkeypatch.setenv("SHARDPLAN_COMPILE_CACHE", "0")  # what --no-cache sets
    assert not _cached(shardplan.api.analyze(PLANS / "dp.splan", **KW))
    monkeypatch.delenv("SHARDPLAN_COMPILE_CACHE")
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # a write cut short
    cost = shardplan.api.analyze(PLANS / "dp.splan", **KW)
    assert not _cached(cost) and cost.flops > 0
    assert _cached(shardplan.api.analyze(PLANS / "dp.splan", **KW))  # written again whole


def test_compiler_flags_are_part_of_the_key(cache, monkeypatch):
    shardplan.api.analyze(PLANS / "dp.splan", **KW)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_spmd_threshold_for_allgather_cse=10")
    assert not _cached(shardplan.api.analyze(PLANS / "dp.splan", **KW))
