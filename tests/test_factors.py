"""The factor rules (shardplan/runtime/factors.py): one test per rule, on equations jax traces
here (no devices), each asserting which operand dim is which result dim, what is reduced, what
must stay whole, and what forward and backward derive from that."""

import jax
import jax.numpy as jnp
import pytest

from shardplan.runtime import factors, roles
from shardplan.runtime.primitives import CATALOGUE


def eqn_of(fn, *shapes, name=None, dtype=jnp.float32):
    args = [jax.ShapeDtypeStruct(s, dtype) if isinstance(s, tuple) else s for s in shapes]
    def walk(jaxpr):  # into jit bodies (jnp.cumsum, jnp.sort are jitted)
        for e in jaxpr.eqns:
            yield e
            for v in e.params.values():
                inner = getattr(v, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from walk(inner)

    eqns = list(walk(jax.make_jaxpr(fn)(*args).jaxpr))
    picked = [e for e in eqns if name is None or e.primitive.name == name]
    assert picked, [e.primitive.name for e in eqns]
    return picked[-1]


def test_elementwise_dims_are_their_operands_dims():
    e = eqn_of(lambda x, y: x * y, (4, 6), (4, 6), name="mul")
    f = factors.of(e)
    assert f.operands[0] == f.operands[1] == f.results[0]
    assert [f.sizes[x] for (x,) in f.results[0]] == [4, 6] and not f.reduced and not f.whole


def test_a_tuple_through_pairs_results_with_their_own_operands():
    e = eqn_of(lambda x, y: jax.lax.optimization_barrier((x, y)), (4, 6), (4, 6))
    f = factors.of(e)
    assert f.results[0] == f.operands[0] and f.results[1] == f.operands[1] and f.operands[0] != f.operands[1]


def test_a_scatter_is_its_operand_updated_and_its_updates_are_other_dims():
    e = eqn_of(lambda t, i, u: t.at[i].add(u), (10, 4), jax.ShapeDtypeStruct((3,), jnp.int32), (3, 4),
               name="scatter-add")
    f = factors.of(e)
    assert f.results[0] == f.operands[0]
    assert not set(x for d in f.operands[2] for x in d) & set(x for d in f.results[0] for x in d)


@pytest.mark.parametrize("fn,dim,name", [(lambda x: jnp.cumsum(x, axis=1), 1, "cumsum"),
                                         (lambda x: jnp.sort(x, axis=0), 0, "sort"),
                                         (lambda x: jnp.flip(x, axis=1), 1, "rev")])
def test_an_op_along_a_dim_needs_that_dim_whole(fn, dim, name):
    e = eqn_of(fn, (4, 6), name=name)
    f = factors.of(e)
    assert f.whole == frozenset(f.results[0][dim]) and f.results[0] == f.operands[0]
    # forward: a split of the dim it runs along is not carried (the op needs it whole)
    layouts, _ = factors.forward(f, [(("data",), ("model",))])
    assert layouts[0][dim] == () and layouts[0][1 - dim] == (("data", "model")[1 - dim],)


def test_slices_and_joins_line_up_where_the_sizes_agree():
    f = factors.of(eqn_of(lambda x: x[:, 1:5], (4, 6), name="slice"))
    assert f.operands[0][0] == f.results[0][0] and f.operands[0][1] != f.results[0][1]
    f = factors.of(eqn_of(lambda x, y: jnp.concatenate([x, y], axis=1), (4, 6), (4, 2), name="concatenate"))
    assert f.operands[0][0] == f.operands[1][0] == f.results[0][0]
    assert len({f.operands[0][1], f.operands[1][1], f.results[0][1]}) == 3


def test_a_reduction_reduces_its_axes():
    e = eqn_of(lambda x: jnp.sum(x, axis=1), (4, 6, 8), name="reduce_sum")
    f = factors.of(e)
    assert f.results[0] == (f.operands[0][0], f.operands[0][2]) and f.reduced == frozenset(f.operands[0][1])
    # a split reduced dim leaves a pending sum over its axes
    layouts, pending = factors.forward(f, [((), ("model",), ("data",))])
    assert layouts == (((), ("data",)),) and pending == ("model",)


def test_a_matmul_contracts_batches_and_keeps_free_dims():
    e = eqn_of(lambda a, b: jnp.einsum("ebd,edf->ebf", a, b), (3, 4, 5), (3, 5, 7), name="dot_general")
    f = factors.of(e)
    (ea, ba, da), (eb, db, fb) = f.operands
    assert ea == eb and da == db and f.reduced == frozenset(da)
    assert f.results[0] == (ea, ba, fb)
    # backward: the result split (expert, batch, _) needs the operands split on the same factors
    assert factors.backward(f, 0, (("expert",), ("data",), ())) == ((("expert",), ("data",), ()),
                                                                     (("expert",), (), ()))
    # forward: a contracted dim split on both sides leaves a pending sum; the free dims carry theirs
    layouts, pending = factors.forward(f, [((), ("data",), ("model",)), ((), ("model",), ())])
    assert layouts == (((), ("data",), ()),) and pending == ("model",)


def test_a_transpose_permutes_its_dims():
    f = factors.of(eqn_of(lambda x: x.T, (4, 6), name="transpose"))
    assert f.results[0] == (f.operands[0][1], f.operands[0][0])
    assert factors.backward(f, 0, (("model",), ("data",))) == ((("data",), ("model",)),)


def test_a_squeeze_drops_its_size_one_dims():
    f = factors.of(eqn_of(lambda x: jnp.squeeze(x, 1), (4, 1, 6), name="squeeze"))
    assert f.operands[0][1] == () and f.results[0] == (f.operands[0][0], f.operands[0][2])


def test_a_broadcast_keeps_matching_dims_and_makes_new_ones():
    e = eqn_of(lambda x: jnp.broadcast_to(x[:, None, :], (4, 5, 6)), (4, 6), name="broadcast_in_dim")
    f = factors.of(e)
    src = f.operands[0]
    assert f.results[0][0] == src[0] and f.results[0][2] == src[-1] and f.sizes[f.results[0][1][0]] == 5
    assert f.results[0][1] not in src
    # a size-1 dim broadcast to a larger one is a new dim, not the operand's
    f = factors.of(eqn_of(lambda x: jnp.broadcast_to(x, (4, 6)), (1, 6), name="broadcast_in_dim"))
    assert f.operands[0][0] == () and f.results[0][1] == f.operands[0][1]


def test_a_reshape_splits_and_merges_dims_into_factors():
    f = factors.of(eqn_of(lambda x: x.reshape(4, 2, 3), (4, 6), name="reshape"))
    (a,), whole = f.operands[0]
    assert f.results[0][0] == (a,) and whole == f.results[0][1] + f.results[0][2]
    assert [f.sizes[x] for x in whole] == [2, 3]  # major first
    f = factors.of(eqn_of(lambda x: x.reshape(4, 6), (4, 2, 3), name="reshape"))
    assert f.results[0][1] == f.operands[0][1] + f.operands[0][2]
    # regrouped dims ((2, 3) -> (3, 2)) relate to nothing; the dims after them still line up
    f = factors.of(eqn_of(lambda x: x.reshape(3, 2, 5), (2, 3, 5), name="reshape"))
    assert f.results[0][2] == f.operands[0][2] and not set(f.results[0][0]) & set(f.operands[0][0] + f.operands[0][1])
    # forward: a split whole dim gives its axes to its major factor
    layouts, _ = factors.forward(factors.of(eqn_of(lambda x: x.reshape(4, 2, 3), (4, 6), name="reshape")),
                                 [((), ("model",))])
    assert layouts == (((), ("model",), ()),)


def test_a_gather_looks_rows_up_and_keeps_the_width():
    e = eqn_of(lambda t, i: t[i], (100, 8), jax.ShapeDtypeStruct((4, 5), jnp.int32), name="gather")
    f = factors.of(e)
    rows, width = f.operands[0]
    assert f.indexed == frozenset(rows) and f.results[0] == (f.operands[1][0], f.operands[1][1], width)


def test_stack_and_unstack_add_and_drop_one_dim():
    f = factors.of(eqn_of(lambda x, y: jnp.stack([x, y], axis=1), (4, 6), (4, 6), name="stack"))
    out = f.results[0]
    assert f.operands[0] == f.operands[1] == (out[0], out[2]) and f.sizes[out[1][0]] == 2
    f = factors.of(eqn_of(lambda x: jax.lax.unstack(x, axis=1), (4, 3, 6), name="unstack"))
    (a, b, c) = f.operands[0]
    assert len(f.results) == 3 and all(r == (a, c) for r in f.results)


def test_structure_and_kernels_have_no_factor_rule():
    e = eqn_of(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x), (4,), name="scan")
    assert factors.of(e) is None
    assert factors.rule_book() <= set(CATALOGUE)
    assert not factors.rule_book() & {"scan", "while", "cond", "pjit", "shard_map", "pallas_call", "iota"}


def test_roles_read_their_per_op_dims_from_the_factor_rules():
    """The roles walker has no per-op rule of its own: every primitive with a factor rule goes
    through it (structure and fallbacks are the walker's)."""
    with_rule, _ = roles.rule_book()
    assert factors.rule_book() <= with_rule
    assert with_rule - factors.rule_book() <= {"scan", "while", "cond", "shard_map", "pallas_call"} | {
        n for n, p in CATALOGUE.items() if "call" in p.traits}
