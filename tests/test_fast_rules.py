"""Fast mode's rules one at a time against XLA: a one- or two-op function jitted for 8 simulated
devices with given input (and output) shardings, its compiled collectives (read by the HLO reader
exact mode uses) against what fast mode's propagator predicts for the same function's jaxpr
(``fast.propagate_function``). Then the misses of issue 29 on models nobody tuned fast mode for
(tests/fixtures/fast_models.py), fast against exact mode on the whole step."""

from __future__ import annotations

import math
import random

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.core import hlo
from shardplan.runtime import fast
from tests.helpers import ROOT

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
MESH = {"data": 4, "model": 2}
B, D, F = 64, 128, 256


def S(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _dims(spec, rank):
    entries = tuple(spec) + (None,) * (rank - len(tuple(spec)))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def by_kind(fn, avals, in_specs, out_spec, mesh=MESH, propagation="shardplan"):
    """Per collective kind, the bytes per device XLA compiles and fast mode predicts (on its own
    propagation's layouts, or on Shardy's: ``propagation="xla"``). ``out_spec``: the output's
    sharding, a list of them for several outputs, or None (XLA's choice)."""
    auto = (AxisType.Auto,) * len(mesh)
    m = jax.make_mesh(tuple(mesh.values()), tuple(mesh), axis_types=auto, devices=jax.devices()[:8])
    several = isinstance(out_spec, list)
    with jax.set_mesh(m):
        outs = jax.eval_shape(fn, *avals)
        shapes = [o.shape for o in outs] if several else [outs.shape]
        specs = out_spec if several else [out_spec]
        kw = {}
        if out_spec is not None:
            shardings = tuple(NamedSharding(m, s) for s in specs)
            kw = {"out_shardings": shardings if several else shardings[0]}
        jitted = jax.jit(fn, in_shardings=tuple(NamedSharding(m, s) for s in in_specs), **kw)
        text = jitted.lower(*avals).compile().as_text()
        ledger = fast.propagate_function(
            fn,
            avals,
            tuple(_dims(s, len(a.shape)) for s, a in zip(in_specs, avals, strict=True)),
            mesh,
            None if out_spec is None else tuple(_dims(s, len(o)) for s, o in zip(specs, shapes, strict=True)),
            propagation,
        )
    xla = dict.fromkeys(KINDS, 0)
    for op in hlo.with_axes(hlo.parse(text, 8), mesh):
        xla["reduce-scatter" if op.as_reduce_scatter else op.kind] += op.bytes_per_step
    return xla, {k: ledger.bytes_of(k) for k in KINDS}


def flops_of(fn, avals, in_specs, mesh=MESH):
    """The FLOPs per device XLA's cost analysis counts for ``fn`` compiled with these input
    shardings, and fast mode's for the same function (no output sharding given)."""
    m = jax.make_mesh(tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Auto,) * len(mesh),
                      devices=jax.devices()[:8])
    with jax.set_mesh(m):
        compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(m, s) for s in in_specs)).lower(*avals).compile()
        ledger = fast.propagate_function(fn, avals, tuple(_dims(s, len(a.shape)) for s, a in zip(in_specs, avals)),
                                         mesh, None)
    costs = compiled.cost_analysis()
    return (costs[0] if isinstance(costs, list) else costs)["flops"], ledger.flops


def _cs(spec):
    return lambda x: jax.lax.with_sharding_constraint(x, spec)


def xfail(reason):
    return pytest.mark.xfail(reason=reason, strict=True)


mm = jnp.matmul


def dispatch(x, m, s):
    """GShard's dispatch: tokens x (g, t, d) into per-expert buffers by one-hots m (g, t, e) and
    s (g, t, c), the buffers constrained (model, data) on (experts, groups)."""
    return jax.lax.with_sharding_constraint(jnp.einsum("gtec,gtd->egcd", m[..., None] * s[:, :, None, :], x),
                                            P("model", "data"))


CASES = [
    # stack (a primitive in jax 0.10): a new whole dim, the operands' splits kept
    ("stack/keeps splits", lambda a, b: jnp.stack([a, b]) * 2.0, (S(B, D), S(B, D)), (P("data", "model"),) * 2,
     P(None, "data", "model")),
    # unstack (a primitive in jax 0.10) along a whole dim: each part keeps the other dims' splits
    ("unstack/keeps splits", lambda a: sum(jnp.unstack(a, axis=0)) * 2.0, (S(4, B, D),),
     (P(None, "data", "model"),), P("data", "model")),
    pytest.param("unstack/along a split dim", lambda a: jnp.unstack(a, axis=1)[0] * 2.0 + jnp.unstack(a, axis=1)[3],
                 (S(B, 8, D),), (P(None, "data", "model"),), P(None, "model"),
                 marks=xfail("XLA moves only the parts read, each from the device that holds it (an all-reduce "
                             "and a collective-permute of 32 KiB); fast mode gathers the dim whole (128 KiB)")),
    # dot_general
    ("dot/column-parallel", mm, (S(B, D), S(D, F)), (P("data"), P(None, "model")), P("data", "model")),
    ("dot/row-parallel", mm, (S(B, F), S(F, D)), (P("data", "model"), P("model")), P("data")),
    ("dot/fsdp-weight", mm, (S(B, D), S(D, F)), (P("data"), P("data")), P("data")),
    # contraction split over different axes on the two sides (hidden states over `model`, a weight's
    # rows over `data`): XLA gathers the weight whole and keeps the matmul split, the result summed
    # over `model`, where that sum is smaller than gathering the states (a 256-deep contraction into
    # 128 columns) ...
    ("dot/contraction split apart: the weight moves", mm, (S(B, F), S(F, D)), (P("data", "model"), P("data")),
     P("data")),
    # ... and gathers both on the contraction where the states are the cheaper move (128 deep into 256)
    ("dot/contraction split apart: both gathered", mm, (S(B, D), S(D, F)), (P("data", "model"), P("data")),
     P("data")),
    # batch dims split over one axis at different dims of the two sides: the first dim keeps it
    ("dot/batch dims split apart", lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
     (S(8, 16, 4, 32), S(8, 16, 4, 32)), (P("data"), P(None, None, "data")), None),
    # a matmul whose sum lands on a dim its batch split already splits: the experts' outputs
    # combined back to the tokens (e over `model`, the groups over `data`), wanted over (data, model):
    # XLA all-reduces over `model`, gathers the groups over `data` and slices (fast mode sliced)
    ("dot/sum onto a batch dim split further", lambda c, y: jnp.einsum("gsec,egcd->gsd", c, y),
     (S(32, 16, 8, 4), S(8, 32, 4, 64)), (P("data", None, "model"), P("model", "data")), P(("data", "model"))),
    # batch dims where one side's split extends the other's by an axis the other side's free dim
    # takes (the combine weights' gradient: tokens over (data, model), the experts' outputs over
    # model on the experts): XLA gathers the tokens over `model`, the result keeps the experts split
    ("dot/batch split extended by the other side's free axis", lambda y, e: jnp.einsum("gsd,egcd->gsec", y, e),
     (S(32, 16, 64), S(8, 32, 4, 64)), (P(("data", "model")), P("model", "data")), None),
    # ... and where the experts' buffers are the smaller operand, XLA moves them instead
    ("dot/batch split extended, the other side smaller", lambda y, e: jnp.einsum("gsd,egcd->gsec", y, e),
     (S(32, 16, 32), S(8, 32, 1, 32)), (P(("data", "model")), P("model", "data")), None),
    ("dot/batch split partly taken by the other side's free axis", lambda y, e: jnp.einsum("gsd,egcd->gsec", y, e),
     (S(32, 16, 64), S(8, 32, 4, 64)), (P(("data", "model")), P("model")), None),
    # a result wanted through the transpose that orders its dims (a step output's layout): the
    # matmul's pending sum reduce-scattered straight onto it (16 / 32 KiB), not onto the matmul's own
    # first dims and moved after (32 / 64 KiB before 2026-12-07)
    ("dot/wanted through a transpose", lambda x, w: (x @ w).T, (S(64, 128), S(128, 256)), (P(None, "data"), P("data")),
     P("data", "model")),
    ("dot/batched, wanted through a transpose", lambda a, b: jnp.einsum("bij,bjk->kbi", a, b),
     (S(8, 32, 64), S(8, 64, 32)), (P(None, None, "data"), P(None, "data")), P("model", None, "data")),
    # ... and through a reshape that keeps its leading dims (32 / 64 KiB all-reduced, not 64 / 128)
    ("dot/wanted through a reshape", lambda x, w: (x @ w).reshape(64, 16, 16), (S(64, 128), S(128, 256)),
     (P(None, "data"), P("data")), P("model")),
    ("dot/weight gradient wanted through a reshape", lambda x, g: jnp.einsum("bd,bf->df", x, g).reshape(128, 4, 64),
     (S(64, 128), S(64, 256)), (P("data"), P("data")), P("model", None, None)),
    ("dot/contracting-split (dp gradient)", lambda x, g: x.T @ g, (S(B, D), S(B, F)), (P("data"), P("data")), P()),
    ("dot/contracting-split onto a split", lambda x, g: x.T @ g, (S(B, D), S(B, F)), (P("data"), P("data")), P("data")),
    (
        "dot/batch-split",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        (S(8, 32, 64), S(8, 64, 32)),
        (P("data"), P("data")),
        P("data"),
    ),
    (
        "dot/batch dims disagree",
        lambda a, b: jnp.einsum("egcf,egcd->efd", a, b),
        (S(4, 8, 8, 96), S(4, 8, 8, 48)),
        (P("model", "data"), P(None, ("data", "model"))),
        P("model"),
    ),
    # one side split on the contraction, the other whole: where the result is split nowhere XLA
    # gathers the split side whatever the sizes (even a 64x smaller sum: 64x1024 @ 1024x16) ...
    ("dot/one side split on the contraction", mm, (S(B, D), S(D, F)), (P(None, "model"), P()), P()),
    ("dot/one side split on the contraction, a small result", mm, (S(64, 1024), S(1024, 16)),
     (P(None, "model"), P()), P()),
    # ... where it is split (the batch over `data`) it weighs the result's sum against the gather
    ("dot/one side split on the contraction, batch split: the sum", mm, (S(B, F), S(F, D)),
     (P("data", "model"), P()), P("data")),
    pytest.param(
        "dot/one side split on the contraction, batch split: the gather",
        mm,
        (S(B, D), S(D, F)),
        (P("data", "model"), P()),
        # XLA gathers the states (8,192 B) rather than sum the larger result (16,384 B): a whole
        # side that is one of the step's inputs (its layout fixed) is weighed; one the step
        # computes (a scanned layer's weight slice) is sliced whatever the bytes (an xfail until
        # 2026-12-07: weighing both had put the FLOPs median of 30 random pairs from 15% to 28% off)
        P("data"),
    ),
    # elementwise with broadcasting
    ("elementwise/same layout", jnp.multiply, (S(B, D), S(B, D)), (P("data"), P("data")), P("data")),
    ("elementwise/layouts merge", jnp.add, (S(B, D), S(B, D)), (P("data"), P(None, "model")), P("data", "model")),
    (
        "elementwise/broadcast",
        lambda a, b: a * b[None, :],
        (S(B, D), S(D)),
        (P("data", "model"), P()),
        P("data", "model"),
    ),
    (
        "elementwise/broadcast split elsewhere",
        lambda a, b: a * b[None, :],
        (S(B, D), S(D)),
        (P("data"), P("model")),
        P("data"),
    ),
    # a norm's scale split where the activations split another dim (or over the same axis): the
    # larger operand keeps its splits, the scale is moved at its own size (gathered over `data`,
    # 512 B), the free axes merge
    ("elementwise/scale split over the batch's axis", jnp.multiply, (S(B, D), S(D)), (P("data"), P("data")), None),
    ("elementwise/scale split over two axes", jnp.multiply, (S(B, D), S(D)), (P("data"), P(("model", "data"))),
     None),
    ("elementwise/scale split over another axis", jnp.multiply, (S(B, D), S(D)), (P("data"), P("model")), None),
    ("elementwise/scale split over the batch's axis, then a matmul", lambda x, s, w: (x * s) @ w,
     (S(B, D), S(D), S(D, F)), (P("data"), P("data"), P()), P("data")),
    # reductions
    ("reduce/sum over a split dim", lambda a: a.sum(0), (S(B, D),), (P("data", "model"),), P("model")),
    ("reduce/max over a split dim", lambda a: a.max(1), (S(B, D),), (P("data", "model"),), P("data")),
    # XLA:CPU all-reduces once per reduced dim (2 x 4 B): Compiler.sums_per_dim
    ("reduce/sum to a scalar over two axes", lambda a: a.sum(), (S(B, D),), (P("data", "model"),), P()),
    # reshape / transpose
    ("reshape/merge keeps the major split", lambda a: a.reshape(B * 4, 32), (S(B, 4, 32),), (P("data"),), P("data")),
    ("reshape/split", lambda a: a.reshape(B, 4, 32), (S(B, D),), (P("data", "model"),), P("data", "model")),
    ("reshape/merge gathers a minor split", lambda a: a.reshape(B * 4, 32), (S(B, 4, 32),), (P(None, "model"),), None),
    ("transpose/view", lambda a: a.T, (S(B, D),), (P("data", "model"),), P("model", "data")),
    ("transpose/all-to-all", lambda a: a.T, (S(B, D),), (P("data"),), P("data")),
    # gather / lookup, scatter-add
    (
        "gather/rows split",
        lambda t, i: t[i],
        (S(256, D), S(B, 16, dtype=jnp.int32)),
        (P("model"), P("data")),
        P("data"),
    ),
    (
        "gather/width split",
        lambda t, i: t[i],
        (S(256, D), S(B, 16, dtype=jnp.int32)),
        (P(None, "model"), P("data")),
        P("data", None, "model"),
    ),
    (
        "gather/take_along_axis",
        lambda x, y: jnp.take_along_axis(x, y[:, None], 1),
        (S(B, 256), S(B, dtype=jnp.int32)),
        (P("data"), P("data")),
        P("data"),
    ),
    (
        "scatter-add/rows whole",
        lambda t, i, u: t.at[i].add(u),
        (S(256, D), S(B, dtype=jnp.int32), S(B, D)),
        (P(), P("data"), P("data")),
        P(),
    ),
    (
        "scatter-add/rows split",
        lambda t, i, u: t.at[i].add(u),
        (S(256, D), S(B, dtype=jnp.int32), S(B, D)),
        (P("model"), P("data"), P("data")),
        P("model"),
    ),
    # dynamic_slice / dynamic_update_slice
    (
        "dynamic_update_slice/into zeros",
        lambda k: jax.lax.dynamic_update_slice(jnp.zeros((B, 32, D)), k, (0, 0, 0)),
        (S(B, 16, D),),
        (P("data", None, "model"),),
        P("data", None, "model"),
    ),
    (
        "dynamic_update_slice/into zeros, output free",
        lambda k: jax.lax.dynamic_update_slice(jnp.zeros((B, 32, D)), k, (0, 0, 0)),
        (S(B, 16, D),),
        (P("data", None, "model"),),
        None,
    ),
    (
        "dynamic_slice/unsplit dim",
        lambda a, i: jax.lax.dynamic_slice(a, (i, 0), (16, D)),
        (S(B, D), S(dtype=jnp.int32)),
        (P(None, "model"), P()),
        P(None, "model"),
    ),
    (
        "dynamic_slice/split dim",
        lambda a, i: jax.lax.dynamic_slice(a, (i, 0), (16, D)),
        (S(B, D), S(dtype=jnp.int32)),
        (P("data"), P()),
        None,
    ),
    # concatenate / pad / slice
    (
        "concatenate/unsplit dim",
        lambda a, b: jnp.concatenate([a, b], 1),
        (S(B, D), S(B, D)),
        (P("data"), P("data")),
        P("data"),
    ),
    (  # XLA concatenates split (an all-to-all, 16,384 B) and gathers the result (16,384 B)
        "concatenate/split dim",
        lambda a, b: jnp.concatenate([a, b], 1),
        (S(B, D), S(B, D)),
        (P("data", "model"), P("data", "model")),
        P("data"),
    ),
    ("pad/unsplit dim", lambda a: jnp.pad(a, ((0, 0), (0, 8))), (S(B, D),), (P("data"),), P("data")),
    ("slice/unsplit dim", lambda a: a[:, :64], (S(B, D),), (P("data"),), P("data")),
    (  # XLA keeps the split and moves each device's missing columns (collective-permute 2,048 B)
        "slice/split dim",
        lambda a: a[:, :64],
        (S(B, D),),
        (P("data", "model"),),
        None,
    ),
    # values made from literals
    ("literal/zeros", lambda a: a + jnp.zeros((B, D)), (S(B, D),), (P("data", "model"),), P("data", "model")),
    (
        "literal/iota",
        lambda a: a + jnp.arange(D, dtype=jnp.float32)[None, :],
        (S(B, D),),
        (P("data", "model"),),
        P("data", "model"),
    ),
    (
        "literal/full, split as its output",
        lambda a: a * 0 + jnp.full((B, D), 2.0),
        (S(B, D),),
        (P("data"),),
        P("data", "model"),
    ),
    (
        "literal/broadcast into a matmul",
        lambda w: jnp.ones((B, D)) @ w,
        (S(D, F),),
        (P(None, "model"),),
        P(None, "model"),
    ),
    # sharding constraints
    ("constraint/gather", lambda a: _cs(P())(a * 2) + 1, (S(B, D),), (P("data", "model"),), P()),
    ("constraint/move an axis", lambda a: _cs(P(None, "data"))(a * 2), (S(B, D),), (P("data"),), P(None, "data")),
    # select / where
    (
        "select/same layout",
        jnp.where,
        (S(B, D, dtype=jnp.bool_), S(B, D), S(B, D)),
        (P("data"), P("data"), P("data")),
        P("data"),
    ),
    (
        "select/mixed layouts",
        jnp.where,
        (S(B, D, dtype=jnp.bool_), S(B, D), S(B, D)),
        (P(), P("data"), P(None, "model")),
        P("data", "model"),
    ),
    # top_k / sort / argmax, cumsum
    # XLA:CPU's top-k is a library call: its operand gathered whole even where only the batch is split
    ("top_k/batch split", lambda a: jax.lax.top_k(a, 4)[0], (S(B, D),), (P("data"),), P("data")),
    ("sort/unsplit dim", lambda a: jnp.sort(a, axis=1), (S(B, D),), (P("data"),), P("data")),
    pytest.param(
        "argmax/split dim",
        lambda a: jnp.argmax(a, 1),
        (S(B, D),),
        (P("data", "model"),),
        P("data"),
        marks=xfail(
            "XLA all-gathers each device's (max, index) pairs (256 B); fast mode all-reduces the result (64 B)"
        ),
    ),
    ("cumsum/unsplit dim", lambda a: jnp.cumsum(a, 1), (S(B, D),), (P("data"),), P("data")),
    # a constraint's layout carried back (Shardy) into the chain that builds a matmul's operand:
    # GShard's dispatch, tokens and one-hots split over (data, model) on the groups, the dispatched
    # buffer constrained (model, data) on (experts, groups): the mask product is built in the
    # experts' layout, its two broadcast operands moved at their own sizes (the expert one-hot by
    # all-to-all, the slot one-hot gathered), the tokens gathered at the dispatch
    (
        "constraint/carried back into the dispatch mask",
        dispatch,
        (S(8, 16, 32), S(8, 16, 4), S(8, 16, 8)),
        (P(("data", "model")),) * 3,
        None,
    ),
    pytest.param(
        "constraint/carried back, one expert per device",
        dispatch,
        (S(8, 16, 32), S(8, 16, 2), S(8, 16, 8)),
        (P(("data", "model")),) * 3,
        None,
        marks=xfail(
            "with as many experts as the expert axis XLA computes the dispatch in the tokens' layout and "
            "moves the result by all-to-all (2,048 B); fast mode gathers the tokens (5,120 B) as it does "
            "for more experts than devices"
        ),
    ),
    # ops along a split dim: a scan gathers it; a sort moves its axis to another dim and back
    # (all-to-alls), or gathers a 1-D array; a reverse permutes the blocks
    ("cumsum/split dim", lambda a: jnp.cumsum(a, 1), (S(B, D),), (P("data", "model"),), None),
    ("sort/split dim", lambda a: jnp.sort(a, axis=1) * 2.0, (S(B, D),), (P("data", "model"),), None),
    ("argsort/split dim", lambda a: jnp.argsort(a, axis=1), (S(B, D),), (P("data", "model"),), None),
    ("argsort/1-D split", lambda a: jnp.argsort(a), (S(512),), (P(("data", "model")),), None),
    ("rev/split dim", lambda a: a[:, ::-1] * 2.0, (S(B, D),), (P("data", "model"),), None),
    ("sort/along a whole dim", lambda a: jnp.sort(a, axis=1) * 2.0, (S(B, D),), (P("data"),), None),
    # a ZeRO-1 update: moments split, the param and its update whole: computed where the moments
    # lie, the new param gathered once (not both of the division's operands)
    ("elementwise/split operands, whole result", lambda p, m, v: p - 0.1 * (m / (jnp.sqrt(v) + 1e-8)),
     (S(B, D), S(B, D), S(B, D)), (P(), P("data"), P("data")), P()),
    # a weight gradient under sequence parallelism: the tokens over `data` on the batch and `model` on
    # the sequence; XLA:CPU sums once per contracted dim, two all-reduces of the whole result
    # (XLA:TPU and XLA:GPU fold them into one: Compiler.sums_per_dim)
    ("dot_general/contraction split over two dims apart", lambda x, g: jnp.einsum("bsd,bsf->df", x, g),
     (S(8, 16, D), S(8, 16, F)), (P("data", "model"), P("data", "model")), P()),
    # the same axes on one dim: one all-reduce
    ("dot_general/contraction split over two axes on one dim", lambda x, g: jnp.einsum("bsd,bsf->df", x, g),
     (S(8, 16, D), S(8, 16, F)), (P(("data", "model")), P(("data", "model"))), P()),
    # cond: every branch partitioned with the operands' layouts (an FSDP weight gathered whole for the
    # branch that multiplies by it, nothing moved by the one that scales)
    ("cond/a branch gathers an fsdp weight",
     lambda p, x, w: jax.lax.cond(p > 0, lambda x, w: x @ w, lambda x, w: jnp.tile(x, (1, 2)) * 2.0, x, w),
     (S(), S(B, D), S(D, D * 2)), (P(), P("data"), P("data")), P("data")),
    # XLA reduce-scatters the first branch's sum and gathers it after the conditional, and moves
    # the second branch's slice with a collective-permute (8 + 8 + 4 KiB)
    ("cond/a row-parallel branch",
     lambda p, x, w: jax.lax.cond(p > 0, lambda x, w: x @ w, lambda x, w: x[:, :D] * 2.0, x, w),
     (S(), S(B, F), S(F, D)), (P(), P("data", "model"), P("model")), P("data")),
    # while: a loop-invariant weight's gather hoisted out of the loop (once, not per trip)
    ("while/an fsdp weight gathered once",
     lambda x, w: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1],
     (S(B, D), S(D, D)), (P("data"), P("data")), P("data")),
    # while: the state carried split over the summed axis, as the next trip's matmul reads it (a
    # reduce-scatter per trip, one gather after the loop), a column-parallel state kept split
    ("while/a row-parallel sum per trip",
     lambda x, w: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1],
     (S(B, D), S(D, D)), (P("data"), P("model")), P("data")),
    ("while/a column-parallel state kept split",
     lambda x, w: jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1],
     (S(B, D), S(D, D)), (P("data"), P(None, "model")), P("data", "model")),
    pytest.param("while/a column-parallel state wanted whole",
                 lambda x, w: jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                                                 (0, x))[1],
                 (S(B, D), S(D, D)), (P("data"), P(None, "model")), P("data"),
                 marks=xfail("XLA gathers the state in each trip and once more after the loop (40 KiB); fast mode "
                             "gathers it per trip only (32 KiB)")),
]


@pytest.mark.parametrize(
    "name, fn, avals, in_specs, out_spec", CASES, ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CASES]
)
def test_fast_rule_matches_xlas_collectives(name, fn, avals, in_specs, out_spec):
    xla, predicted = by_kind(fn, avals, in_specs, out_spec)
    assert predicted == xla


# A matmul whose contraction one side splits and the other holds whole, the layouts fixed (the
# function's inputs, or values XLA's propagation laid out): XLA slices the whole side and
# all-reduces the result while the result's bytes are under the split side's gathered bytes, and
# gathers the split side from equal on (measured on XLA:CPU, 2026-12-06).
_SEQ = {"data": 2, "seq": 4}
_PROJECT = lambda x, w: jnp.einsum("bsd,df->bsf", x, w)  # noqa: E731
CONTRACTIONS = [
    ("weight split, result smaller: summed", (2, 8, 32, 96), P("data"), P("seq", None)),  # 3 KiB < 12 KiB
    ("weight split, result just smaller: summed", (2, 31, 32, 96), P("data"), P("seq", None)),  # 11.6 < 12 KiB
    ("weight split, result larger: gathered", (2, 33, 32, 96), P("data"), P("seq", None)),  # 12.4 > 12 KiB
    ("weight split, result equal: gathered", (4, 16, 32, 96), P("data"), P("seq", None)),  # 12 = 12 KiB
    ("tokens split, result larger: gathered", (8, 16, 32, 96), P("data", None, "seq"), P()),
    ("tokens split, result smaller: summed", (8, 16, 32, 8), P("data", None, "seq"), P()),
]


@pytest.mark.parametrize("name, shape, x_spec, w_spec", CONTRACTIONS, ids=[c[0] for c in CONTRACTIONS])
def test_a_contraction_split_on_one_side_is_summed_or_gathered_as_xla_weighs_it(name, shape, x_spec, w_spec):
    b, s, d, f = shape
    xla, predicted = by_kind(_PROJECT, (S(b, s, d), S(d, f)), (x_spec, w_spec), None, _SEQ, propagation="xla")
    assert predicted == xla
    assert (xla["all-reduce"] > 0) == name.endswith("summed")


# A sum over a split dim read back broadcast (a softmax's or a norm's denominators): XLA all-reduces
# the sums at their own size, (8, 16, 1), not at the size of what they divide (measured 2026-12-06;
# fast mode reduce-scattered the broadcast (8, 16, 16), 16x the bytes, until then).
NORMALIZE = {
    "sum": lambda s: s / jnp.sum(s, axis=-1, keepdims=True),
    "softmax": lambda s: jnp.exp(s) / jnp.sum(jnp.exp(s), axis=-1, keepdims=True),
}


@pytest.mark.parametrize("propagation", ["shardplan", "xla"])
@pytest.mark.parametrize("name", sorted(NORMALIZE))
@pytest.mark.parametrize("split, out", [(P(None, None, "seq"), P(None, None, "seq")),
                                        (P("data", None, "seq"), P("data", None, "seq")),
                                        (P(None, None, "seq"), None)])
def test_a_sum_read_back_broadcast_is_reduced_at_its_own_size(name, split, out, propagation):
    xla, predicted = by_kind(NORMALIZE[name], (S(8, 16, 16),), (split,), out, _SEQ, propagation=propagation)
    assert predicted == xla
    assert xla["all-reduce"] == 8 * 16 * 4 // (2 if split[0] else 1)


def _on_xla_and_exact(index, model):
    """Pair ``index`` of the random-plan benchmark's seed 0 (on ``model``): fast mode on XLA's
    propagation and exact mode."""
    from benchmarks import random_plans as rp

    drawn, text = rp.draw_pair(0, index, rp.leaves_of, models=rp.FIRST_POOL)
    assert drawn == model
    plan = shardplan.loads(text, "random.splan")
    kw = dict(model=rp.POOL[model][0], step=rp.POOL[model][1], batch=rp.BATCH_ARG, devices=8)
    return shardplan.api.analyze(plan, mode="fast", propagation="xla", **kw), shardplan.api.analyze(
        plan, mode="exact", **kw
    )


def test_fast_mode_on_xlas_propagation_is_within_target_on_a_held_out_plan():
    """Pair 18 of the random-plan benchmark's seed 0 (a decoder that builds its KV cache in the
    step, sequence x data, a constrained q-norm): fast mode's own propagation missed XLA's
    all-gathers by 53% of the step's bytes and its permutes by 23%; on Shardy's layouts
    (``--propagation xla``) every kind is within the target of XLA:CPU's compiled program."""
    on_xla, exact = _on_xla_and_exact(18, "kv_decoder")
    got, want = on_xla.bytes_by_kind(), exact.bytes_by_kind()
    total = sum(want.values())
    assert total > 0
    errors = {k: abs(got.get(k, 0) - want.get(k, 0)) / total for k in KINDS}
    assert max(errors.values()) <= 0.10, errors
    assert on_xla.flops == pytest.approx(exact.flops, rel=0.02)


def test_a_scanned_layer_reads_its_weights_as_xlas_propagation_slices_them():
    """Pair 19 of the random-plan benchmark's seed 0 (a scanned Llama, batch over (expert, seq),
    the MLP's weights split over `expert` on their columns): XLA's propagation slices each layer's
    weights over `seq` on their rows too (free: they are whole there), so the MLP's matmuls sum a
    contraction split over `seq`. Given the loop's slices as XLA lays them out, fast mode on XLA's
    propagation counts XLA's FLOPs within 6% (28% over before) and its all-reduces within 3% of
    the step's bytes (11% before)."""
    on_xla, exact = _on_xla_and_exact(19, "llama_tiny_scan")
    assert on_xla.flops == pytest.approx(exact.flops, rel=0.06)
    got, want = on_xla.bytes_by_kind(), exact.bytes_by_kind()
    assert abs(got["all-reduce"] - want["all-reduce"]) <= 0.03 * sum(want.values())


def test_a_while_loop_is_costed_per_trip_where_its_trip_count_is_fixed_and_once_with_a_note_where_not():
    """The body's collectives times the trips XLA's trip-count analysis finds (a counter from a literal,
    stepped by a literal, against a literal bound), as in the compiled program; a bound read from an
    input is one trip, as exact mode reads a loop of unknown trips, and the step's notes say so."""
    from shardplan.runtime.sharding import while_trips

    def loop(n, step=1):
        return lambda x, w: jax.lax.while_loop(
            lambda c: c[0] < n, lambda c: (c[0] + step, jnp.tanh(c[1] @ w)), (0, x))[1]

    specs = (P("data"), P("model"))
    per_trip = B // 4 * D * 4  # the (16, 128) float32 sum of each trip's row-parallel matmul, scattered
    for n, step, trips in ((5, 1, 5), (7, 2, 4)):
        xla, predicted = by_kind(loop(n, step), (S(B, D), S(D, D)), specs, P("data"))
        assert predicted == xla and xla["reduce-scatter"] == trips * per_trip
        eqn = jax.make_jaxpr(loop(n, step))(S(B, D), S(D, D)).eqns[-1]
        assert while_trips(eqn) == trips
    dynamic = lambda n, x, w: jax.lax.while_loop(  # noqa: E731
        lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
    xla, predicted = by_kind(dynamic, (S(dtype=jnp.int32), S(B, D), S(D, D)), (P(),) + specs, P("data"))
    assert predicted == xla and xla["reduce-scatter"] == per_trip
    avals = (S(dtype=jnp.int32), S(B, D), S(D, D))
    ledger = fast.propagate_function(dynamic, avals, ((), (("data",), ()), ((), ("model",))), MESH)
    assert len(ledger.loops) == 1 and "test_fast_rules.py" in ledger.loops[0]  # the step's notes name it
    assert not fast.propagate_function(loop(5), avals[1:], ((("data",), ()), ((), ("model",))), MESH).loops
    assert while_trips(jax.make_jaxpr(dynamic)(S(dtype=jnp.int32), S(B, D), S(D, D)).eqns[-1]) is None


def test_a_sum_onto_a_further_split_batch_dim_with_an_idle_axis_is_permuted():
    # XLA splits the matmul's groups over the idle `model` axis, all-reduces that quarter (32 KiB)
    # and permutes it into place (fast mode all-reduced the half, 64 KiB, until 2026-12-05)
    fn = lambda c, y: jnp.einsum("gsec,egcd->gsd", c, y)  # noqa: E731
    mesh = {"data": 2, "expert": 2, "model": 2}
    xla, predicted = by_kind(fn, (S(32, 16, 8, 4), S(8, 32, 4, 64)), (P("data", None, "expert"), P("expert", "data")),
                             P(("data", "expert")), mesh)
    assert xla["all-gather"] == 0 and xla["collective-permute"] > 0  # not the gather of the case above
    assert predicted == xla


@pytest.mark.parametrize(
    "specs",
    [(P("data"), P("model"), P()), (P("data"), P(), P()), (P("data"), P(None, None, "model"), P())],
    ids=["experts split", "experts whole", "expert columns split"],
)
def test_a_grouped_matmul_is_costed_as_xla_cpu_runs_it(specs):
    # jax lowers ragged_dot for XLA:CPU as a dense matmul over masked copies of the tokens, one per
    # group: FLOPs the groups' count times the useful ones, and the dense matmul's collectives
    fn = lambda x, w, g: jax.lax.ragged_dot(x, w, g) * 2.0  # noqa: E731
    avals = (S(64, 128), S(4, 128, 64), jax.ShapeDtypeStruct((4,), jnp.int32))
    m = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    jitted = jax.jit(fn, in_shardings=tuple(NamedSharding(m, s) for s in specs))
    compiled = jitted.lower(*avals).compile()
    xla = dict.fromkeys(KINDS, 0)
    for op in hlo.with_axes(hlo.parse(compiled.as_text(), 8), MESH):
        xla[op.kind] += op.bytes_per_step
    ledger = fast.propagate_function(fn, avals, tuple(_dims(s, len(a.shape)) for s, a in zip(specs, avals)), MESH)
    assert not ledger.unmodeled
    # fast mode counts the masks' elementwise ops (about 9 per element of the tokens' masked copies)
    # above XLA's cost analysis: 13-16% at these widths, 9 / (2 x 64 columns); nothing at a model's
    xla_flops = compiled.cost_analysis()["flops"]
    assert abs(ledger.flops - xla_flops) <= 0.2 * xla_flops, (ledger.flops, xla_flops)
    useful = 2 * (64 / 4) * 128 * 64  # per device (the tokens over data): XLA:CPU does 2-4x that
    assert ledger.flops > 1.5 * useful and xla_flops > 1.5 * useful
    for kind in KINDS:  # XLA also gathers the 16 bytes of group ends it splits
        assert abs(ledger.bytes_of(kind) - xla[kind]) <= 64, (kind, ledger.bytes_of(kind), xla[kind])


def test_a_grouped_matmul_jax_cannot_decompose_is_reported_not_modelled(monkeypatch):
    from jax._src.lax import lax as lax_internal

    def refuse(*args, **kwargs):
        raise NotImplementedError("a ragged mode this jax does not decompose")

    monkeypatch.setattr(lax_internal, "_ragged_dot_general_impl", refuse)
    fn = lambda x, w, g: jax.lax.ragged_dot(x, w, g)  # noqa: E731
    avals = (S(64, 128), S(4, 128, 64), jax.ShapeDtypeStruct((4,), jnp.int32))
    ledger = fast.propagate_function(fn, avals, (_dims(P("data"), 2), _dims(P(), 3), _dims(P(), 1)), MESH)
    assert any("ragged_dot_general" in u for u in ledger.unmodeled), ledger.unmodeled


def test_scan_counts_a_body_collective_per_iteration():
    def f(xs, w):
        def body(c, x):
            return c + x @ w, None

        return jax.lax.scan(body, jnp.zeros((B, F)), xs)[0]

    xla, predicted = by_kind(f, (S(3, B, D), S(D, F)), (P(None, "data"), P("data")), P("data"))
    assert xla["all-gather"] > 0 and predicted == xla


# -- the misses of issue 29, on models of our own ------------------------------------------------

MODELS = ROOT / "tests" / "fixtures" / "fast_models.py"
BATCH = ["tokens=int32[8,16],labels=int32[8,16]"]
TP = """param "embed/embedding" (model, _)
param "layers/\\d+/attn/(q|k|v)/kernel" (_, model)
param "layers/\\d+/attn/o/kernel" (model, _)
param "layers/\\d+/mlp/(gate|up)/kernel" (_, model)
param "layers/\\d+/mlp/down/kernel" (model, _)
param "lm_head/kernel" (_, model)"""
TWO_D = """param "embed/embedding" (model, data)
param "layers/\\d+/attn/(q|k|v)/kernel" (data, model)
param "layers/\\d+/attn/o/kernel" (model, data)
param "layers/\\d+/mlp/(gate|up)/kernel" (data, model)
param "layers/\\d+/mlp/down/kernel" (model, data)
param "lm_head/kernel" (data, model)"""
FSDP = 'param ".*/embedding" (data, _)\nparam ".*/kernel" (data, _)'
MOE = 'param "layers/\\d+/ffn/(wi|wo)" (expert, _, _)'


def _plan(mesh, batch, rules):
    return shardplan.loads(f'plan "t"\nmesh {mesh}\nbatch {batch}\n{rules}\ndefault replicated\n')


def errors(model, loss, plan):
    """Fast mode against exact mode: per kind |fast - exact| / the step's collective bytes, peak and
    FLOPs as ratios."""
    kw = dict(model=f"{MODELS}:{model}", step=f"{MODELS}:{loss}", batch=BATCH, devices=8)
    f, e = (shardplan.api.analyze(plan, mode=m, **kw) for m in ("fast", "exact"))
    total = sum(c.bytes for c in e.communication)

    def kind(cost, k):
        return sum(c.bytes for c in cost.communication if c.kind == k)

    comm = {k: abs(kind(f, k) - kind(e, k)) / total for k in KINDS}
    return comm, f.memory.peak / e.memory.peak, f.flops / e.flops


MISSES = [
    ("gqa_stack 2-D", "gqa_stack", "lm_loss", _plan("data = 4, model = 2", "(data, _)", TWO_D)),
    ("routed_moe expert", "routed_moe", "moe_loss", _plan("data = 2, expert = 4", "((data, expert), _)", MOE)),
    ("zero_cache_lm tp", "zero_cache_lm", "lm_loss", _plan("data = 4, model = 2", "(data, _)", TP)),
    ("zero_cache_lm fsdp", "zero_cache_lm", "lm_loss", _plan("data = 8", "(data, _)", FSDP)),
]


@pytest.mark.parametrize("name, model, loss, plan", MISSES, ids=[m[0] for m in MISSES])
def test_fast_mode_is_within_target_on_untuned_models(name, model, loss, plan):
    comm, peak, flops = errors(model, loss, plan)
    assert max(comm.values()) <= 0.10, comm
    assert abs(peak - 1) <= 0.15
    assert abs(flops - 1) <= 0.02


def test_a_reshard_over_automatic_axes_moves_nothing():
    """``jnp.where`` under a mesh context reshards its value to the mask's (replicated) sharding; over
    an all-auto mesh jax lowers that reshard to nothing, and XLA keeps the value's split: no gather."""
    mesh = {"stage": 4, "model": 2}

    def pick(w, rep):
        hot = jnp.arange(2)[:, None] == rep[None, :]
        return jnp.where(hot.reshape(hot.shape + (1,) * (w.ndim - 2)), w, 0).sum(0)

    avals = [S(2, 4, 16, 32), S(4, dtype=jnp.int32)]
    xla, ours = by_kind(pick, avals, [P(None, "stage", None, "model"), P()], None, mesh=mesh)
    assert ours == xla and xla["all-gather"] == 0


def test_data_parallel_peak_holds_the_combined_gradient_reduction():
    """XLA reduces a step's gradients in one combined all-reduce before the optimizer: its results
    are new buffers beside the unreduced gradients. Where the gradients outweigh the activations (a
    GPT-2-style model of our own, one sequence per device) that moment is the step's peak: fast
    mode counted the gradients once, 20.7% under XLA:CPU's peak (1.04 vs 1.32 MB)."""
    engine = ROOT / "tests" / "fixtures" / "engine_models.py"
    kw = dict(model=f"{engine}:gpt2", step=f"{engine}:gpt2_loss", devices=8,
              batch=["tokens=int32[8,16]", "labels=int32[8,16]"])
    plan = _plan("data = 8", "(data, _)", "")
    f, e = (shardplan.api.analyze(plan, mode=m, **kw) for m in ("fast", "exact"))
    assert f.memory.peak == pytest.approx(e.memory.peak, rel=0.03)
    assert f.memory.peak - (f.memory.params + f.memory.opt_state) >= 2 * f.memory.params  # both copies
    # One gradient differs: XLA reduces the position table's 16 looked-up rows of 32 (its indices
    # are an iota: a slice), fast mode the whole table (1.1% of the step's bytes).
    assert f.bytes_by_kind() == pytest.approx(e.bytes_by_kind(), rel=0.015, abs=64)


def test_batch_dims_split_apart_are_counted_at_each_devices_share_of_the_flops():
    """Heads split over `data` on one side of an attention einsum, the batch over `data` on the
    other: the matmul runs split 4 ways over `data` (one batch dim keeps the axis), as XLA's own
    cost analysis counts it; an axis counted on both batch dims would halve the FLOPs again."""
    fn = lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k)  # noqa: E731
    xla, predicted = flops_of(fn, (S(8, 16, 4, 32), S(8, 16, 4, 32)), (P("data"), P(None, None, "data")))
    assert xla == 2 * 8 * 4 * 16 * 16 * 32 / 4
    assert predicted == xla


def test_a_pending_sum_is_scattered_onto_the_contraction_the_other_side_splits():
    """A weight's gradient under batch x sequence splits: the keys' cotangents, a sum over queries
    split over `seq`, contracted with the layer's inputs split over `seq` on the same tokens. XLA
    reduce-scatters the cotangents onto the tokens and contracts split; fast mode had gathered the
    inputs and contracted every token on every device (8,192 B all-gathered, 2.8x the FLOPs)."""
    keys_grad = lambda a, p, x: jnp.einsum("bkd,bke->de", x, jnp.einsum("bqd,bqk->bkd", a, p))  # noqa: E731
    avals, specs = (S(8, 16, 32), S(8, 16, 16), S(8, 16, 32)), (P("data", "seq"),) * 3
    xla, predicted = by_kind(keys_grad, avals, specs, None, _SEQ)
    assert xla["all-gather"] == predicted["all-gather"] == 0
    assert predicted["reduce-scatter"] == xla["reduce-scatter"] == 8 * 16 * 32 * 4 // 2  # the cotangents (per device)
    flops, fast_flops = flops_of(keys_grad, avals, specs, _SEQ)
    assert abs(fast_flops - flops) / flops < 0.02, (fast_flops, flops)  # (XLA counts its reductions' adds)


@pytest.mark.parametrize("mesh, spec, d, summed", [
    ({"seq": 2, "model": 4}, P(None, None, ("seq", "model")), 256, True),
    ({"a": 8}, P(None, None, "a"), 256, True),
    ({"seq": 2, "model": 4}, P(None, None, "model"), 256, False),
    ({"a": 2, "b": 2, "c": 2}, P(None, None, ("a", "b")), 256, False),
    ({"seq": 2, "model": 4}, P(None, None, ("seq", "model")), 32, False),
], ids=["every device over two axes", "every device over one", "4 of 8", "4 of 8 over two axes", "bytes equal"])
def test_a_contraction_split_over_every_device_meeting_a_whole_weight_is_summed(mesh, spec, d, summed):
    """Activations split on their width only, times a whole weight, the result split nowhere:
    where the split leaves devices holding copies XLA gathers the activations whatever the sizes;
    where it splits every device XLA slices the weight's rows and all-reduces the result, when
    that is fewer bytes than the gather (16 KiB against 128 KiB: an eighth of the FLOPs). XLA:CPU,
    XLA:TPU v5e and XLA:GPU H100 alike (2026-12-06); fast mode had gathered in every case."""
    mm = lambda x, w: x @ w  # noqa: E731
    avals, specs = (S(8, 16, d), S(d, 32)), (spec, P())
    xla, predicted = by_kind(mm, avals, specs, None, mesh)
    assert predicted == xla
    assert (xla["all-reduce"] == 8 * 16 * 32 * 4) == summed and (xla["all-gather"] == 8 * 16 * d * 4) != summed
    flops, fast_flops = flops_of(mm, avals, specs, mesh)
    assert abs(fast_flops - flops) / flops < 0.02, (fast_flops, flops)



@pytest.mark.parametrize("made", ["scaled", "sliced"])
@pytest.mark.parametrize("mesh, spec, d", [
    ({"seq": 2, "model": 4}, P(None, None, ("seq", "model")), 32),
    ({"seq": 2, "model": 4}, P(None, None, "model"), 256),
    ({"seq": 2, "model": 4}, P("seq", None, "model"), 32),
], ids=["every device, bytes equal", "4 of 8", "rows over seq"])
def test_a_whole_weight_the_step_computes_takes_the_contractions_split(mesh, spec, d, made):
    """The same activations times a whole weight the step computes (``w * 2``, a stacked weight's
    slice ``ws[0]``) rather than reads as its argument: XLA's propagation gives the computed weight
    the activations' split on its rows (slicing it is free) and all-reduces the result, whatever
    the bytes; where the weight is the jit's argument (above) its layout is fixed and XLA gathers
    in these cases. XLA:CPU, 2026-12-06; fast mode had gathered (8x the FLOPs over every device)."""
    if made == "scaled":
        fn, w = (lambda x, w: x @ (w * 2)), S(d, 32)
    else:
        fn, w = (lambda x, ws: x @ ws[0]), S(2, d, 32)
    avals, specs = (S(8, 16, d), w), (spec, P())
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla
    assert xla["all-gather"] == 0 and xla["all-reduce"] == 8 * 16 * 32 * 4 // (2 if spec[0] else 1)
    flops, fast_flops = flops_of(fn, avals, specs, mesh)
    assert abs(fast_flops - flops) / flops < 0.05, (fast_flops, flops)


def test_a_scanned_weight_slice_meeting_a_carry_split_on_its_width_gathers_the_carry():
    """In a scan whose carry enters split on its width, ``tanh(c @ w)`` carried: the result must
    come out split as the carry is, so the weight slice cannot take the carry's split on its rows
    (the two splits would be over the same axes): XLA gathers the carry in every trip (2 x 16 KiB),
    as fast mode predicts, not the sliced all-reduce of the matmul above (XLA:CPU, 2026-12-06)."""
    body = lambda c, w: (jnp.tanh(c @ w), None)  # noqa: E731
    fn = lambda x, ws: jax.lax.scan(body, x, ws)[0]  # noqa: E731
    avals, specs = (S(8, 16, 32), S(2, 32, 32)), (P(None, None, ("seq", "model")), P())
    xla, predicted = by_kind(fn, avals, specs, None, {"seq": 2, "model": 4})
    assert predicted == xla
    assert xla["all-gather"] == 2 * 8 * 16 * 32 * 4 and xla["all-reduce"] == 0



_PIECES = {
    "split in three": (lambda x: (lambda a: a[0] * a[1] * a[2])(jnp.split(x, 3, axis=-1)), 192),
    "split in two": (lambda x: (lambda a: a[0] * a[1])(jnp.split(x, 2, axis=-1)), 256),
    "first third sliced": (lambda x: x[..., :64] * 2, 192),
}


@pytest.mark.parametrize("mesh", [{"data": 4, "model": 2}, {"data": 2, "model": 4}], ids=["model=2", "model=4"])
@pytest.mark.parametrize("case", sorted(_PIECES))
def test_a_fused_projection_split_along_its_split_width_permutes_blocks(case, mesh):
    """A fused projection's result (a GPT-2 ``c_attn``, a fused gate and up) split over `model` on
    its width, split into pieces or sliced: XLA keeps each piece split over `model` and permutes
    the blocks a device's piece lacks; fast mode had gathered the whole width (an all-gather of
    the operand, 1.5-4x the bytes, another kind). Fast mode counts one block per device whose
    piece is elsewhere: XLA's program moves 0.5-1.2x that (measured 2026-12-06, XLA:CPU:
    16,384 / 8,192, 16,384 / 16,384, 8,192 / 4,096 B on model=2; 40,960 / 32,768, 40,960 /
    49,152, 12,288 / 12,288 B on model=4)."""
    fn, width = _PIECES[case]
    xla, predicted = by_kind(fn, (S(8, 16, width),), (P("data", None, "model"),), None, mesh)
    assert xla["all-gather"] == predicted["all-gather"] == 0
    assert {k for k, v in xla.items() if v} == {k for k, v in predicted.items() if v} == {"collective-permute"}
    assert 0.8 <= xla["collective-permute"] / predicted["collective-permute"] <= 2.0


@pytest.mark.parametrize("mesh", [{"data": 4, "model": 2}, {"data": 2, "model": 4}], ids=["model=2", "model=4"])
@pytest.mark.parametrize("read", [0, 1])
def test_a_split_moves_nothing_for_a_piece_nothing_reads(read, mesh):
    """``jnp.split(x, 2)[read]`` of a width split over `model`: XLA computes only the piece read and
    permutes only its blocks; fast mode counted both pieces' (XLA:CPU, 2026-12-07, read / fast
    mode before: 8,192 / 16,384 B on model=2; 24,576 / 49,152 and 16,384 / 49,152 B on model=4,
    where XLA moves one block fewer for the second half than fast mode's one per device whose
    piece is elsewhere, as in the split above)."""
    fn = lambda x: jnp.split(x, 2, axis=-1)[read] * 2  # noqa: E731
    xla, predicted = by_kind(fn, (S(8, 16, 256),), (P("data", None, "model"),), None, mesh)
    assert {k for k, v in xla.items() if v} == {k for k, v in predicted.items() if v} == {"collective-permute"}
    ratio = predicted["collective-permute"] / xla["collective-permute"]
    assert ratio == 1.0 if (read, mesh["model"]) != (1, 4) else ratio == 1.5


@pytest.mark.parametrize("mesh", [{"data": 4, "model": 2}, {"data": 2, "model": 4}], ids=["model=2", "model=4"])
@pytest.mark.parametrize("pieces", [2, 3])
def test_pieces_split_along_the_concatenated_dim_are_moved_by_an_all_to_all(pieces, mesh):
    """Pieces each split over `model` on the dim they are concatenated along (the backward pass of
    a fused projection's split): XLA concatenates them split, with an all-to-all of twice their
    bytes per device; fast mode had gathered every piece whole (measured 2026-12-06, XLA:CPU)."""
    width = 384 // pieces
    cat = lambda *xs: jnp.concatenate(xs, -1) * 2  # noqa: E731
    xla, predicted = by_kind(cat, (S(8, 16, width),) * pieces, (P("data", None, "model"),) * pieces, None, mesh)
    assert predicted == xla
    assert xla["all-to-all"] == 2 * pieces * 8 * 16 * width * 4 // 8 and xla["all-gather"] == 0



def test_fused_projections_split_under_tensor_parallelism_are_costed_as_xla_moves_them():
    """A GPT-J-style decoder of our own (``engine_models.parallel``: fused q/k/v and gate/up
    projections split with ``jnp.split``), tensor parallel over `model`: XLA:CPU's program
    permutes the pieces' blocks (256 KiB) and concatenates their gradients split (all-to-alls,
    448 KiB). Fast mode had gathered every fused result and gradient (896 KiB of all-gathers,
    none compiled, and 331.5 KiB of all-reduces over `data` against 218.5)."""
    engine = ROOT / "tests" / "fixtures" / "engine_models.py"
    kw = dict(model=f"{engine}:parallel", step=f"{engine}:parallel_loss", devices=8,
              batch=["tokens=int32[16,32]", "labels=int32[16,32]"])
    plan = _plan("data = 4, model = 2", "(data, _)", "\n".join([
        'param "blocks/\\d+/(qkv|wi)/kernel" (_, model)',
        'param "blocks/\\d+/wi/bias" (model)',
        'param "blocks/\\d+/(wo|wf)/kernel" (model, _)',
    ]))
    f, e = (shardplan.api.analyze(plan, mode=m, **kw) for m in ("fast", "exact"))
    fb, eb = f.bytes_by_kind(), e.bytes_by_kind()
    assert fb["all-gather"] == eb["all-gather"] == 0
    assert fb["all-to-all"] == eb["all-to-all"]
    assert fb["all-reduce"] == pytest.approx(eb["all-reduce"], abs=64)  # (the loss's sum: 4 B apart)
    assert 0.5 <= fb["collective-permute"] / eb["collective-permute"] <= 1.0  # 192 vs 256 KiB
    assert f.flops == pytest.approx(e.flops, rel=0.02)



_WEIGHT_GRAD = (lambda x, g: jnp.einsum("btd,btf->df", x, g), ((8, 16, 64), (8, 16, 160)))
_MATMUL = (lambda x, w: x @ w, ((8, 16, 64), (64, 160)))


@pytest.mark.parametrize("fn_shapes, mesh, specs, moved", [
    (_WEIGHT_GRAD, {"seq": 2, "data": 2, "model": 2}, (P("seq"), P("data")), True),
    (_WEIGHT_GRAD, {"seq": 2, "data": 4}, (P("seq"), P("data")), False),
    (_WEIGHT_GRAD, {"data": 4, "model": 2}, (P("model"), P("data")), False),
    (_MATMUL, {"seq": 2, "data": 2, "model": 2}, (P(None, None, "seq"), P("data")), True),
    (_MATMUL, {"seq": 2, "data": 2, "model": 2}, (P("model", None, "seq"), P("data")), True),
    (_MATMUL, {"seq": 2, "data": 2, "model": 2}, (P(None, None, "seq"), P("data", "model")), True),
], ids=["weight gradient, 2 and 2", "weight gradient, 2 and 4", "weight gradient, 2 and 4 (model)",
        "matmul", "matmul, rows over model", "matmul, weight over data x model"])
def test_a_contraction_split_over_other_axes_of_as_many_devices_is_permuted(fn_shapes, mesh, specs, moved):
    """A contraction split over one axis on one side and another on the other: where the two
    split it over as many devices, XLA permutes the smaller side onto the other's split, contracts
    split and all-reduces the result (a weight gradient with its inputs over `seq` and the
    cotangents over `data`: 16 KiB permuted, 40 KiB all-reduced); where they do not (2 and 4
    devices) it gathers both, as fast mode did in every case (114,688 B gathered). XLA:CPU,
    2026-12-06."""
    fn, shapes = fn_shapes
    xla, predicted = by_kind(fn, tuple(S(*s) for s in shapes), specs, None, mesh)
    assert predicted == xla
    assert (xla["collective-permute"] > 0 and xla["all-reduce"] > 0) == moved and (xla["all-gather"] == 0) == moved


@pytest.mark.parametrize("fn_shapes, mesh, specs", [
    (_WEIGHT_GRAD, {"data": 4, "model": 2}, (P("data", "model"), P("model", "data"))),
    (_WEIGHT_GRAD, {"data": 4, "model": 2}, (P("model", "data"), P("data", "model"))),
    (_WEIGHT_GRAD, {"data": 4, "model": 2}, (P(("data", "model")), P(("model", "data")))),
    (_WEIGHT_GRAD, {"a": 2, "b": 2, "c": 2}, (P(("a", "b"), "c"), P("c", ("b", "a")))),
    ((lambda x, g: jnp.einsum("bhtd,bhtf->hdf", x, g), ((8, 4, 16, 16), (8, 4, 16, 40))), {"data": 2, "model": 4},
     (P("data", None, "model"), P("model", None, "data"))),
], ids=["batch and sequence crossed", "the other way", "one dim, axes in other order", "three axes",
        "under a batch dim"])
def test_a_contraction_split_over_the_same_axes_laid_out_otherwise_moves_the_smaller_side(fn_shapes, mesh, specs):
    """Both sides split the contraction over the same axes, crossed (x over data on the batch
    and model on the sequence, the cotangents the other way round): XLA lays the smaller side out
    as the other (all-to-all and collective-permute of its local bytes, 4 KiB), contracts split
    and all-reduces; fast mode gathered both (160 KiB, 8x the FLOPs: the random pairs' act rules
    that cross the batch's axes). XLA:CPU, 2026-12-06; XLA:TPU v5e and XLA:GPU H100 the same."""
    fn, shapes = fn_shapes
    xla, predicted = by_kind(fn, tuple(S(*s) for s in shapes), specs, None, mesh)
    assert predicted == xla
    assert xla["all-gather"] == 0 and xla["all-reduce"] > 0


_X_W = (lambda x, w: x @ w, ((8, 16, 32), (32, 16)))


@pytest.mark.parametrize("mesh, specs, kinds", [
    ({"expert": 4, "data": 2}, (P(None, None, "data"), P("expert", "data")), {"collective-permute", "all-reduce"}),
    ({"data": 2, "model": 4}, (P(None, None, "data"), P("model", "data")), {"collective-permute", "all-reduce"}),
    ({"a": 2, "b": 2, "c": 2}, (P(None, "c", "a"), P("b", "a")), {"collective-permute", "all-reduce"}),
    ({"expert": 4, "data": 2}, (P("data", None, "expert"), P("data", None)), {"collective-permute", "all-reduce"}),
    ({"data": 2, "model": 4}, (P("data", None, "model"), P("data", None)), {"collective-permute", "all-reduce"}),
    ({"data": 4, "model": 2}, (P("data", None, "model"), P("data", None)), {"all-gather", "all-reduce"}),
    ({"data": 2, "model": 4}, (P(None, None, "model"), P("data", "model")), {"all-gather"}),
    ({"expert": 4, "data": 2}, (P(None, "expert", "data"), P("expert", "data")), {"all-gather"}),
], ids=["states moved onto the weight's rows", "the same over model", "three axes", "weight rows permuted finer",
        "weight rows over model", "coarser: gathered", "states over 4 meet rows over 2: gathered",
        "the rows' axis taken: gathered"])
def test_a_contraction_split_the_other_side_takes_elsewhere_is_moved_onto_its_split(mesh, specs, kinds):
    """Hidden states split over `data` on their width meet a weight over `expert` on its rows and
    `data` on its columns: XLA permutes the states onto `expert` (4 KiB), contracts split and
    all-reduces (4 KiB); fast mode gathered both (17 KiB, 4x the FLOPs). A weight over `data` on
    its rows against states over `data` on the batch and `expert` or `model` (more devices) on the
    width: the weight permuted onto the width's axis (512 B), not gathered (2 KiB). Where the move
    would split over fewer devices or the other's axis is taken, both are gathered, as before (with
    an axis neither side splits, XLA gathers too, by a route of its own that permutes 4 KiB more:
    not asserted). XLA:CPU, 2026-12-06; XLA:TPU v5e and XLA:GPU H100 move the same."""
    fn, shapes = _X_W
    xla, predicted = by_kind(fn, tuple(S(*s) for s in shapes), specs, None, mesh)
    assert predicted == xla
    assert {k for k, v in xla.items() if v} == kinds


@pytest.mark.parametrize("mesh, shapes, specs, moved", [
    ({"data": 2, "model": 4}, ((8, 16, 32), (32, 16)), (P(None, None, "data"), P(None, "data")), True),
    ({"data": 2, "model": 2, "expert": 2}, ((8, 16, 32), (32, 16)), (P(None, None, "data"), P(None, "data")), True),
    ({"data": 2, "model": 4}, ((8, 16, 64), (64, 16)), (P(None, None, "data"), P(None, "data")), True),
    ({"data": 2, "model": 4}, ((8, 64, 32), (32, 16)), (P(None, None, "data"), P(None, "data")), True),
    ({"data": 4, "model": 2}, ((8, 16, 32), (32, 16)), (P(None, None, "data"), P(None, "data")), False),
    ({"data": 2, "model": 4}, ((8, 16, 32), (32, 16)), (P("model", None, "data"), P(None, "data")), False),
    ({"expert": 4, "data": 2}, ((8, 16, 32), (32, 16)), (P("data", None, None), P("data", None)), False),
], ids=["onto model", "onto two idle axes", "wider states", "longer sequence", "fewer idle devices: gathered",
        "no idle axis: gathered", "a weight's rows: gathered"])
def test_a_contraction_split_the_other_side_takes_elsewhere_moves_onto_idle_axes(mesh, shapes, specs, moved):
    """Hidden states over `data` on their width times a weight whole on its rows and over `data` on
    its columns, with axes neither splits (idle): XLA permutes the states onto the idle axes (as
    many devices or a multiple), slices the weight, contracts split and all-reduces (4 KiB and
    4 KiB where fast mode gathered 16 KiB), where that moves fewer bytes than the gather; a
    weight's rows over `data` against states over `data` on the batch are gathered (2 KiB, where
    moving them and summing would be 4.5 KiB). XLA:CPU, 2026-12-06."""
    fn = _X_W[0]
    xla, predicted = by_kind(fn, tuple(S(*s) for s in shapes), specs, None, mesh)
    kinds = {k for k, v in xla.items() if v}
    if moved:
        assert predicted == xla and kinds == {"collective-permute", "all-reduce"}
    else:  # gathered (XLA:CPU's route may permute a piece first: not asserted)
        assert predicted["all-gather"] == xla["all-gather"] > 0 and not xla["all-reduce"]


@pytest.mark.parametrize("specs, wanted, moved", [
    ((P(None, ("model", "data")), P()), P("model", "data"), {"all-gather": 98_304}),
    ((P(None, ("model", "data")), P()), P(None, "data"), {"all-gather": 98_304}),
    ((P(None, "model"), P()), P("data", "model"), {"all-gather": 98_304}),
    ((P("data", "model"), P()), P("data", "model"), {"all-gather": 49_152}),
    ((P("data", "model"), P()), P("data"), {"all-reduce": 12_288}),
    ((P(None, ("model", "data")), P()), None, {"all-reduce": 24_576}),
], ids=["over both, on both dims", "on the other's columns", "on both dims", "rows kept split", "no contraction axis",
        "not wanted"])
def test_a_contraction_split_against_a_whole_side_wanted_split_over_it_elsewhere_is_gathered(specs, wanted, moved):
    """``h @ w``, w whole, h split on the contraction (8 devices as model = 4, data = 2), the result
    wanted split over a contraction axis on a dim h's split cannot move to: XLA gathers h whole on
    the contraction (its other splits kept) and computes only the wanted tile, no partial sum (fast
    mode had sliced w and reduce-scattered: 24,576 B where XLA gathers 98,304). Wanted over no
    contraction axis, or not wanted: w sliced, the partial results all-reduced. XLA:CPU; XLA:TPU
    v5e and XLA:GPU H100 gather the same (the TPU's bf16 copy), 2026-12-07. FLOPs: the tile's."""
    mesh = {"model": 4, "data": 2}
    fn, avals = (lambda h, w: h @ w), (S(128, 192), S(192, 48))
    xla, predicted = by_kind(fn, avals, specs, wanted, mesh)
    assert predicted == xla and {k: v for k, v in xla.items() if v} == moved
    m = jax.make_mesh((4, 2), ("model", "data"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    with jax.set_mesh(m):
        kw = {} if wanted is None else {"out_shardings": NamedSharding(m, wanted)}
        compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(m, sp) for sp in specs), **kw).lower(*avals).compile()
        ledger = fast.propagate_function(fn, avals, tuple(_dims(sp, 2) for sp in specs), mesh,
                                         None if wanted is None else (_dims(wanted, 2),))
    assert ledger.flops == pytest.approx(compiled.cost_analysis()["flops"], rel=0.001)


_EXPERT_DATA = {"expert": 4, "data": 2}


@pytest.mark.parametrize("cotangents, wanted, whole", [
    (P("data", "expert"), P(None, ("expert", "data")), True),
    (P("data", "expert"), P(None, "expert"), False),
    (P("data", "expert"), P(), True),
    (P("data"), P(None, ("expert", "data")), False),
], ids=["split further over the sum", "as the inputs", "whole", "no clash: scattered"])
def test_a_weight_gradient_wanted_split_further_over_its_sum_is_computed_whole(cotangents, wanted, whole):
    """A weight's gradient ``bsf,bsd->fd``: cotangents over data x expert on the tokens, inputs over
    data on the batch and expert on ``d``, a sum over data. Wanted over (expert, data) on ``d`` (the
    weight's FSDP split, its row dim here), XLA does not scatter the sum onto ``d``, which the
    inputs split over the axis the cotangents' tokens are split over too: it gathers their ``d``,
    computes the whole gradient on every device (4x the FLOPs), all-reduces it (8,192 B) and
    slices. XLA:CPU, XLA:TPU v5e and XLA:GPU H100 alike (2026-12-06); fast mode had reduce-scattered
    2,048 B at a quarter of the FLOPs. With the cotangents' tokens over data alone (no clash) XLA
    reduce-scatters the 2,048 B onto ``d`` as it is split."""
    grad = lambda g, x: jax.lax.with_sharding_constraint(jnp.einsum("bsf,bsd->fd", g, x), wanted)  # noqa: E731
    avals, specs = (S(8, 16, 64), S(8, 16, 32)), (cotangents, P("data", None, "expert"))
    xla, predicted = by_kind(grad, avals, specs, None, _EXPERT_DATA)
    assert predicted == xla
    if whole:
        assert xla["all-reduce"] == 64 * 32 * 4 and xla["reduce-scatter"] == 0
    else:
        assert xla["all-reduce"] + xla["reduce-scatter"] == 64 * 32 * 4 // 4
    flops, fast_flops = flops_of(grad, avals, specs, _EXPERT_DATA)
    assert abs(fast_flops - flops) / flops < 0.02, (fast_flops, flops)
    assert (flops > 2 * 8 * 16 * 64 * 32 / 8 * 2) == whole  # the whole gradient on every device: 4x


@pytest.mark.parametrize("b, s, d, f", [(8, 16, 32, 64), (4, 8, 128, 512)])
def test_a_sum_the_next_weights_rows_split_is_scattered_onto_their_split(b, s, d, f):
    """A gated MLP reading hidden states split over `model` on their width, every weight's rows
    split over `model`: the gate's and up's sums over `model` are reduce-scattered onto the hidden
    dim the down projection's rows split, through the SiLU (a call of elementwise ops), as XLA:CPU,
    XLA:TPU and XLA:GPU compile it (measured 2026-12-06); fast mode had all-reduced both."""
    mlp = lambda x, wg, wu, wd: (jax.nn.silu(x @ wg) * (x @ wu)) @ wd  # noqa: E731
    avals = (S(b, s, d), S(d, f), S(d, f), S(f, d))
    xla, predicted = by_kind(mlp, avals, (P("data", None, "model"), P("model"), P("model"), P("model")), None)
    assert predicted == xla
    assert xla["reduce-scatter"] == 2 * b * s * f * 4 // 4  # gate and up, each device's quarter of the batch


def test_a_scanned_layers_sums_are_scattered_onto_its_next_weights_rows_split():
    """The same MLP as layers of a scan, the weights stacked: each layer's gate and up sums are
    reduce-scattered onto the hidden dim its down rows split, as XLA compiles it (2 layers x 2 x
    16,384 B). XLA also reduce-scatters the down projection's sum into the carried residual,
    split on its width; fast mode all-reduces that one (16,384 B), the bytes otherwise equal."""
    def layer(x, w):
        wg, wu, wd = w
        return x + (jax.nn.silu(x @ wg) * (x @ wu)) @ wd, None

    def layers(x, wg, wu, wd):
        return jax.lax.scan(layer, x, (wg, wu, wd))[0]

    avals = (S(8, 16, 64), S(2, 64, 256), S(2, 64, 256), S(2, 256, 64))
    specs = (P("data", None, "model"),) + (P(None, "model"),) * 3
    xla, predicted = by_kind(layers, avals, specs, None)
    assert predicted["reduce-scatter"] == 2 * 2 * 8 * 16 * 256 * 4 // 4
    assert xla["reduce-scatter"] == predicted["reduce-scatter"] + predicted["all-reduce"]


def test_a_constraint_far_from_the_batch_layout_is_carried_back_through_the_norms():
    """A plan nobody tuned for (random pair 10 of seed 3): the batch over `model`, the final norm's
    output constrained (seq, model, ...). XLA's program carries the constraint's layout back through
    the step (through the norms' reductions): 512 B of all-to-all in all. Fast mode stopped it at the
    first reduction and moved activations at every layer: 0.97 MiB of all-to-alls, 2.4x XLA's FLOPs."""
    engine = ROOT / "tests" / "fixtures" / "engine_models.py"
    kw = dict(model=f"{engine}:gpt2", step=f"{engine}:gpt2_loss", devices=8,
              batch=["tokens=int32[8,16]", "labels=int32[8,16]"])
    plan = _plan("seq = 4, model = 2", "(model, _)", 'act "h/\\d+/mlp" (..., seq)\nact "ln_f" (seq, model, ...)')
    f, e = (shardplan.api.analyze(plan, mode=m, **kw) for m in ("fast", "exact"))
    assert f.flops == pytest.approx(e.flops, rel=0.05)
    total = sum(e.bytes_by_kind().values())
    assert abs(f.bytes_by_kind()["all-to-all"] - e.bytes_by_kind()["all-to-all"]) <= 0.10 * total
    assert f.memory.peak == pytest.approx(e.memory.peak, rel=0.05)


def _rms(x, s):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * s


_THREE = {"data": 2, "expert": 2, "seq": 2}
_TOKENS = P(("data", "expert", "seq"))


@pytest.mark.parametrize("fn, shapes, specs, wanted", [
    # a norm's scale split on the width over axes the activations' batch uses, the result wanted
    # in the activations' layout: the scale gathered (256 B; fast mode moved the activations, 12 KiB)
    (_rms, ((8, 16, 64), (64,)), (_TOKENS, P(("seq", "expert"))), _TOKENS),
    (_rms, ((8, 16, 64), (64,)), (_TOKENS, P("data")), _TOKENS),
    (lambda x, b: jnp.tanh(x) + b, ((8, 16, 64), (64,)), (_TOKENS, P(("seq", "expert"))), _TOKENS),
    # wanted split on the sequence too: computed there (the activations sliced), the scale gathered
    (_rms, ((8, 16, 64), (64,)), (P("data"), P(("seq", "expert"))), P("data", "seq")),
    # a row scale split on (batch, seq) times activations split on the width: computed split three
    # ways, the result gathered to the wanted layout (two gathers, 24 KiB)
    (lambda x, r: x * r[:, :, None], ((8, 16, 64), (8, 16)), (P(None, None, "expert"), P("data", "seq")),
     P("data")),
    (lambda x, r: x * r[:, :, None], ((8, 16, 64), (8, 16)), (P(None, None, "expert"), P("data", "seq")),
     P(None, None, "expert")),
])
def test_an_op_wanted_elsewhere_is_computed_where_its_operands_lie_and_its_small_operands_move(fn, shapes, specs,
                                                                                               wanted):
    """An elementwise op whose result a step output wants in a layout: XLA computes it on the
    wanted splits plus those its operands add where their axes are free, moves each operand there
    at its own size (a broadcast's operand, not the broadcast) and moves the result to the wanted
    layout. Fast mode moved every operand, at the result's size, to the wanted layout."""
    xla, predicted = by_kind(fn, tuple(S(*s) for s in shapes), specs, wanted, _THREE)
    assert predicted == xla


_EXPERT_MODEL = {"expert": 4, "model": 2}


@pytest.mark.parametrize("x, w, wanted", [
    ((8, 16, 32), (32, 32), P(("model", "expert"))),
    ((8, 16, 32), (32, 128), P(("model", "expert"))),
    ((8, 16, 256), (256, 8), P(("model", "expert"))),  # the all-to-all 8x the reduce-scatter
    ((8, 16, 32), (32, 32), P("model", "expert")),  # onto a free dim the operand leaves whole
    ((8, 16, 32), (32, 32), P(("expert", "model"))),  # the other order: a permute after
])
def test_a_contraction_split_the_result_wants_elsewhere_moves_there_before_the_matmul(x, w, wanted):
    """Activations over `model` on the batch and `expert` on their width, times a whole weight, the
    result wanted with `expert` on the batch or the sequence: XLA moves `expert` from the width to
    that dim (an all-to-all) and contracts whole, whatever the sizes; fast mode had sliced the
    weight and reduce-scattered the result (XLA:GPU h100:8 the same bytes, XLA:TPU v5e the same
    kinds at bf16, 2026-12-06)."""
    xla, predicted = by_kind(lambda a, b: a @ b, (S(*x), S(*w)), (P("model", None, "expert"), P()), wanted,
                             _EXPERT_MODEL)
    assert predicted == xla and xla["all-to-all"] and not xla["reduce-scatter"]


@pytest.mark.parametrize("fn", [lambda x, r: jnp.tanh(x * r[:, :, None]),
                                lambda x, r: jnp.sum(jnp.tanh(x * r[:, :, None]), axis=-1)])
@pytest.mark.parametrize("x_spec, r_spec", [(P("model"), P(("model", "expert"))),
                                            (P(None, "model"), P(None, ("model", "expert")))])
def test_a_split_another_operand_extends_is_extended(fn, x_spec, r_spec):
    """Activations over `model` on the batch (or the sequence) times a row factor over (model,
    expert) there: XLA computes on the longer split (Shardy merges a dim's shardings where one is
    a prefix of the other), the activations sliced for free, nothing moved and an eighth of the
    work per device; fast mode kept the activations' split, gathered the factor over `expert`
    and counted 4x the FLOPs."""
    avals, specs = (S(8, 16, 64), S(8, 16)), (x_spec, r_spec)
    xla, predicted = by_kind(fn, avals, specs, None, _EXPERT_MODEL)
    assert predicted == xla and not any(xla.values())
    compiled, fast_flops = flops_of(fn, avals, specs, _EXPERT_MODEL)
    assert fast_flops == pytest.approx(compiled, rel=0.01)


@pytest.mark.parametrize("rows", [2048, 512])
def test_an_fsdp_table_smaller_than_its_lookup_is_gathered_and_a_larger_one_looked_up_where_it_lies(rows):
    """A table split over its rows by the axis that splits the batch (an FSDP embedding), forward and
    backward: where the whole lookup's output is smaller than the table (2,048 rows of 128 for 32 x 32
    indices: 512 KiB against 1 MiB) XLA gathers the indices, looks them up in the rows each device
    holds and reduce-scatters the output, and its gradient gathers the updates; where it is not (512
    rows: 256 KiB), it gathers the table and reduce-scatters the table's gradient."""

    def step(table, idx):
        return jax.grad(lambda t: jnp.sum(jnp.sin(jnp.take(t, idx, axis=0))))(table)

    xla, predicted = by_kind(step, (S(rows, 128), S(32, 32, dtype=jnp.int32)), (P("data", None), P("data", None)),
                             P("data", None), mesh={"data": 8})
    assert predicted == xla, (predicted, xla)
    table = rows * 128 * 4
    assert (xla["all-gather"] < table) == (rows == 2048)  # the indices and updates, not the table


@pytest.mark.parametrize("batch, mesh", [(32, MESH), (40, MESH), (64, MESH), (16, {"data": 2, "model": 4}),
                                         (32, {"data": 2, "model": 4})])
def test_a_2d_table_looked_up_for_more_than_its_bytes_is_regathered_not_summed(batch, mesh):
    """An embedding split over its rows (`model`) and its width (`data`), looked up for a batch
    split over `data` and wanted so (plans/gpt_2d.splan). Up to the table's bytes of output per
    device (32 sequences of 32 tokens on data=4: 128 KiB, as the 256 x 128 table) XLA looks the
    indices up where the width lies, sums over `model` and moves the output onto the batch split
    (all-to-all); past them (40 sequences: 160 KiB) it regathers the table and all-gathers the
    output over `model`: no sum, no all-to-all. Fast mode took the first way at every size. (The
    gradient's way is checked on a whole step: test_stepcost's 2-D plan past the table's bytes.)"""

    def lookup(table, idx):
        return jnp.sin(jax.lax.with_sharding_constraint(jnp.take(table, idx, axis=0), P("data", None, None)))

    table = 256 * 128 * 4
    out = batch // mesh["data"] * 32 * 128 * 4
    xla, predicted = by_kind(lookup, (S(256, 128), S(batch, 32, dtype=jnp.int32)), (P("model", "data"), P("data", None)),
                             P("data", None, None), mesh=mesh)
    assert (xla["all-to-all"] == 0) == (out > table), xla
    assert predicted == pytest.approx(xla, rel=0.35, abs=40_000), (predicted, xla)
    assert predicted["all-to-all"] == xla["all-to-all"]


IDLE = {"data": 2, "expert": 2, "model": 2}


@pytest.mark.parametrize("fn, avals, in_specs, wanted, mesh", [
    # summed over expert, wanted over (data, model): computed on the half, the half all-reduced
    (mm, (S(B, D), S(D, F)), (P("data", "expert"), P("expert")), P(("data", "model")), IDLE),
    # the same wanted over model on the columns
    (mm, (S(B, D), S(D, F)), (P("data", "expert"), P("expert")), P("data", "model"), IDLE),
    # no sum: the result computed on its model quarter
    (mm, (S(B, D), S(D, F)), (P("data"), P()), P("data", "model"), MESH),
    # wanted over the summed axis: an idle axis of its size stands in, then a permute
    (mm, (S(B, D), S(D, F)), (P("data", "expert"), P("expert")), P(("data", "expert")), IDLE),
    pytest.param(mm, (S(B, D), S(D, F)), (P(None, "expert"), P("expert")), P("expert"),
                 {"data": 1, "expert": 2, "model": 4},
                 marks=xfail("XLA stands in with a part of the larger idle axis (an all-reduce and a permute of the "
                             "half); fast mode's stand-ins are whole axes of the summed one's size: a reduce-scatter")),
    # no idle axis: reduce-scattered
    (mm, (S(B, D), S(D, F)), (P("data", "expert"), P("expert")), P(("data", "expert")), {"data": 2, "expert": 4}),
], ids=["sum, wanted over an idle axis", "sum, idle axis on the columns", "no sum, idle axis on the columns",
        "wanted over the summed axis", "idle axis larger than the summed one", "no idle axis"])
def test_a_matmul_is_computed_split_over_an_idle_axis_its_readers_want(fn, avals, in_specs, wanted, mesh):
    """XLA's dot partitioner computes the result as its readers want it, slicing an operand over an
    axis neither operand nor the sum uses (a share of the FLOPs, the pending sum reduced on that
    share); fast mode computed the whole local result, summed it and sliced (2-4x the FLOPs, 2x the
    all-reduce). Measured 2026-12-05; the result constrained as ``wanted``."""
    def constrained(a, b):
        return jnp.sum(jax.lax.with_sharding_constraint(fn(a, b), wanted) ** 2, axis=0)

    xla, predicted = by_kind(constrained, avals, in_specs, P(), mesh)
    assert predicted == xla
    m = jax.make_mesh(tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Auto,) * len(mesh),
                      devices=jax.devices()[:8])
    with jax.set_mesh(m):
        compiled = jax.jit(constrained, in_shardings=tuple(NamedSharding(m, s) for s in in_specs),
                           out_shardings=NamedSharding(m, P())).lower(*avals).compile()
        ledger = fast.propagate_function(constrained, avals, tuple(_dims(s, len(a.shape)) for s, a in zip(in_specs, avals)),
                                         mesh, ((),))
    assert ledger.flops == pytest.approx(compiled.cost_analysis()["flops"], rel=0.02)


@pytest.mark.parametrize("src, dst", [(P(("data", "model")), P(("data", "expert"))), (P("model"), P("expert")),
                                      (P(None, "model"), P(None, "expert"))])
def test_an_axis_replaced_by_another_of_its_size_is_a_permute(src, dst):
    """A dim's axis replaced by another of the same size that splits nothing else: XLA sends each
    device's part to the device that holds it in the target (a collective-permute of the local
    part); fast mode gathered it (measured 2026-12-05)."""
    xla, predicted = by_kind(lambda x: jnp.tanh(x) * 2, (S(B, F),), (src,), dst, IDLE)
    assert xla["collective-permute"] > 0 and predicted == xla


def _adam(g, mu, nu, p):
    mu2 = 0.9 * mu + 0.1 * g
    nu2 = 0.999 * nu + 0.001 * g**2
    return p - 1e-3 * mu2 / (jnp.sqrt(nu2) + 1e-8), mu2, nu2


@pytest.mark.parametrize("grad, state", [
    (P(None, "model"), P()),
    (P("data", "model"), P()),
    (P(("data", "model")), P()),
    pytest.param(P(None, "model"), P("data"), marks=xfail(
        "XLA computes the update of an FSDP weight in its gradient's and its own splits together and gathers "
        "each output over `model` (3 x 32 KiB); fast mode moves the gradient to the weight's layout (32 KiB)")),
], ids=["replicated weight", "replicated weight, gradient over two dims", "replicated weight, gradient over two axes",
        "FSDP weight, gradient split elsewhere"])
def test_an_update_wanted_whole_is_computed_where_its_gradient_lies(grad, state):
    """Adam's update of a weight whose gradient comes more split than the weight (an activation
    constraint splits the gradient's dim, the weight is replicated): XLA computes the update where
    the gradient lies and gathers each output, the new weight, mu and nu (three gathers); fast mode
    gathered the gradient once before the update (random pair 1 of seed 0: 148,096 B of gathers
    where XLA makes 442,368 B). Measured 2026-12-05."""
    avals = (S(D, F),) * 4
    specs = (grad, state, state, state)
    m = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    with jax.set_mesh(m):
        out = NamedSharding(m, state)
        text = jax.jit(_adam, in_shardings=tuple(NamedSharding(m, s) for s in specs),
                       out_shardings=(out, out, out)).lower(*avals).compile().as_text()
        ledger = fast.propagate_function(_adam, avals, tuple(_dims(s, 2) for s in specs), MESH,
                                         (_dims(state, 2),) * 3)
    xla = dict.fromkeys(KINDS, 0)
    for op in hlo.with_axes(hlo.parse(text, 8), MESH):
        xla["reduce-scatter" if op.as_reduce_scatter else op.kind] += op.bytes_per_step
    assert {k: ledger.bytes_of(k) for k in KINDS} == xla
    assert xla["all-gather"] >= 3 * D * F * 4


def test_a_dispatch_summed_over_the_sequence_is_all_reduced_not_scattered_onto_the_experts():
    """A GShard MoE of our own with every weight replicated, the batch's groups over `model` and its
    sequence over `data` (random pair 157 of seed 0): the dispatch "gsec,gsd->egcd" sums over the
    sequence, and XLA all-reduces that sum over `data`. Fast mode reduce-scattered it onto the
    buffer's leading dim (the experts', not the groups' rows), so every expert weight's gradient
    came split over `data` and each update was gathered three times: 1.32 MB of all-gathers where
    XLA makes 52 KB (measured 2026-12-05)."""
    engine = ROOT / "tests" / "fixtures" / "engine_models.py"
    kw = dict(model=f"{engine}:moe", step=f"{engine}:moe_loss", devices=8,
              batch=["tokens=int32[8,16]", "labels=int32[8,16]"])
    plan = _plan("data = 2, model = 4", "(model, data)", "")
    f, e = (shardplan.api.analyze(plan, mode=m, **kw) for m in ("fast", "exact"))
    total = sum(e.bytes_by_kind().values())
    for kind in ("all-gather", "all-reduce"):
        assert abs(f.bytes_by_kind()[kind] - e.bytes_by_kind()[kind]) <= 0.10 * total, kind
    assert f.memory.peak == pytest.approx(e.memory.peak, rel=0.02)


@pytest.mark.parametrize("shape, src, dst", [
    ((8, 16), P(("data", "model")), P(("model", "data"))),  # a dim's axes in another order: a permute
    ((8, 64, 16), P("model"), P(("data", "model"))),  # further split, not by a slice: the target's block sent
    ((32, 64), P("model"), P("data")),
    ((32, 16), P("model"), P("data", "model")),
    ((32, 32, 8), P(None, "model"), P(("data", "model"))),  # sliced over data, then a quarter all-to-all'd
    ((8, 64, 16), P(None, None, "data"), P(("data", "model"))),  # sliced, all-to-all'd, then permuted
    ((64, 8), P("model", "data"), P(("data", "model"))),  # all-to-all'd after model: permuted
    ((32, 64), P(("data", "model")), P("model", "data")),  # the dim's first axis all-to-all'd: permuted
    ((64, 16, 8), P("model", None, "data"), P(None, ("data", "model"))),  # two dims to one: gathered whole
    ((32, 8, 8), P(("data", "model")), P(None, "data", "model")),  # one dim to two: gathered whole
    ((8, 32, 16), P(("model", "data")), P("data")),  # a kept axis after a gathered one: permuted first
    ((8, 8), P("data"), P("model")),  # coarser over another axis: permuted, gathered in pairs
    ((32, 8), P("data", "model"), P(None, "data")),  # gathered where data goes, then all-to-all'd
    ((16, 64), P("model", "data"), P(None, "model")),  # fewer blocks, not by a suffix gather: permuted, gathered
    ((64, 8), P(("data", "model")), P("model")),  # (block counts over data=4, model=2: 8 -> 2)
])
def test_a_reshard_moves_what_xla_moves(shape, src, dst):
    """A value resharded from one layout to another (no op between: the input's and the output's
    shardings), fast mode's collectives per kind against XLA:CPU's. The cases are the kinds of
    miss a fuzz of random layout pairs found (2026-12-05, rank 2-3, dims 8-64: over data=4,
    model=2, 31 of 76 pairs differed before these rules, 2 after; another 71 pairs 32 -> 6; over
    data=2, model=2, expert=2, 31 -> 22 of 76: XLA reasons in tile counts there, so an axis
    dropped and another of its size added on a dim is a permute, which fast mode gathers)."""
    xla, predicted = by_kind(lambda x: x * 2.0, (S(*shape),), (src,), dst)
    assert predicted == xla


@pytest.mark.parametrize("shape, src, dst", [
    ((32, 16), P(("model", "expert")), P("data", "model")),  # blocks 4x1 -> 2x2: one all-to-all, a permute
    ((64, 32), P(None, ("model", "expert")), P("model", "data")),
    ((16, 64, 32), P(("model", "expert"), "data"), P(None, "expert", ("model", "data"))),  # 4x2x1 -> 1x2x4
    ((32, 16), P("expert", "data"), P("data")),  # 2x2 -> 2x1: permuted, then gathered
    ((64, 32, 32), P(("expert", "model"), "data"), P("data", "model")),  # 4x2x1 -> 2x2x1
])
def test_a_reshard_over_axes_of_one_size_moves_block_counts(shape, src, dst):
    """Over data=2, expert=2, model=2 XLA reshards by block counts per dim, not axis names: one dim's
    blocks fewer by the factor another's are more is one all-to-all and, where the devices then hold
    other blocks than the target's, a permute; fewer blocks on some dims and none more is a permute
    and gathers (random layout pairs over this mesh: 25 of 77 missed before, 16 after)."""
    xla, predicted = by_kind(lambda x: x * 2.0, (S(*shape),), (src,), dst, IDLE)
    assert predicted == xla


def _random_layout(rng, shape, mesh):
    """A random layout of ``shape`` over ``mesh``: each dim whole or split over one or two axes an
    axis at most once, each split dividing its dim."""
    out, used = [], set()
    for size in shape:
        axes = ()
        for _ in range(10):
            pick = tuple(rng.sample(sorted(mesh), rng.choice([0, 0, 1, 1, 2])))
            if not set(pick) & used and size % math.prod(mesh[a] for a in pick) == 0:
                axes = pick
                break
        used |= set(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


@pytest.mark.parametrize("mesh, seed, most", [(MESH, 11, 4), (IDLE, 12, 9)], ids=["data4-model2", "three-axes"])
def test_random_reshards_mostly_move_what_xla_moves(mesh, seed, most):
    """Held out from the cases above: 24 random (shape, layout, layout) draws per mesh, rank 2-3,
    dims 8-64, each reshard compiled; fast mode's bytes per kind equal XLA:CPU's on all but the
    misses measured when these rules landed (2026-12-05, these seeds: 4 and 9 of 24; before them 10
    and 14): a new miss fails, listed with its layouts. The misses left: XLA gathering whole where
    fast mode slices then all-to-alls onto a layout that leaves devices holding copies, and
    all-to-alls XLA runs on a block a slice made smaller."""
    rng = random.Random(seed)
    missed = []
    for _ in range(24):
        shape = tuple(rng.choice([8, 16, 32, 64]) for _ in range(rng.choice([2, 3])))
        src, dst = _random_layout(rng, shape, mesh), _random_layout(rng, shape, mesh)
        xla, predicted = by_kind(lambda x: x * 2.0, (S(*shape),), (src,), dst, mesh)
        if predicted != xla:
            missed.append((shape, src, dst, xla, predicted))
    assert len(missed) <= most, missed


ENGINE = ROOT / "tests" / "fixtures" / "engine_models.py"


@pytest.mark.parametrize("propagation", ["shardplan", "xla"])
@pytest.mark.parametrize("rows, cols", [(16, 32), (8, 16)], ids=["tokens larger", "weights larger"])
def test_experts_weights_or_their_tokens_move_whichever_is_smaller(rows, cols, propagation):
    """A GShard MoE of our own names, no axis rules (engine_models.py:moe), experts over `expert`,
    the batch over (data, expert). Each expert weight is 73,728 B; the dispatched tokens per layer
    are 196,608 B at 16 x 32 tokens and 49,152 B at 8 x 16. XLA:CPU gathers the weights for their
    matmuls where the tokens are larger, and moves the tokens by all-to-all where they are
    smaller; the weights' gradients are summed over the tokens' axes (a reduce-scatter over
    `expert`, then its slice over `data`). Fast mode had kept the weights' split and moved the
    tokens at 16 x 32: 1,343,488 B of all-gathers and 200,704 B of all-to-all against XLA's
    294,912 B of all-gathers (the four weights) and none. On XLA's own layouts (the weights'
    gradients laid out over `expert` on the experts' dim) fast mode had moved the tokens' experts'
    dim onto `expert` and gathered them over (data, expert): 2,359,296 B more."""
    plan = _plan("data = 2, expert = 4", "((data, expert), _)", 'param "blocks/\\d+/moe/(w_in|w_out)" (expert, _, _)')
    batch = [f"tokens=int32[{rows},{cols}],labels=int32[{rows},{cols}]"]
    kw = dict(model=f"{ENGINE}:moe", step=f"{ENGINE}:moe_loss", batch=batch, devices=8)
    fast = shardplan.api.analyze(plan, mode="fast", propagation=propagation, **kw).bytes_by_kind()
    exact = shardplan.api.analyze(plan, mode="exact", **kw).bytes_by_kind()
    for kind in ("all-gather", "all-to-all", "reduce-scatter"):
        assert fast[kind] == exact[kind], kind
    assert fast["all-reduce"] == pytest.approx(exact["all-reduce"], rel=0.01)
    if rows == 16:
        assert exact["all-gather"] == 4 * 4 * 48 * 96 * 4 and exact["all-to-all"] == 0  # two weights, two layers
    else:
        assert exact["all-to-all"] > 0



def test_on_xlas_layouts_a_matmuls_sum_is_scattered_where_xla_lays_its_result_out():
    """gpt_tiny with its batch over `model` and its sequence over `seq`, nothing else split, on XLA's
    own layouts: the attention's key and value gradients sum over queries split over `seq` and are
    laid out over `seq` on the keys; XLA reduce-scatters them there. Fast mode carried the sum on to
    the projections' backward matmuls, which then ran on whole sequences (their FLOPs 2x, the step's
    +13.8%) until the rule that a matmul whose result its readers compute split is computed in that
    split (``matmul.dot``, ``Walker.free``; an xfail until 2026-12-07)."""
    plan = _plan("model = 2, seq = 4", "(model, seq)", "")
    kw = dict(model=f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
              batch=["tokens=int32[8,16],labels=int32[8,16]"], devices=8)
    fast = shardplan.api.analyze(plan, mode="fast", propagation="xla", **kw)
    exact = shardplan.api.analyze(plan, mode="exact", **kw)
    f, e = fast.bytes_by_kind(), exact.bytes_by_kind()
    for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert f[kind] == e[kind], kind
    assert e["reduce-scatter"] > 0
    assert fast.flops == pytest.approx(exact.flops, rel=0.01)


@pytest.mark.parametrize("init, width, weights_win", [
    (lambda x, b: x, 128, False),
    (lambda x, b: jnp.sin(x), 128, False),
    (lambda x, b: x @ b, 256, True),
    (lambda x, b: x[:, :128], 256, True),
], ids=["input", "elementwise", "matmul", "slice"])
def test_in_a_scanned_layer_a_weight_laid_out_first_keeps_its_split(init, width, weights_win):
    """A scanned layer's weight slice split over `data` on its output dim meets activations carried
    in over `data` on the batch. Shardy lays out first the values its first round reaches through
    pass-through ops (the weight's slice, through the loop's edges; activations carried from the
    step's input or an elementwise op of it): then the larger operand keeps its split and the
    weights are gathered. Activations made by a matmul or a slice before the loop get their layout
    in a later round, after the weight's split has claimed the hidden state: XLA gathers the
    activations (all tokens, the hidden state split over `data` on its width) and sums the second
    matmul's split contraction. Measured on XLA:CPU; the same on a scanned Llama's backward pass
    under plans/fsdp_any_rank.splan on XLA:TPU and XLA:GPU (docs/stepcost.md)."""
    layers, n, d, f = 4, 1024, 128, 384

    def step(x, b, w):
        def layer(c, wl):
            return c + jnp.tanh(c @ wl.T) @ wl, None

        y, _ = jax.lax.scan(layer, init(x, b), w)
        return jnp.sum(y * y)

    avals = (S(n, width), S(width, d), S(layers, f, d))
    specs = (P("data", None), P(None, None), P(None, "data", None))
    xla, predicted = by_kind(step, avals, specs, None, {"data": 8})
    activations, weights = layers * n * d * 4, 2 * layers * f * d * 4  # (each weight read twice)
    assert xla["all-gather"] == (activations if weights_win else weights)
    assert predicted["all-gather"] == xla["all-gather"], (predicted, xla)
    # the second matmul's sum: reduce-scattered onto the batch by XLA; fast mode, without a
    # step's batch axes here, all-reduces the same bytes
    assert sum(predicted.values()) == sum(xla.values()), (predicted, xla)


def test_shardys_first_round_reaches_what_pass_through_ops_make_of_the_inputs():
    """``priority.early_values``: a loop's carried value made by a matmul waits for a later round
    (and so does what elementwise ops make of it alone); one made elementwise from an input, or
    pinned by a sharding constraint, is laid out in the first; an operand broadcast over size-1
    dims does not carry its layout into the result in the first round."""
    from shardplan.runtime.fast.priority import early_values

    def step(x, b, w, scale):
        def layer(c, wl):  # a fresh body per loop (one body called from several loops: any call counts)
            h = c * 2.0
            return h + jnp.tanh(h @ wl.T) @ wl, None

        carried = {
            "matmul": x @ b,
            "elementwise": jnp.sin(x),
            "constrained": jax.lax.with_sharding_constraint(x @ b, P("data", None)),
        }
        ys = [jax.lax.scan(lambda c, wl: layer(c, wl), c, w)[0] for c in carried.values()]
        outer = jnp.sum(x, axis=-1, keepdims=True) * scale  # (n, 1) times an input's (1, d): both broadcast
        return ys, outer

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step)(S(64, 32), S(32, 32), S(2, 48, 32), S(1, 32)).jaxpr
    early, late = early_values(jaxpr)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    carries = [e.params["jaxpr"].jaxpr.invars[0] for e in scans]  # (no constants: the carry first)
    doubled = [e.params["jaxpr"].jaxpr.eqns[0].outvars[0] for e in scans]
    weights = [e.params["jaxpr"].jaxpr.invars[1] for e in scans]
    assert [c in early for c in carries] == [False, True, True]
    assert [c in late for c in carries] == [True, False, False]
    assert [h in late for h in doubled] == [True, False, False]
    assert all(w in early for w in weights)
    scaled = jaxpr.outvars[-1]
    assert scaled not in early


@pytest.mark.parametrize("rows", [64, 512])
def test_an_activation_gathered_for_a_matmul_is_held_while_it_runs(rows):
    """Activations split on the contraction alone times a whole weight: XLA gathers them for the
    matmul, and the gathered buffer is among the program's temporaries (XLA:CPU holds it twice:
    2x the gathered bytes in its memory analysis). Fast mode counts it in the peak for as long as
    the matmul runs; it had counted the result alone (4 KiB and 32 KiB here, against 256 KiB and
    2 MiB gathered)."""
    fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    avals, specs = (S(rows, 1024), S(1024, 16)), (P(None, "model"), P(None, None))
    xla, predicted = by_kind(fn, avals, specs, None)
    gathered = rows * 1024 * 4
    assert predicted == xla and xla["all-gather"] == gathered
    m = jax.make_mesh(tuple(MESH.values()), tuple(MESH), axis_types=(AxisType.Auto,) * len(MESH),
                      devices=jax.devices()[:8])
    with jax.set_mesh(m):
        compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(m, s) for s in specs)).lower(*avals).compile()
        ledger = fast.propagate_function(fn, avals, (((), ("model",)), ((), ())), MESH)
    xla_temp = compiled.memory_analysis().temp_size_in_bytes
    assert xla_temp >= gathered
    assert gathered <= ledger.temporaries <= xla_temp


@pytest.mark.parametrize("tokens, wanted, mesh", [
    (P(("data", "expert")), P("expert", "data"), {"expert": 4, "data": 2}),
    (P(("expert", "data")), P("data", "expert"), {"expert": 4, "data": 2}),
    (P(("a", "b", "c")), P("a", ("b", "c")), {"a": 2, "b": 2, "c": 2}),
    (P(("a", "b", "c")), P("a", "b"), {"a": 2, "b": 2, "c": 2}),  # c summed, left out of the layout
    (P(("a", "b")), P("a", "b"), {"a": 2, "b": 2, "c": 2}),  # c idle: it stands in for no summed axis
])
def test_a_sum_wanted_split_over_its_axes_on_two_dims_is_all_reduced_whole_then_sliced(tokens, wanted, mesh):
    """A weight gradient ``x.T @ g`` with the tokens over several axes, wanted split over those axes
    on both its dims (an FSDP x TP rule such as ``(expert, data)`` under a batch over
    ``(data, expert)``): XLA:CPU all-reduces the whole once per dim's axes and slices each device's
    block (2 x 128 KiB here), no reduce-scatter; an axis summed but left out of the layout is
    all-reduced after, on the block. Fast mode reduce-scattered it (128 KiB) until 2026-12-07, and
    with an idle axis computed it split over that axis, all-reduced a quarter and permuted it.
    (Offline, XLA:GPU all-reduces once over all the axes and XLA:TPU reduce-scatters onto both
    dims: ``Compiler.scatters_one_dim``.)"""
    xla, predicted = by_kind(lambda x, g: x.T @ g, (S(64, 128), S(64, 256)), (tokens, tokens), wanted, mesh=mesh)
    assert xla["reduce-scatter"] == 0 and xla["all-reduce"] >= 2 * 128 * 256 * 4
    assert predicted == xla, (predicted, xla)


def test_a_sum_wanted_over_its_axes_and_an_idle_one_is_computed_over_the_idle_one_and_scattered():
    """The same gradient wanted ``((a, c), b)``: XLA computes it split over ``c`` (no side uses
    it, nothing sums over it), reduce-scatters that half over ``(a, b)`` and permutes the blocks
    into place (XLA:CPU, and offline XLA:TPU v5e and XLA:GPU H100 alike: 64 KiB and 16 KiB); fast
    mode reduce-scattered the whole (128 KiB) until 2026-12-07."""
    tokens, mesh = P(("a", "b")), {"a": 2, "b": 2, "c": 2}
    xla, predicted = by_kind(lambda x, g: x.T @ g, (S(64, 128), S(64, 256)), (tokens, tokens), P(("a", "c"), "b"),
                             mesh=mesh)
    assert xla["reduce-scatter"] == 128 * 256 * 4 // 2 and xla["collective-permute"] > 0
    assert predicted == xla, (predicted, xla)


@pytest.mark.parametrize("x_spec, b_spec, d, n, share", [
    (P(None, None, ("model", "data")), P("data"), 48, 144, 2),
    (P(None, None, ("model", "data")), P("model"), 48, 144, 4),
    (P(None, None, ("model", "data")), P(("data", "model")), 48, 144, 8),
    (P(None, None, "model"), P("data"), 64, 128, 2),
], ids=["bias over data", "bias over model", "bias over both", "x over model, bias over data"])
def test_a_matmul_whose_readers_split_its_result_computes_only_their_split(x_spec, b_spec, d, n, share):
    """``x @ w + b``: x split on its width (the contraction), w whole, the bias split on the
    result's columns. XLA gathers x whole (its bytes are fewer than the result's), then computes
    only the columns the bias add keeps on each device: w's columns sliced for free, 1/share of the
    FLOPs. Fast mode computed the whole result and sliced it at the add (2x to 8x the FLOPs). The
    same FLOPs from XLA:CPU, and offline from XLA:TPU v5e (2x4) and XLA:GPU H100 (8), 2026-12-07:
    893,955 / 894,723 / 893,955 with the bias over data, 446,979 / 447,747 / 446,979 over model."""
    mesh = {"model": 4, "data": 2}
    fn = lambda x, w, b: x @ w + b  # noqa: E731
    avals, specs = (S(8, 16, d), S(d, n), S(n)), (x_spec, P(), b_spec)
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla and xla["all-gather"] == 8 * 16 * d * 4  # x gathered whole
    flops, fast_flops = flops_of(fn, avals, specs, mesh)
    assert fast_flops == pytest.approx(flops, rel=0.02)
    assert flops < 1.05 * 2 * 8 * 16 * d * n / share


@pytest.mark.parametrize("idx_spec, table_spec, laid", [
    (P(("data", "expert")), P("expert", "data"), P(None, None, "data")),
    (P(("expert", "data")), P("expert", "data"), P("expert", None, "data")),
    (P(("data", "expert")), P(None, "data"), P(None, None, "data")),
    (P(("expert", "data")), P(None, "data"), P("expert", None, "data")),
], ids=["batch (data, expert)", "batch (expert, data)", "whole rows, (data, expert)", "whole rows, (expert, data)"])
def test_a_lookup_whose_width_clashes_with_its_batch_keeps_the_batch_axes_before_the_clash(idx_spec, table_spec, laid):
    """Tokens split over two axes looked up in a table whose width is split over one of them: XLA's
    propagation lays the result out with the batch axes before the first that clashes (a dim's axes
    are major to minor, and it keeps the longest prefix that does not conflict): over (data,
    expert) the batch is whole, over (expert, data) it keeps `expert`. The lookup is computed over
    the axes that do not clash either way, so over (data, expert) XLA all-gathers its output over
    `expert` (6,144 B); fast mode had left it split there (XLA:CPU, 2026-12-07)."""
    mesh = {"data": 4, "expert": 2}
    fn = lambda table, idx: table[idx]  # noqa: E731
    avals, specs = (S(112, 48), S(8, 16, dtype=jnp.int32)), (table_spec, idx_spec)
    m = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    with jax.set_mesh(m):
        compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(m, s) for s in specs)).lower(*avals).compile()
    assert compiled.output_shardings.spec == laid
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla
    assert (xla["all-gather"] >= 8 * 16 * 48 * 4 // 4) == (idx_spec[0][0] == "data")


_PREFIX = xfail("not modelled: fast mode keeps the other axis (taking only the prefix before the clash, as XLA does "
                "here, made 80 random pairs of seed 7 worse: all-gather p90 28.6 -> 30.2%, FLOPs 21.9 -> 22.3%, 7 "
                "pairs better and 9 worse, 2026-12-07; XLA:TPU v5e and XLA:GPU H100 gather w whole too)")


@pytest.mark.parametrize("x_spec, w_spec", [
    pytest.param(P("data", None, None), P(None, ("data", "model")), marks=_PREFIX),
    pytest.param(P("model", None, None), P(None, ("model", "data")), marks=_PREFIX),
    (P("data", None, None), P(None, ("model", "data"))),
], ids=["w over (data, model)", "w over (model, data)", "the clash second"])
def test_a_weight_split_on_its_columns_over_the_batchs_axis_and_another_keeps_what_precedes_the_clash(x_spec, w_spec):
    """x (8, 16, 48) over one axis on its rows times w (48, 64) over that axis and another on its
    columns. Where the clashing axis comes first in w's columns, XLA gathers w whole (its columns
    keep only the axes before the clash: none) and computes the rows' share; where it comes
    second, w keeps the first over its columns. Fast mode keeps w over the other axis in every
    case, a quarter or an eighth of XLA's FLOPs (XLA:CPU, 2026-12-07)."""
    mesh = {"data": 2, "model": 4}
    fn = lambda x, w: x @ w  # noqa: E731
    avals, specs = (S(8, 16, 48), S(48, 64)), (x_spec, w_spec)
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla
    flops, fast_flops = flops_of(fn, avals, specs, mesh)
    assert fast_flops == pytest.approx(flops, rel=0.02)


@pytest.mark.parametrize("x_spec, w_spec, b_spec", [
    (P(None, None, ("data", "model")), P(None, "model"), P(("model", "data"))),
    (P(None, None, ("model", "data")), P(None, "model"), P(("model", "data"))),
    (P(None, None, None), P("model", "data"), P(("data", "model"))),
], ids=["x gathered, w over model", "x gathered over (model, data)", "w moved onto its columns"])
def test_a_matmul_split_over_a_prefix_of_what_its_readers_split_is_split_further(x_spec, w_spec, b_spec):
    """``x @ w + b`` with the bias split over two axes on the columns and w over the first of them
    (or over both, the second on its rows): XLA computes only the bias's eighth of the columns, w
    sliced further (or moved onto its columns by an all-to-all, 1,536 B); fast mode had computed
    the columns w's own split gave (2x or 4x XLA's FLOPs; XLA:CPU, 2026-12-07)."""
    mesh = {"data": 2, "model": 4}
    fn = lambda x, w, b: x @ w + b  # noqa: E731
    avals, specs = (S(8, 16, 48), S(48, 64), S(64)), (x_spec, w_spec, b_spec)
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla
    flops, fast_flops = flops_of(fn, avals, specs, mesh)
    assert fast_flops == pytest.approx(flops, rel=0.02)
    assert flops < 1.05 * 2 * 8 * 16 * 48 * 64 / 8


@pytest.mark.parametrize("g_spec, w_spec, h_spec", [
    (P("b", "a", None), P(None, "b"), P(None, ("a", "b"), None)),
    (P("b", "a", None), P(), P(None, None, "b")),
    (P(None, "b", None), P(None, "a"), P(None, "b", "a")),
    (P("a", "b", None), P("a", "b"), P(None, None, "a")),
    (P(None, ("b", "a"), None), P("b", "a"), P(None, "b", None)),
], ids=["g moved by all-to-all", "g gathered on its rows", "w moved onto its rows",
        "w gathered, the rows kept", "a prefix extended"])
def test_a_matmul_whose_result_meets_a_split_input_elementwise_is_computed_in_the_inputs_layout(g_spec, w_spec, h_spec):
    """``(g @ w.T) * sin(h)`` (a GELU's backward: the cotangent times a term of the forward
    activation), h a split input: Shardy's propagation runs elementwise ops first
    (``OpPriorityPropagation``), so h's layout reaches the matmul's result before the matmul's
    operands do. XLA moves g or w to compute the result in h's layout (its other dims keeping the
    operands' splits where their axes are free); fast mode had computed the result in g's layout
    and moved it (46 of 60 random layouts differed, 5 after; XLA:CPU, and the first four offline on
    XLA:TPU v5e and XLA:GPU H100, equal per kind, 2026-12-07)."""
    mesh = {"a": 2, "b": 4}
    fn = lambda g, w, h: (g @ w.T) * jnp.sin(h)  # noqa: E731
    avals, specs = (S(8, 16, 48), S(64, 48), S(8, 16, 64)), (g_spec, w_spec, h_spec)
    xla, predicted = by_kind(fn, avals, specs, None, mesh)
    assert predicted == xla, (predicted, xla)
    flops, fast_flops = flops_of(fn, avals, specs, mesh)
    assert fast_flops == pytest.approx(flops, rel=0.02)


@pytest.mark.parametrize("propagation", ["shardplan", "xla"])
def test_an_update_computed_split_moves_each_output_to_its_layout(propagation):
    """An Adam-style update of a replicated weight whose gradient comes out split (x over `model`
    on the tokens and `expert` on its width, the cotangent over `data` on its width: the gradient
    over (expert, data)): XLA computes the update split and gathers each of its three outputs
    (weight, mu, nu: 3 x (18,432 + 36,864) B). On XLA's own layouts fast mode let the outputs'
    whole layout win over XLA's and gathered the gradient once (55,296 B) until 2026-12-07; 80
    random pairs of seed 7 on XLA's layouts: all-gather p90 28.5 -> 24.3% (median 11.6 -> 5.2%)."""
    mesh = {"model": 2, "expert": 2, "data": 2}

    def fn(x, dy, w, mu, nu):
        g = jnp.einsum("btd,btf->df", x, dy)
        mu2 = 0.9 * mu + 0.1 * g
        nu2 = 0.99 * nu + 0.01 * g**2
        return w - 1e-3 * mu2 / (jnp.sqrt(nu2) + 1e-8), mu2, nu2

    avals = (S(8, 16, 48), S(8, 16, 192), S(48, 192), S(48, 192), S(48, 192))
    specs = (P("model", None, "expert"), P("model", None, "data"), P(), P(), P())
    xla, predicted = by_kind(fn, avals, specs, [P(), P(), P()], mesh, propagation=propagation)
    assert xla["all-gather"] == 3 * (24 * 192 + 48 * 192) * 4
    assert predicted == xla, (predicted, xla)


@pytest.mark.parametrize("propagation", [
    pytest.param("shardplan", marks=xfail(
        "not modelled on fast mode's own layouts: the pieces' layout carried back from the output (hints) taken as "
        "XLA's made 80 random pairs of seed 7 worse (all-gather p90 28.6 -> 31.9%), so only claimed layouts (a "
        "constraint's, XLA's) count")),
    "xla",
])
def test_a_split_whose_pieces_are_wanted_whole_on_the_cut_dim_gathers_it(propagation):
    """A fused projection's result (8, 16, 144), its columns over `expert` (w's), split into q, k, v
    that are wanted over (expert, data) on the batch (``q * k + v`` under that output sharding, as
    attention wants its heads' batch): XLA gathers the result's columns whole (73,728 B) and slices
    each piece's batch from it; fast mode had permuted each piece's blocks along the columns and
    then moved them onto the batch by all-to-all (43,008 + 18,432 B; XLA:CPU, 2026-12-07)."""
    mesh = {"expert": 2, "seq": 2, "data": 2}

    def fn(x, w):
        q, k, v = jnp.split(x @ w, 3, axis=-1)
        return q * k + v

    avals, specs = (S(8, 16, 48), S(48, 144)), (P(), P(None, "expert"))
    xla, predicted = by_kind(fn, avals, specs, P(("expert", "data")), mesh, propagation=propagation)
    assert xla == {**dict.fromkeys(KINDS, 0), "all-gather": 8 * 16 * 144 * 4}
    assert predicted == xla, (predicted, xla)


BMM = ("bij,bjk->bik", (jax.ShapeDtypeStruct((16, 64, 32), jnp.float32), jax.ShapeDtypeStruct((16, 32, 48), jnp.float32)))
SMALL_RHS = (jax.ShapeDtypeStruct((16, 64, 32), jnp.float32), jax.ShapeDtypeStruct((16, 32, 8), jnp.float32))


@pytest.mark.parametrize("lhs_spec, rhs_spec, out_spec, avals, permuted, propagations", [
    # the rhs gathered off its batch dim over expert, the lhs keeping expert on i: all three permuted
    (P("data", "expert"), P(("data", "expert")), P("data", "expert"), BMM[1], 32_768 + 24_576 + 49_152,
     ("shardplan", "xla")),
    # the same with a small rhs (gathered, no larger than the lhs): the rhs alone, before and after its gather
    (P("data", "expert"), P(("data", "expert")), P("data", "expert"), SMALL_RHS, 4_096 + 8_192, ("shardplan", "xla")),
    # the rhs gathered off its columns, or off its contraction: the rhs alone permuted
    (P("data", "expert"), P("data", None, "expert"), P("data", "expert"), BMM[1], 24_576, ("shardplan", "xla")),
    (P("data", "expert"), P("data", "expert"), P("data", "expert"), BMM[1], 24_576, ("shardplan", "xla")),
    # mirrored: the lhs gathered off its batch dim, the rhs keeping expert on k
    (P(("data", "expert")), P("data", None, "expert"), P("data", None, "expert"), BMM[1], 32_768 + 24_576 + 49_152,
     ("xla",)),
    # the lhs takes expert on i by a slice (it kept nothing): gathered, nothing permuted
    (P("data"), P(("data", "expert")), P("data", "expert"), BMM[1], 0, ("xla",)),
], ids=["off the batch dim", "off the batch dim, small rhs", "off its columns", "off its contraction", "mirrored",
        "kept by a slice"])
def test_a_matmul_gathering_an_axis_the_other_side_keeps_beside_an_idle_axis_permutes_blocks(
        lhs_spec, rhs_spec, out_spec, avals, permuted, propagations):
    """Over data=2, expert=2, model=2 (model split by nothing in the matmul), an operand gathered
    over expert while the other keeps expert on a free dim: XLA:CPU permutes the gathered operand's
    blocks before gathering them, and where expert leaves a batch dim also the other operand's and
    the result's (the matmul computed in another device order), unless the gathered operand is
    no larger than the other: then it is permuted again after its gather. Fast mode had only the
    gather (``matmul._reordered``)."""
    spec = BMM[0]
    for propagation in propagations:
        xla, fast_mode = by_kind(lambda a, b: jnp.einsum(spec, a, b), avals, (lhs_spec, rhs_spec), out_spec,
                                 mesh={"data": 2, "expert": 2, "model": 2}, propagation=propagation)
        assert xla["collective-permute"] == permuted, xla
        assert fast_mode == xla, (propagation, xla, fast_mode)


def test_a_matmul_on_two_axes_gathers_without_permuting():
    """The same first case over data=2, expert=4 (no idle axis): the gather alone, as fast mode says."""
    spec, avals = BMM
    xla, fast_mode = by_kind(lambda a, b: jnp.einsum(spec, a, b), avals,
                             (P("data", "expert"), P(("data", "expert"))), P("data", "expert"),
                             mesh={"data": 2, "expert": 4})
    assert xla["collective-permute"] == 0 and xla["all-gather"] > 0 and fast_mode == xla, (xla, fast_mode)


@pytest.mark.parametrize("lhs_spec, rhs_spec, avals, moved", [
    (P("data", "expert"), P(("data", "expert")), BMM[1], 32_768),  # the lhs, expert off i
    (P("data", None, "expert"), P(("data", "expert")), BMM[1], 32_768),  # the lhs, expert off its contraction
    (P(("data", "expert")), P("data", None, "expert"), BMM[1], 24_576),  # the rhs, expert off k
    (P("data", "expert"), P(("data", "expert")), SMALL_RHS, 32_768),
], ids=["lhs off i", "lhs off j", "rhs off k", "small rhs"])
def test_an_operand_moved_onto_the_others_batch_split_beside_an_idle_axis_goes_through_it(
        lhs_spec, rhs_spec, avals, moved):
    """``bij,bjk->bik`` over data=2, expert=2, model=2, the result over (data, expert) on b, one
    operand over data on b and expert on another dim, the other over (data, expert) on b: XLA:CPU
    slices the first's batch over the idle `model`, permutes the half blocks so `model` stands where
    `expert` was, and gathers over `model` (half the operand's local bytes permuted, its bytes
    gathered), not the all-to-all of the operand alone that fast mode had predicted."""
    xla, fast_mode = by_kind(lambda a, b: jnp.einsum(BMM[0], a, b), avals, (lhs_spec, rhs_spec),
                             P(("data", "expert")), mesh={"data": 2, "expert": 2, "model": 2}, propagation="xla")
    assert xla["all-to-all"] == 0 and xla["collective-permute"] == moved // 2 and xla["all-gather"] == moved, xla
    assert fast_mode == xla, (xla, fast_mode)
