"""Matching param paths against a plan's regexes: RE2 full-match sets, compiled once."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import re2

from shardplan.core.automaton import Automaton
from shardplan.errors import as_error, error

_DIGITS = str.maketrans("0123456789", "0000000000")
# Inside a character class, a range whose ends are not both letters (e.g. [!-@]) can hold
# digits without naming one; such a pattern is treated as able to tell digits apart.
_CLASS_RANGE = re.compile(r"\[[^\]]*[^A-Za-z\]]-[^\]]*\]|\[[^\]]*-[^A-Za-z\]][^\]]*\]")


class HasPattern(Protocol):
    @property
    def pattern(self) -> str: ...


R = TypeVar("R", bound=HasPattern)


def digit_blind(pattern: str) -> bool:
    """True if the regex cannot tell one digit from another: it names no digit (outside
    repetition counts like {2,3}) and has no class range that could hold digits. Then every
    path matches exactly as the path with each digit replaced by 0 does, so paths that
    differ only in layer or expert numbers (of equal length) share one match."""
    stripped = re.sub(r"\{\d+(,\d*)?\}", "", pattern)
    return not any(c.isdigit() for c in stripped) and not _CLASS_RANGE.search(stripped)


class RuleSet(Generic[R]):
    """Rules of one kind compiled once into an RE2 full-match set (linear time, first wins)."""

    def __init__(self, rules: Sequence[R]):
        self.rules: tuple[R, ...] = tuple(rules)
        self.blind = all(digit_blind(r.pattern) for r in rules)
        self._automaton: object = _UNBUILT
        self._cache: dict[object, Any] = {}  # what later stages build from the rules alone (see cached)
        # One RE2 set has a memory budget (thousands of rules exceed it: "failed to compile
        # Set"); rules are compiled in chunks, halved until each fits.
        self._sets: list[tuple[int, Any]] = []
        start = 0
        while start < len(self.rules):
            size = min(CHUNK, len(self.rules) - start)
            while True:
                compiled = _compile([r.pattern for r in self.rules[start : start + size]])
                if compiled is not None or size == 1:
                    break
                size = max(size // 2, 1)
            if compiled is None:
                rule = self.rules[start]
                raise as_error(
                    [
                        error(
                            "unsupported-regex",
                            f"regex '{rule.pattern[:80]}' is too large to compile",
                            "simplify the regex or split it into several rules",
                            span=getattr(rule, "pattern_span", None),
                        )
                    ]
                )
            self._sets.append((start, compiled))
            start += size

    def automaton(self) -> Automaton | None:
        """The rules' prefix automaton (``shardplan.core.automaton``), built on first use;
        None where a regex is one it does not model."""
        if self._automaton is _UNBUILT:
            self._automaton = Automaton.build([r.pattern for r in self.rules])
        return self._automaton  # type: ignore[return-value]

    def cached(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()``, once per rule set and ``key``: work that depends only on the rules
        (the near-miss automata of ``shardplan.core.explain``) is done once per plan."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def key(self, path: str) -> str:
        """What a match can depend on: the path, with digits zeroed when every rule is digit-blind."""
        return path.translate(_DIGITS) if self.blind else path

    def matches(self, path: str) -> list[int]:
        """Indices of every rule whose regex full-matches ``path`` (empty: none)."""
        out: list[int] = []
        for offset, compiled in self._sets:
            hits = compiled.Match(path)
            if hits:
                out += [offset + i for i in hits]
        return out


_UNBUILT = object()
CHUNK = 1024  # rules per RE2 set (smaller where a chunk exceeds RE2's memory budget)


def _compile(patterns: list[str]) -> Any:
    opts = re2.Options()
    opts.log_errors = False
    s = re2.Set.FullMatchSet(opts)
    for p in patterns:
        s.Add(p)
    try:
        s.Compile()
    except re2.error:
        return None
    return s
