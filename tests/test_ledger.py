"""The collective ledger (shardplan/ledger.py): one row type and one merge that fast mode, the
shard_map partitioner's record and exact mode all write, read by every report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardplan import ledger
from shardplan.core import stepcost
from shardplan.ledger import Communication
from shardplan.runtime import partition


def test_merge_sums_identical_collectives_names_what_they_move_and_puts_the_largest_first():
    rows = [
        Communication("all-gather", ("data",), 100, 1, "dot_general", "m.py:3", "sm/w"),
        Communication("all-gather", ("data",), 100, 1, "dot_general", "m.py:3", "sm/w"),
        Communication("all-gather", ("data",), 500, 2, "dot_general", "m.py:9", "sm/v"),
        Communication("all-reduce", ("model",), 40, 1, "transpose", "m.py:3"),
    ]
    rules = {"sm/w": ("w", "p.splan:4"), "sm/v": ("v", "p.splan:5")}
    got = ledger.merged(rows, lambda moves: rules.get(moves, (moves, "")))
    assert got == (
        Communication("all-gather", ("data",), 500, 2, "dot_general", "m.py:9", "v", "p.splan:5"),
        Communication("all-gather", ("data",), 200, 2, "dot_general", "m.py:3", "w", "p.splan:4"),
        Communication("all-reduce", ("model",), 40, 1, "transpose", "m.py:3", "", ""),
    )
    # Merging merged rows changes nothing; a step's totals are the rows' sums.
    assert ledger.merged(got) == tuple(
        Communication(c.kind, c.axes, c.bytes, c.count, c.op, c.source, c.moves) for c in got
    )


def test_the_partitioners_record_and_the_step_cost_hold_the_ledgers_rows():
    assert stepcost.Communication is Communication
    w = jnp.asarray(np.ones((16, 4), np.float32))
    x = jnp.asarray(np.ones((8, 16), np.float32))
    closed = jax.make_jaxpr(jax.value_and_grad(lambda w, x: (x @ w).sum()))(w, x)
    # w split over data on its rows (FSDP), x over data on its batch: w gathered, its gradient reduced
    record = partition.predict(closed, {"data": 4, "model": 2}, [(("data",), ())], [(("data",), ())], paths=["w"])
    assert record.issued and all(type(c) is Communication for c in record.issued)
    kinds = {c.kind for c in record.issued}
    assert "all-gather" in kinds and kinds & {"reduce-scatter", "all-reduce"}, record.issued
    gathered = [c for c in record.issued if c.kind == "all-gather"]
    assert all(c.moves == "w" and c.bytes == 16 * 4 * 4 for c in gathered), gathered  # the whole weight, per device
