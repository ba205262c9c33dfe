"""Explicit sharding (JAX's sharding in types) under a plan: the mesh's axis types in the language,
a model typed by mesh axes trained on both backends equal to one device, fast mode, and the
diagnostics for a typed model under auto axes and for JAX's sharding type check."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan import api
from shardplan.lang.fmt import format_text
from tests.fixtures import typed_models
from tests.helpers import FIXTURES, diags_of, only
from tests.reference import assert_trains_alike

PLAN = """plan "typed"
mesh explicit data = 4, model = 2
batch (data, _)
param "layers/\\d+/up" (_, model)
param "layers/\\d+/down" (model, _)
param "head" (_, model)
default replicated
"""
AUTO_PLAN = PLAN.replace("mesh explicit data", "mesh data")
STEPS = 3


def tx():
    return optax.adamw(1e-2, eps=1e-5)


def params_of(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def one_device(build=typed_models.build, loss=typed_models.loss, batches=None, axes=("data", "model")):
    """The reference: plain Flax NNX and optax on one device (no shardplan), under a 1x1 mesh
    with the model's axis names, explicit as the model's code needs."""
    mesh = jax.make_mesh((1, 1), axes, axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = build()
        optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            value, grads = nnx.value_and_grad(loss)(model, batch)
            optimizer.update(model, grads)
            return value

        losses = [float(step(model, optimizer, b)) for b in (batches or typed_models.batches(STEPS))]
    return losses, params_of(model)


# -- the language ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,types",
    [
        ("mesh explicit data = *, model = 2", ("explicit", "explicit")),
        ("mesh data = * @dcn : explicit, model = 2", ("explicit", "auto")),
        ("mesh explicit data = *, model = 2 : auto", ("explicit", "auto")),
        ("mesh data = *, model = 2", ("auto", "auto")),
        ("mesh explicit = 8", ("auto",)),  # an axis may still be named explicit
    ],
)
def test_axis_types_parse_check_and_format(text, types):
    plan = shardplan.loads(text + "\ndefault replicated\n")
    assert plan.axis_types == types
    formatted = format_text(text)
    assert shardplan.loads(formatted + "default replicated\n").axis_types == types
    assert format_text(formatted) == formatted


def test_format_writes_the_types_where_they_were():
    assert format_text("mesh  explicit data=*,model=2 @ici:auto\n") == "mesh explicit data = *, model = 2 @ici : auto\n"


@pytest.mark.parametrize(
    "text,col,hint",
    [
        ("mesh explict data = *", 6, "did you mean 'explicit'?"),
        ("mesh data = * : manual", 17, "shard_map makes inside its body"),
    ],
)
def test_unknown_axis_type_is_located(text, col, hint):
    d = only(diags_of(shardplan.loads, text, "t.splan"), "unknown-axis-type")
    assert (d.span.line, d.span.column) == (1, col)
    assert hint in d.hint


def test_type_after_the_size_is_a_syntax_error_saying_where_it_goes():
    d = only(diags_of(shardplan.loads, "mesh data = 8 explicit", "t.splan"), "syntax")
    assert d.span.column == 15 and "model = 2 : explicit" in d.hint and "mesh explicit data" in d.hint


def test_a_mesh_given_later_keeps_the_types_by_name():
    plan = shardplan.loads("mesh data = * : explicit, model = 2\ndefault replicated\n")
    assert shardplan.with_mesh(plan, {"data": 2, "model": 4}).axis_types == ("explicit", "auto")
    assert shardplan.loads(PLAN, mesh={"data": 2, "model": 4}).axis_types == ("explicit", "explicit")


def test_make_mesh_follows_the_plan_and_an_argument_overrides_it():
    plan = shardplan.loads("mesh data = * : explicit, model = 2\ndefault replicated\n")
    assert shardplan.make_mesh(plan).axis_types == (AxisType.Explicit, AxisType.Auto)
    assert shardplan.make_mesh(plan, axis_types="auto").axis_types == (AxisType.Auto, AxisType.Auto)


# -- training ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return one_device()


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
def test_typed_model_trains_as_on_one_device(backend, reference):
    plan = shardplan.loads(PLAN)
    model, optimizer, placement = shardplan.init_sharded(plan, typed_models.build, tx())
    assert placement.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    step = shardplan.train_step(placement, typed_models.loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in typed_models.batches(STEPS)]  # no jax.set_mesh here
    shardplan.verify(placement, model, optimizer)
    assert jax.typeof(model.layers[0].up[...]).sharding.spec == P(None, "model")  # typed as the plan says
    assert_trains_alike(losses, params_of(model), *reference)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
def test_fast_mode_costs_the_typed_step(backend, tmp_path):
    plan_file = tmp_path / "typed.splan"
    plan_file.write_text(PLAN)
    cost = api.analyze(
        plan_file,
        model=f"{FIXTURES / 'typed_models.py'}:build",
        step=f"{FIXTURES / 'typed_models.py'}:loss",
        batch={"tokens": ((16, 8), "int32"), "labels": ((16, 8), "int32")},
        backend=backend,
        mode="fast",
    )
    assert cost.memory.peak > cost.memory.params > 0
    kinds = {c.kind for c in cost.communication}
    assert "all-reduce" in kinds  # the gradients' sum over data, the row-parallel matmul's over model


def test_checkpoint_round_trip_keeps_the_typed_layout(tmp_path):
    plan = shardplan.loads(PLAN)
    model, optimizer, placement = shardplan.init_sharded(plan, typed_models.build, tx())
    before = params_of(model)
    ckpt = shardplan.Checkpointer(tmp_path / "ckpt", placement, async_save=False)
    ckpt.save(1, model, optimizer)
    fresh, fresh_opt, _ = shardplan.init_sharded(plan, lambda: typed_models.TypedStack(nnx.Rngs(1)), tx())
    assert ckpt.restore(fresh, fresh_opt) == 1
    ckpt.close()
    for path, want in before.items():
        np.testing.assert_array_equal(params_of(fresh)[path], want)
    assert fresh.layers[1].down[...].sharding == model.layers[1].down[...].sharding
    assert fresh.layers[1].down[...].sharding.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)


# -- diagnostics ------------------------------------------------------------------------------
def test_typed_model_under_auto_axes_names_the_plan_line_to_write():
    plan = shardplan.loads(AUTO_PLAN, "typed.splan")
    model, optimizer, placement = shardplan.init_sharded(plan, typed_models.build, tx())
    step = shardplan.train_step(placement, typed_models.loss, model, optimizer)
    d = only(diags_of(step, model, optimizer, typed_models.batches(1)[0]), "needs-explicit-axes")
    assert "typed_models.py:" in d.message and "P('data', None, None) to .get" in d.message
    assert "write `mesh explicit data = 4, model = 2`" in d.hint and "typed.splan:2" in d.hint


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
def test_sharding_type_error_keeps_the_users_line_and_jax_advice(backend):
    plan = shardplan.loads(PLAN)
    model, optimizer, placement = shardplan.init_sharded(plan, typed_models.build, tx())
    step = shardplan.train_step(placement, typed_models.loss_vocab_split, model, optimizer, backend=backend)
    d = only(diags_of(step, model, optimizer, typed_models.batches(1)[0]), "sharding-type")
    assert "typed_models.py:" in d.message and "softmax_cross_entropy_with_integer_labels" in d.message
    assert "Use `.at[...].get(out_sharding=)`" in d.message  # JAX's own advice, kept
    assert "reshard" in d.hint


# -- a model of our own with what broke google/flax's Gemma on shard_map ------------------------
@pytest.fixture(scope="module")
def post_norm_reference():
    return one_device(typed_models.build_post_norm, typed_models.masked_loss, typed_models.padded_batches())


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
def test_post_norm_on_a_split_width_trains_as_on_one_device(backend, post_norm_reference):
    """An RMSNorm after a projection whose output width is split (explicit out_sharding): its mean
    is a pending sum, and its eps is added to the total once (the shard_map backend added it once
    per device: Gemma's first loss 0.6% off). Tied embedding, a padding-masked loss."""
    plan = shardplan.loads(PLAN.replace('param "head" (_, model)\n', 'param "table" (_, model)\n'))
    model, optimizer, placement = shardplan.init_sharded(plan, typed_models.build_post_norm, tx())
    step = shardplan.train_step(placement, typed_models.masked_loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in typed_models.padded_batches()]
    assert_trains_alike(losses, params_of(model), *post_norm_reference)


# -- google/flax's Gemma example, sharded (tests/fixtures/third_party/gemma, copied unchanged) --------
GEMMA_PLAN = """plan "gemma-fsdp-tp"
mesh explicit fsdp = 4, tensor = 2
batch (fsdp, _)
axis fsdp -> fsdp
axis tensor -> tensor
default replicated
"""


@pytest.fixture(scope="module")
def gemma_reference():
    from tests.fixtures import gemma_tiny

    return one_device(gemma_tiny.build, gemma_tiny.loss, gemma_tiny.batches(), axes=("fsdp", "tensor"))


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
def test_flax_gemma_example_sharded_trains_as_on_one_device(backend, gemma_reference):
    from tests.fixtures import gemma_tiny

    plan = shardplan.loads(GEMMA_PLAN)
    model, optimizer, placement = shardplan.init_sharded(plan, gemma_tiny.build, tx())
    # The example's own ShardingConfig.fsdp_tp_sharding layout, read from its annotations.
    assert model.layers[0].mlp.gate_proj.kernel[...].sharding.spec == P("fsdp", "tensor")
    assert model.embedder.embedding[...].sharding.spec == P("tensor", "fsdp")
    step = shardplan.train_step(placement, gemma_tiny.loss, model, optimizer, backend=backend)
    losses = [float(step(model, optimizer, b)) for b in gemma_tiny.batches()]
    assert_trains_alike(losses, params_of(model), *gemma_reference)


# -- generation under explicit axes -----------------------------------------------------------------
GEN_PLAN = """plan "typed-gen"
mesh explicit data = 4, model = 2
batch (data, _)
param "q|k|v" (_, model, _)
param "o" (model, _, _)
param "mix/up" (_, model)
param "mix/down" (model, _)
param "layers/\\d+/up" (_, model)
param "layers/\\d+/down" (model, _)
default replicated
"""
GEN_PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [11, 3]]  # two buckets: 4 and 8
NEW = 4


def greedy_on_one_device(build, cached: bool) -> list[list[int]]:
    """The reference: plain Flax NNX on one device (no shardplan, no padding, no cache reuse):
    each prompt alone, the whole sequence recomputed for every new token, under a 1x1 mesh with
    the model's axis names, explicit as its code needs."""
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1])
    out = []
    with jax.set_mesh(mesh):
        model = build()
        gd, state = nnx.split(model)

        @jax.jit
        def logits_of(state, tokens):
            m = nnx.merge(gd, state)
            if not cached:
                return m(tokens)
            t = tokens.shape[1]
            positions = jnp.arange(t, dtype=jnp.int32)[None, :]
            mask = jnp.arange(t)[None, None, :] <= positions[:, :, None]
            return m(tokens, positions, mask, m.init_cache(1, t, jnp.float32))[0]

        for prompt in GEN_PROMPTS:
            seq = list(prompt)
            for _ in range(NEW):
                seq.append(int(jnp.argmax(logits_of(state, jnp.asarray([seq], jnp.int32))[0, -1])))
            out.append(seq[len(prompt):])
    return out


@pytest.mark.parametrize("build,cached", [(typed_models.build, False), (typed_models.build_attention, True)],
                         ids=["plain", "typed-cache"])
def test_a_typed_model_generates_under_explicit_axes_as_on_one_device(build, cached):
    from shardplan.runtime.generate import GenerationConfig, Generator

    model, _, placement = shardplan.init_sharded(shardplan.loads(GEN_PLAN), build, None)
    assert placement.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    gen = Generator(placement, model, GenerationConfig(max_len=16, buckets=(4, 8), max_new_tokens=NEW))
    assert gen.mode == ("cache" if cached else "plain")
    if cached:  # the cache keeps the layout the model typed it with: heads over model
        assert gen.cache_specs == [P("data", None, "model", None)] * 2
        assert "explicit" in gen.cache_origin
    out = gen.generate(GEN_PROMPTS)  # no jax.set_mesh here
    assert out.tokens == greedy_on_one_device(build, cached)
    if cached:
        assert out.compiles.get("jit(shardplan_decode)") == 1
