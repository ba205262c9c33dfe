"""The records resolution works on: leaves in, decisions out. Pure data, jax-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

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


@dataclass(frozen=True)
class Resolution:
    """The result of resolving leaves: per-leaf decisions (in leaf order) and warnings."""

    mesh: dict[str, int]
    decisions: tuple[Decision, ...]
    warnings: tuple[Diagnostic, ...]

    def bytes_per_device(self, role: Role | None = None) -> int:
        return sum(d.bytes_per_device for d in self.decisions if role is None or d.role == role)

    def by_path(self) -> dict[str, Decision]:
        return {d.path: d for d in self.decisions}
