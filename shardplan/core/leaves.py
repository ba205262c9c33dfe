"""The records resolution works on: leaves in, decisions out. Pure data, jax-free."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Union, overload

from shardplan.core.spec import Spec
from shardplan.errors import Diagnostic

Role = Literal["param", "state", "opt", "input"]
How = Literal["rule", "axes", "default", "mirror", "scalar", "replicated", "batch", "state"]

# Variable kinds that are trained (and get optimizer state). Any other kind a model holds
# (``batch_stat``, ``rng_key``, ``rng_count``, ``cache``, a user's Variable subclass) is
# model *state*: placed by the plan, never counted as params, never given optimizer state.
PARAM_KINDS = (None, "param", "opt_state")


# Leaf and Decision are NamedTuples, not frozen dataclasses: a 100k-leaf state makes 100k
# of each, and a frozen dataclass's __init__ costs several times a tuple's. Both immutable.
class Leaf(NamedTuple):
    """What resolution needs of an array: its path, shape, dtype and Flax annotation."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    names: tuple | None = None  # nnx.with_partitioning logical names, if any
    kind: str | None = None  # the NNX Variable kind (snake_case type name); None: a bare array

    @property
    def is_param(self) -> bool:
        return self.kind in PARAM_KINDS

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class Decision(NamedTuple):
    """The spec decided for one leaf and why."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    spec: Spec
    how: How
    origin: str  # 'file:line' of the deciding rule, or the mirrored param's path
    role: Role
    shard_shape: tuple[int, ...]

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class Node(NamedTuple):
    """A subtree of a state, shared: subtrees equal but for their paths (same keys, same leaf
    shapes, dtypes, kinds and annotations) are one object, so a 100-layer model is one layer
    and a list of 100 references. Leaves in it are ``Leaf`` records with an empty path; a
    leaf's path is the keys from the root joined with '/'."""

    keys: tuple[str, ...]
    children: tuple[Union[Node, Leaf], ...]  # noqa: UP007 (a forward reference in a NamedTuple)
    leaves: int  # how many leaves under it


def share(leaves: Sequence[Leaf]) -> Node | None:
    """Leaves (in order, with paths) as a shared ``Node``: equal subtrees become one object.

    None where the paths do not form a tree in that order (a duplicate path, a path that is
    also another's prefix, a subtree whose leaves are not contiguous): resolve leaf by leaf.
    """
    root: dict = {}
    records: dict[tuple, Leaf] = {}
    for leaf in leaves:
        parts = leaf.path.split("/")
        node = root
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif type(nxt) is not dict or next(reversed(node)) != part:
                return None
            node = nxt
        last = parts[-1]
        if last in node:
            return None
        sig = leaf[1:]
        rec = records.get(sig)
        if rec is None:
            rec = records[sig] = Leaf("", *sig)
        node[last] = rec
    made: dict[tuple, Node] = {}

    def cons(d: dict) -> Node:
        kids = tuple(cons(v) if type(v) is dict else v for v in d.values())
        key = (tuple(d), tuple(map(id, kids)))
        hit = made.get(key)
        if hit is None:
            count = sum(k.leaves if type(k) is Node else 1 for k in kids)
            hit = made[key] = Node(key[0], kids, count)
        return hit

    return cons(root)


def _walk(tree: Node | Leaf) -> list[tuple[str, Leaf]]:
    """(path, leaf record) for every leaf of a shared tree, in order."""
    out: list[tuple[str, Leaf]] = []

    def walk(node: Node | Leaf, prefix: str) -> None:
        if type(node) is Leaf:
            out.append((prefix, node))
            return
        assert type(node) is Node
        sep = "/" if prefix else ""
        for k, child in zip(node.keys, node.children, strict=True):
            walk(child, f"{prefix}{sep}{k}")

    walk(tree, "")
    return out


def paths(tree: Node | Leaf) -> list[str]:
    """Every leaf's path, in order."""
    return [path for path, _ in _walk(tree)]


def leaves_of(tree: Node | Leaf) -> list[Leaf]:
    """The leaves of a shared tree as records with their paths, in order."""
    return [leaf._replace(path=path) for path, leaf in _walk(tree)]


class Decisions(Sequence[Decision]):
    """Decisions in leaf order, made on first use from shared records.

    A resolution of a big state decides each distinct subtree once: ``records`` holds, per
    leaf, its decision with an empty path (the same object for every leaf that decided
    alike), which is all that specs and byte counts need. The per-leaf decisions, paths
    included, are built the first time they are read.
    """

    def __init__(self, records: list[Decision], paths: Callable[[], list[str]], cuts: dict[int, int]):
        self.records = records
        self._paths = paths
        self._cuts = cuts  # id(record) -> for a mirror, how many of the path's last keys its origin is
        self._made: tuple[Decision, ...] | None = None

    def _all(self) -> tuple[Decision, ...]:
        if self._made is None:
            cuts = self._cuts
            out = []
            for path, r in zip(self._paths(), self.records, strict=True):
                keys = cuts.get(id(r)) if cuts else None  # a mirror: its param's path, the last keys
                origin = r.origin if keys is None else "/".join(path.split("/")[-keys:])
                out.append(Decision(path, r.shape, r.dtype, r.itemsize, r.spec, r.how, origin, r.role, r.shard_shape))
            self._made = tuple(out)
        return self._made

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> Decision: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Decision]: ...
    def __getitem__(self, i):
        if isinstance(i, slice) and self._made is None:
            whole = self._paths
            return Decisions(self.records[i], lambda: whole()[i], self._cuts)
        return self._all()[i]

    def __iter__(self) -> Iterator[Decision]:
        return iter(self._all())

    def __add__(self, other: Sequence[Decision]) -> tuple[Decision, ...]:
        return self._all() + tuple(other)

    def __radd__(self, other: Sequence[Decision]) -> tuple[Decision, ...]:
        return tuple(other) + self._all()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Decisions, tuple)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"Decisions({len(self)} leaves, {len({id(r) for r in self.records})} distinct)"


def records(decisions: Sequence[Decision]) -> Sequence[Decision]:
    """What per-leaf figures need (specs, shapes, bytes, roles), without building paths."""
    return decisions.records if isinstance(decisions, Decisions) else decisions


@dataclass(frozen=True)
class Resolution:
    """The result of resolving leaves: per-leaf decisions (in leaf order) and warnings."""

    mesh: dict[str, int]
    decisions: Sequence[Decision]  # a tuple, or Decisions built on first read
    warnings: tuple[Diagnostic, ...]

    def bytes_per_device(self, role: Role | None = None) -> int:
        return sum(d.bytes_per_device for d in records(self.decisions) if role is None or d.role == role)

    def by_path(self) -> dict[str, Decision]:
        return {d.path: d for d in self.decisions}
