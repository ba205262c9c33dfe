"""Where every array really lives: a live sharding view, and a check against the plan."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console
from rich.table import Table

from shardplan.core.format import fmt_bytes, fmt_shape, layer_group
from shardplan.errors import Diagnostic, PlanApplyError, error
from shardplan.runtime import specs
from shardplan.runtime.placement import Placement
from shardplan.runtime.tree import path_str


@dataclass(frozen=True)
class LiveLeaf:
    """One live array: its path, global shape, sharding and per-device shard shapes."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Any
    shard_shapes: tuple[tuple[tuple[int, ...], int], ...]  # (shard shape, number of devices)
    array: Any

    @property
    def spec(self) -> str:
        s = self.sharding
        return str(s.spec) if isinstance(s, NamedSharding) else type(s).__name__

    @property
    def bytes_per_device(self) -> int:
        biggest = max((s for s, _ in self.shard_shapes), key=math.prod, default=self.shape)
        return math.prod(biggest) * self.array.dtype.itemsize


def live_leaves(tree: Any) -> list[LiveLeaf]:
    """Every array in a model / optimizer / state / batch, with its real placement."""
    if isinstance(tree, nnx.Module) or (isinstance(tree, nnx.Pytree) and not isinstance(tree, nnx.State)):
        tree = nnx.state(tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = []
    for kp, x in flat:
        if isinstance(x, nnx.Variable):
            x = x.get_value()
        if not isinstance(x, jax.Array):
            continue
        # Every device's shard, this process's and the others' (the shape from the index map:
        # no data is read, so it also holds for arrays spread over several processes).
        shapes = Counter(
            tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, x.shape))
            for idx in x.sharding.devices_indices_map(tuple(x.shape)).values()
        )
        out.append(LiveLeaf(path_str(kp), tuple(x.shape), str(x.dtype), x.sharding, tuple(sorted(shapes.items())), x))
    return out


def mismatches(placement: Placement, model: Any, optimizer: Any = None, batch: Any = None) -> list[Diagnostic]:
    """Every leaf whose live sharding differs from the plan's."""
    diags = []
    pairs = [(model, placement.params)]
    if optimizer is not None and placement.opt is not None:
        pairs.append((optimizer, placement.opt))
    if batch is not None:
        pairs.append((batch, specs.resolve_batch(placement.plan, batch, mesh=placement.mesh_shape)))
        for kp, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if not isinstance(x, jax.Array):
                diags.append(
                    error(
                        "sharding-mismatch",
                        f"batch leaf {path_str(kp) or '<root>'} is a host {type(x).__name__}, not placed on the mesh",
                        "place the batch with placement.shard_batch(batch) before the step",
                        path=path_str(kp) or "<root>",
                    )
                )
    for tree, res in pairs:
        expected = res.by_path()
        for leaf in live_leaves(tree):
            d = expected.get(leaf.path)
            if d is None:
                continue
            want = NamedSharding(placement.mesh, specs.pspec(d.spec))
            if not leaf.sharding.is_equivalent_to(want, len(leaf.shape)):
                diags.append(
                    error(
                        "sharding-mismatch",
                        f"{leaf.path} lives as {leaf.spec} on {leaf.sharding.num_devices} "
                        f"device(s); the plan says {specs.pspec(d.spec)} ({d.origin})",
                        "place it with shardplan.shard_model / shard_batch, or check what moved it "
                        "(a jit without out_shardings, a host round-trip)",
                        path=leaf.path,
                    )
                )
    return diags


def verify(placement: Placement, model: Any, optimizer: Any = None, batch: Any = None) -> None:
    """Check that live shardings equal the plan's.

    Raises:
        PlanApplyError: naming each leaf that differs.
    """
    diags = mismatches(placement, model, optimizer, batch)
    if diags:
        raise PlanApplyError(diags)


def show(
    tree: Any,
    *,
    console: Console | None = None,
    title: str = "live state",
    visualize: bool = True,
    max_visualize: int = 6,
    expand: bool = False,
) -> None:
    """Print where each array lives: a table of per-device shard shapes for every leaf, and
    ``jax.debug.visualize_array_sharding`` for the first few 1-2D arrays (one per group
    of layer-identical arrays)."""
    console = console or Console()
    leaves = live_leaves(tree)
    table = Table(title=title, header_style="bold")
    for col in ("path", "global shape", "dtype", "sharding", "shard / device (x devices)", "bytes / device"):
        table.add_column(col, justify="right" if col.startswith("bytes") else "left")
    by_path = {leaf.path: leaf for leaf in leaves}
    rows = _group_live(leaves, expand)
    for path, count, leaf in rows:
        shards = ", ".join(f"{fmt_shape(s)} x{n}" for s, n in leaf.shard_shapes)
        table.add_row(
            path + (f"  x{count}" if count > 1 else ""),
            fmt_shape(leaf.shape),
            leaf.dtype,
            leaf.spec,
            shards,
            fmt_bytes(leaf.bytes_per_device),
        )
    console.print(table)
    if not visualize:
        return
    shown = 0
    for _, _, leaf in rows:
        if shown >= max_visualize or not 1 <= len(leaf.shape) <= 2:
            continue
        console.print(f"[bold]{leaf.path}[/] {fmt_shape(leaf.shape)} {leaf.spec}")
        if jax.process_index() != 0 or console.quiet:
            continue  # jax prints to stdout itself: only the process that shows the tables
        # Prints through rich to stdout: which device holds which block of the array.
        jax.debug.visualize_array_sharding(
            by_path[leaf.path].array, use_color=False, max_width=60 if len(leaf.shape) == 2 else 80
        )
        shown += 1


def _group_live(leaves: list[LiveLeaf], expand: bool):
    if expand:
        return [(leaf.path, 1, leaf) for leaf in leaves]
    groups: dict[tuple, list] = {}
    for leaf in leaves:
        key = (layer_group(leaf.path), leaf.shape, leaf.dtype, leaf.spec, leaf.shard_shapes)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [leaf, 1]
    return [(k[0] if n > 1 else leaf.path, n, leaf) for k, (leaf, n) in groups.items()]
