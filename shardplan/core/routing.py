"""How tokens are routed to experts, as a user states it, and what it does to a step's expert shards.

A mixture-of-experts step whose experts are split over an axis (expert parallelism) does as much
grouped-matmul work on a device as tokens were routed to that device's experts. With a uniform
router every shard does the mean; in practice the busiest shard does more, and the step waits
for it. :class:`ExpertLoad` is the stated routing: a router histogram (tokens per expert, as a
training loop logs it: the shards' loads follow from which experts each holds) or, without one,
the busiest shard's tokens over the mean. The time model (``core.timing``) scales each split
grouped matmul's work on the busiest shard by :func:`imbalance`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shardplan.errors import as_error, error

MAX_FILE_BYTES = 16 * 2**20  # a histogram file larger than this is something else (read whole)
UNIFORM_HINT = "give tokens per expert (e.g. 900,100,500,548), a JSON file of them, or a factor >= 1 (e.g. 1.3)"


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert (``counts``, in the experts' order: expert ``e`` is row ``e``
    of the stacked weights), or the busiest's tokens over the mean (``factor``: the busiest expert
    shard's for the step time, :func:`shares`; the busiest expert's for tokens dropped,
    :func:`dropped`)."""

    counts: tuple[float, ...] = ()
    factor: float = 1.0
    where: str = "--expert-load"  # where it was stated, for messages

    def describe(self) -> str:
        if self.counts:
            return f"tokens per expert over {len(self.counts)} experts, the busiest expert {self._peak():.2f}x the mean"
        return f"the busiest at {self.factor:g}x the mean (an expert, for tokens dropped; an expert shard, for time)"

    def _peak(self) -> float:
        return max(self.counts) * len(self.counts) / sum(self.counts)


def shares(load: ExpertLoad, experts: int, shards: int) -> tuple[float, ...]:
    """Each shard's fraction of the routed tokens, the experts split into ``shards`` contiguous
    blocks as a sharded dim is (shard ``s`` holds experts ``[s * E / n, (s + 1) * E / n)``).
    A factor gives the busiest shard its share and the others the rest evenly.

    Raises:
        ArgumentError: the histogram's length is not ``experts``; the shards do not divide the
            experts; a factor above ``shards`` (the busiest holds at most every token).
    """
    if shards < 1 or experts % shards:
        raise _bad(load, f"{experts} experts do not split into {shards} shards", "split the experts evenly")
    if load.counts:
        if len(load.counts) != experts:
            raise _bad(
                load,
                f"the histogram has {len(load.counts)} experts, the step's grouped matmuls {experts}",
                "give one count per expert of a layer (one histogram serves every layer)",
            )
        per = experts // shards
        total = sum(load.counts)
        return tuple(sum(load.counts[s * per : (s + 1) * per]) / total for s in range(shards))
    if load.factor > shards:
        raise _bad(
            load,
            f"a busiest shard at {load.factor:g}x the mean: over {shards} expert shards it holds at most {shards}x",
            f"give a factor between 1 and {shards}, or a histogram",
        )
    if shards == 1:
        return (1.0,)
    rest = (1 - load.factor / shards) / (shards - 1)
    return (load.factor / shards,) + (rest,) * (shards - 1)


def imbalance(load: ExpertLoad, experts: int, shards: int) -> float:
    """The busiest shard's tokens over the mean shard's (1.0: uniform)."""
    return max(shares(load, experts, shards)) * shards


@dataclass(frozen=True)
class Capacity:
    """A capacity-style dispatch read from the step: ``experts`` experts, each token choosing
    ``k`` of them (``tokens`` tokens per step), each expert's buffers holding ``slots`` tokens
    per step (over all groups). Tokens routed to an expert beyond its slots are dropped."""

    experts: int
    k: int  # 0: no router the step shows (a top-k, argmaxes as many per layer): drops not estimated
    tokens: int
    slots: int

    @property
    def factor(self) -> float:
        """The capacity factor: slots over the mean tokens an expert is routed (0: unknown)."""
        return self.slots * self.experts / (self.tokens * self.k) if self.k else 0.0

    def describe(self) -> str:
        if not self.k:
            return f"{self.experts} experts, {self.slots:,} slots per expert"
        return (
            f"{self.experts} experts, top-{self.k} of {self.tokens:,} tokens, {self.slots:,} slots per expert "
            f"(capacity factor {self.factor:.2f}: the slots over the {self.tokens * self.k / self.experts:,.0f} "
            "choices an expert is routed on average)"
        )


def dropped(load: ExpertLoad | None, cap: Capacity) -> tuple[float, float]:
    """(the fraction of token choices over capacity, the busiest expert's tokens over its slots)
    under ``load`` (None: every expert alike), each group routed as the whole step is: a lower
    bound where groups differ (an expert over capacity in one group cannot use another's slots).
    A factor puts the busiest expert at that multiple of the mean, the others even."""
    if not cap.k:
        raise ValueError("no top-k router found for these experts: the tokens routed are not known")
    routed = cap.tokens * cap.k
    if load is None:
        each = (1.0 / cap.experts,) * cap.experts
    elif load.counts:
        shares(load, cap.experts, cap.experts)  # the histogram's length checked
        each = tuple(c / sum(load.counts) for c in load.counts)
    else:
        each = shares(load, cap.experts, cap.experts)
    over = sum(max(0.0, e * routed - cap.slots) for e in each)
    return over / routed, max(each) * routed / cap.slots


def parse(text: str, where: str = "--expert-load") -> ExpertLoad:
    """``1.3`` (a factor), ``900,100,500,548`` (tokens per expert) or a JSON file holding a list
    of counts, or an object with one (``{"tokens_per_expert": [...]}``).

    Raises:
        ArgumentError: not a number, a list of counts or a readable file of them; a negative or
            non-finite count; every count zero; a factor below 1.
    """
    text = text.strip()
    try:
        factor = float(text)
    except ValueError:
        factor = None
    if factor is not None:
        if not math.isfinite(factor) or factor < 1:
            raise _bad(
                ExpertLoad(where=where),
                f"a busiest shard at {text}x the mean: the busiest shard holds at least the mean",
                UNIFORM_HINT,
            )
        return ExpertLoad(factor=factor, where=where)
    if "," in text:
        return _counts(text.split(","), where)
    if not os.path.isfile(text):
        raise _bad(ExpertLoad(where=where), f"'{text}' is not a factor, a list of counts or a file", UNIFORM_HINT)
    if os.path.getsize(text) > MAX_FILE_BYTES:
        raise _bad(
            ExpertLoad(where=where),
            f"{text}: {os.path.getsize(text):,} bytes, not a histogram of tokens per expert",
            f"write the counts alone (under {MAX_FILE_BYTES // 2**20} MiB)",
        )
    try:
        with open(text) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise _bad(ExpertLoad(where=where), f"{text}: not a JSON file of counts ({e})", UNIFORM_HINT) from None
    if isinstance(doc, dict):
        lists = [v for v in doc.values() if isinstance(v, list)]
        doc = doc.get("tokens_per_expert", lists[0] if len(lists) == 1 else None)
    if not isinstance(doc, list):
        raise _bad(
            ExpertLoad(where=where),
            f"{text}: holds no list of counts",
            'write a list ([900, 100, ...]) or {"tokens_per_expert": [...]}',
        )
    return _counts(doc, f"{where} {text}")


def _counts(items: list, where: str) -> ExpertLoad:
    try:
        if any(isinstance(x, bool) for x in items):
            raise TypeError("a boolean")
        counts = tuple(float(x) for x in items)
    except (TypeError, ValueError):
        raise _bad(ExpertLoad(where=where), f"counts {items!r} are not all numbers", UNIFORM_HINT) from None
    if any(not math.isfinite(c) or c < 0 for c in counts):
        raise _bad(ExpertLoad(where=where), "a count is negative or not finite", "tokens per expert are >= 0")
    if not sum(counts):
        raise _bad(ExpertLoad(where=where), "every count is zero: no token was routed", UNIFORM_HINT)
    return ExpertLoad(counts=counts, where=where)


def _bad(load: ExpertLoad, message: str, hint: str):
    return as_error([error("bad-argument", message, hint, path=load.where)])
