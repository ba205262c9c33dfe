"""One test per local rule of the shard_map partitioner (shardplan/runtime/partition/): a one-
or two-op function run through the partitioner under shard_map on 8 simulated devices, its
output equal to the op on one device, the output's layout what the rule says, and no op run on
whole operands (docs/backends.md's coverage table)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardplan.runtime import partition

MESH = {"data": 4, "model": 2}


def _spec(dims):
    return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])


def partitioned(fn, args, in_dims, out_hints=None):
    """``fn(*args)`` partitioned: (outputs gathered whole, their layouts before, the record,
    collectives issued before the outputs were gathered); ``out_hints``: the layouts the outputs
    are wanted in (a gradient's param layout)."""
    closed = jax.make_jaxpr(fn)(*args)
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH), axis_types=(jax.sharding.AxisType.Auto,) * len(MESH))
    record = partition.Record()
    layouts: list = []
    before: list = []

    def local(*xs):
        part = partition.Partitioner(MESH, record, batch_axes=frozenset({"data"}))
        vals = [
            partition.V(x, tuple(a.shape), a.dtype, tuple(tuple(d) for d in dims), act=True)
            for x, a, dims in zip(xs, args, in_dims, strict=True)
        ]
        outs = part.run(closed.jaxpr, list(closed.consts), vals, out_hints)
        layouts[:] = [(o.dims, o.partial) for o in outs]
        before[:] = list(record.issued)
        return [part.whole(o).x for o in outs]

    n_out = len(closed.jaxpr.outvars)
    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(_spec(d) for d in in_dims),
        out_specs=[P()] * n_out,
        check_vma=False,
    )
    got = jax.jit(f)(*args)
    return got, layouts, record, before


def check(fn, args, in_dims, dims=None, issued=(), out_hints=None):
    """Equal to one device; no fallback; the first output's layout ``dims`` (when given); the
    collectives issued by the op itself, by kind, ``issued``."""
    got, layouts, record, before = partitioned(fn, args, in_dims, out_hints)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-5)  # float32 sums reordered
    assert record.fallbacks == []
    if dims is not None:
        assert layouts[0][0] == dims, layouts
    assert sorted(c.kind for c in before) == sorted(issued), before
    return layouts, record


RNG = np.random.default_rng(0)


def f32(*shape):
    return jnp.asarray(RNG.normal(size=shape).astype(np.float32))


BH = (("data",), (), ("model",), ())  # a (batch, time, heads, head_dim) layout: batch and heads split


# -- values made in the step -------------------------------------------------------------------
def test_zeros_cache_written_at_a_time_position_stays_split_like_the_update():
    def write(k):
        cache = jnp.zeros((8, 12, 4, 2), k.dtype)
        return jax.lax.dynamic_update_slice(cache, k, (0, 3, 0, 0))

    check(write, [f32(8, 5, 4, 2)], [BH], dims=BH)


def test_full_and_iota_take_their_readers_layout():
    def add(x):
        return x + jnp.full(x.shape, 2.0) * jnp.arange(x.shape[0], dtype=x.dtype)[:, None]

    check(add, [f32(8, 6)], [(("data",), ())], dims=(("data",), ()))


def test_iota_split_over_its_own_dim_counts_from_each_blocks_start():
    def pos(x):
        return x * jax.lax.broadcasted_iota(jnp.float32, x.shape, 1)

    check(pos, [f32(4, 8)], [((), ("data", "model"))], dims=((), ("data", "model")))


# -- windows at a position -------------------------------------------------------------------
def test_dynamic_update_slice_into_a_split_buffer():
    def roll(buf, x, i):
        return jax.lax.dynamic_update_slice(buf, x, (0, i, 0, 0))

    check(roll, [f32(8, 12, 4, 2), f32(8, 1, 4, 2), jnp.int32(7)], [BH, BH, ()], dims=BH)


def test_dynamic_slice_at_a_time_position_keeps_other_splits():
    def window(buf, i):
        return jax.lax.dynamic_slice(buf, (0, i, 0, 0), (8, 3, 4, 2))

    check(window, [f32(8, 12, 4, 2), jnp.int32(5)], [BH, ()], dims=BH)


def test_dynamic_slice_over_a_split_position_dim_reads_it_whole():
    def window(buf, i):
        return jax.lax.dynamic_slice(buf, (i, 0), (3, 6))

    check(window, [f32(8, 6), jnp.int32(2)], [(("data",), ()), ()], dims=((), ()), issued=["all-gather"])


# -- along an unsplit dim --------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,fn",
    [
        ("top_k", lambda x: jax.lax.top_k(x, 3)),
        ("sort", lambda x: jax.lax.sort(x, dimension=2)),
        ("argmax", lambda x: jnp.argmax(x, axis=-1)),
        ("argmin", lambda x: jnp.argmin(x, axis=-1)),
        ("reduce_max", lambda x: jnp.max(x, axis=-1)),
        ("reduce_min", lambda x: jnp.min(x, axis=-1)),
        ("cumsum", lambda x: jax.lax.cumsum(x, axis=2)),
        ("cumprod", lambda x: jax.lax.cumprod(x, axis=2)),
        ("cummax", lambda x: jax.lax.cummax(x, axis=2)),
        ("cumlogsumexp", lambda x: jax.lax.cumlogsumexp(x, axis=2)),
    ],
)
def test_op_along_an_unsplit_dim_is_local(name, fn):
    closed = jax.make_jaxpr(fn)(f32(8, 4, 6))
    assert name in {e.primitive.name for e in closed.jaxpr.eqns}
    reduced = name in ("argmax", "argmin", "reduce_max", "reduce_min")
    dims = (("data",), ("model",)) if reduced else (("data",), ("model",), ())
    check(fn, [f32(8, 4, 6)], [(("data",), ("model",), ())], dims=dims)


ALONG = [
    ("sort", lambda x: jax.lax.sort(x, dimension=2)),
    ("argmax", lambda x: jnp.argmax(x, axis=2)),
    ("argmin", lambda x: jnp.argmin(x, axis=2)),
    ("cumsum", lambda x: jax.lax.cumsum(x, axis=2)),
    ("cumprod", lambda x: jax.lax.cumprod(x, axis=2)),
    ("cummax", lambda x: jax.lax.cummax(x, axis=2)),
    ("cumlogsumexp", lambda x: jax.lax.cumlogsumexp(x, axis=2)),
    ("rev", lambda x: jax.lax.rev(x, (2,))),
]


@pytest.mark.parametrize("name,fn", ALONG, ids=[n for n, _ in ALONG])
def test_op_along_a_split_dim_takes_that_dim_whole_and_keeps_the_others(name, fn):
    """The dim the op runs along is split over ``model``: computed per block it would be wrong
    (a cumsum restarting at each block, an argmax of a block): gathered first, other splits kept."""
    x = f32(8, 3, 6)
    closed = jax.make_jaxpr(fn)(x)
    assert name in {e.primitive.name for e in closed.jaxpr.eqns}
    reduced = name in ("argmax", "argmin")
    dims = (("data",), ()) if reduced else (("data",), (), ())
    check(fn, [x], [(("data",), (), ("model",))], dims=dims, issued=["all-gather"])


@pytest.mark.parametrize(
    "name,fn",
    [
        ("add", lambda x: jnp.sum(x, axis=-1) + 0.5),
        ("sub", lambda x: 2.0 - jnp.sum(x, axis=-1)),
        ("add", lambda x: jnp.mean(x * x, axis=-1, keepdims=True) + 1e-2),  # an RMSNorm's mean + eps
    ],
)
def test_a_constant_added_to_a_pending_sum_is_added_once(name, fn):
    """A sum over a split dim is pending (one partial per device); a constant added to it must be
    added to the total, not to each partial (which would add it once per device)."""
    x = f32(8, 6)
    got, layouts, record, _ = partitioned(fn, [x], [(("data",), ("model",))])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(jax.jit(fn)(x)), rtol=1e-6, atol=1e-6)
    assert layouts[0][1] == frozenset() and record.fallbacks == []


def test_pending_sums_added_together_stay_pending():
    """Linear in both operands: the sum of two partial sums over the same axis is one partial sum."""

    def fn(x, y):
        return jnp.sum(x, axis=-1) + jnp.sum(y, axis=-1)

    _, layouts, _, before = partitioned(fn, [f32(8, 6), f32(8, 6)], [(("data",), ("model",))] * 2)
    assert layouts[0][1] == frozenset({"model"}) and before == []
    check(fn, [f32(8, 6), f32(8, 6)], [(("data",), ("model",))] * 2)


def test_reduce_max_over_a_split_dim_is_a_pmax():
    check(lambda x: jnp.max(x, axis=0), [f32(8, 6)], [(("data",), ())], dims=((),), issued=["all-reduce"])


def test_top_k_over_a_split_dim_falls_back_and_is_recorded():
    x = f32(6, 8)
    got, _, record, _ = partitioned(lambda x: jax.lax.top_k(x, 3)[0], [x], [((), ("data",))])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(jax.lax.top_k(x, 3)[0]))
    assert [(f.op, f.bytes) for f in record.fallbacks] == [("top_k", 6 * 8 * 4)]


# -- grouped matmuls (jax.lax.ragged_dot: experts stacked by group) ------------------------------
SIZES = jnp.asarray([3, 5, 0, 6], jnp.int32)  # 14 of 16 rows grouped (the rest: no group), one empty


def test_grouped_matmul_with_its_groups_split_runs_each_devices_groups_and_leaves_a_pending_sum():
    """The experts' weights split over ``data`` by group (``model`` idle): each device multiplies
    its share of the rows of its own groups, the two devices that hold the same groups (``model``)
    half each (zero elsewhere): a pending sum over ``data`` and ``model``; nothing moves for the
    matmul. With ``model`` splitting the weights' output dim there is no axis to share the rows."""
    layouts, _ = check(jax.lax.ragged_dot, [f32(16, 6), f32(4, 6, 5), SIZES],
                       [((), ()), (("data",), (), ()), ((),)], dims=((), ()))
    assert layouts[0][1] == frozenset({"data", "model"})
    layouts, _ = check(jax.lax.ragged_dot, [f32(16, 6), f32(4, 6, 10), SIZES],
                       [((), ()), (("data",), (), ("model",)), ((),)], dims=((), ("model",)))
    assert layouts[0][1] == frozenset({"data"})


def test_grouped_matmul_keeps_the_weights_output_split_and_sums_a_split_contraction():
    """Experts over ``data``, the weights' output dim over ``model`` (expert x tensor parallel):
    the result split over ``model``; a contraction split on the weight (expert + FSDP) is taken by
    the whole tokens at no cost and summed."""
    check(jax.lax.ragged_dot, [f32(16, 6), f32(4, 6, 10), SIZES],
          [((), ()), (("data",), (), ("model",)), ((),)], dims=((), ("model",)))
    layouts, _ = check(jax.lax.ragged_dot, [f32(16, 6), f32(4, 6, 5), SIZES],
                       [((), ()), (("data",), ("model",), ()), ((),)], dims=((), ()))
    assert layouts[0][1] == frozenset({"data", "model"})


def test_grouped_matmuls_gradients_come_out_in_the_params_layout_with_nothing_gathered():
    """The backward pass of a grouped matmul (the tokens' gradient, a grouped matmul by the
    transposed weights; the weights' gradient, one contracting the ragged rows): with the weights'
    gradient wanted split by group over ``data``, each device computes its own groups'; no fallback
    and nothing moves: the tanh runs on each device's own rows (the forward result is not summed),
    the tokens' gradient is pending over the groups' axis and the weights' output split."""

    def grads(x, w, s):
        return jax.grad(lambda x, w: jnp.sum(jnp.tanh(jax.lax.ragged_dot(x, w, s))), argnums=(0, 1))(x, w)

    wd = (("data",), (), ("model",))
    closed = jax.make_jaxpr(grads)(f32(16, 6), f32(4, 6, 10), SIZES)
    assert sum(e.primitive.name == "ragged_dot_general" for e in closed.jaxpr.eqns) == 3
    _, layouts, _, before = partitioned(grads, [f32(16, 6), f32(4, 6, 10), SIZES], [((), ()), wd, ((),)],
                                        out_hints=[None, wd])
    assert layouts[1] == (wd, frozenset()), layouts
    assert layouts[0] == (((), ()), frozenset({"data", "model"})), layouts
    assert before == [], before
    check(grads, [f32(16, 6), f32(4, 6, 10), SIZES], [((), ()), wd, ((),)], out_hints=[None, wd])


# -- comparisons and scatters -----------------------------------------------------------------
def test_one_hot_of_split_labels_is_elementwise():
    labels = jnp.asarray(RNG.integers(0, 10, size=(8, 4)), jnp.int32)
    check(lambda y: jax.nn.one_hot(y, 10), [labels], [(("data",), ("model",))], dims=(("data",), ("model",), ()))


def test_scatter_add_of_batch_split_updates_is_a_pending_sum():
    idx = jnp.asarray(RNG.integers(0, 5, size=(8,)), jnp.int32)

    def counts(i, u):
        return jnp.zeros((5, 6)).at[i].add(u)

    layouts, _ = check(counts, [idx, f32(8, 6)], [(("data",),), (("data",), ())], dims=((), ()))
    assert layouts[0][1] == frozenset({"data"})


def test_scatter_add_along_an_unsplit_dim_keeps_window_splits():
    idx = jnp.asarray(RNG.integers(0, 5, size=(8,)), jnp.int32)

    def counts(i, u):
        return jnp.zeros((5, 6)).at[i].add(u)

    layouts, _ = check(counts, [idx, f32(8, 6)], [((),), ((), ("model",))], dims=((), ("model",)))
    assert layouts[0][1] == frozenset()


# -- random numbers ----------------------------------------------------------------------------
def test_random_bits_of_split_keys_stay_split():
    keys = jax.random.split(jax.random.key(3), 8)

    def noise(k):
        return jax.vmap(lambda kk: jax.random.normal(kk, (3,)))(k)

    check(noise, [keys], [(("data",),)], dims=(("data",), ()))


def test_dropout_mask_from_one_key_equals_one_device():
    def dropout(x):
        keep = jax.random.bernoulli(jax.random.key(7), 0.75, x.shape)
        return jnp.where(keep, x / 0.75, 0.0)

    check(dropout, [f32(8, 6)], [(("data",), ("model",))], dims=(("data",), ("model",)))


def test_split_and_fold_in_of_split_keys():
    keys = jax.random.split(jax.random.key(1), 8)

    def bits(k):
        k2 = jax.vmap(lambda kk: jax.random.fold_in(kk, 5))(k)
        return jax.vmap(lambda kk: jax.random.bits(jax.random.split(kk, 2)[1], (2,)))(k2)

    check(bits, [keys], [(("data",),)], dims=(("data",), ()))


def test_zeros_buffer_filled_in_a_scan_takes_the_bodys_layout():
    """A rolling buffer made with jnp.zeros and written one time step per iteration: the carry
    starts split like the K/V written into it, so no iteration gathers anything."""

    def fill(x):
        def body(buf, i):
            step = jax.lax.dynamic_slice_in_dim(x, i, 1, axis=1)
            return jax.lax.dynamic_update_slice(buf, step * 2.0, (0, i, 0, 0)), None

        return jax.lax.scan(body, jnp.zeros(x.shape, x.dtype), jnp.arange(x.shape[1]))[0]

    check(fill, [f32(8, 6, 4, 2)], [BH], dims=BH)


def test_scatter_set_keeps_a_split_window_dim():
    idx = jnp.asarray([[4], [0], [2]], jnp.int32)

    def put(x, u):
        return x.at[idx[:, 0]].set(u)

    assert "scatter" in {e.primitive.name for e in jax.make_jaxpr(put)(f32(5, 6), f32(3, 6)).jaxpr.eqns}
    check(put, [f32(5, 6), f32(3, 6)], [((), ("model",)), ((), ("model",))], dims=((), ("model",)))


# -- regions and layouts of pipelines ----------------------------------------------------------
def test_a_shard_map_region_runs_on_its_blocks_with_its_own_permute():
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH), axis_types=(jax.sharding.AxisType.Auto,) * len(MESH))

    def shift(x):
        step = jax.shard_map(
            lambda b: jax.lax.ppermute(b, "model", [(0, 1), (1, 0)]),
            mesh=mesh,
            in_specs=P("model"),
            out_specs=P("model"),
            axis_names={"model"},
            check_vma=False,
        )
        return step(x) * 2.0

    # Laid out as the region's in_specs over its manual axis (a local slice), the data split kept.
    check(shift, [f32(4, 8)], [((), ("data",))], dims=(("model",), ("data",)), issued=["collective-permute"])


def test_a_reshape_keeps_a_split_past_inserted_size_one_dims():
    check(lambda x: x.reshape(1, 4, 2, 6) + 1.0, [f32(8, 6)], [(("data",), ())], dims=((), ("data",), (), ()))


def test_coverage_table_names_every_rule():
    """docs/backends.md's coverage table lists every primitive the partitioner has a rule for."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "backends.md").read_text()
    table = text[text.index("### What runs locally") : text.index("### Fallbacks are loud")]
    rules = {n.replace("scatter_add", "scatter-add") for n in partition.RULES.ops}
    missing = sorted(r for r in rules if f"`{r}`" not in table)
    assert missing == [], missing


def test_stack_keeps_the_operands_splits_under_a_new_whole_dim():
    layouts, _ = check(lambda a, b: jnp.stack([a, b], axis=1), (f32(8, 4), f32(8, 4)),
                       ((("data",), ("model",)), (("data",), ("model",))), dims=(("data",), (), ("model",)))


def test_unstack_along_a_whole_dim_keeps_the_other_splits_and_along_a_split_one_takes_it_whole():
    x = f32(4, 16, 8)
    check(lambda a: jnp.unstack(a, axis=0)[1] * 2.0, [x], [((), ("data",), ("model",))], dims=(("data",), ("model",)))
    check(lambda a: jnp.unstack(a, axis=1)[3] + 1.0, [x], [((), ("data",), ("model",))], dims=((), ("model",)),
          issued=("all-gather",))



def test_cond_runs_each_branch_on_local_blocks_with_the_index_whole():
    """Both branches partitioned with the operands' layouts (a row-parallel matmul's sum and a
    scale), the predicate computed from split data made whole so every device takes the same
    branch; each branch's collectives recorded once (the compiled program holds both)."""
    x, w = RNG.normal(size=(8, 16)).astype(np.float32), RNG.normal(size=(16, 4)).astype(np.float32)

    def fn(x, w):
        return jax.lax.cond(jnp.sum(x) > 0, lambda x, w: x @ w, lambda x, w: x[:, :4] * 2.0, x, w)

    for sign in (1.0, -1.0):  # both branches taken
        check(fn, (sign * np.abs(x), w), [(("data",), ("model",)), (("model",), ())],
              issued=("all-reduce", "all-reduce", "all-gather"))
    assert _compiled_equals_record(fn, (x, w), [(("data",), ("model",)), (("model",), ())])


def _compiled_equals_record(fn, args, in_dims):
    """The partitioned function's compiled collectives (per kind, bytes per step, read by exact
    mode's HLO reader: loops times their trip counts) equal to what the partitioner recorded."""
    from shardplan.core import hlo

    closed = jax.make_jaxpr(fn)(*args)
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH), axis_types=(jax.sharding.AxisType.Auto,) * len(MESH))
    record = partition.Record()

    def local(*xs):
        part = partition.Partitioner(MESH, record, batch_axes=frozenset({"data"}))
        vals = [partition.V(x, tuple(a.shape), a.dtype, d, act=True) for x, a, d in zip(xs, args, in_dims, strict=True)]
        outs = [part.whole(o) for o in part.run(closed.jaxpr, list(closed.consts), vals)]
        return [o.x for o in outs]

    f = jax.shard_map(local, mesh=mesh, in_specs=tuple(_spec(d) for d in in_dims),
                      out_specs=[P()] * len(closed.jaxpr.outvars), check_vma=False)
    compiled, recorded = {}, {}
    for op in hlo.with_axes(hlo.parse(jax.jit(f).lower(*args).compile().as_text(), 8), MESH):
        compiled[op.kind] = compiled.get(op.kind, 0) + op.bytes_per_step
    for c in record.issued:
        recorded[c.kind] = recorded.get(c.kind, 0) + c.bytes
    assert compiled == recorded, (compiled, recorded)
    return True


def test_a_while_loop_runs_its_body_on_local_blocks_per_trip():
    """A loop of fixed trips (a counter against a literal) and one whose bound is data: the body's
    row-parallel sum issued and recorded per trip where the trips are fixed, once where not; the
    carry split as the body keeps it; equal to one device."""
    x, w = RNG.normal(size=(8, 16)).astype(np.float32), (RNG.normal(size=(16, 16)) / 4).astype(np.float32)

    def fixed(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]

    def until(x, w):  # stops when the state's norm falls under a bound: trips known only at run time
        body = lambda c: (c[0] + 1, c[1] * 0.5)  # noqa: E731
        return jax.lax.while_loop(lambda c: jnp.sum(c[1] * c[1]) > 1.0, body, (0, x @ w))[1]

    layouts, record = check(fixed, (x, w), [(("data",), ()), (("model",), ())], dims=(("data",), ()),
                            issued=("all-reduce",))
    assert [c.count for c in record.issued if c.kind == "all-reduce"][0] == 3
    assert _compiled_equals_record(fixed, (x, w), [(("data",), ()), (("model",), ())])
    check(until, (x, w), [(("data",), ()), (("model",), ())], dims=(("data",), ()),
          issued=("all-reduce", "all-reduce"))
