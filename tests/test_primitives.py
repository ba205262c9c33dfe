"""The primitive catalogue (shardplan/runtime/primitives.py): every catalogued primitive has, in
each engine over a step's jaxpr, a rule or a declared fallback; every name an engine's rule book
holds is catalogued (or a name of it in another jax release, listed here); and the primitives
jax's own step functions bind are catalogued."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from shardplan.runtime import fast, partition, primitives, roles
from shardplan.runtime.primitives import CATALOGUE, KINDS, TRAITS

ENGINES = {"fast": fast, "partition": partition, "roles": roles}
# Names an engine handles that are not primitives of jax 0.10 (older or newer releases' names):
# a rule for them does no harm, and they stay out of the catalogue.
OTHER_RELEASES = {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_catalogued_primitive_has_a_rule_or_a_declared_fallback(engine):
    rules, fallbacks = ENGINES[engine].rule_book()
    missing = sorted(set(CATALOGUE) - rules - fallbacks)
    assert not missing, f"{engine} has neither a rule nor a declared fallback for {missing}"
    assert not rules & fallbacks, f"{engine} declares a fallback for primitives it has a rule for: {rules & fallbacks}"
    stray = sorted((rules | fallbacks) - set(CATALOGUE) - OTHER_RELEASES)
    assert not stray, f"{engine} names primitives the catalogue does not: {stray}"


def test_rows_are_facts_of_known_kinds_and_traits():
    for name, row in CATALOGUE.items():
        assert row.kind in KINDS, name
        assert row.traits <= set(TRAITS), name
    # Derived sets agree with the rows they come from.
    assert primitives.TRANSCENDENTAL <= primitives.ELEMENTWISE
    assert primitives.kind_of("dot_general") == "contraction" and primitives.kind_of("no_such_op") is None
    assert primitives.named(kinds=("view",), every=("bitcast",)) >= {"reshape", "transpose"}


def _primitives_of(fn, *args) -> set[str]:
    names: set[str] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for v in eqn.params.values():
                for j in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(j, "jaxpr", j)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


class _Net(nnx.Module):
    """Not an example model: a norm, an activation of another family, a gather, a scan, a cond."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(50, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.up = nnx.Linear(16, 24, rngs=rngs)
        self.down = nnx.Linear(24, 16, rngs=rngs)

    def __call__(self, ids):
        h = self.norm(self.embed(ids))
        h = self.down(jax.nn.mish(self.up(h)) * jnp.arcsinh(h @ jnp.ones((16, 24)) / 4))
        h = jax.lax.cond(h.sum() > 0, lambda x: x * 2, lambda x: x, h)
        h, _ = jax.lax.scan(lambda c, x: (c + jnp.cumsum(x, 0), None), h, jnp.stack([h, h]))
        return jnp.sort(h, axis=-1)[..., :4].mean()


def test_a_training_step_of_a_model_of_our_own_binds_only_catalogued_primitives():
    model = _Net(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, ids):
        def loss(s):
            return nnx.merge(graphdef, s)(ids)

        value, grads = jax.value_and_grad(loss)(state)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    names = _primitives_of(step, state, jnp.zeros((4, 8), jnp.int32))
    assert names >= {"dot_general", "gather", "scan", "cond", "cumsum", "sort"}, names
    assert not names - set(CATALOGUE), f"not catalogued: {sorted(names - set(CATALOGUE))}"
