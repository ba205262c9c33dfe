"""Which path prefixes a rule set cannot tell apart: a lazy DFA over the plan's regexes.

Resolution of a big state is mostly repetition: 100 layers, 64 experts, Adam's mu and nu
mirroring the params. Two subtrees with the same structure decide the same specs when the
rules cannot distinguish their path prefixes: after reading ``blocks/3`` and ``blocks/57`` every
rule's automaton is in the same state, so every suffix matches the same rules. This module
builds that automaton (a Thompson NFA per rule, run as a lazily built DFA whose states are
sets of NFA states) so the resolver can decide each distinct subtree once.

Only an equivalence test: the rule hits themselves still come from RE2 (``RuleSet``), and the
resolver checks the automaton's accepting rules against RE2's on every path it decides. A
regex feature this module does not model (anchors, flags, lookaround, POSIX classes, ...)
makes ``Automaton.build`` return None and resolution goes leaf by leaf.

Classes (``[a-z]``, ``\\d``, ``.``) are tested with RE2 itself, one character at a time, so
their meaning is RE2's; the structure comes from Python's regex parser, used only on
patterns whose structure both engines read alike (the cases that differ are refused).
"""

from __future__ import annotations

import re
import re._constants as _c  # Python's own regex parser (3.11+), for the structure only
import re._parser as _p
from collections.abc import Sequence

import re2

MAX_NFA_STATES = 50_000  # larger rule sets resolve leaf by leaf
MAX_DFA_STATES = 20_000  # a blow-up past this gives up (Unsupported) mid-walk
MAX_RULES = 2_000
ANY = r"[\x{0}-\x{10ffff}]"  # every character, newlines too (RE2's '.' leaves them out)

# Text where RE2 and Python's parser disagree on structure, or that we do not model.
_REFUSE = re.compile(r"\[:|\{,|\\[QEpPzCAbBZxNuUG0-9]|\(\?(?!:|P<)")
_CATEGORIES = {
    _c.CATEGORY_DIGIT: r"\d",
    _c.CATEGORY_NOT_DIGIT: r"\D",
    _c.CATEGORY_SPACE: r"\s",
    _c.CATEGORY_NOT_SPACE: r"\S",
    _c.CATEGORY_WORD: r"\w",
    _c.CATEGORY_NOT_WORD: r"\W",
}


class Unsupported(Exception):
    """A pattern (or a blow-up) this automaton does not handle: resolve leaf by leaf."""


def _char(c: int) -> str:
    return f"\\x{{{c:x}}}"


def _class_source(op, av) -> str:
    """RE2 source for one single-character item of Python's parse."""
    if op is _c.LITERAL:
        return _char(av)
    if op is _c.NOT_LITERAL:
        return f"[^{_char(av)}]"
    if op is _c.ANY:
        return "."
    if op is _c.IN:
        parts = []
        neg = ""
        for iop, iav in av:
            if iop is _c.NEGATE:
                neg = "^"
            elif iop is _c.LITERAL:
                parts.append(_char(iav))
            elif iop is _c.RANGE:
                parts.append(f"{_char(iav[0])}-{_char(iav[1])}")
            elif iop is _c.CATEGORY and iav in _CATEGORIES:
                parts.append(_CATEGORIES[iav])
            else:
                raise Unsupported(f"class item {iop}")
        if not parts:
            raise Unsupported("empty class")
        return f"[{neg}{''.join(parts)}]"
    raise Unsupported(str(op))


def _parse(pattern: str):
    """Python's parse of ``pattern``, where both engines read its structure alike."""
    if _REFUSE.search(pattern):
        raise Unsupported("refused")
    parsed = _p.parse(pattern)
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise Unsupported("flags")
    return list(parsed)


def _holds_any(nfa: _NFA, cls: int, chars: set[str]) -> bool:
    """Whether class ``cls`` holds one of ``chars``."""
    lit = nfa.lits.get(cls)
    if lit is not None:
        return lit in chars
    rx = re2.compile(nfa.classes[cls])
    return any(rx.fullmatch(c) is not None for c in chars)


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int]]] = []  # (class id, target)
        self.accept: dict[int, int] = {}  # state -> rule index
        self.classes: list[str] = []
        self.class_ids: dict[str, int] = {}
        self.lits: dict[int, str] = {}  # class id -> its one character, for a literal

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise Unsupported("too many states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def cls(self, source: str, lit: str | None = None) -> int:
        hit = self.class_ids.get(source)
        if hit is None:
            hit = self.class_ids[source] = len(self.classes)
            self.classes.append(source)
            if lit is not None:
                self.lits[hit] = lit
        return hit

    def seq(self, items, cur: int) -> int:
        """Append ``items`` (Python's parse) from state ``cur``; return the end state."""
        for op, av in items:
            if op in (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN):
                nxt = self.new()
                lit = chr(av) if op is _c.LITERAL else None
                self.edges[cur].append((self.cls(_class_source(op, av), lit), nxt))
                cur = nxt
            elif op is _c.SUBPATTERN:
                _group, add_flags, del_flags, sub = av
                if add_flags or del_flags:
                    raise Unsupported("flags")
                cur = self.seq(sub, cur)
            elif op is _c.BRANCH:
                end = self.new()
                for alt in av[1]:
                    start = self.new()
                    self.eps[cur].append(start)
                    self.eps[self.seq(alt, start)].append(end)
                cur = end
            elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):  # greediness does not change a full match
                lo, hi, sub = av
                for _ in range(lo):
                    cur = self.seq(sub, cur)
                if hi is _c.MAXREPEAT:
                    entry = self.new()
                    self.eps[cur].append(entry)
                    self.eps[self.seq(sub, entry)].append(entry)
                    cur = entry
                else:
                    end = self.new()
                    for _ in range(hi - lo):
                        self.eps[cur].append(end)
                        cur = self.seq(sub, cur)
                    self.eps[cur].append(end)
                    cur = end
            else:
                raise Unsupported(str(op))
        return cur


class Automaton:
    """The rules' combined automaton; states are small ints, built on demand.

    ``step(state, text)`` reads ``text`` (memoised per whole string); ``hits(state)`` are the
    indices of the rules that fully match what was read. Two prefixes that reach the same
    state match exactly the same rules after any suffix.
    """

    def __init__(self, nfa: _NFA, starts: list[int]):
        self._nfa = nfa
        self._starts = starts
        self._sets: list[frozenset[int]] = []
        self._ids: dict[frozenset[int], int] = {}
        self._trans: dict[tuple[int, str], int] = {}
        self._text: dict[tuple[int, str], int] = {}
        self._hits: list[tuple[int, ...]] = []
        self._member: dict[tuple[int, str], bool] = {}
        self._live: dict[tuple[int, str], str] = {}
        self._lits = [nfa.lits.get(i) for i in range(len(nfa.classes))]
        self._compiled = [re2.compile(src) if self._lits[i] is None else None for i, src in enumerate(nfa.classes)]
        self.dead = self._intern(frozenset())
        self.start = self._intern(self._closure(starts))

    @staticmethod
    def build(patterns: Sequence[str]) -> Automaton | None:
        """The automaton for ``patterns`` (first index wins), or None where one is refused."""
        if len(patterns) > MAX_RULES:
            return None
        nfa = _NFA()
        starts = []
        try:
            for i, pattern in enumerate(patterns):
                start = nfa.new()
                starts.append(start)
                nfa.accept[nfa.seq(_parse(pattern), start)] = i
            return Automaton(nfa, starts)
        except (Unsupported, re.error, RecursionError, OverflowError, re2.error):
            return None

    @staticmethod
    def near(patterns: Sequence[str], alphabets: Sequence[str]) -> Automaton | None:
        """An automaton for near misses: accepting index ``2 * i`` where part of the text matches
        pattern ``i`` (RE2's ``search``), ``2 * i + 1`` where one edit to the text (a character
        left out, replaced by one of ``alphabets[i]``, or one of them added) makes it a full
        match. None where a pattern is one ``build`` refuses."""
        if len(patterns) > MAX_RULES:
            return None
        nfa = _NFA()
        starts = []
        try:
            anyc = nfa.cls(ANY)
            for i, (pattern, alphabet) in enumerate(zip(patterns, alphabets, strict=True)):
                parsed = _parse(pattern)
                # Search: anything, the pattern, anything.
                head, body, tail = nfa.new(), nfa.new(), nfa.new()
                nfa.edges[head].append((anyc, head))
                nfa.eps[head].append(body)
                nfa.eps[nfa.seq(parsed, body)].append(tail)
                nfa.edges[tail].append((anyc, tail))
                nfa.accept[tail] = 2 * i
                starts.append(head)
                # One edit: the pattern's states twice, the copy reached by the one edit allowed.
                lo = len(nfa.eps)
                start = nfa.new()
                end = nfa.seq(parsed, start)
                off = len(nfa.eps) - lo
                for _ in range(off):
                    nfa.new()
                allowed = set(alphabet)
                for s in range(lo, lo + off):
                    nfa.eps[s + off] = [t + off for t in nfa.eps[s]]
                    nfa.edges[s + off] = [(c, t + off) for c, t in nfa.edges[s]]
                    edited = [(anyc, s + off)]  # a character of the text left out
                    for c, t in nfa.edges[s]:
                        if _holds_any(nfa, c, allowed):
                            edited.append((anyc, t + off))  # replaced by one the pattern reads here
                            nfa.eps[s].append(t + off)  # one the pattern reads here, added
                    nfa.edges[s] += edited
                nfa.accept[end + off] = 2 * i + 1
                starts.append(start)
            return Automaton(nfa, starts)
        except (Unsupported, re.error, RecursionError, OverflowError, re2.error):
            return None

    def reverse(self) -> Automaton:
        """The automaton of the reversed texts (every edge turned around): which suffixes can
        still end a match. For a one-pattern automaton."""
        nfa = self._nfa
        rev = _NFA()
        rev.classes, rev.class_ids, rev.lits = nfa.classes, nfa.class_ids, nfa.lits
        rev.eps = [[] for _ in nfa.eps]
        rev.edges = [[] for _ in nfa.edges]
        for s, targets in enumerate(nfa.eps):
            for t in targets:
                rev.eps[t].append(s)
        for s, edges in enumerate(nfa.edges):
            for c, t in edges:
                rev.edges[t].append((c, s))
        rev.accept = {s: 0 for s in self._starts}
        return Automaton(rev, list(nfa.accept))

    def _closure(self, states) -> frozenset[int]:
        """The epsilon closure, kept to the states that matter for what follows (those that
        read a character, or accept): prefixes that differ only in pass-through states are
        the same DFA state."""
        nfa = self._nfa
        eps, edges, accept = nfa.eps, nfa.edges, nfa.accept
        seen = set(states)
        todo = list(states)
        while todo:
            for t in eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(s for s in seen if edges[s] or s in accept)

    def _intern(self, states: frozenset[int]) -> int:
        hit = self._ids.get(states)
        if hit is None:
            if len(self._sets) >= MAX_DFA_STATES:
                raise Unsupported("automaton too large")
            hit = self._ids[states] = len(self._sets)
            self._sets.append(states)
            accept = self._nfa.accept
            self._hits.append(tuple(sorted({accept[s] for s in states if s in accept})))
        return hit

    def _in(self, cls: int, ch: str) -> bool:
        lit = self._lits[cls]
        if lit is not None:
            return lit == ch
        key = (cls, ch)
        hit = self._member.get(key)
        if hit is None:
            hit = self._member[key] = self._compiled[cls].fullmatch(ch) is not None  # type: ignore[union-attr]
        return hit

    def live(self, state: int, alphabet: str) -> str:
        """The characters of ``alphabet`` (in its order) after which ``state`` is not dead."""
        key = (state, alphabet)
        hit = self._live.get(key)
        if hit is None:
            hit = self._live[key] = "".join(c for c in alphabet if self._step_char(state, c) != self.dead)
        return hit

    def _step_char(self, state: int, ch: str) -> int:
        key = (state, ch)
        hit = self._trans.get(key)
        if hit is None:
            edges = self._nfa.edges
            nxt = [t for s in self._sets[state] for cls, t in edges[s] if self._in(cls, ch)]
            hit = self._trans[key] = self._intern(self._closure(nxt)) if nxt else self.dead
        return hit

    def step(self, state: int, text: str) -> int:
        if state == self.dead:
            return state
        key = (state, text)
        hit = self._text.get(key)
        if hit is None:
            hit = state
            for ch in text:
                if hit == self.dead:
                    break
                hit = self._step_char(hit, ch)
            self._text[key] = hit
        return hit

    def hits(self, state: int) -> tuple[int, ...]:
        return self._hits[state]
