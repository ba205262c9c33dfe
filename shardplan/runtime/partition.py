"""The step's computation lowered to per-device code: the shard_map backend's partitioner.

The training step's forward and backward pass is traced once over global abstract values
(a jaxpr: ``value_and_grad`` of the loss). Inside ``jax.shard_map`` the jaxpr is then run
equation by equation on *local* shards: every value carries its layout (per dimension the
mesh axes that split it, and the axes over which it is a pending partial sum), each op is
given operands in a layout it can run on locally, and an explicit collective is issued
only where the layout requires one:

- a matmul contracting a dimension split on both sides (a row-parallel layer, a data
  parallel weight gradient) runs locally and leaves a pending sum, reduced once where a
  consumer needs the value whole: ``psum``, or ``psum_scatter`` where the consumer splits
  a dimension over the same axis (an FSDP gradient, a sequence-parallel activation);
- a column-parallel matmul (weight split on its output dim) stays split, and so does
  attention with heads split over an axis;
- an operand split where the op needs it whole is ``all_gather``-ed right before that op
  (an FSDP weight before its matmul, and again in the backward pass: nothing keeps it);
- a lookup in a table split over its rows is a masked local lookup and a pending sum;
- a value made in the step (``jnp.zeros``, ``iota``, masks from them) is built in the layout
  its reader wants, so a KV cache made with ``jnp.zeros`` and written with
  ``dynamic_update_slice`` is split like the K/V written into it;
- an op with no local rule gets its operands whole (gathered) and runs replicated:
  correct, and listed in :attr:`Record.fallbacks` with its source line and the bytes made
  whole (the backend warns of each, or refuses them with ``strict``).

Reductions over the batch become local reductions and a sum over the batch axes, so the
loss is the global loss whatever it divides by (a padding-masked token count included).
Every collective issued is recorded (kind, axes, per-device bytes in the convention of
``shardplan.core.hlo``, why, source line): the prediction of the compiled step's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from shardplan.ledger import Communication
from shardplan.runtime.primitives import CATALOGUE, ELEMENTWISE, named
from shardplan.runtime.sharding import (
    Dims,
    constraint_target,
    permuted,
    scan_counts,
    spec_axes,
    typed_dims,
    update_paths,
)

# The partitioner's sets, as policy over the primitive catalogue (shardplan/runtime/primitives.py).
# Run on local shards laid out alike (operands of the result's rank, or scalars): elementwise
# arithmetic, identities, and a bitcast to a dtype of the same size (its rule checks the ranks).
_ELEMENTWISE = ELEMENTWISE | named(kinds=("identity",)) | {"bitcast_convert_type"}
# Equation params that carry an output sharding when traced under explicit mesh axes.
_SHARDING_PARAMS = ("sharding", "out_sharding")
# Layout changes of values typed by mesh axes (``jax.sharding.reshard``; ``sharding_cast`` and
# ``mesh_cast`` in other jax releases): a reshard to the layout they name, as a constraint is.
_RESHARDS = named(kinds=("reshard",)) - {"sharding_constraint"}
# Linear in all operands together: a sum of partial sums is a partial sum.
# ``name`` is ``checkpoint_name``: an identity tagging a value for a remat policy.
_LINEAR_ALL = named(traits=("linear",)) & _ELEMENTWISE
_REMAT = named(traits=("remat",))
_INLINE = named(traits=("call",)) - _REMAT


# What the partitioner runs on whole operands by design (gathered first, then the op as traced,
# reported as a fallback when anything moved; see ``Partitioner.fallback``): collectives (they are
# only met inside a shard_map region the user wrote, which runs as written), kernels XLA cannot
# split, loops and branches it does not partition, and the rest below. The coverage test
# (tests/test_primitives.py) holds every catalogued primitive to a rule or an entry here.
_FALLBACKS = named(kinds=("collective", "kernel")) - {"ppermute"} | {
    "while",
    "cond",
    "expand_dims",
    "scatter-mul",
    "scatter_mul",
    "rng_bit_generator",
    "threefry2x32",
}


def rule_book() -> tuple[frozenset[str], frozenset[str]]:
    """The partitioner's primitives with a local rule, and its declared fallbacks (for the
    coverage test)."""
    ops = {n[3:] for n in dir(Partitioner) if n.startswith("op_")}
    structure = _INLINE | _REMAT | {"scan", "shard_map"} | _ELEMENTWISE | _RESHARDS
    return frozenset(structure | ops | {n for n in CATALOGUE if n.replace("-", "_") in ops}), _FALLBACKS


@dataclass(frozen=True)
class Fallback:
    """An op that had no local rule for its operands' layout and ran on whole (gathered) operands."""

    op: str
    source: str
    why: str
    bytes: int = 0  # per device per step: the operands' bytes made whole (gathered or summed) for it


@dataclass
class Record:
    issued: list[Communication] = field(default_factory=list)  # the collective ledger's rows
    fallbacks: list[Fallback] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"count", "bytes"}} per device per step, as ``shardplan.core.hlo.summarize``."""
        out = {k: {"count": 0, "bytes": 0} for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}
        for c in self.issued:
            out[c.kind]["count"] += c.count
            out[c.kind]["bytes"] += c.bytes
        return out


@dataclass(frozen=True, eq=False)
class Rows:
    """Along ``dim``, the rows of this device's groups (``[start, start + count)`` of the tokens
    sorted by group, the groups split over ``axes`` by the group sizes ``sizes``) are exact, the
    others are not (zero out of a grouped matmul, anything after an elementwise op): a pending sum
    over ``axes`` once those rows are zeroed. Ops that read only this device's rows (elementwise
    ops, grouped matmuls over the same groups) run on it as it is; any other op gets it zeroed
    outside its rows and summed, as a pending sum is."""

    # The group sizes' ``V``: rows of one grouping are the same rows. (``Any``: the emitted module's
    # copy of this file has no postponed annotations, and V comes after.)
    sizes: Any
    axes: tuple[str, ...]
    dim: int
    start: Any  # traced scalars (None in a dry run)
    count: Any

    def fits(self, v: Any, sizes: Any, axes: tuple[str, ...], dim: int) -> bool:
        return self.sizes is sizes and self.axes == axes and self.dim == dim and not v.dims[dim]


@dataclass
class V:
    """A value in the per-device program: the local array (None in a dry run) and its layout."""

    x: Any
    shape: tuple[int, ...]
    dtype: Any
    dims: Dims
    partial: frozenset[str] = frozenset()
    act: bool = False  # derived from the batch (an activation), not only from params and constants
    shared: bool = False  # read by several ops: its pending sum is reduced once, by the first reader
    # A value made inside the step from nothing split (``jnp.zeros``, ``full``, ``iota``, ``arange``
    # and elementwise ops of those): ``make(dims)`` builds its local block in any layout, so it takes
    # the layout its reader wants at no cost, as XLA does (a dry run's returns None).
    make: Callable[[Dims], Any] | None = None
    # A grouped matmul's result with its groups split (see ``Rows``): exact on this device's rows.
    rows: Rows | None = None


def _t(dims) -> Dims:
    return tuple(tuple(d) for d in dims)


def _source(eqn: Any) -> str:
    from shardplan.runtime.sources import eqn_source  # the emitted copy replaces this function

    return eqn_source(eqn)


class Partitioner:
    """Runs a jaxpr on local shards under ``jax.shard_map`` (or, ``dry``, only its layouts)."""

    def __init__(
        self,
        mesh: dict[str, int],
        record: Record | None = None,
        dry: bool = False,
        predict: bool = False,
        batch_axes: frozenset[str] = frozenset(),
    ):
        self.mesh = dict(mesh)
        self.batch_axes = batch_axes  # the axes inputs are split over (data parallelism)
        self.record = record if record is not None else Record()
        self.dry = dry or predict
        self.predict = predict  # a dry run that records what it would issue (no devices needed)
        self.mult = 1
        self.source = ""
        self.op = ""
        # Reductions and activation reshards done once per value; a stack, one level per nested
        # trace (a scan or remat body), so a value made inside never leaks out of it.
        self.caches: list[dict] = [{}]
        self.hints: dict[Any, Dims] = {}  # jaxpr var -> the layout its consumers want
        self.eqn_now: Any = None
        # What a collective moves: jaxpr var -> param path (a gradient, update_paths), and the
        # values so named, by id (each kept alive with its name): a param, a gradient.
        self.labels: dict[Any, str] = {}
        self.named: dict[int, tuple[V, str]] = {}

    def name(self, v: V, path: str) -> None:
        self.named.setdefault(id(v), (v, path))

    def moves(self, v: V) -> str:
        hit = self.named.get(id(v))
        return hit[1] if hit is not None and hit[0] is v else ""

    def _cached(self, key: tuple) -> V | None:
        for cache in reversed(self.caches):
            hit = cache.get(key)
            if hit is not None:
                return hit[1]
        return None

    # -- layouts -------------------------------------------------------------------------
    def n(self, axes) -> int:
        return math.prod(self.mesh[a] for a in axes)

    def local_shape(self, shape, dims) -> tuple[int, ...]:
        return tuple(s // self.n(d) if d else s for s, d in zip(shape, dims, strict=True))

    def nbytes(self, shape, dims, dtype) -> int:
        size = getattr(dtype, "itemsize", None)  # a PRNG key's dtype has one; numpy reads no key<fry>
        return math.prod(self.local_shape(shape, dims)) * (size if isinstance(size, int) else np.dtype(dtype).itemsize)

    def fits(self, shape, dims) -> bool:
        return all(s % self.n(d) == 0 for s, d in zip(shape, dims, strict=True) if d)

    def issue(self, kind: str, axes, nbytes: int, why: str = "", moves: str = "") -> None:
        if (self.dry and not self.predict) or not axes:
            return
        row = Communication(kind, tuple(axes), nbytes * self.mult, self.mult, why or self.op, self.source, moves)
        self.record.issued.append(row)

    def index(self, axes) -> Any:
        """This device's linear index over ``axes`` (the first the major one)."""
        idx = jnp.int32(0)
        for a in axes:
            idx = idx * self.mesh[a] + jax.lax.axis_index(a)
        return idx

    def local_index(self, col: Any, axes, size: int) -> tuple[Any, Any]:
        """A global index along a dim split over ``axes`` into blocks of ``size``: this device's
        local index (clamped into its block) and whether the index falls in its block."""
        local = col - self.index(axes) * size
        return jnp.clip(local, 0, size - 1), (local >= 0) & (local < size)

    # -- collectives ---------------------------------------------------------------------
    def resolve(self, v: V, target: Dims | None = None, keep: frozenset[str] = frozenset()) -> V:
        """``v`` with its pending sums done (except ``keep``): ``psum_scatter`` over a partial
        axis that ``target`` adds next to a dimension, ``psum`` over the rest."""
        v = self.unown(v)
        if v.shared:
            keep = frozenset()
            hit = self._cached(("resolve-shared", id(v)))
            if hit is not None:
                return hit
        todo = v.partial - keep
        if not todo:
            return v
        if target is not None and not any(a in todo for t in target for a in t):
            target = None  # no scatter possible: the same all-reduce whatever the layout wanted
        key = ("resolve", id(v), target, keep)
        hit = self._cached(key)
        if hit is not None:
            return hit
        out = self._resolve(v, todo, target, keep)
        self.caches[-1][("resolve-shared", id(v)) if v.shared else key] = (v, out)
        return out

    def _resolve(self, v: V, todo: frozenset[str], target: Dims | None, keep: frozenset[str]) -> V:
        dims = [list(d) for d in v.dims]
        x = v.x
        if target is not None:
            for i, t in enumerate(target):
                while (
                    len(dims[i]) < len(t)
                    and list(t[: len(dims[i])]) == dims[i]
                    and v.shape[i] % self.n((*dims[i], t[len(dims[i])])) == 0
                    and all(t[len(dims[i])] not in d for d in dims)
                    and (t[len(dims[i])] in todo or any(a in todo for a in t[len(dims[i]) + 1 :]))
                ):
                    a = t[len(dims[i])]
                    if a in todo:
                        self.issue("reduce-scatter", (a,), self.nbytes(v.shape, dims, v.dtype), moves=self.moves(v))
                        if not self.dry:
                            x = jax.lax.psum_scatter(x, a, scatter_dimension=i, tiled=True)
                        todo = todo - {a}
                    elif a not in v.partial:
                        # Replicated over ``a`` (no sum pending over it): its block is sliced here,
                        # free, so the sum over the axis after it scatters (a value whole over
                        # ``data`` and pending over ``expert``, wanted split over both).
                        if not self.dry:
                            size = x.shape[i] // self.mesh[a]
                            x = jax.lax.dynamic_slice_in_dim(x, self.index((a,)) * size, size, axis=i)
                    else:
                        break
                    dims[i].append(a)
        if todo:
            rest = tuple(a for a in self.mesh if a in todo)
            self.issue("all-reduce", rest, self.nbytes(v.shape, dims, v.dtype), moves=self.moves(v))
            if not self.dry:
                x = jax.lax.psum(x, rest)
        return V(x, v.shape, v.dtype, _t(dims), frozenset(v.partial & keep), v.act)

    def unown(self, v: V) -> V:
        """``v`` with rows other than its own zeroed (see ``Rows``): a plain pending sum."""
        rows = v.rows
        if rows is None:
            return v
        hit = self._cached(("unown", id(v)))
        if hit is not None:
            return hit
        x = v.x
        if not self.dry:
            at = jax.lax.broadcasted_iota(jnp.int32, x.shape, rows.dim)
            x = jnp.where((at >= rows.start) & (at < rows.start + rows.count), x, jnp.zeros((), x.dtype))
        out = V(x, v.shape, v.dtype, v.dims, v.partial, v.act)
        self.caches[-1][("unown", id(v))] = (v, out)
        return out

    def bare(self, v: V, axes: tuple[str, ...] = ()) -> V:
        """``v``'s local array as it is, its rows' pending sum (over ``axes``, by default its
        rows') set aside: for ops that read only this device's rows (``owned`` puts it back)."""
        axes = axes or (v.rows.axes if v.rows is not None else ())
        if not axes:
            return v
        hit = self._cached(("bare", id(v)))
        if hit is not None:
            return hit
        out = V(v.x, v.shape, v.dtype, v.dims, v.partial - set(axes), v.act)
        self.caches[-1][("bare", id(v))] = (v, out)
        return out

    @staticmethod
    def owned(v: V, rows: Rows) -> V:
        return V(v.x, v.shape, v.dtype, v.dims, v.partial | set(rows.axes), v.act, rows=rows)

    def to(self, v: V, target: Dims, keep_partial: bool = False) -> V:
        """``v`` laid out as ``target``: pending sums reduced (scattered where the target splits),
        axes the target drops gathered (``all_gather``), axes it adds sliced locally."""
        target = _t(target)
        adds = {a for d in target for a in d}
        v = self.resolve(v, target, keep=(v.partial - adds) if keep_partial else frozenset())
        if v.dims == target:
            return v
        # Once per value and layout: XLA merges equal collectives of one operand (CSE), so a
        # weight gathered for the forward pass is the one the backward pass reuses.
        key = ("to", id(v), target)
        hit = self._cached(key)
        if hit is not None:
            return hit
        if v.make is not None and not v.partial and self.fits(v.shape, target):
            # Made in the step: built in the wanted layout, nothing gathered or sliced.
            out = V(v.make(target), v.shape, v.dtype, target, frozenset(), v.act, make=v.make)
        else:
            out = self._to(v, target)
        self.caches[-1][key] = (v, out)
        return out

    def made(self, eqn: Any, build: Callable[[Dims], Any]) -> Callable[[Dims], Any]:
        """``make`` for the output of ``eqn``: ``build(dims)``, the local block in layout ``dims``
        (None in a dry run, where only layouts are followed)."""
        if self.dry:
            return lambda dims: None
        return build

    def _to(self, v: V, target: Dims) -> V:
        dims = [list(d) for d in v.dims]
        x = v.x
        # An axis that leaves one dim's minor end for the next place of another: one all_to_all
        # (each device sends the blocks of the new split and keeps its share of the old), the
        # same bytes on the wire as the buffer, where gather-then-slice moves the axis-size times more.
        while (move := _a2a_move(dims, target, v.shape, self.n)) is not None:
            i, j, a = move
            self.issue("all-to-all", (a,), self.nbytes(v.shape, dims, v.dtype), moves=self.moves(v))
            if not self.dry:
                x = jax.lax.all_to_all(x, a, split_axis=j, concat_axis=i, tiled=True)
            dims[i].pop()
            dims[j].append(a)
        # Gather what the target does not keep as a prefix, minor axes first.
        for i, (cur, tgt) in enumerate(zip(_t(dims), target, strict=True)):
            k = 0
            while k < len(cur) and k < len(tgt) and cur[k] == tgt[k]:
                k += 1
            drop = cur[k:]
            if drop:
                dims[i] = list(cur[:k])
                self.issue("all-gather", drop, self.nbytes(v.shape, dims, v.dtype), moves=self.moves(v))
                if not self.dry:
                    x = jax.lax.all_gather(x, drop if len(drop) > 1 else drop[0], axis=i, tiled=True)
        # Slice what it adds (the value is replicated over those axes: free).
        for i, tgt in enumerate(target):
            add = tgt[len(dims[i]) :]
            if add:
                if any(a in d for d in dims for a in add) or any(a in v.partial for a in add):
                    raise AssertionError(f"cannot slice {add} into {v.dims} (partial {set(v.partial)})")
                if not self.dry:
                    size = x.shape[i] // self.n(add)
                    x = jax.lax.dynamic_slice_in_dim(x, self.index(add) * size, size, axis=i)
                dims[i] = list(tgt)
        return V(x, v.shape, v.dtype, _t(dims), v.partial, v.act)

    def whole(self, v: V) -> V:
        return self.to(v, ((),) * len(v.shape))

    # -- running -------------------------------------------------------------------------
    def run(self, jaxpr: Any, consts: list, args: list[V], out_hints: list | None = None) -> list[V]:
        """Run ``jaxpr``; ``out_hints``: the layouts its outputs are wanted in (a gradient's
        param layout), carried back to where they are made so a pending sum there is
        reduce-scattered straight into that layout (a scanned layer's weight gradient)."""
        if out_hints:
            _hints(jaxpr, out_hints, self.hints)
        uses: dict[Any, int] = {}
        for e in jaxpr.eqns:
            for x in e.invars:
                if not isinstance(x, jcore.Literal):
                    uses[x] = uses.get(x, 0) + 1
        for x in jaxpr.outvars:
            if not isinstance(x, jcore.Literal):
                uses[x] = uses.get(x, 0) + 1
        env: dict[Any, V] = {}
        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.const(c)
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [self.read(env, x) for x in eqn.invars]
            self.source, self.op = _source(eqn), eqn.primitive.name
            self.eqn_now = eqn
            outs = self.eqn(eqn, ins)
            for var, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jcore.DropVar):
                    if val.partial and val.rows is None and uses.get(var, 0) > 1:
                        # A pending sum read by several ops: reduced once (into the layout its
                        # first reader wants), not per reader.
                        val = V(val.x, val.shape, val.dtype, val.dims, val.partial, val.act, shared=True)
                    if var in self.labels:
                        self.name(val, self.labels[var])
                    env[var] = val
        return [self.read(env, x) for x in jaxpr.outvars]

    def const(self, c: Any) -> V:
        a = np.asarray(c) if not hasattr(c, "shape") else c
        shape = tuple(a.shape)
        return V(None if self.dry else c, shape, a.dtype, ((),) * len(shape))

    def read(self, env: dict, x: Any) -> V:
        if isinstance(x, jcore.Literal):
            shape = tuple(getattr(x.aval, "shape", ()))
            # As a host value: a literal traced inside a shard_map region is typed by that region's
            # mesh, which this all-manual one is not.
            val = None if self.dry else np.asarray(x.val, dtype=getattr(x.aval, "dtype", None))
            return V(val, shape, getattr(x.aval, "dtype", None), ((),) * len(shape))
        return env[x]

    def out(self, eqn: Any, dims_list, partials=None, act: bool = False, xs=None) -> list[V]:
        outs = []
        for k, o in enumerate(eqn.outvars):
            aval = o.aval
            shape = tuple(getattr(aval, "shape", ()))
            p = partials[k] if partials is not None else frozenset()
            outs.append(V(None if xs is None else xs[k], shape, aval.dtype, _t(dims_list[k]), frozenset(p), act))
        return outs

    def bind(self, eqn: Any, xs: list, **changes) -> list | None:
        if self.dry:
            return None
        # Inside shard_map every axis is manual: an output sharding traced under explicit axes
        # (dot_general's out_sharding, broadcast_in_dim's and iota's sharding) names a global layout
        # the local op cannot take; the layout is this partitioner's (see ``typed``).
        params = {**eqn.params, **{k: None for k in _SHARDING_PARAMS if eqn.params.get(k) is not None}, **changes}
        try:
            res = eqn.primitive.bind(*xs, **params)
        except Exception as e:
            raise RuntimeError(f"{eqn} with {[getattr(x, 'shape', None) for x in xs]}") from e
        return list(res) if eqn.primitive.multiple_results else [res]

    def eqn(self, eqn: Any, ins: list[V]) -> list[V]:
        name = eqn.primitive.name
        if name in _INLINE:
            return self.inline(eqn, ins)
        if name in _REMAT:
            return self.remat(eqn, [self.unown(v) for v in ins])
        if name == "scan":
            return self.scan(eqn, [self.unown(v) for v in ins])
        if name == "shard_map":
            return self.shard_map(eqn, [self.unown(v) for v in ins])
        if name in _ELEMENTWISE and all(len(v.shape) in (0, len(eqn.outvars[0].aval.shape)) for v in ins):
            return self.elementwise(eqn, ins)
        if name != "ragged_dot_general":  # the ops that read only a grouped matmul's own rows
            ins = [self.unown(v) for v in ins]
        if name != "sharding_constraint":  # rules that carry a pending sum on: not a shared one
            ins = [self.resolve(v) if v.shared and v.partial else v for v in ins]
        if name in _RESHARDS:
            return self.op_sharding_constraint(eqn, ins)
        rule = getattr(self, "op_" + name.replace("-", "_"), None)
        if rule is not None:
            got = rule(eqn, ins)
            if got is not None:
                return self.typed(eqn, got)
        why = f"no local rule for {name}" if rule is None else "operands' layout"
        return self.typed(eqn, self.fallback(eqn, ins, why))

    def typed(self, eqn: Any, outs: list[V]) -> list[V]:
        """Outputs an op was told to give a sharding (``out_sharding=`` under explicit axes: a
        matmul's, a ``jnp.zeros``'s broadcast) laid out as told, as the auto backend's XLA lays out
        values typed by explicit axes; a pending sum is reduced (scattered where the type splits)."""
        if not any(eqn.params.get(k) is not None for k in _SHARDING_PARAMS):
            return outs
        out = []
        for v, var in zip(outs, eqn.outvars, strict=True):
            target = typed_dims(var.aval, v.dims, self.mesh)
            out.append(self.to(v, target) if target is not None and self.fits(v.shape, target) else v)
        return out

    def fallback(self, eqn: Any, ins: list[V], why: str) -> list[V]:
        """Operands whole (sums done, splits gathered), the op run as traced: replicated outputs."""
        moved = [v for v in ins if v.dims != ((),) * len(v.shape) or v.partial]
        if moved and (not self.dry or self.predict):
            nbytes = sum(self.nbytes(v.shape, ((),) * len(v.shape), v.dtype) for v in moved) * self.mult
            self.record.fallbacks.append(Fallback(eqn.primitive.name, self.source, why, nbytes))
        whole = [self.whole(v) for v in ins]
        xs = self.bind(eqn, [v.x for v in whole])
        act = any(v.act for v in ins)
        return self.out(eqn, [((),) * len(getattr(o.aval, "shape", ())) for o in eqn.outvars], act=act, xs=xs)

    # -- structure -------------------------------------------------------------------------
    def inline(self, eqn: Any, ins: list[V]) -> list[V]:
        closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
        consts = list(getattr(closed, "consts", ()))
        n = len(jaxpr.invars)
        return self.run(jaxpr, consts, ins[:n], [self.hints.get(o) for o in eqn.outvars])

    def remat(self, eqn: Any, ins: list[V]) -> list[V]:
        jaxpr = eqn.params["jaxpr"]
        if self.dry:
            return self.run(jaxpr, [], ins, [self.hints.get(o) for o in eqn.outvars])
        layouts: list[V] = []

        def body(*xs):
            vals = [V(x, v.shape, v.dtype, v.dims, v.partial, v.act, v.shared) for x, v in zip(xs, ins, strict=True)]
            self.caches.append({})
            try:
                outs = self.run(jaxpr, [], vals, [self.hints.get(o) for o in eqn.outvars])
            finally:
                self.caches.pop()
            layouts[:] = outs
            return [o.x for o in outs]

        fn = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy"))
        xs = fn(*[v.x for v in ins])
        return [V(x, o.shape, o.dtype, o.dims, o.partial, o.act) for x, o in zip(xs, layouts, strict=True)]

    def shard_map(self, eqn: Any, ins: list[V]) -> list[V]:
        """A ``jax.shard_map`` region in the step (manual over some axes, the rest automatic): its
        operands laid out as ``in_specs`` over its manual axes, keeping their splits over the others;
        its body run on those blocks, which are already this device's (every axis is manual here),
        the collectives in it issued as written; its results laid out as ``out_specs`` plus the
        body's own splits."""
        p = eqn.params
        closed = p["jaxpr"]
        body = getattr(closed, "jaxpr", closed)
        consts = list(getattr(closed, "consts", ()))
        manual = set(p.get("newly_manual_axes") or p.get("manual_axes") or self.mesh)
        inner = []
        for v, spec, var in zip(ins, p["in_specs"], body.invars, strict=True):
            want = spec_axes(spec, len(v.shape))
            auto = tuple(tuple(a for a in d if a not in manual) for d in v.dims)
            v = self.to(self.resolve(v), tuple(w + a for w, a in zip(want, auto, strict=True)))
            inner.append(V(v.x, tuple(var.aval.shape), v.dtype, auto, v.partial, v.act))
        results = self.run(body, consts, inner)
        outs = []
        for r, spec, var in zip(results, p["out_specs"], eqn.outvars, strict=True):
            dims = tuple(w + a for w, a in zip(spec_axes(spec, len(r.dims)), r.dims, strict=True))
            outs.append(V(r.x, tuple(var.aval.shape), r.dtype, dims, r.partial - manual, r.act))
        return outs

    def op_ppermute(self, eqn: Any, ins: list[V]) -> list[V]:
        """A permute the model wrote (inside a shard_map region): run on the local block as written."""
        (v,) = ins
        axes = eqn.params["axis_name"]
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        self.issue("collective-permute", axes, self.nbytes(v.shape, v.dims, v.dtype))
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [v.dims], [v.partial], v.act, xs)

    def scan(self, eqn: Any, ins: list[V]) -> list[V]:
        p = eqn.params
        (nc, ncarry), closed, length = scan_counts(eqn), p["jaxpr"], p["length"]
        consts, carry, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
        carry = [self.resolve(c) for c in carry]
        # The scanned dim of each xs whole (each iteration reads one slice).
        xs = [self.to(x, ((), *x.dims[1:]), keep_partial=True) if x.dims and x.dims[0] else x for x in xs]
        xs = [self.resolve(x) for x in xs]

        def sliced(v: V, x: Any = None) -> V:
            return V(x, v.shape[1:], v.dtype, v.dims[1:], v.partial, v.act)

        # Carry layouts: a fixed point of the body (a carry changing layout is made less split).
        # A carry made in the step (a jnp.zeros buffer) starts in the layout the body gives it.
        dims = [c.dims for c in carry]
        free = [c.make is not None for c in carry]
        dry = Partitioner(self.mesh, Record(), dry=True, batch_axes=self.batch_axes)
        for _ in range(8):
            vals = [V(None, c.shape, c.dtype, d, frozenset(), c.act) for c, d in zip(carry, dims, strict=True)]
            outs = dry.run(closed.jaxpr, list(closed.consts), [*consts, *vals, *[sliced(x) for x in xs]])
            new = [o.dims if f else _common(d, o.dims) for d, o, f in zip(dims, outs[:ncarry], free, strict=True)]
            free = [False] * ncarry
            acts = [c.act or o.act for c, o in zip(carry, outs[:ncarry], strict=True)]
            if new == dims:
                break
            dims = new
        else:
            dims = [((),) * len(c.shape) for c in carry]
        carry = [self.to(c, d) for c, d in zip(carry, dims, strict=True)]
        carry = [V(c.x, c.shape, c.dtype, c.dims, c.partial, a) for c, a in zip(carry, acts, strict=True)]
        ys_layout: list[V] = []
        outer_mult = self.mult
        # A stacked output wanted split (a scanned layer's weight gradient in its param's layout):
        # each iteration's slice is reduced straight into that split.
        y_hints: list = []
        for o in eqn.outvars[ncarry:]:
            h = self.hints.get(o)
            y_hints.append(h[1:] if h is not None and h and not h[0] else None)
        self.mult = outer_mult * length

        def body(c, x):
            cv = [V(a, v.shape, v.dtype, v.dims, v.partial, v.act) for a, v in zip(c, carry, strict=True)]
            xv = [sliced(v, a) for a, v in zip(x, xs, strict=True)]
            self.caches.append({})
            try:
                outs = self.run(closed.jaxpr, list(closed.consts), [*consts, *cv, *xv], [None] * ncarry + y_hints)
                new_c = [self.to(o, d) for o, d in zip(outs[:ncarry], dims, strict=True)]
                ys = [
                    self.resolve(o, h) if h is not None and self.fits(o.shape, h) else self.resolve(o)
                    for o, h in zip(outs[ncarry:], y_hints, strict=True)
                ]
            finally:
                self.caches.pop()
            ys_layout[:] = ys
            return [v.x for v in new_c], [v.x for v in ys]

        try:
            if self.dry:
                body([None] * len(carry), [None] * len(xs))
                c_out, y_out = [None] * len(carry), [None] * len(ys_layout)
            else:
                c_out, y_out = jax.lax.scan(
                    body,
                    [c.x for c in carry],
                    [x.x for x in xs],
                    length=length,
                    reverse=p["reverse"],
                    unroll=p["unroll"],
                )
        finally:
            self.mult = outer_mult
        outs = [V(x, c.shape, c.dtype, c.dims, frozenset(), c.act) for x, c in zip(c_out, carry, strict=True)]
        for y, lay in zip(y_out, ys_layout, strict=True):
            outs.append(V(y, (length, *lay.shape), lay.dtype, ((), *lay.dims), frozenset(), lay.act))
        return outs

    # -- elementwise -----------------------------------------------------------------------
    def elementwise(self, eqn: Any, ins: list[V]) -> list[V]:
        """Elementwise ops; on a grouped matmul's own rows (``Rows``) where every other operand is
        exact on them (no pending sum over the groups' axes, those rows not split): the rows kept."""
        held = [v.rows for v in ins if v.rows is not None]
        if not held:
            return self._elementwise(eqn, ins)
        r = held[0]
        rank = len(eqn.outvars[0].aval.shape)
        # Another operand pending over the groups' axes (a lookup of the routing weights) is
        # summed first where it is no larger than the rows' value.
        size = max(self.nbytes(v.shape, v.dims, v.dtype) for v in ins if v.rows is not None)
        ins = [
            self.resolve(v)
            if v.rows is None and v.partial & set(r.axes) and self.nbytes(v.shape, v.dims, v.dtype) <= size
            else v
            for v in ins
        ]
        if all(
            (v.rows is not None and v.rows.fits(v, r.sizes, r.axes, r.dim))
            or (v.rows is None and not v.partial & set(r.axes) and (len(v.shape) < rank or not v.dims[r.dim]))
            for v in ins
        ):
            return [self.owned(o, r) for o in self._elementwise(eqn, [self.bare(v) for v in ins])]
        return self._elementwise(eqn, [self.unown(v) for v in ins])

    def _elementwise(self, eqn: Any, ins: list[V]) -> list[V]:
        name = eqn.primitive.name
        shape = tuple(eqn.outvars[0].aval.shape)
        act = any(v.act for v in ins)
        full = [i for i, v in enumerate(ins) if len(v.shape) == len(shape) and shape]
        scal = [i for i in range(len(ins)) if i not in full]
        partials = {ins[i].partial for i in full}
        keep: frozenset[str] = frozenset()
        if any(v.shared and v.partial for v in ins):
            partials = {frozenset(), frozenset({"?"})}  # a shared operand is reduced, not carried
        if len(partials) == 1 and not any(ins[i].partial for i in scal):
            only = next(iter(partials))
            # Linear in all operands together: every operand, scalars too, must carry the same
            # pending sum (a constant added to each device's partial would be summed n times:
            # an RMSNorm's ``mean + eps`` on a row-parallel output).
            if only and name in _LINEAR_ALL and all(v.partial == only for v in ins):
                keep = only
        if name == "mul" and len(ins) == 2 and not keep and not any(v.shared for v in ins):
            ps = [v.partial for v in ins]
            if bool(ps[0]) != bool(ps[1]):
                keep = ps[0] or ps[1]
        if name == "div" and ins[0].partial and not ins[1].partial and not ins[0].shared:
            keep = ins[0].partial
        # The layout: the most split operand's, extended by other operands' splits where free.
        if full:
            base = max(full, key=lambda i: (self.n(tuple(a for d in ins[i].dims for a in d)), ins[i].act))
            target = [list(d) for d in ins[base].dims]
            used = {a for d in target for a in d}
            for i in full:
                for j, d in enumerate(ins[i].dims):
                    if (
                        d
                        and not target[j]
                        and not (set(d) & used)
                        and shape[j] % self.n(d) == 0
                        and (ins[i].shape[j] == shape[j])
                    ):
                        target[j] = list(d)
                        used |= set(d)
            tgt = _t(target)
            if used & keep:
                keep = frozenset()
        vals = []
        for i, v in enumerate(ins):
            if i in full:
                own = tuple(t if v.shape[j] == shape[j] else () for j, t in enumerate(tgt))
                vals.append(self.to(v, own, keep_partial=bool(keep) and v.partial == keep))
            else:
                vals.append(self.resolve(v, keep=keep if v.partial == keep else frozenset()))
        xs = self.bind(eqn, [v.x for v in vals])
        out_dims = tgt if full else ((),) * len(shape)
        outs = self.out(eqn, [out_dims], [keep], act=act, xs=xs)
        if any(v.make is not None for v in ins) and all(v.make is not None or not (v.shape or v.partial) for v in ins):
            # Of values made in the step only (a mask from iotas): made too, in any layout.
            def build(want: Dims) -> Any:
                args = []
                for v in ins:
                    own = tuple(d if v.shape[j] == shape[j] else () for j, d in enumerate(want)) if v.shape else ()
                    args.append(v.x if v.make is None else v.make(own))
                return self.bind(eqn, args)[0]  # type: ignore[index]

            outs[0].make = self.made(eqn, build)
        return outs

    # -- shapes ----------------------------------------------------------------------------
    def op_broadcast_in_dim(self, eqn: Any, ins: list[V]) -> list[V] | None:
        v, rest = ins[0], ins[1:]
        if rest:  # dynamic shapes
            return None
        shape = tuple(eqn.params["shape"])
        dims: list[tuple[str, ...]] = [()] * len(shape)
        for i, j in enumerate(eqn.params["broadcast_dimensions"]):
            if v.shape[i] == shape[j]:
                dims[j] = v.dims[i]
        xs = self.bind(eqn, [v.x], shape=self.local_shape(shape, dims), sharding=None)
        outs = self.out(eqn, [dims], [v.partial], act=v.act, xs=xs)
        if not v.partial and (not v.shape or v.make is not None):
            # ``jnp.zeros``/``full`` (a broadcast scalar), or a broadcast of a value made in the step.
            bdims = tuple(eqn.params["broadcast_dimensions"])

            def build(want: Dims) -> Any:
                src = tuple(want[j] if v.shape[i] == shape[j] else () for i, j in enumerate(bdims))
                x = self.to(v, src).x if v.shape else v.x
                return jax.lax.broadcast_in_dim(x, self.local_shape(shape, want), bdims)

            outs[0].make = self.made(eqn, build)
        return outs

    def op_transpose(self, eqn: Any, ins: list[V]) -> list[V]:
        # A pending sum is reduced before a transpose: XLA would otherwise fold the transpose into
        # the producing matmul (a weight gradient), in a form XLA:CPU runs without its fast dot path.
        hint = self.hints.get(eqn.outvars[0])
        v = self.resolve(ins[0], None if hint is None else permuted(hint, eqn.params["permutation"]))
        perm = eqn.params["permutation"]
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [tuple(v.dims[p] for p in perm)], [v.partial], act=v.act, xs=xs)

    def op_squeeze(self, eqn: Any, ins: list[V]) -> list[V]:
        v = ins[0]
        gone = {d % len(v.shape) for d in eqn.params["dimensions"]}
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [tuple(d for i, d in enumerate(v.dims) if i not in gone)], [v.partial], v.act, xs)

    def op_reshape(self, eqn: Any, ins: list[V]) -> list[V] | None:
        v = ins[0]
        if eqn.params.get("dimensions") is not None or len(ins) > 1:
            return None
        shape = tuple(eqn.params["new_sizes"])
        groups = _groups(v.shape, shape)
        if groups is None:
            return None
        need = [list(d) for d in v.dims]
        out: list[tuple[str, ...]] = [()] * len(shape)
        for ii, jj in groups:
            split = [i for i in ii if v.dims[i]]
            if not split:
                continue
            if len(ii) == 1 and jj:  # one dim split into several: the major output dim keeps the split
                i = ii[0]
                j = next((j for j in jj if shape[j] != 1), jj[0])  # past inserted size-1 dims ([L] -> [1, P, K])
                if shape[j] % self.n(v.dims[i]) == 0:
                    out[j] = v.dims[i]
                else:
                    need[i] = []
            elif len(jj) == 1:  # several dims merged into one: only the major one may be split
                first = next(i for i in ii if v.shape[i] != 1)
                for i in split:
                    if i != first:
                        need[i] = []
                out[jj[0]] = tuple(need[first])
            else:
                for i in split:
                    need[i] = []
        v = self.to(v, _t(need), keep_partial=True)
        xs = self.bind(eqn, [v.x], new_sizes=self.local_shape(shape, out), sharding=None)
        return self.out(eqn, [out], [v.partial], v.act, xs)

    def op_iota(self, eqn: Any, ins: list[V]) -> list[V]:
        p = eqn.params
        shape, dim, dtype = tuple(p["shape"]), p["dimension"], p["dtype"]

        def build(want: Dims) -> Any:
            loc = self.local_shape(shape, want)
            x = jax.lax.broadcasted_iota(dtype, loc, dim)
            if want[dim]:  # this device's block of the iota: offset by its first index
                x = x + (self.index(want[dim]) * loc[dim]).astype(dtype)
            return x

        xs = self.bind(eqn, [])
        outs = self.out(eqn, [((),) * len(shape)], xs=xs)
        outs[0].make = self.made(eqn, build)
        return outs

    def _unsplit(self, eqn: Any, ins: list[V], which: set[int], first: int = 1) -> tuple[V, list[V]]:
        v = ins[0]
        v = self.to(v, tuple(() if i in which else d for i, d in enumerate(v.dims)), keep_partial=True)
        rest = [self.resolve(x) for x in ins[first:]]
        rest = [self.whole(x) for x in rest]
        return v, rest

    def op_slice(self, eqn: Any, ins: list[V]) -> list[V]:
        v = ins[0]
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params["strides"] or (1,) * len(v.shape)
        cut = {i for i in range(len(v.shape)) if (start[i], limit[i], strides[i]) != (0, v.shape[i], 1)}
        v, _ = self._unsplit(eqn, ins, cut)
        loc = self.local_shape(v.shape, v.dims)
        lim = tuple(loc[i] if i not in cut else limit[i] for i in range(len(loc)))
        xs = self.bind(eqn, [v.x], limit_indices=lim)
        return self.out(eqn, [v.dims], [v.partial], v.act, xs)

    def op_dynamic_slice(self, eqn: Any, ins: list[V]) -> list[V]:
        """A window at a position (a rolling buffer's read, a KV cache's): dims it takes whole keep
        their split (the position there is clamped to 0 on every device), the others are read whole."""
        sizes = tuple(eqn.params["slice_sizes"])
        cut = {i for i, n in enumerate(sizes) if n != ins[0].shape[i]}
        v, idx = self._unsplit(eqn, ins, cut)
        xs = self.bind(eqn, [v.x, *[i.x for i in idx]], slice_sizes=self.local_shape(sizes, v.dims))
        return self.out(eqn, [v.dims], [v.partial], v.act or any(i.act for i in idx), xs)

    def op_dynamic_update_slice(self, eqn: Any, ins: list[V]) -> list[V]:
        """A window written at a position (a KV-cache write): dims the update covers whole take one
        split on both operands (a buffer made in the step takes the update's), the others whole."""
        op, upd, idx = ins[0], ins[1], ins[2:]
        if op.partial != upd.partial:  # linear in both together: one pending sum carried, else none
            op, upd = self.resolve(op), self.resolve(upd)
        first, second = (upd, op) if op.make is not None else (op, upd)
        dims: list[tuple[str, ...]] = []
        used: set[str] = set()
        for i, n in enumerate(op.shape):
            pick: tuple[str, ...] = ()
            if upd.shape[i] == n:
                for cand in (first.dims[i], second.dims[i]):
                    if cand and not set(cand) & used and n % self.n(cand) == 0:
                        pick = cand
                        break
            dims.append(pick)
            used |= set(pick)
        tgt = _t(dims)
        op2, upd2 = self.to(op, tgt, keep_partial=True), self.to(upd, tgt, keep_partial=True)
        if op2.partial != upd2.partial:
            op2, upd2 = self.resolve(op2), self.resolve(upd2)
        idx = [self.whole(self.resolve(i)) for i in idx]
        xs = self.bind(eqn, [op2.x, upd2.x, *[i.x for i in idx]])
        act = op.act or upd.act or any(i.act for i in idx)
        return self.out(eqn, [tgt], [op2.partial], act, xs)

    def op_pad(self, eqn: Any, ins: list[V]) -> list[V]:
        cfg = eqn.params["padding_config"]
        cut = {i for i, c in enumerate(cfg) if tuple(c) != (0, 0, 0)}
        v, rest = self._unsplit(eqn, ins, cut)
        if v.partial:
            v = self.resolve(v)
        xs = self.bind(eqn, [v.x, *[r.x for r in rest]])
        return self.out(eqn, [v.dims], act=v.act or any(r.act for r in rest), xs=xs)

    def op_split(self, eqn: Any, ins: list[V]) -> list[V]:
        axis = eqn.params["axis"]
        v, _ = self._unsplit(eqn, ins, {axis})
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [v.dims] * len(eqn.outvars), [v.partial] * len(eqn.outvars), v.act, xs)

    def op_concatenate(self, eqn: Any, ins: list[V]) -> list[V]:
        dim = eqn.params["dimension"]
        base = max(ins, key=lambda v: (self.n(tuple(a for d in v.dims for a in d)), v.act))
        tgt = tuple(() if i == dim else d for i, d in enumerate(base.dims))
        vals = [self.to(v, tgt) for v in ins]
        xs = self.bind(eqn, [v.x for v in vals])
        return self.out(eqn, [tgt], act=any(v.act for v in ins), xs=xs)

    def op_stack(self, eqn: Any, ins: list[V]) -> list[V]:
        """``jnp.stack`` (a primitive in this jax): the operands laid out alike, a new whole dim."""
        axis = eqn.params["axis"]
        base = max(ins, key=lambda v: (self.n(tuple(a for d in v.dims for a in d)), v.act))
        vals = [self.to(self.resolve(v), base.dims) for v in ins]
        xs = self.bind(eqn, [v.x for v in vals])
        dims = base.dims[:axis] + ((),) + base.dims[axis:]
        return self.out(eqn, [dims], act=any(v.act for v in ins), xs=xs)

    def op_unstack(self, eqn: Any, ins: list[V]) -> list[V]:
        """``unstack`` along ``axis``: that dim whole, the others stay split; each result the
        operand's layout less that dim."""
        axis = eqn.params["axis"] % len(ins[0].shape)
        v = self.to(self.resolve(ins[0]), tuple(() if i == axis else d for i, d in enumerate(ins[0].dims)))
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [v.dims[:axis] + v.dims[axis + 1 :]] * len(eqn.outvars), act=v.act, xs=xs)

    def _along(self, eqn: Any, ins: list[V], axes) -> list[V]:
        """Ops along some dims (cumsum, sort, argsort, rev): those dims whole, others stay split."""
        which = {a % len(ins[0].shape) for a in axes}
        vals = [self.to(self.resolve(v), tuple(() if i in which else d for i, d in enumerate(ins[0].dims)))
                for v in ins]  # fmt: skip
        xs = self.bind(eqn, [v.x for v in vals])
        return self.out(eqn, [vals[0].dims] * len(eqn.outvars), act=any(v.act for v in ins), xs=xs)

    def op_cumsum(self, eqn, ins):
        return self._along(eqn, ins, (eqn.params["axis"],))

    op_cumprod = op_cummax = op_cummin = op_cumlogsumexp = op_cumsum

    def op_top_k(self, eqn: Any, ins: list[V]) -> list[V] | None:
        v = ins[0]
        axis = eqn.params.get("axis", len(v.shape) - 1) % len(v.shape)
        if v.dims[axis]:  # the k largest of a split dim: whole operands (a reported fallback)
            return None
        return self._along(eqn, ins, (axis,))

    # -- random numbers: a function of each key, so a batch of keys stays split ---------------
    def _per_key(self, eqn: Any, ins: list[V], rank: int) -> list[V]:
        """An op of each key: the keys' layout on the leading ``rank`` dims (the key array's
        shape), the trailing output dims (bits per key, split keys, key data) whole."""
        keys = self.resolve(ins[0])
        lead = tuple(keys.dims[:rank])
        keys = self.to(keys, lead + ((),) * (len(keys.shape) - rank))
        rest = []
        for v in ins[1:]:
            v = self.resolve(v)
            rest.append(self.to(v, lead) if v.shape == keys.shape[:rank] and v.shape else self.whole(v))
        xs = self.bind(eqn, [keys.x, *[v.x for v in rest]])
        dims = [lead + ((),) * (len(getattr(o.aval, "shape", ())) - rank) for o in eqn.outvars]
        return self.out(eqn, dims, act=any(v.act for v in ins), xs=xs)

    def op_random_bits(self, eqn, ins):
        return self._per_key(eqn, ins, len(ins[0].shape))

    op_random_split = op_random_bits

    def op_random_fold_in(self, eqn, ins):
        return self._per_key(eqn, ins, len(ins[0].shape))

    op_random_seed = op_random_clone = op_random_unwrap = op_random_fold_in

    def op_random_wrap(self, eqn, ins):  # key data (..., 2) -> keys (...)
        return self._per_key(eqn, ins, len(ins[0].shape) - 1)

    def op_rev(self, eqn, ins):
        return self._along(eqn, ins, eqn.params["dimensions"])

    def op_sort(self, eqn, ins):
        if any(v.shape != ins[0].shape for v in ins):
            return None
        return self._along(eqn, ins, (eqn.params["dimension"],))

    # -- reductions ------------------------------------------------------------------------
    def op_reduce_sum(self, eqn: Any, ins: list[V]) -> list[V]:
        v = ins[0]
        axes = tuple(eqn.params["axes"])
        kept = [i for i in range(len(v.shape)) if i not in axes]
        reduced = frozenset(a for i in axes for a in v.dims[i])
        xs = self.bind(eqn, [v.x], out_sharding=None) if "out_sharding" in eqn.params else self.bind(eqn, [v.x])
        return self.out(eqn, [tuple(v.dims[i] for i in kept)], [v.partial | reduced], v.act, xs)

    def op_reduce_max(self, eqn: Any, ins: list[V]) -> list[V]:
        v = self.resolve(ins[0])
        axes = tuple(eqn.params["axes"])
        kept = [i for i in range(len(v.shape)) if i not in axes]
        reduced = tuple(a for a in self.mesh if any(a in v.dims[i] for i in axes))
        changes = {"out_sharding": None} if "out_sharding" in eqn.params else {}
        xs = self.bind(eqn, [v.x], **changes)
        dims = tuple(v.dims[i] for i in kept)
        if reduced:
            o = eqn.outvars[0].aval
            self.issue("all-reduce", reduced, self.nbytes(tuple(o.shape), dims, o.dtype))
            if xs is not None:
                red = jax.lax.pmax if eqn.primitive.name == "reduce_max" else jax.lax.pmin
                xs = [red(xs[0], reduced)]
        return self.out(eqn, [dims], act=v.act, xs=xs)

    op_reduce_min = op_reduce_max

    def op_argmax(self, eqn: Any, ins: list[V]) -> list[V]:
        v = ins[0]
        axes = set(eqn.params["axes"])
        v = self.to(self.resolve(v), tuple(() if i in axes else d for i, d in enumerate(v.dims)))
        xs = self.bind(eqn, [v.x])
        return self.out(eqn, [tuple(d for i, d in enumerate(v.dims) if i not in axes)], act=v.act, xs=xs)

    op_argmin = op_argmax

    # Reductions with no cheap cross-device form: the reduced dims gathered first.
    op_reduce_and = op_reduce_or = op_reduce_prod = op_reduce_xor = op_argmax

    # -- matmul ----------------------------------------------------------------------------
    def op_dot_general(self, eqn: Any, ins: list[V]) -> list[V]:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        if lhs.partial and rhs.partial:
            rhs = self.resolve(rhs)
        ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
        lfree = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
        rfree = [j for j in range(len(rhs.shape)) if j not in rc and j not in rb]
        # Which side keeps its layout in a conflict: the activation (the batch's split), else the
        # side whose gather would move more bytes.
        lbytes = self.nbytes(lhs.shape, lhs.dims, lhs.dtype)
        rbytes = self.nbytes(rhs.shape, rhs.dims, rhs.dtype)
        keep_left = (lhs.act, lbytes) >= (rhs.act, rbytes)

        def used(dims, skip):
            return {a for k, d in enumerate(dims) if k != skip for a in d}

        # Batch dims: both sides the same layout.
        for i, j in zip(lb, rb, strict=True):
            if ldims[i] != rdims[j]:
                src = ldims[i] if keep_left else rdims[j]
                ldims[i], rdims[j] = list(src), list(src)
        # An axis a batch dim takes is given up by the other dims of that side.
        for dims, bs in ((ldims, lb), (rdims, rb)):
            taken = {a for i in bs for a in dims[i]}
            for k in range(len(dims)):
                if k not in bs:
                    dims[k] = [a for a in dims[k] if a not in taken]
        # Contracting dims: split alike on both sides -> local, and a pending sum.
        for i, j in zip(lc, rc, strict=True):
            if ldims[i] == rdims[j]:
                continue
            for _ in range(3):
                a, b = ldims[i], rdims[j]
                if a == b:
                    break
                if not a and not set(b) & (used(ldims, i) | lhs.partial):
                    ldims[i] = list(b)
                elif not b and not set(a) & (used(rdims, j) | rhs.partial):
                    rdims[j] = list(a)
                elif keep_left and b:
                    rdims[j] = []
                elif a:
                    ldims[i] = []
                else:
                    rdims[j] = []
            if ldims[i] != rdims[j]:
                ldims[i], rdims[j] = [], []
        contract = {a for i in lc for a in ldims[i]}
        # Free dims: an axis splits one free dim of one side, and not the contraction or batch.
        inner = {a for i in (*lc, *lb) for a in ldims[i]}
        for i in lfree:
            ldims[i] = [a for a in ldims[i] if a not in inner]
        for j in rfree:
            rdims[j] = [a for a in rdims[j] if a not in inner]
        lf = {a for i in lfree for a in ldims[i]}
        rf = {a for j in rfree for a in rdims[j]}
        clash = lf & rf
        if clash:
            # A batch axis stays on the activation; another axis (a sequence split meeting a
            # column-parallel weight) stays where gathering the other side moves fewer bytes.
            if not clash & self.batch_axes and lhs.act != rhs.act:
                lgain = self.nbytes(lhs.shape, [[a for a in d if a not in clash] for d in ldims], lhs.dtype)
                rgain = self.nbytes(rhs.shape, [[a for a in d if a not in clash] for d in rdims], rhs.dtype)
                keep_left = lgain > rgain
            if keep_left:
                for j in rfree:
                    rdims[j] = [a for a in rdims[j] if a not in clash]
            else:
                for i in lfree:
                    ldims[i] = [a for a in ldims[i] if a not in clash]
        # An axis pending on one operand must not split the other (its blocks would not line up).
        lt, rt = _t(ldims), _t(rdims)
        # A pending sum over an axis that splits the other side would pair the wrong blocks.
        if lhs.partial & {a for d in rt for a in d}:
            lhs = self.resolve(lhs)
        if rhs.partial & {a for d in lt for a in d}:
            rhs = self.resolve(rhs)
        l2 = self.to(lhs, lt, keep_partial=True)
        r2 = self.to(rhs, rt, keep_partial=True)
        partial = set(l2.partial | r2.partial | contract)
        out_dims = [lt[i] for i in lb] + [lt[i] for i in lfree] + [rt[j] for j in rfree]
        xs = (
            self.bind(eqn, [l2.x, r2.x], out_sharding=None)
            if "out_sharding" in eqn.params
            else self.bind(eqn, [l2.x, r2.x])
        )
        return self.out(eqn, [out_dims], [frozenset(partial)], act=lhs.act or rhs.act, xs=xs)

    # -- grouped matmul (jax.lax.ragged_dot: experts stacked by group, tokens sorted by group) --
    def op_ragged_dot_general(self, eqn: Any, ins: list[V]) -> list[V] | None:
        """A grouped matmul with its groups split over axes ``G`` (an expert axis): each device
        runs its own groups on the rows they own (rows ``[start, start + its sizes)`` of the
        sorted tokens, rolled to the front: jax's grouped matmul has no group offset), locally.

        Forward (the weights' group dim split, the ragged rows a free dim): rows outside the
        device's groups come out zero, so the result is a pending sum over ``G``. Weight
        gradient (the ragged rows contracted, the result's group dim split as its param wants):
        each device's groups, nothing pending. The ragged rows and the group sizes are whole
        (the sort that made them is global); contracting dims follow the matmul's rule."""
        lhs, rhs, sizes = ins
        nums = eqn.params["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = nums.dot_dimension_numbers
        if lb or rb or len(nums.lhs_ragged_dimensions) != 1 or len(nums.rhs_group_dimensions) > 1:
            return None
        (r,) = nums.lhs_ragged_dimensions
        grouping = sizes
        sizes = self.whole(self.resolve(sizes))
        g = sizes.shape[0]
        lfree = [i for i in range(len(lhs.shape)) if i not in lc]
        forward = bool(nums.rhs_group_dimensions)
        if forward:  # lhs (..., m, ..., k), rhs (g, k, n): out (lhs free dims, rhs free dims)
            (gd,) = nums.rhs_group_dimensions
            rfree = [j for j in range(len(rhs.shape)) if j not in rc and j != gd]
            group = tuple(rhs.dims[gd])
            ragged_pairs: list[tuple[int, int]] = []
        else:  # ragged rows contracted: out (g, lhs free dims, rhs free dims)
            rfree = [j for j in range(len(rhs.shape)) if j not in rc]
            hint = self.hints.get(eqn.outvars[0])
            group = tuple(hint[0]) if hint is not None and hint[0] and g % self.n(hint[0]) == 0 else ()
            ragged_pairs = [(r, rc[lc.index(r)])]
            want = list(hint[1:]) if hint is not None else None
        # Operands exact on this device's rows of this grouping (an earlier grouped matmul's result
        # and what elementwise ops made of it) are read as they are: only those rows are read.
        # (zeroed elsewhere: a row no group takes must add nothing, whatever it held)
        rrow = ragged_pairs[0][1] if ragged_pairs else -1
        lhs, rhs = (
            self.bare(self.unown(v), v.rows.axes) if v.rows and v.rows.fits(v, grouping, group, dim) else self.unown(v)
            for v, dim in ((lhs, r), (rhs, rrow))
        )
        if lhs.partial and rhs.partial:
            rhs = self.resolve(rhs)
        ldims, rdims = [list(d) for d in lhs.dims], [list(d) for d in rhs.dims]
        if not forward and want is not None:
            # The gradient's layout where an operand's dim is whole and its axes idle (a free
            # slice); where they split something already, the result moves afterwards instead.
            free = [ldims[i] for i in lfree] + [rdims[j] for j in rfree]  # the result's dims after the group's
            for dim, wanted in zip(free, want, strict=True):
                if wanted and not dim and not set(wanted) & ({x for d in (*ldims, *rdims) for x in d} | set(group)):
                    dim[:] = list(wanted)
        # The ragged rows whole; the group axes nowhere else.
        for i, j in ragged_pairs:
            ldims[i], rdims[j] = [], []
        ldims[r] = []
        for dims in (ldims, rdims):
            for k in range(len(dims)):
                if not (forward and dims is rdims and k == gd):
                    dims[k] = [a for a in dims[k] if a not in group]
        # Contracting dims split alike: local, and a pending sum. Split unlike: the cheapest of
        # both whole (the split sides gathered) and one side taking the other's split (its own
        # split of the dim, and of other dims over those axes, gathered; the result's sum
        # pending): an FSDP expert weight is gathered where the tokens are larger.
        out_elems = math.prod(lhs.shape[i] for i in lfree) * math.prod(rhs.shape[j] for j in rfree)
        out_bytes = out_elems * np.dtype(eqn.outvars[0].aval.dtype).itemsize // self.n(group)

        def taking(dims: list, k: int, split: list, nbytes: int, closed: set) -> int | None:
            """What laying ``dims``' dim ``k`` out as ``split`` moves (None: it cannot)."""
            if set(split) & closed:
                return None
            moved = set(dims[k]) | {x for m, d in enumerate(dims) if m != k for x in d if x in split}
            return nbytes * self.n(tuple(moved)) if moved else 0

        for i, j in zip(lc, rc, strict=True):
            a, b = ldims[i], rdims[j]
            if a == b:
                continue
            lb_, rb_ = self.nbytes(lhs.shape, _t(ldims), lhs.dtype), self.nbytes(rhs.shape, _t(rdims), rhs.dtype)
            options = [((lb_ * self.n(tuple(a)) if a else 0) + (rb_ * self.n(tuple(b)) if b else 0), 0)]
            take_l = taking(ldims, i, b, lb_, set(lhs.partial))
            if take_l is not None:
                options.append((take_l + out_bytes, 1))
            take_r = taking(rdims, j, a, rb_, set(rhs.partial) | set(group))
            if take_r is not None:
                options.append((take_r + out_bytes, 2))
            choice = min(options)[1]
            if choice == 0:
                ldims[i], rdims[j] = [], []
            else:
                dims, k, split = (ldims, i, b) if choice == 1 else (rdims, j, a)
                for m in range(len(dims)):
                    dims[m] = list(split) if m == k else [x for x in dims[m] if x not in split]
        contract = {a for i in lc for a in ldims[i]}
        # A free axis on both sides: the weight's side gives it up.
        lf = {a for i in lfree for a in ldims[i]}
        for j in rfree:
            rdims[j] = [a for a in rdims[j] if a not in lf and a not in contract]
        for i in lfree:
            ldims[i] = [a for a in ldims[i] if a not in contract]
        lt, rt = _t(ldims), _t(rdims)
        lsplit = {a for d in lt for a in d} | set(group)
        rsplit = {a for d in rt for a in d} | set(group)
        if lhs.partial & rsplit:
            lhs = self.resolve(lhs)
        if rhs.partial & lsplit:
            rhs = self.resolve(rhs)
        l2 = self.to(lhs, lt, keep_partial=True)
        r2 = self.to(rhs, rt, keep_partial=True)
        xs: list | None = None
        start: Any = None
        count: Any = None
        if not self.dry:
            lx, rx, local_sizes = l2.x, r2.x, sizes.x
            if group:
                n = g // self.n(group)
                first = self.index(group) * n
                local_sizes = jax.lax.dynamic_slice_in_dim(sizes.x, first, n)
                start = jnp.sum(jnp.where(jnp.arange(g) < first, sizes.x, 0))
                count = jnp.sum(local_sizes)
                lx = jnp.roll(lx, -start, axis=r)
                if not forward:
                    rx = jnp.roll(rx, -start, axis=rrow)
            xs = self.bind(eqn, [lx, rx, local_sizes])
            if forward and group and xs is not None:
                xs = [jnp.roll(xs[0], start, axis=lfree.index(r))]
        out_free = [lt[i] for i in lfree] + [rt[j] for j in rfree]
        out_dims = out_free if forward else [group, *out_free]
        partial = l2.partial | r2.partial | contract
        (out,) = self.out(eqn, [out_dims], [frozenset(partial)], act=lhs.act or rhs.act, xs=xs)
        if forward and group:  # this device's rows: its groups' tokens (zero elsewhere)
            out = self.owned(out, Rows(grouping, group, lfree.index(r), start, count))
        return [out]

    # -- constraints ------------------------------------------------------------------------
    def op_sharding_constraint(self, eqn: Any, ins: list[V]) -> list[V]:
        v = ins[0]
        tgt = constraint_target(eqn, v.dims)
        if tgt is None:
            return [v]
        tgt = tuple(tuple(a for a in d if a in self.mesh) for d in tgt)
        if not self.fits(v.shape, tgt):
            return [v]
        return [self.to(v, tgt)]

    # -- lookups ---------------------------------------------------------------------------
    def op_gather(self, eqn: Any, ins: list[V]) -> list[V] | None:
        op, idx = ins
        dn = eqn.params["dimension_numbers"]
        sizes = tuple(eqn.params["slice_sizes"])
        mode = eqn.params["mode"]
        mode_name = getattr(mode, "name", str(mode))
        if op.partial or idx.partial:
            op, idx = self.resolve(op), self.resolve(idx)
        r = len(op.shape)
        out_rank = len(eqn.outvars[0].aval.shape)
        batch_out = [k for k in range(out_rank) if k not in dn.offset_dims]
        ib = list(range(len(idx.shape) - 1))  # indices batch dims, in order -> batch_out
        idims = [list(d) for d in idx.dims[:-1]]
        odims = [list(d) for d in op.dims]
        # Operand batching dims follow the indices' layout.
        for od, idd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True):
            odims[od] = list(idims[idd])
        masked: list[int] = []
        for k, od in enumerate(dn.start_index_map):
            if odims[od]:
                if sizes[od] == 1 and od in dn.collapsed_slice_dims and self.fits(op.shape, _t(odims)):
                    masked.append(k)
                else:
                    odims[od] = []
        window = [d for d in range(r) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        for d in window:
            if odims[d] and sizes[d] != op.shape[d]:
                odims[d] = []
        # An axis on the indices and on a window/indexed dim of the table: the table gives it up.
        idx_axes = {a for d in idims for a in d}
        for d in range(r):
            if d not in dn.operand_batching_dims:
                odims[d] = [a for a in odims[d] if a not in idx_axes]
        masked = [k for k in masked if odims[dn.start_index_map[k]]]
        if masked and mode_name == "FILL_OR_DROP" and not jnp.issubdtype(op.dtype, jnp.floating):
            return None
        op2 = self.to(op, _t(odims))
        idx2 = self.to(idx, (*_t(idims), ()))
        out_dims: list[tuple[str, ...]] = [()] * out_rank
        for k, i in zip(batch_out, ib, strict=True):
            out_dims[k] = tuple(idims[i])
        for k, d in zip(dn.offset_dims, window, strict=True):
            out_dims[k] = tuple(odims[d])
        partial = frozenset(a for k in masked for a in odims[dn.start_index_map[k]])
        act = op.act or idx.act
        if self.dry:
            return self.out(eqn, [out_dims], [partial], act)
        loc_sizes = tuple(s // self.n(odims[d]) if d in window else s for d, s in enumerate(sizes))
        if not masked:
            xs = self.bind(eqn, [op2.x, idx2.x], slice_sizes=loc_sizes)
            return self.out(eqn, [out_dims], [partial], act, xs)
        indices = idx2.x
        valid: Any = None
        gvalid: Any = None
        cols = []
        for k, od in enumerate(dn.start_index_map):
            col = indices[..., k]
            if k in masked:
                n = self.n(odims[od])
                size = op.shape[od] // n
                if mode_name == "CLIP":
                    col = jnp.clip(col, 0, op.shape[od] - 1)
                g_ok = (col >= 0) & (col < op.shape[od])
                gvalid = g_ok if gvalid is None else gvalid & g_ok
                col, ok = self.local_index(col, odims[od], size)
                valid = ok if valid is None else valid & ok
            cols.append(col)
        new_idx = jnp.stack(cols, axis=-1).astype(indices.dtype)
        bound = self.bind(eqn, [op2.x, new_idx], slice_sizes=loc_sizes, mode=jax.lax.GatherScatterMode.CLIP)
        assert bound is not None
        res = bound[0]
        bdims = tuple(batch_out)
        mask = jax.lax.broadcast_in_dim(valid, res.shape, bdims)
        res = jnp.where(mask, res, jnp.zeros((), res.dtype))
        if mode_name == "FILL_OR_DROP":
            fill = eqn.params.get("fill_value")
            fill = jnp.nan if fill is None else fill
            first = self.index(tuple(partial)) == 0
            bad = jax.lax.broadcast_in_dim(~gvalid & first, res.shape, bdims)
            res = jnp.where(bad, jnp.asarray(fill, res.dtype), res)
        return self.out(eqn, [out_dims], [partial], act, [res])

    def op_scatter_add(self, eqn: Any, ins: list[V]) -> list[V] | None:
        op, idx, upd = ins
        dn = eqn.params["dimension_numbers"]
        if idx.partial:
            return None
        op = self.resolve(op)
        r = len(op.shape)
        uwin = list(dn.update_window_dims)
        uscat = [k for k in range(len(upd.shape)) if k not in uwin]
        owin = [d for d in range(r) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
        # Indices and updates' scatter dims: the updates' layout (the activation's).
        udims = [list(d) for d in upd.dims]
        for n_, k in enumerate(uscat):  # the more split of updates and indices (slicing the other is free)
            if self.n(tuple(idx.dims[n_])) > self.n(tuple(udims[k])) and not set(idx.dims[n_]) & upd.partial:
                udims[k] = list(idx.dims[n_])
        seen: set[str] = set()
        for k in range(len(udims)):
            udims[k] = [a for a in udims[k] if a not in seen]
            seen |= set(udims[k])
        idims = [list(udims[k]) for k in uscat] + [[]]
        odims = [list(d) for d in op.dims]
        for d, k in zip(owin, uwin, strict=True):
            if udims[k] and op.shape[d] == upd.shape[k]:
                odims[d] = list(udims[k])
            else:
                udims[k] = []
                odims[d] = []
        for od, idd in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True):
            odims[od] = list(idims[idd])
        masked = [k for k, od in enumerate(dn.scatter_dims_to_operand_dims) if odims[od]]
        if masked and any(od not in dn.inserted_window_dims for od in dn.scatter_dims_to_operand_dims if odims[od]):
            for od in dn.scatter_dims_to_operand_dims:
                odims[od] = []
            masked = []
        scat_axes = {a for d in idims for a in d}
        for d in range(r):
            if d not in dn.operand_batching_dims:
                odims[d] = [a for a in odims[d] if a not in scat_axes]
        masked = [k for k in masked if odims[dn.scatter_dims_to_operand_dims[k]]]
        op2 = self.to(op, _t(odims))
        idx2 = self.to(idx, _t(idims))
        upd2 = self.to(upd, _t(udims), keep_partial=True)
        batch_axes = {a for d in idims for a in d} - {a for od in dn.operand_batching_dims for a in odims[od]}
        partial = frozenset(batch_axes | upd2.partial)
        act = op.act or idx.act or upd.act
        if self.dry:
            return self.out(eqn, [op2.dims], [partial], act)
        base = op2.x
        if partial:
            first = self.index(tuple(a for a in self.mesh if a in partial)) == 0
            base = jnp.where(first, base, jnp.zeros((), base.dtype))
        indices, updates = idx2.x, upd2.x
        if masked:
            cols: list = []
            valid: Any = None
            for k, od in enumerate(dn.scatter_dims_to_operand_dims):
                col = indices[..., k]
                if k in masked:
                    col, ok = self.local_index(col, odims[od], op.shape[od] // self.n(odims[od]))
                    valid = ok if valid is None else valid & ok
                cols.append(col)
            indices = jnp.stack(cols, axis=-1).astype(indices.dtype)
            mask = jax.lax.broadcast_in_dim(valid, updates.shape, tuple(uscat))
            updates = jnp.where(mask, updates, jnp.zeros((), updates.dtype))
        xs = self.bind(eqn, [base, indices, updates])
        return self.out(eqn, [op2.dims], [partial], act, xs)

    def op_scatter(self, eqn: Any, ins: list[V]) -> list[V] | None:
        """``x.at[i].set(u)``: indices whole, the scattered dims whole; a window dim the update
        covers whole keeps one split on operand and update (each device writes its block)."""
        op, idx, upd = (self.resolve(v) for v in ins)
        dn = eqn.params["dimension_numbers"]
        if dn.operand_batching_dims:
            return None
        owin = [d for d in range(len(op.shape)) if d not in dn.inserted_window_dims]
        scattered = set(dn.scatter_dims_to_operand_dims)
        odims: list[tuple[str, ...]] = [()] * len(op.shape)
        udims: list[tuple[str, ...]] = [()] * len(upd.shape)
        used: set[str] = set()
        for d, k in zip(owin, dn.update_window_dims, strict=True):
            cand = op.dims[d] or upd.dims[k]
            if d not in scattered and op.shape[d] == upd.shape[k] and cand and not set(cand) & used:
                odims[d] = udims[k] = cand
                used |= set(cand)
        op2, upd2, idx2 = self.to(op, _t(odims)), self.to(upd, _t(udims)), self.whole(idx)
        xs = self.bind(eqn, [op2.x, idx2.x, upd2.x])
        return self.out(eqn, [_t(odims)], act=op.act or idx.act or upd.act, xs=xs)


_HINT_THROUGH = {"add_any", "add", "convert_element_type", "copy", "copy_p", "mul", "neg", "sub", "div"}


def _hints(jaxpr: Any, out_hints: list, hints: dict) -> None:
    """Wanted layouts from ``jaxpr``'s outputs back through same-shape elementwise ops, calls
    and scans' stacked outputs (first hint wins)."""
    for var, h in zip(jaxpr.outvars, out_hints, strict=False):
        if h is not None and not isinstance(var, jcore.Literal):
            hints.setdefault(var, h)
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name in _HINT_THROUGH and len(eqn.outvars) == 1:
            h = hints.get(eqn.outvars[0])
            if h is None:
                continue
            shape = tuple(eqn.outvars[0].aval.shape)
            for x in eqn.invars:
                if not isinstance(x, jcore.Literal) and tuple(getattr(x.aval, "shape", ())) == shape:
                    hints.setdefault(x, h)


def _a2a_move(dims: list[list[str]], target: Dims, shape, n: Callable) -> tuple[int, int, str] | None:
    """A mesh axis the relayout from ``dims`` to ``target`` moves by one all-to-all: the minor
    axis of dim ``i``, which ``target`` does not keep there, and the next axis ``target`` adds to
    dim ``j`` (whose local size it divides). None when no axis moves that way."""
    for i, cur in enumerate(dims):
        if not cur or list(target[i][: len(cur)]) == cur:
            continue
        a = cur[-1]
        for j, (dj, tj) in enumerate(zip(dims, target, strict=True)):
            if (
                j != i
                and len(tj) > len(dj)
                and list(tj[: len(dj)]) == dj
                and tj[len(dj)] == a
                and (shape[j] // n(dj)) % n((a,)) == 0
            ):
                return i, j, a
    return None


def _common(a: Dims, b: Dims) -> Dims:
    """The layout both ``a`` and ``b`` refine: per dim, their common leading axes."""
    out = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < len(x) and k < len(y) and x[k] == y[k]:
            k += 1
        out.append(tuple(x[:k]))
    return tuple(out)


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dims of ``src`` and ``dst`` grouped where their running products meet (a reshape's blocks)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        ii, jj = [], []
        a = b = 1
        if i < len(src):
            a *= src[i]
            ii.append(i)
            i += 1
        if j < len(dst):
            b *= dst[j]
            jj.append(j)
            j += 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]
                ii.append(i)
                i += 1
            elif b < a and j < len(dst):
                b *= dst[j]
                jj.append(j)
                j += 1
            else:
                return None
        # Trailing size-1 dims join this group.
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            ii.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            jj.append(j)
            j += 1
        groups.append((ii, jj))
    return groups


def predict(
    closed: Any, mesh: dict[str, int], param_dims: list[Dims], batch_dims: list[Dims], paths: Sequence[str] = ()
) -> Record:
    """What the per-device code of ``closed`` issues on ``mesh``, from a dry run (no devices);
    ``paths``: the params' paths, named in what each collective moves."""
    record = Record()
    local_step(closed, mesh, param_dims, batch_dims, record, predict=True, paths=paths)(
        [None] * len(param_dims), [None] * len(batch_dims)
    )
    return record


def local_step(
    closed: Any,
    mesh: dict[str, int],
    param_dims: list[Dims],
    batch_dims: list[Dims],
    record: Record,
    predict: bool = False,
    paths: Sequence[str] = (),
) -> Callable:
    """The per-device function: (flat local params, flat local batch) -> (loss, flat local grads).
    ``paths`` (the params' paths, optional) name what each recorded collective moves: a param
    gathered where it is read, a gradient where its sum is reduced."""
    labels = update_paths(closed.jaxpr, paths, first=1) if paths else {}

    def fn(params: list, batch: list):
        batch_axes = frozenset(a for d in batch_dims for dd in d for a in dd)
        part = Partitioner(mesh, record, predict=predict, batch_axes=batch_axes)
        part.labels = labels
        record.issued.clear()
        record.fallbacks.clear()
        args = []
        for x, d, var in zip(params, param_dims, closed.jaxpr.invars[: len(params)], strict=True):
            args.append(V(x, tuple(var.aval.shape), var.aval.dtype, d))
        for a, path in zip(args, paths, strict=False):
            part.name(a, path)
        for x, d, var in zip(batch, batch_dims, closed.jaxpr.invars[len(params) :], strict=True):
            args.append(V(x, tuple(var.aval.shape), var.aval.dtype, d, act=True))
        outs = part.run(closed.jaxpr, list(closed.consts), args, [None, *param_dims])
        part.source, part.op = "", "gradient"
        loss = part.whole(outs[0])
        for g, path in zip(outs[1:], paths, strict=False):
            part.name(g, path)
        grads = [part.to(g, d) for g, d in zip(outs[1:], param_dims, strict=True)]
        return loss.x, [g.x for g in grads]

    return fn
