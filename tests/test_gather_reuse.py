"""Which matmul reads of a weight share one gather where XLA:TPU merges gathers within a distance
(shardplan/runtime/gather_reuse.py; measured against XLA:TPU's program in tests/test_target_compile.py)."""

import jax
import jax.numpy as jnp

from shardplan.runtime import gather_reuse


@jax.jit
def _layer(x, w):  # a call XLA inlines: its matmul is read through the call's body
    return jnp.tanh(x @ w)


def _loss(ws, x):
    for w in ws:
        x = _layer(x, w)
    return jnp.mean(x**2)


def _step():
    ws = [jnp.ones((16, 16), jnp.float32) for _ in range(6)]
    closed = jax.make_jaxpr(jax.value_and_grad(_loss))(ws, jnp.ones((4, 16), jnp.float32))
    return closed.jaxpr


def _groups(jaxpr, threshold):
    """Per weight (input index), how many gathers its matmul reads use."""
    shares = gather_reuse.shares(jaxpr, threshold)
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    out: dict[int, set[int]] = {}
    for (_, var), share in shares.items():
        out.setdefault(index[var], set()).add(share.group)
    return {i: len(g) for i, g in out.items()}


def test_a_weight_read_close_to_the_turn_shares_its_gather_and_a_far_one_is_gathered_again():
    jaxpr = _step()
    near = _groups(jaxpr, 12)
    # the last layer's weight is read by its forward matmul and, a few equations later, by the
    # backward pass's; the second layer's forward and backward reads are most of the step apart
    # (the first layer's weight is read once: no gradient flows to the input)
    assert near[5] == 1 and near[1] == 2 and near[0] == 1, near
    assert set(_groups(jaxpr, 10**6).values()) == {1}  # every gather merged
    assert [_groups(jaxpr, -1)[i] for i in range(1, 6)] == [2] * 5  # none: forward and backward gather each


def test_the_first_reader_makes_the_shared_gather_and_the_last_releases_it():
    jaxpr = _step()
    last_weight = jaxpr.invars[5]
    reads = sorted((s.first, s.last) for (_, var), s in gather_reuse.shares(jaxpr, 10**6).items() if var is last_weight)
    assert reads == [(False, True), (True, False)]
    alone = [s for (_, var), s in gather_reuse.shares(jaxpr, -1).items() if var is last_weight]
    assert len(alone) == 2 and all(s.first and s.last for s in alone)  # each read its own gather, held by none


def test_heights_count_the_longest_way_to_the_result_not_the_equations_between():
    """A weight read twice side by side, far from the result, merges (XLA compares heights, the
    distance to the program's root, not positions in the program)."""

    def loss(w, x):
        a, b = x @ w, (x + 1.0) @ w
        h = a * b
        for _ in range(30):
            h = jnp.sin(h)
        return jnp.sum(h)

    jaxpr = jax.make_jaxpr(loss)(jnp.ones((8, 8)), jnp.ones((2, 8))).jaxpr
    shares = [s for (_, var), s in gather_reuse.shares(jaxpr, 2).items() if var is jaxpr.invars[0]]
    assert len(shares) == 2 and len({s.group for s in shares}) == 1
