"""The neutral floor under both sharding engines (fast mode's propagation, the shard_map
backend's partitioner): the layout vocabulary and the jaxpr helpers they share. It imports
nothing else from shardplan, so the standalone module ``shardplan lower`` emits carries it
beside the partitioner (shardplan/tools/emit.py copies both).

- ``Dims``: a value's layout, per dim the mesh axes that split it, major first;
- ``spec_axes``: a PartitionSpec as ``Dims``;
- ``constraint_target``: the layout a ``sharding_constraint`` / ``reshard`` equation sets;
- ``typed_dims``: the layout an aval's sharding type names over a mesh's explicit axes;
- ``permuted``: the operand layout a transpose turns into a given one;
- ``scan_counts``: a ``scan`` equation's constants and carries, across jax releases;
- ``update_paths``: the values a param's update is computed from element by element (what a
  gradient's all-reduce or reduce-scatter moves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from shardplan.runtime.primitives import CALLS, ELEMENTWISE, named

Dims = tuple[tuple[str, ...], ...]


def spec_axes(spec: Any, rank: int) -> Dims:
    """A PartitionSpec's entries as per-dim axis tuples, ``rank`` long."""
    dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in tuple(spec)]
    return tuple(dims + [()] * (rank - len(dims)))


def constraint_target(eqn: Any, dims: Dims) -> Dims | None:
    """The layout a ``sharding_constraint`` (or ``reshard``) equation sets, per dim the mesh axes (an
    unconstrained dim keeps ``dims``); None when it carries no PartitionSpec. A ``reshard`` sets
    only its mesh's explicit axes: jax lowers it to nothing over automatic ones (its ``dst_sharding``
    replicated over an all-auto mesh, as ``jnp.where`` writes under a mesh context, moves nothing)."""
    sharding = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    auto: set[str] = set()
    if "dst_sharding" in eqn.params:
        mesh = getattr(sharding, "mesh", None)
        names, types = getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())
        auto = {n for n, t in zip(names, types, strict=False) if getattr(t, "name", str(t)) == "Auto"}
    unconstrained = getattr(type(spec), "UNCONSTRAINED", object())
    target: list[tuple[str, ...] | None] = []
    for i in range(len(dims)):
        entry = spec[i] if i < len(spec) else None
        if entry is unconstrained:
            target.append(None)
        else:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            target.append(tuple(a for a in axes if a not in auto))
    # An unconstrained dim keeps its split over the axes the constrained dims leave free (and a
    # reshard's dim its automatic axes).
    taken = {a for t in target if t is not None for a in t}
    return tuple(
        t + tuple(a for a in current if a in auto and a not in taken)
        if t is not None
        else tuple(a for a in current if a not in taken)
        for t, current in zip(target, dims, strict=True)
    )


def typed_dims(aval: Any, dims: Dims, mesh: dict[str, int]) -> Dims | None:
    """The layout an aval's sharding type names over the explicit axes of ``mesh`` (a dim whose
    type names none keeps ``dims``); None when the aval is not typed by explicit axes."""
    sharding = getattr(aval, "sharding", None)
    explicit = set(getattr(getattr(sharding, "mesh", None), "explicit_axes", ()) or ()) & set(mesh)
    spec = getattr(sharding, "spec", None)
    if not explicit or spec is None or len(dims) != len(getattr(aval, "shape", ())):
        return None
    typed = []
    for i in range(len(dims)):
        entry = spec[i] if i < len(spec) else None
        named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        typed.append(tuple(a for a in named if a in explicit))
    used = {a for d in typed for a in d}
    # Explicit axes where the type says; an auto axis keeps its split where the type leaves room.
    return tuple(t + tuple(a for a in cur if a not in explicit and a not in used) for t, cur in zip(typed, dims))


def permuted(out: Dims, perm) -> Dims:
    """The operand layout a transpose by ``perm`` turns into ``out``."""
    inv: list[tuple[str, ...]] = [()] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = out[i]
    return tuple(inv)


def scan_counts(eqn: Any) -> tuple[int, int]:
    """A ``scan`` equation's (constants, carries) counts: ``num_consts``/``num_carry`` up to jax 0.10;
    from jax 0.11 its operands are grouped (consts, carry, xs) by the ``ft_in`` flat tree."""
    params = eqn.params
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carry))


def while_trips(eqn: Any) -> int | None:
    """A ``while_loop``'s iterations where its jaxpr fixes them, as XLA's trip-count analysis finds
    them: the condition is ``counter < N`` on a carried counter that starts at a literal and that
    the body steps by a literal, N a literal or a carried value the body passes through from a
    literal; else None."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_j, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    init = eqn.invars[nc + nb :]
    test = cond_j.eqns[0] if len(cond_j.eqns) == 1 else None
    if test is None or test.primitive.name != "lt" or test.outvars[0] is not cond_j.outvars[0]:
        return None
    carried = {v: k for k, v in enumerate(cond_j.invars[nc:])}

    def start(x: Any) -> int | None:  # a literal, or a carried value from one the body passes on
        if hasattr(x, "val"):
            return int(x.val)
        k = carried.get(x)
        if k is None or not hasattr(init[k], "val"):
            return None
        return int(init[k].val)

    counter, bound = test.invars
    k = carried.get(counter)
    first, stop = start(counter), start(bound)
    if k is None or first is None or stop is None:
        return None
    if not hasattr(bound, "val") and body.outvars[carried[bound]] is not body.invars[nb + carried[bound]]:
        return None  # the bound changes in the loop
    bump = next((e for e in body.eqns if body.outvars[k] in e.outvars), None)
    mine = body.invars[nb + k]
    if bump is None or bump.primitive.name != "add":
        return None
    a, b = bump.invars
    step = int(b.val) if a is mine and hasattr(b, "val") else int(a.val) if b is mine and hasattr(a, "val") else 0
    return max(0, -(-(stop - first) // step)) if step > 0 else None


# What a param's update is followed back through: element-by-element ops and layout views.
_SAME_ELEMENTS = ELEMENTWISE | named(kinds=("identity", "view")) - {"bitcast_convert_type"}


def update_paths(jaxpr: Any, paths: Sequence[str | None], first: int = 0) -> dict[Any, str]:
    """Each value of the step that the update of one param is computed from element by element
    (its gradient, and the matmul transpose or sum that made it, through the optimizer's
    arithmetic) -> that param's path: a gradient's all-reduce or reduce-scatter moves that param's
    gradient. ``paths[k]`` names ``jaxpr.outvars[first + k]`` (the updated param, or its gradient);
    found backwards from there, through elementwise and layout ops whose operand has as many
    elements as the result (a global norm's scalar, a reduction's input, are not followed), into
    calls."""
    labels: dict[Any, str] = {}
    for var, path in zip(jaxpr.outvars[first:], paths, strict=False):
        if path and not hasattr(var, "val"):
            labels[var] = path
    _label_back(jaxpr, labels, _SAME_ELEMENTS)
    return labels


def _label_back(jaxpr: Any, labels: dict[Any, str], same: frozenset[str]) -> None:
    for eqn in reversed(jaxpr.eqns):
        outs = [labels.get(o) for o in eqn.outvars]
        if not any(outs):
            continue
        name = eqn.primitive.name
        sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        if name in CALLS and sub is not None:
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            for io, label in zip(inner.outvars, outs, strict=False):
                if label and not hasattr(io, "val"):
                    labels.setdefault(io, label)
            _label_back(inner, labels, same)
            for iv, ov in zip(inner.invars, eqn.invars[len(eqn.invars) - len(inner.invars) :], strict=True):
                if iv in labels and not hasattr(ov, "val"):
                    labels.setdefault(ov, labels[iv])
            continue
        if name not in same:
            continue
        for o, label in zip(eqn.outvars, outs, strict=True):
            size = math.prod(getattr(o.aval, "shape", ()))
            for x in eqn.invars:
                if label and not hasattr(x, "val") and math.prod(getattr(x.aval, "shape", ())) == size and size > 1:
                    labels.setdefault(x, label)
