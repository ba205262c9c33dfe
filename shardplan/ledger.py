"""The collective ledger: one row per collective of a step (kind, mesh axes, bytes, count, the op
it comes from, its source line, what it moves and the plan rule that placed that), and one way
to merge rows. Fast mode's propagation, the shard_map partitioner's record and exact mode's
reading of a compiled program all write these rows and merge them here; every report (``check
--step``, ``--vs``, ``suggest``, the benchmarks) reads them from ``StepCost.communication``.

It imports nothing (``shardplan lower``'s standalone module carries it with the partitioner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Communication:
    """One collective (or a group of identical ones) per device per step."""

    kind: str
    axes: tuple[str, ...]  # the mesh axes it runs over
    bytes: int  # per device per step, all executions
    count: int  # executions (launches) per step; 0 for an array carried by another row's combined launch
    op: str = ""  # the jax op it comes from, e.g. transpose(jvp())/dot_general
    source: str = ""  # model source 'file:line'
    moves: str = ""  # the param / optimizer-state / input path it moves, when it moves one
    rule: str = ""  # the plan rule 'file:line' that placed that path


def merged(
    rows: Iterable[Communication], named: Callable[[str], tuple[str, str]] | None = None
) -> tuple[Communication, ...]:
    """One row per (kind, axes, op, source, what it moves), bytes and counts summed, largest
    first within a kind. ``named(moves) -> (path, rule)`` names what each row moves as the
    report shows it and the plan rule that placed it (None: rows keep theirs)."""
    groups: dict[tuple, list[int]] = {}
    for c in rows:
        acc = groups.setdefault((c.kind, c.axes, c.op, c.source, c.moves), [0, 0])
        acc[0] += c.bytes
        acc[1] += c.count
    out = []
    for (kind, axes, op, source, moves), (nbytes, count) in groups.items():
        path, rule = named(moves) if named is not None else (moves, "")
        out.append(Communication(kind, axes, nbytes, count, op, source, path, rule))
    return tuple(sorted(out, key=lambda c: (c.kind, -c.bytes)))
