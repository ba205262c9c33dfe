"""Why a path got its spec: every rule tried in order, which matched and decided, the annotation
and default considered, and near misses (a rule that would match after a small change).

Pure and jax-free. The decision itself comes from :func:`shardplan.core.resolve.resolve_leaves`
(the same code ``check`` runs), so what ``explain`` says decided is what ``check`` applies; this
module adds the trail that led there.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

import re2

from shardplan.core.automaton import Automaton, Unsupported
from shardplan.core.leaves import Decision, Leaf
from shardplan.core.matching import RuleSet
from shardplan.core.plan import Plan, Rule, RuleKind

_EDIT_CHARS = "_/-.0123456789"
MAX_EDIT_PATH = 300  # one-character edits are tried on paths up to this long (bounded work)
NEAR_RULES = 256  # unused rules up to this many get their near misses from one automaton walk

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


def near_miss(pattern: str, path: str, auto: tuple[Automaton, Automaton] | None = None) -> str:
    """How ``pattern`` could match ``path`` after a small change, or ''. ``auto`` (the
    pattern's own automaton and its reverse) narrows the one-character edits tried to those
    that can match."""
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
    alphabet = _alphabet(pattern)
    found = _first_edit(auto, path, alphabet) if auto is not None else None
    if found is None or not rx.fullmatch(found[1]):  # none, or RE2 disagrees: RE2 decides
        found = next((e for i in range(len(path) + 1) for e in _edits(path, i, alphabet) if rx.fullmatch(e[1])), None)
    if found is not None:
        return f"it would match '{found[1]}', the path with {found[0]}: check the rule's spelling"
    return ""


def _alphabet(pattern: str) -> str:
    """The characters a one-character edit may put in: separators, digits, the pattern's own."""
    return "".join(sorted(set(_EDIT_CHARS) | {c for c in pattern if c.isalnum()}))


def _first_edit(autos: tuple[Automaton, Automaton], path: str, alphabet: str) -> tuple[str, str] | None:
    """The first edit in ``_edits``' order whose result the automaton accepts, trying only what
    can match: an edit comes at or before the first character the pattern cannot continue with
    (the prefix before it is unchanged), after the last one the reversed pattern cannot (the
    same for the suffix), and puts in only a character that keeps the pattern alive. A few
    automaton steps instead of thousands of RE2 matches."""
    auto, rev = autos
    dead = auto.dead
    first = 0  # path[first:] can end a match (path[first - 1:] cannot)
    state = rev.start
    for j in range(len(path) - 1, -1, -1):
        state = rev.step(state, path[j])
        if state == rev.dead:
            first = j + 1
            break
    before = [auto.start]  # the state after path[:i], while alive
    for ch in path:
        state = auto.step(before[-1], ch)
        if state == dead:
            break
        before.append(state)

    def accepts(state: int, j: int) -> bool:
        return state != dead and bool(auto.hits(auto.step(state, path[j:])))

    for i in range(max(first - 1, 0), len(before)):
        state = before[i]
        live = auto.live(state, alphabet)
        if i < len(path):
            if accepts(state, i + 1):
                return f"its '{path[i]}' at column {i + 1} left out", path[:i] + path[i + 1 :]
            for c in live:
                if c != path[i] and accepts(auto.step(state, c), i + 1):
                    return f"'{c}' for its '{path[i]}' at column {i + 1}", path[:i] + c + path[i + 1 :]
        for c in live:
            if accepts(auto.step(state, c), i):
                return f"'{c}' added at column {i + 1}", path[:i] + c + path[i:]
    return None


def _edits(path: str, i: int, alphabet: str):
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


def first_hits(auto: Automaton, paths: Iterable[str]) -> dict[int, str]:
    """For each accepting index of the near automaton, the first of ``paths`` that reaches it
    (one-edit indices only on paths ``near_miss`` would edit). Read key by key, as the shared
    resolution walks a tree, so both give the same answer."""
    out: dict[int, str] = {}
    step, hits, start = auto.step, auto.hits, auto.start
    for path in paths:
        state = start
        for j, k in enumerate(path.split("/")):
            state = step(state, f"/{k}" if j else k)
        record(out, hits(state), path)
    return out


def record(out: dict[int, str], hits: tuple[int, ...], path: str) -> None:
    """Note ``path`` as the first for each index in ``hits`` that has none yet."""
    for h in hits:
        if h not in out and (h % 2 == 0 or len(path) <= MAX_EDIT_PATH):
            out[h] = path


def near_misses(
    ruleset: RuleSet, unused: Sequence[int], walk: Callable[[Automaton], dict[int, str]]
) -> dict[int, str] | None:
    """The near miss of each unused rule, by index (absent where none is found): the first path
    (in leaf order) that it matches in part, else the first that one edit would make it match.

    ``walk(auto)`` runs the near automaton (``Automaton.near`` over the unused rules) over every
    path of the model: accepting index -> first path (``first_hits``, or the same on a shared
    tree). The automata are built once per plan. None where the rules are too many or a regex
    is one the automaton does not model: the caller samples paths instead (``nearest``).
    """
    if len(unused) > NEAR_RULES:
        return None
    patterns = [ruleset.rules[i].pattern for i in unused]
    auto = ruleset.cached(("near", tuple(unused)), lambda: Automaton.near(patterns, [_alphabet(p) for p in patterns]))
    if auto is None:
        return None
    try:
        first = walk(auto)
    except (Unsupported, RecursionError):
        return None
    out: dict[int, str] = {}
    for n, (i, pattern) in enumerate(zip(unused, patterns, strict=True)):
        path = first.get(2 * n)
        if path is not None:  # a search match: the hint needs no edits
            out[i] = f"{path}: {near_miss(pattern, path)}"
            continue
        path = first.get(2 * n + 1)
        if path is not None:
            own = ruleset.cached(("one", pattern), partial(_own, pattern))
            hint = near_miss(pattern, path, own)
            if hint:
                out[i] = f"{path}: {hint}"
    return out


def _own(pattern: str) -> tuple[Automaton, Automaton] | None:
    """One pattern's automaton and its reverse (``_first_edit``), or None where refused."""
    auto = Automaton.build([pattern])
    return (auto, auto.reverse()) if auto is not None else None


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
