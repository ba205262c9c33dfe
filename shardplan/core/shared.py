"""Resolution of a shared state: each distinct subtree decided once, leaves expanded on demand.

The same decisions as :func:`shardplan.core.resolve.resolve_leaves`, found with less work: a
subtree is decided once per (structure, automaton state), where the automaton state after its
path says which rules its leaves can match (``shardplan.core.automaton``). Optimizer state
mirrors its params by walking both trees together: an alignment is the param subtree that the
path's suffix after a cut has reached, so Adam's mu and nu reuse the params' decisions.

Every decision for a representative leaf is made by the leaf-by-leaf resolver itself, and the
automaton's accepting rules are checked against RE2's on each one. Whatever this pass does not
handle the same way (an error, a per-leaf warning that lists leaves, a regex the automaton
refuses) sends the whole resolution leaf by leaf, so the answer never depends on which path ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from shardplan.core.automaton import Automaton, Unsupported
from shardplan.core.explain import record
from shardplan.core.leaves import Decision, Decisions, Leaf, Node, Resolution, leaves_of, paths
from shardplan.core.plan import Plan
from shardplan.core.resolve import (
    DEFAULT_REPLICATED_THRESHOLD,
    SAMPLE,
    _check_mesh_names,
    _prefix_hits,
    _raise_or_warnings,
    _Resolver,
    act_usage,
    resolve_leaves,
)
from shardplan.core.spec import REPLICATED

Tree = Node | Leaf


class _Fallback(Exception):
    """Resolve leaf by leaf instead."""


class _Sub:
    """A decided param subtree: its leaves' records in order and its children by key."""

    __slots__ = ("kids", "flat")

    def __init__(self, kids: dict[str, _Sub | Decision], flat: list[Decision]):
        self.kids = kids
        self.flat = flat


def _automaton(plan: Plan, kind: str) -> Automaton:
    auto = plan.rule_sets[kind].automaton()  # type: ignore[index]
    if auto is None:
        raise _Fallback
    return auto


class _Walk:
    def __init__(self, r: _Resolver, threshold: int):
        self.r = r
        self.threshold = threshold
        plan = r.plan
        self.pauto = _automaton(plan, "param")
        self.oauto = _automaton(plan, "opt")
        self.pmemo: dict[tuple, _Sub | Decision] = {}
        self.omemo: dict[tuple, list[Decision] | Decision] = {}
        self.keys: dict[int, tuple[str, str]] = {}  # id(record) -> (rule kind, match key) for usage counts
        self.cuts: dict[int, int] = {}  # id(mirror record) -> path components before the mirrored param
        self.leaves: list[Leaf] = []  # one representative per param record (for axis usage)
        self.rules = {x.origin: x for x in plan.params}
        self.passes = False  # a per-leaf warning may apply: run those passes over all leaves

    def _hits(self, kind: str, auto: Automaton, state: int, path: str, rec: Decision) -> None:
        """The automaton must agree with RE2 on a path it decided; where it does not, it is not
        trusted for this plan at all."""
        ruleset = self.r.plan.rule_sets[kind]  # type: ignore[index]
        if not ruleset.rules:
            return
        hits = self.r.memo[kind][ruleset.key(path)][1]
        if tuple(sorted(hits)) != auto.hits(state):
            raise _Fallback
        self.keys[id(rec)] = (kind, ruleset.key(path))

    # -- params -------------------------------------------------------------------------
    def params(self, node: Tree, state: int, path: str) -> _Sub | Decision:
        key = (id(node), state)
        hit = self.pmemo.get(key)
        if hit is not None:
            return hit
        r = self.r
        if type(node) is Leaf:
            leaf = node._replace(path=path)
            d = r.param(leaf) if leaf.is_param else r.state(leaf)
            if d is None or r.diags or r.grouped:
                raise _Fallback
            rec = d._replace(path="")
            self._hits("param", self.pauto, state, path, rec)
            self.leaves.append(leaf)
            if self._warns(rec):
                self.passes = True
            self.pmemo[key] = rec
            return rec
        assert type(node) is Node
        kids: dict[str, _Sub | Decision] = {}
        flat: list[Decision] = []
        auto = self.pauto
        for k, child in zip(node.keys, node.children, strict=True):
            if "/" in k or k in kids:  # a path that does not split back into these keys
                raise _Fallback
            # Joined as paths() joins them: no '/' after an empty path (so a leading empty key
            # adds nothing), and the automaton reads exactly that text.
            sub = self.params(child, auto.step(state, f"/{k}" if path else k), f"{path}/{k}" if path else k)
            kids[k] = sub
            if type(sub) is _Sub:
                flat.extend(sub.flat)
            else:
                flat.append(sub)  # type: ignore[arg-type]
        out = self.pmemo[key] = _Sub(kids, flat)
        return out

    def _warns(self, d: Decision) -> bool:
        """Could a per-leaf warning pass report this record (large replicated; a rule with fewer
        dims than a stacked array that splits its dim 0)?"""
        if d.role != "input" and d.shard_shape == d.shape and d.nbytes > self.threshold:
            return True
        if d.role == "param" and d.how == "rule" and d.shape and d.shard_shape[0] != d.shape[0]:
            rule = self.rules.get(d.origin)  # stacked_splits' own test, less the grouping
            return rule is None or (not rule.spec.open and len(rule.spec.dims) < len(d.shape))
        return False

    # -- optimizer state ----------------------------------------------------------------
    def opt(self, node: Tree, state: int, align: tuple, root: _Sub, path: str) -> list[Decision] | Decision:
        key = (id(node), state, tuple((id(x), j) for x, j in align))
        hit = self.omemo.get(key)
        if hit is not None:
            return hit
        if type(node) is Leaf:
            leaf = node._replace(path=path)
            out = self._opt_leaf(leaf, state, align)
            self.omemo[key] = out
            return out
        assert type(node) is Node
        flat: list[Decision] = []
        auto = self.oauto
        for k, child in zip(node.keys, node.children, strict=True):
            if "/" in k:
                raise _Fallback
            # An alignment: a param subtree reached by a suffix of the path (one starting after a
            # '/'), and how many keys that suffix has so far: relative, so a memoised subtree is
            # right wherever it sits. The longest suffix comes first.
            sub_align = tuple((x.kids[k], n + 1) for x, n in align if type(x) is _Sub and k in x.kids)
            if path and k in root.kids:
                sub_align += ((root.kids[k], 1),)
            sub = self.opt(
                child,
                auto.step(state, f"/{k}" if path else k),
                sub_align,
                root,
                f"{path}/{k}" if path else k,
            )
            if type(sub) is list:
                flat.extend(sub)
            else:
                flat.append(sub)  # type: ignore[arg-type]
        self.omemo[key] = flat
        return flat

    def _opt_leaf(self, leaf: Leaf, state: int, align: tuple) -> Decision:
        r = self.r
        mirror = next(((x, j) for x, j in align if type(x) is Decision and x.shape == leaf.shape), None)
        rule = r.match("opt", leaf.path)
        if rule is not None:
            d = r.decide(leaf, rule.spec, "rule", rule.origin, "opt", rule, f"the rule at {rule.origin}")
        elif mirror is not None:
            m = mirror[0]
            d = Decision(leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, m.spec, "mirror", "", "opt", m.shard_shape)
        elif not leaf.shape:
            d = Decision(leaf.path, (), leaf.dtype, leaf.itemsize, REPLICATED, "scalar", "scalar", "opt", ())
        else:
            d = Decision(
                leaf.path, leaf.shape, leaf.dtype, leaf.itemsize, REPLICATED, "replicated", "mirrors no param", "opt",
                leaf.shape,
            )  # fmt: skip
        if r.diags or r.grouped:
            raise _Fallback
        rec = d._replace(path="")
        self._hits("opt", self.oauto, state, leaf.path, rec)
        if rec.how == "mirror":  # the mirrored param's path: the leaf path's last n keys
            self.cuts[id(rec)] = mirror[1]  # type: ignore[index]
        if self._warns(rec) or (
            rec.how in ("rule", "replicated")
            and rec.shape
            and mirror is not None
            and rec.bytes_per_device > mirror[0].bytes_per_device
        ):
            self.passes = True
        return rec


def first_keys(tree: Tree, key: Callable[[str], str], limit: int) -> list[str]:
    """The path of each of the first ``limit`` distinct match keys, in leaf order: what the
    leaf-by-leaf resolver's memo holds. A subtree met again under an equal key prefix adds no
    key (``key`` only zeroes digits, or is the path itself), so it is not walked again."""
    out: dict[str, str] = {}
    walked: set[tuple[int, str]] = set()

    def walk(node: Tree, prefix: str) -> None:
        if len(out) >= limit:
            return
        if type(node) is Leaf:
            out.setdefault(key(prefix), prefix)
            return
        assert type(node) is Node
        mark = (id(node), key(prefix))
        if mark in walked:
            return
        walked.add(mark)
        sep = "/" if prefix else ""
        for k, child in zip(node.keys, node.children, strict=True):
            walk(child, f"{prefix}{sep}{k}")

    walk(tree, "")
    return list(out.values())


def tree_hits(auto: Automaton, tree: Tree) -> dict[int, str]:
    """``explain.first_hits`` on a shared tree: for each accepting index of the near automaton,
    the first leaf path (in leaf order) that reaches it, each (subtree, state) walked once (again
    only from a shorter path: a long path gets no one-edit hint)."""
    out: dict[int, str] = {}
    walked: dict[tuple[int, int], int] = {}  # (subtree, state) -> the shortest path it was walked from

    def walk(node: Tree, state: int, path: str) -> None:
        if type(node) is Leaf:
            record(out, auto.hits(state), path)
            return
        assert type(node) is Node
        mark = (id(node), state)
        if walked.get(mark, len(path) + 1) <= len(path):
            return
        walked[mark] = len(path)
        for k, child in zip(node.keys, node.children, strict=True):
            walk(child, auto.step(state, f"/{k}" if path else k), f"{path}/{k}" if path else k)

    walk(tree, auto.start, "")
    return out


def _module_hits(plan: Plan, tree: Tree) -> set[int]:
    """``_prefix_hits`` on a shared tree: the act rules that some internal node's path matches,
    each (subtree, automaton state) walked once."""
    auto = plan.rule_sets["act"].automaton()
    if auto is None:
        return _prefix_hits(plan, leaves_of(tree))
    hit: set[int] = set(auto.hits(auto.start))  # the root's path '' always counts
    seen: set[tuple[int, int]] = set()

    def walk(node: Tree, state: int, path: str) -> None:
        # A module path is a proper prefix of some leaf's: subtrees without leaves do not count.
        if type(node) is not Node or not node.leaves or (id(node), state) in seen:
            return
        seen.add((id(node), state))
        hit.update(auto.hits(state))
        for k, child in zip(node.keys, node.children, strict=True):
            walk(child, auto.step(state, f"/{k}" if path else k), f"{path}/{k}" if path else k)

    try:
        walk(tree, auto.start, "")
    except (Unsupported, RecursionError):
        return _prefix_hits(plan, leaves_of(tree))
    return hit


def _shadowing(r: _Resolver, kind: str) -> bool:
    """Whether some rule matches a leaf but decides none."""
    matched: set[int] = set()
    decided: set[int] = set()
    for win, hits in r.memo[kind].values():
        matched.update(hits)
        if win >= 0:
            decided.add(win)
    return bool(matched - decided)


def resolve_tree(
    plan: Plan,
    mesh: dict[str, int],
    params: Tree,
    opt_state: Tree | None = None,
    replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
    *,
    report_params: bool = True,
) -> Resolution:
    """:func:`resolve_leaves` for shared trees (``shardplan.runtime.tree.shared``): the same
    decisions and warnings, with ``decisions`` built on first read.

    Raises:
        PlanCheckError: every error found, together (warnings included after them).
    """
    res = _shared(plan, mesh, params, opt_state, replicated_threshold, report_params)
    if res is not None:
        return res
    return resolve_leaves(
        plan,
        mesh,
        leaves_of(params),
        leaves_of(opt_state) if opt_state is not None else (),
        replicated_threshold,
        report_params=report_params,
    )


def _shared(
    plan: Plan, mesh: dict[str, int], params: Tree, opt_state: Tree | None, threshold: int, report_params: bool
) -> Resolution | None:
    """The shared pass, or None where it hands over to the leaf-by-leaf resolver."""
    _check_mesh_names(plan, mesh)
    r = _Resolver(plan, mesh, threshold)
    try:
        w = _Walk(r, threshold)
        proot = w.params(params, w.pauto.start, "")
        if opt_state is not None and type(proot) is not _Sub:
            raise _Fallback
        pflat: list[Decision] = proot.flat if isinstance(proot, _Sub) else [proot]
        oflat: list[Decision] = []
        if opt_state is not None:
            assert type(proot) is _Sub
            sub = w.opt(opt_state, w.oauto.start, (), proot, "")
            oflat = sub if type(sub) is list else [sub]  # type: ignore[list-item]
    except (_Fallback, Unsupported, RecursionError):
        return None
    if _shadowing(r, "param") or _shadowing(r, "opt"):
        # A shadowed-rule warning says how many leaves a rule matched: count them. (Otherwise
        # usage needs only whether a rule matched or decided anything, which every
        # representative already says.)
        counts = Counter(map(id, pflat))
        counts.update(map(id, oflat))
        for kind in ("param", "opt"):
            for entry in r.seen[kind].values():
                entry[0] = 0
        for rec_id, (kind, key) in w.keys.items():
            r.seen[kind][key][0] += counts.get(rec_id, 0)
    pdec = Decisions(pflat, lambda: paths(params), {})
    odec = Decisions(oflat, (lambda: paths(opt_state)) if opt_state is not None else list, w.cuts)
    if report_params:
        r.usage(
            "param",
            "param",
            lambda: first_keys(params, plan.rule_sets["param"].key, SAMPLE),
            lambda auto: tree_hits(auto, params),
        )
        if plan.acts:
            r.diags += act_usage(plan, _module_hits(plan, params))
        r.axis_usage(w.leaves)
        if w.passes:
            r.stacked_splits(pdec)
    if w.passes:
        r.opt_less_sharded(odec, {d.path: d for d in pdec})
    if (
        oflat and opt_state is not None
    ):  # as leaf by leaf: an empty optimizer state (optax's EmptyState) has no usage to check
        r.usage(
            "opt",
            "optimizer-state leaf",
            lambda: first_keys(opt_state, plan.rule_sets["opt"].key, SAMPLE),
            lambda auto: tree_hits(auto, opt_state),
        )
    if w.passes:
        r.big_replicated(list(pdec if report_params else ()) + list(odec))
    r.flush()
    warnings = _raise_or_warnings(r.diags, plan.warnings)
    if report_params:
        both = pflat + oflat
        whole = (lambda: paths(params) + paths(opt_state)) if opt_state is not None else (lambda: paths(params))
        decisions = Decisions(both, whole, w.cuts)
    else:
        decisions = odec
    return Resolution(dict(mesh), decisions, warnings)
