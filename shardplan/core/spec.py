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

    def __hash__(self) -> int:  # cached: specs key the per-(shape, spec) memo of every leaf
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(self.dims)
        return h

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    @functools.cached_property
    def is_replicated(self) -> bool:
        return not self.axes

    @functools.cached_property
    def entries(self) -> tuple[Entry, ...]:
        """The ``PartitionSpec(*entries)`` arguments, trailing whole dims dropped."""
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
        if self.is_replicated:
            return "replicated"
        parts = ["_" if not d else d[0] if len(d) == 1 else "(" + ", ".join(d) + ")" for d in self.dims]
        return "(" + ", ".join(parts) + ")"


REPLICATED = Spec(())
