"""Partition specs as data: per array dimension, the mesh axes it is split over."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

# One PartitionSpec entry: None (whole), an axis name, or several axes splitting one dim.
Entry = None | str | tuple[str, ...]
MeshShape = Mapping[str, int]


@dataclass(frozen=True)
class Spec:
    """A partition spec: per array dimension, the mesh axes it is split over (``()`` = whole).

    ``Spec(())`` is fully replicated. Trailing dimensions beyond ``dims`` are whole.
    """

    dims: tuple[tuple[str, ...], ...] = ()
    # ``(head..., ..., tail...)``: ``tail`` names the array's last dims, whatever its rank, and the
    # dims between stay whole. ``for_rank`` turns it into a plain spec for one array.
    tail: tuple[tuple[str, ...], ...] = ()
    open: bool = False

    def __hash__(self) -> int:  # cached: specs key the per-(shape, spec) memo of every leaf
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.dims, self.tail, self.open))
        return h

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims + self.tail for a in d)

    @property
    def named(self) -> int:
        """How many dims the spec names (an open spec fits any rank at least this)."""
        return len(self.dims) + len(self.tail)

    def for_rank(self, rank: int) -> Spec | None:
        """The plain spec of this one for an array of ``rank`` dims (None: too few dims)."""
        if not self.open:
            return self
        if rank < self.named:
            return None
        return Spec(self.dims + ((),) * (rank - self.named) + self.tail)

    @functools.cached_property
    def is_replicated(self) -> bool:
        return not self.axes

    @functools.cached_property
    def entries(self) -> tuple[Entry, ...]:
        """The ``PartitionSpec(*entries)`` arguments, trailing whole dims dropped."""
        assert not self.open, "an open spec (with '...') has entries only for a rank: use for_rank"
        out: list[Entry] = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        while out and out[-1] is None:
            out.pop()
        return tuple(out)

    def split(self, dim: int, mesh: MeshShape) -> int:
        """How many blocks dimension ``dim`` is cut into on ``mesh``."""
        return math.prod(mesh[a] for a in self.dims[dim]) if dim < len(self.dims) else 1

    def shard_shape(self, shape: tuple[int, ...], mesh: MeshShape) -> tuple[int, ...]:
        out = list(shape)
        for i, d in enumerate(self.dims[: len(shape)]):
            out[i] = shape[i] // math.prod(mesh[a] for a in d) if d else shape[i]
        return tuple(out)

    def __str__(self) -> str:
        if self.is_replicated and not self.open:
            return "replicated"

        def show(ds):
            return ["_" if not d else d[0] if len(d) == 1 else "(" + ", ".join(d) + ")" for d in ds]

        parts = show(self.dims) + (["..."] + show(self.tail) if self.open else [])
        return "(" + ", ".join(parts) + ")"


REPLICATED = Spec(())
