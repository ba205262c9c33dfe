"""Why a path got its spec: every rule tried in order, which matched and decided, the annotation
and default considered, and near misses (a rule that would match after a small change).

Pure and jax-free. The decision itself comes from :func:`shardplan.core.resolve.resolve_leaves`
(the same code ``check`` runs), so what ``explain`` says decided is what ``check`` applies; this
module adds the trail that led there.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache

import re2

from shardplan.core.leaves import Decision, Leaf
from shardplan.core.plan import Plan, Rule, RuleKind

_EDIT_CHARS = "_/-.0123456789"
MAX_EDIT_PATH = 300  # one-character edits are tried on paths up to this long (bounded work)

_DIGITS = str.maketrans("0123456789", "0000000000")


@dataclass(frozen=True)
class Trial:
    """One rule tried against the path."""

    rule: Rule
    matched: bool
    decided: bool
    near: str = ""  # how a small change would make it match, when it does not


@dataclass(frozen=True)
class Explanation:
    path: str
    role: str  # "param", "state", "opt"
    trials: tuple[Trial, ...]
    annotation: tuple | None  # the leaf's logical names
    axis_rules: tuple[tuple[str, str], ...]  # (logical name, what it maps to) for its names
    default: str | None  # the plan's default spec, if any
    decision: Decision

    @property
    def deciding(self) -> Trial | None:
        return next((t for t in self.trials if t.decided), None)


@lru_cache(maxsize=4096)
def _regex(pattern: str):
    return re2.compile(pattern)


def _full(pattern: str, text: str) -> bool:
    return _regex(pattern).fullmatch(text) is not None


def near_miss(pattern: str, path: str) -> str:
    """How ``pattern`` could match ``path`` after a small change, or ''."""
    rx = _regex(pattern)
    if rx.fullmatch(path):
        return ""
    parts = path.split("/")
    for k in range(1, len(parts)):
        tail = "/".join(parts[k:])
        if rx.fullmatch(tail):
            prefix = "/".join(parts[:k]) + "/"
            return f"it matches '{tail}', but the path starts with '{prefix}': write '.*/{pattern}'"
    if rx.search(path):
        return (
            f"it matches part of the path, but a rule must match all of it (regexes are full-match): "
            f"write '.*{pattern}.*' or spell out the rest"
        )
    if len(path) > MAX_EDIT_PATH:
        return ""
    alphabet = sorted(set(_EDIT_CHARS) | {c for c in pattern if c.isalnum()})
    for i in range(len(path) + 1):
        for kind, edited in _edits(path, i, alphabet):
            if rx.fullmatch(edited):
                return f"it would match '{edited}', the path with {kind}: check the rule's spelling"
    return ""


def _edits(path: str, i: int, alphabet: list[str]):
    if i < len(path):
        yield f"its '{path[i]}' at column {i + 1} left out", path[:i] + path[i + 1 :]
        for c in alphabet:
            if c != path[i]:
                yield f"'{c}' for its '{path[i]}' at column {i + 1}", path[:i] + c + path[i + 1 :]
    for c in alphabet:
        yield f"'{c}' added at column {i + 1}", path[:i] + c + path[i:]


def nearest(pattern: str, paths: list[str]) -> str:
    """A near miss of ``pattern`` against some path of a model (for a rule that matches none):
    the first path it matches in part or at its end, else the one-character miss of the path
    closest to the pattern's text; ''."""
    rx = _regex(pattern)
    for p in paths:
        if rx.search(p):
            return f"{p}: {near_miss(pattern, p)}"
    literal = "".join(c for c in pattern if c.isalnum() or c in "/_")
    # Paths that differ only in digits (layer and expert numbers) are one candidate: the text
    # comparison is the slow part, and 5,000 numbered copies of one path add nothing to it.
    distinct: dict[str, str] = {}
    for p in paths:
        distinct.setdefault(p.translate(_DIGITS), p)
    for p in difflib.get_close_matches(literal, list(distinct.values()), n=2, cutoff=0.5):
        hint = near_miss(pattern, p)
        if hint:
            return f"{p}: {hint}"
    return ""


def explain(plan: Plan, leaf: Leaf, decision: Decision) -> Explanation:
    """The trail to ``decision`` (the resolver's, for this leaf)."""
    role = decision.role
    kind: RuleKind = "opt" if role == "opt" else "param"
    rules = plan.rule_sets[kind].rules
    decided_at = decision.origin if decision.how == "rule" else None
    trials = []
    won = False
    for r in rules:
        matched = _full(r.pattern, leaf.path)
        decided = matched and not won and r.origin == decided_at
        won = won or decided
        trials.append(Trial(r, matched, decided, "" if matched else near_miss(r.pattern, leaf.path)))
    axis_map = {a.logical: a for a in plan.axes}
    axes = tuple(
        (name, " x ".join(axis_map[name].axes) or "_") if name in axis_map else (name, "no axis rule")
        for name in (leaf.names or ())
        if name is not None
    )
    default = str(plan.default) if plan.default is not None else None
    return Explanation(leaf.path, role, tuple(trials), leaf.names, axes, default, decision)
