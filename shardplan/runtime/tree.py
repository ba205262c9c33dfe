"""Pytrees <-> resolution leaves: where JAX / NNX structures are walked.

Path format (documented in docs/language.md): the keys from the root to the leaf,
joined with '/': dict keys and attribute names as written, sequence indices as
decimal numbers. An NNX ``Variable`` is a leaf (its ``.value`` is not part of the path),
so ``nnx.state(model)`` gives paths like ``blocks/3/attn/query/kernel``.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from shardplan.core.leaves import Leaf, Node
from shardplan.errors import as_error, error


def device_count() -> int:
    return jax.device_count()


def key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(keypath) -> str:
    return "/".join(key_str(k) for k in keypath)


def logical_names(v: nnx.Variable) -> tuple | None:
    """The Flax logical-axis annotation of a Variable (``nnx.with_partitioning``), if any."""
    meta = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            return tuple(names)
    return None


_VAR_TYPES: dict[type, bool] = {}
_DTYPES: dict[Any, tuple[str, int]] = {}
_ARRAY_TYPES: tuple[type, ...] = (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic)
# The concrete array type, for an exact-type fast path (jax.Array is an abstract base).
_ARRAY_IMPL: type | None
try:
    from jax._src.array import ArrayImpl as _ArrayImpl

    _ARRAY_IMPL = _ArrayImpl
except ImportError:  # pragma: no cover
    _ARRAY_IMPL = None


def _is_var(x) -> bool:
    t = type(x)
    hit = _VAR_TYPES.get(t)
    if hit is None:
        hit = _VAR_TYPES[t] = issubclass(t, nnx.Variable)
    return hit


def _dtype(dtype) -> tuple[str, int]:
    hit = _DTYPES.get(dtype)
    if hit is None:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # typed PRNG keys (nnx.Rngs state)
            hit = (str(dtype), 8)
        else:
            dt = np.dtype(dtype)
            hit = (dt.name, dt.itemsize)
        _DTYPES[dtype] = hit
    return hit


_KINDS: dict[type, str] = {}


def variable_kind(t: type) -> str:
    """The kind of a Variable type: ``param`` for ``nnx.Param`` and its subclasses, else the
    type's name in snake_case (``BatchStat`` -> ``batch_stat``, ``RngKey`` -> ``rng_key``)."""
    hit = _KINDS.get(t)
    if hit is None:
        if issubclass(t, nnx.Param):
            hit = "param"
        elif issubclass(t, nnx.OptState):
            hit = "opt_state"
        else:
            hit = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", t.__name__).lower()
        _KINDS[t] = hit
    return hit


def _leaf(path: str, x) -> Leaf:
    names = None
    kind = None
    if _is_var(x):
        names = logical_names(x)
        kind = variable_kind(type(x))
        x = x.get_value()
    if isinstance(x, (int, float, bool, complex)):
        x = np.asarray(x)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise as_error(
            [
                error(
                    "not-an-array",
                    f"the leaf at '{path or '<root>'}' is a {type(x).__name__}, not an array or shape",
                    "pass an NNX Module or State, or a pytree of arrays / jax.ShapeDtypeStruct",
                    path=path or "<root>",
                )
            ]
        )
    name, itemsize = _dtype(dtype)
    if type(shape) is not tuple:
        shape = tuple(int(s) for s in shape)
    return Leaf(path, shape, name, itemsize, names, kind)


def _walk(x, prefix: str, out: list) -> None:
    """Append (path, leaf) in jax's flatten order: dict and State keys sorted, sequences in
    order, NamedTuples by field name; other pytree nodes through jax itself."""
    t = type(x)
    if t is jax.ShapeDtypeStruct or t is _ARRAY_IMPL or t is np.ndarray:  # the hot case: inline
        shape = x.shape
        name, itemsize = _dtype(x.dtype)
        out.append(Leaf(prefix, shape if type(shape) is tuple else tuple(map(int, shape)), name, itemsize, None))
    elif t is dict or t is nnx.State:
        for k in sorted(x.keys()):
            _walk(x[k], f"{prefix}/{k}" if prefix else str(k), out)
    elif _is_var(x) or isinstance(x, _ARRAY_TYPES) or t in (int, float, bool, complex):
        out.append(_leaf(prefix, x))
    elif t is list or t is tuple:
        for i, v in enumerate(x):
            _walk(v, f"{prefix}/{i}" if prefix else str(i), out)
    elif x is None:
        return
    elif isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple (optax states): by field name
        for name in x._fields:
            _walk(getattr(x, name), f"{prefix}/{name}" if prefix else name, out)
    else:
        try:
            flat = jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_var)[0]
        except Exception as e:  # a pytree node whose flatten raises
            raise as_error(
                [
                    error(
                        "not-a-pytree",
                        f"cannot flatten the state at '{prefix or '<root>'}': {e}",
                        "pass an NNX Module or State, or a pytree of arrays",
                        path=prefix or "<root>",
                    )
                ]
            ) from None
        for kp, v in flat:
            sub = path_str(kp)
            out.append(_leaf(f"{prefix}/{sub}" if prefix and sub else prefix or sub, v))


def _state(tree: Any) -> Any:
    if isinstance(tree, nnx.Module) or (
        hasattr(nnx, "Pytree") and isinstance(tree, nnx.Pytree) and not isinstance(tree, nnx.State)
    ):
        return nnx.state(tree)
    return tree


def rebuilder(tree: Any) -> Callable[[list], Any]:
    """A function that rebuilds the tree's shape from one value per leaf (Variables are
    replaced by the value)."""
    tree = _state(tree)

    def rebuild(values: list) -> Any:
        treedef = jax.tree_util.tree_structure(tree, is_leaf=_is_var)
        return jax.tree_util.tree_unflatten(treedef, values)

    return rebuild


def flatten(tree: Any) -> tuple[list[Leaf], Callable[[list], Any]]:
    """Leaves of ``tree`` with their paths, and a function that rebuilds the tree's shape
    from one value per leaf (Variables are replaced by the value)."""
    tree = _state(tree)
    leaves: list[Leaf] = []
    _walk(tree, "", leaves)
    return leaves, rebuilder(tree)


MAX_CANDIDATES = 8  # equal-sized subtrees compared per lookup (more distinct ones are not shared)


def _keys(typ: type, data: Any, n: int) -> tuple[str, ...] | None:
    """Child keys of a pytree node, as path components (None: a node only _walk handles)."""
    if typ is dict or typ is nnx.State or typ is collections.OrderedDict:
        keys = tuple(str(k) for k in data)
    elif typ is collections.defaultdict:  # node data (default_factory, keys)
        keys = tuple(str(k) for k in data[1])
    elif typ is list or typ is tuple:
        keys = tuple(str(i) for i in range(n))
    elif typ is type(None):
        keys = ()
    elif isinstance(typ, type) and issubclass(typ, tuple) and hasattr(typ, "_fields"):
        keys = tuple(typ._fields)
    else:
        return None
    return keys if len(keys) == n else None


def shared(tree: Any) -> Node | Leaf | None:
    """The tree as a shared ``Node`` (equal subtrees one object), built from JAX's C++ flatten
    without visiting each leaf in Python; None where the tree holds a node this does not
    read (custom pytree classes, Python scalars, Variables holding pytrees): use ``flatten``.

    Same leaves, in the same order, with the same paths, kinds and annotations as
    ``flatten``; ``jax.tree_util.tree_unflatten`` of the tree's structure puts values back.
    """
    tree = _state(tree)
    try:
        flat, treedef = jax.tree_util.tree_flatten(tree)
        shapes = [x.shape for x in flat]
        dtypes = [x.dtype for x in flat]
    except (AttributeError, TypeError, ValueError):
        return None
    # Candidates by (nodes, leaves): comparing treedefs only when their sizes agree, rather than
    # hashing every subtree's treedef (each hash walks the whole subtree: O(size x depth)).
    memo: dict[tuple[int, int], list[tuple[Any, int, Node | Leaf]]] = {}
    records: dict[tuple, Leaf] = {}

    def record(i: int, names: tuple | None, kind: str | None) -> Leaf:
        shape, dtype = shapes[i], dtypes[i]
        key = (shape, dtype, names, kind)
        hit = records.get(key)
        if hit is None:
            name, itemsize = _dtype(dtype)
            hit = records[key] = Leaf(
                "", shape if type(shape) is tuple else tuple(int(s) for s in shape), name, itemsize, names, kind
            )
        return hit

    def build(td: Any, start: int) -> Node | Leaf | None:
        n = td.num_leaves
        if td.num_nodes == 1 and n == 1:
            return record(start, None, None)
        sizes = (td.num_nodes, n)
        cands = memo.get(sizes)
        if cands:
            for ctd, cstart, node in cands[:MAX_CANDIDATES]:
                if (
                    ctd == td
                    and shapes[cstart : cstart + n] == shapes[start : start + n]
                    and dtypes[cstart : cstart + n] == dtypes[start : start + n]
                ):
                    return node
        data = td.node_data()
        if data is None:
            return None
        typ, aux = data
        children = td.children()
        out: Node | Leaf | None
        if _is_var_type(typ):
            if len(children) != 1 or children[0].num_nodes != 1 or n != 1:
                return None
            try:
                meta = dict(aux)
            except (TypeError, ValueError):
                return None
            out = record(start, _names(meta), variable_kind(typ))
        else:
            keys = _keys(typ, aux, len(children))
            if keys is None:
                return None
            kids = []
            pos = start
            for child in children:
                sub = build(child, pos)
                if sub is None:
                    return None
                kids.append(sub)
                pos += child.num_leaves
            out = Node(keys, tuple(kids), n)
        memo.setdefault(sizes, []).append((td, start, out))
        return out

    try:
        return build(treedef, 0)
    except (TypeError, RecursionError):  # unhashable node data, absurd depth
        return None


def _is_var_type(t: Any) -> bool:
    if not isinstance(t, type):
        return False
    hit = _VAR_TYPES.get(t)
    if hit is None:
        hit = _VAR_TYPES[t] = issubclass(t, nnx.Variable)
    return hit


def _names(meta: dict) -> tuple | None:
    """``logical_names`` from a Variable's metadata as its pytree node carries it."""
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            return tuple(names)
    return None
