"""The shard_map partitioner's interpreter: ``Partitioner`` runs a jaxpr on local shards, equation by
equation, with each value's layout; it lays values out (collectives issued where a layout needs
one), walks structure (calls, remat, scans, shard_map regions) and applies the local rules of
``RULES``, which the rule modules (``ops_*.py``) fill.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from shardplan.ledger import Communication
from shardplan.runtime.partition.values import (
    _ELEMENTWISE,
    _FALLBACKS,
    _INLINE,
    _REMAT,
    _RESHARDS,
    _SHARDING_PARAMS,
    Fallback,
    Record,
    Rows,
    V,
    _a2a_move,
    _common,
    _source,
    _t,
)
from shardplan.runtime.primitives import CATALOGUE
from shardplan.runtime.sharding import (
    Dims,
    scan_counts,
    spec_axes,
    typed_dims,
)


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
            assert RULES.elementwise is not None  # registered by ops_layout
            return RULES.elementwise(self, eqn, ins)
        if name != "ragged_dot_general":  # the ops that read only a grouped matmul's own rows
            ins = [self.unown(v) for v in ins]
        if name != "sharding_constraint":  # rules that carry a pending sum on: not a shared one
            ins = [self.resolve(v) if v.shared and v.partial else v for v in ins]
        if name in _RESHARDS:
            laid = RULES.ops["sharding_constraint"](self, eqn, ins)
            assert laid is not None  # a reshard always has its layout
            return laid
        rule = RULES.ops.get(name.replace("-", "_"))
        if rule is not None:
            got = rule(self, eqn, ins)
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

    def carry_layouts(
        self, closed: Any, consts: list[V], carry: list[V], rest: list[V]
    ) -> tuple[list[Dims], list[bool]]:
        """A loop's carry layouts (and whether each is an activation): a fixed point of the body run
        dry (a carry changing layout is made less split; a carry made in the step, a jnp.zeros
        buffer, starts in the layout the body gives it). ``closed``'s operands are ``consts``, the
        carry, then ``rest`` (a scan's slices); its first results are the new carry."""
        n = len(carry)
        dims = [c.dims for c in carry]
        free = [c.make is not None for c in carry]
        acts = [c.act for c in carry]
        dry = Partitioner(self.mesh, Record(), dry=True, batch_axes=self.batch_axes)
        for _ in range(8):
            vals = [V(None, c.shape, c.dtype, d, frozenset(), c.act) for c, d in zip(carry, dims, strict=True)]
            outs = dry.run(closed.jaxpr, list(closed.consts), [*consts, *vals, *rest])
            new = [o.dims if f else _common(d, o.dims) for d, o, f in zip(dims, outs[:n], free, strict=True)]
            free = [False] * n
            acts = [c.act or o.act for c, o in zip(carry, outs[:n], strict=True)]
            if new == dims:
                return dims, acts
            dims = new
        return [((),) * len(c.shape) for c in carry], acts

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

        dims, acts = self.carry_layouts(closed, consts, carry, [sliced(x) for x in xs])
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


# rule(partitioner, eqn, operands) -> results (None: not for these operands' layouts: the op runs on
# whole operands, a fallback)
OpRule = Callable[["Partitioner", Any, list[V]], "list[V] | None"]


@dataclass
class Rules:
    """The partitioner's rule book, filled by the rule modules (``ops_*.py``) as they are imported,
    as jax registers its rules (``batching.primitive_batchers``): ``ops``, per primitive (``-``
    written ``_``) its local rule; ``elementwise``, the rule of elementwise ops whose operands have
    the result's rank or are scalars."""

    ops: dict[str, OpRule] = field(default_factory=dict)
    elementwise: Callable[[Partitioner, Any, list[V]], list[V]] | None = None


RULES = Rules()


def rule_book() -> tuple[frozenset[str], frozenset[str]]:
    """The partitioner's primitives with a local rule, and its declared fallbacks (for the
    coverage test)."""
    ops = set(RULES.ops)
    structure = _INLINE | _REMAT | {"scan", "shard_map"} | _ELEMENTWISE | _RESHARDS
    return frozenset(structure | ops | {n for n in CATALOGUE if n.replace("-", "_") in ops}), _FALLBACKS
