"""Matching param paths against a plan's regexes: RE2 full-match sets, compiled once."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import re2

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
        self._set = None
        if rules:
            opts = re2.Options()
            opts.log_errors = False
            s = re2.Set.FullMatchSet(opts)
            for r in rules:
                s.Add(r.pattern)
            s.Compile()
            self._set = s

    def key(self, path: str) -> str:
        """What a match can depend on: the path, with digits zeroed when every rule is digit-blind."""
        return path.translate(_DIGITS) if self.blind else path

    def matches(self, path: str) -> list[int]:
        """Indices of every rule whose regex full-matches ``path`` (empty: none)."""
        return (self._set.Match(path) or []) if self._set is not None else []
