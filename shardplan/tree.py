"""Pytrees <-> resolution leaves. The only stage that walks JAX / NNX structures.

Path format (documented in docs/language.md): the keys from the root to the leaf,
joined with '/': dict keys and attribute names as written, sequence indices as
decimal numbers. An NNX ``Variable`` is a leaf (its ``.value`` is not part of the path),
so ``nnx.state(model)`` gives paths like ``blocks/3/attn/query/kernel``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from shardplan.errors import PlanApplyError, error
from shardplan.resolve import Leaf


def device_count() -> int:
    return jax.device_count()


def key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(keypath) -> str:
    return "/".join(key_str(k) for k in keypath)


def _is_leaf(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(v: nnx.Variable) -> tuple | None:
    """The Flax logical-axis annotation of a Variable (``nnx.with_partitioning``), if any."""
    meta = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            return tuple(names)
    return None


def _leaf(path: str, x) -> Leaf:
    names = None
    if isinstance(x, nnx.Variable):
        names = logical_names(x)
        x = x.get_value()
    if isinstance(x, (int, float, bool, np.number, np.bool_)):
        x = np.asarray(x)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise PlanApplyError([error(
            "not-an-array", f"the leaf at '{path or '<root>'}' is a {type(x).__name__}, not an array or shape",
            "pass an NNX Module or State, or a pytree of arrays / jax.ShapeDtypeStruct", path=path or "<root>")])
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # typed PRNG keys (nnx.Rngs state)
        return Leaf(path, tuple(int(s) for s in shape), str(dtype), 8, names)
    dt = np.dtype(dtype)
    return Leaf(path, tuple(int(s) for s in shape), dt.name, dt.itemsize, names)


def flatten(tree: Any) -> tuple[list[Leaf], Callable[[list], Any]]:
    """Leaves of ``tree`` with their paths, and a function that rebuilds the tree's shape
    from one value per leaf (Variables are replaced by the value)."""
    if isinstance(tree, nnx.Module) or (hasattr(nnx, "Pytree") and isinstance(tree, nnx.Pytree)
                                         and not isinstance(tree, nnx.State)):
        tree = nnx.state(tree)
    try:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    except Exception as e:  # a pytree node whose flatten raises
        raise PlanApplyError([error("not-a-pytree", f"cannot flatten the state: {e}",
                                    "pass an NNX Module or State, or a pytree of arrays")]) from None
    leaves = [_leaf(path_str(kp), x) for kp, x in flat]

    def rebuild(values: list) -> Any:
        return jax.tree_util.tree_unflatten(treedef, values)

    return leaves, rebuild


def abstract(tree: Any) -> Any:
    """``ShapeDtypeStruct`` leaves for any tree of arrays (Variables unwrapped)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.asarray(x).dtype)),
                        tree)
