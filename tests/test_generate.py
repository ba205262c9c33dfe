"""Sharded generation: one decode compile, one prefill per bucket, and token-for-token
equality with an unpadded, unsharded, cache-free reference."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplan
from examples import models
from shardplan.runtime.generate import GenerationAdapter, GenerationConfig, Generator
from tests.fixtures import gen_models
from tests.helpers import FIXTURES, PLANS, ROOT

CFG = models.GPTConfig(max_len=64)
LENGTHS = (3, 5, 8, 11, 16)  # 5 prompt lengths over 2 buckets


def placed(plan_name):
    plan = shardplan.load(PLANS / plan_name)
    model, _, placement = shardplan.init_sharded(plan, lambda: models.GPT(CFG, nnx.Rngs(0)), None)
    return model, placement


def prompts(n, length, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, CFG.vocab, size=length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    """Unsharded, cache-free, unpadded: the model on one device, run on exact-length sequences."""
    model = models.GPT(CFG, nnx.Rngs(0))
    state = jax.device_put(nnx.state(model), jax.devices()[0])
    gm = nnx.graphdef(model)
    forward = jax.jit(lambda st, seq: nnx.merge(gm, st)(seq))

    def check_greedy(prompt, generated):
        """Greedy decode is deterministic: it equals the reference token for token iff, fed
        the prompt and the generated tokens, the reference's argmax at every position from
        the prompt's last one on is the next generated token."""
        seq = jnp.asarray([prompt + generated], jnp.int32)
        logits = forward(state, seq)[0]
        want = [int(t) for t in jnp.argmax(logits[len(prompt) - 1:-1], axis=-1)] + [
            int(jnp.argmax(logits[-1]))]
        return want[:len(generated)] == generated

    return check_greedy


@pytest.mark.parametrize("plan_name", ["gpt_tp.splan", "dp.splan"])
def test_greedy_matches_reference_and_compiles_once(plan_name, reference):
    model, placement = placed(plan_name)
    gen = Generator(placement, model, GenerationConfig(max_len=64, buckets=(8, 16), max_new_tokens=32))
    n = 8
    prefill = decode = 0
    for i, length in enumerate(LENGTHS):
        batch = prompts(n, length, seed=i)
        out = gen.generate(batch)
        prefill += out.compiles.get("jit(shardplan_prefill)", 0)
        decode += out.compiles.get("jit(shardplan_decode)", 0)
        assert out.bucket == (8 if length <= 8 else 16)
        for p, toks in zip(batch, out.tokens):
            assert len(toks) == 32
            assert reference(p, toks), (plan_name, length, p)
    assert decode == 1  # one decode compile for 5 prompt lengths x 32 tokens
    assert prefill == 2  # one per bucket used
    assert gen._decode._cache_size() == 1 and gen._prefill._cache_size() == 2


def test_kv_cache_is_sharded_by_the_plan():
    model, placement = placed("gpt_tp.splan")
    gen = Generator(placement, model, GenerationConfig(max_len=64, buckets=(8,), max_new_tokens=4))
    assert gen.cache_spec == P("data", None, "model", None)  # batch over data, heads over model
    tokens = jax.device_put(np.ones((8, 8), np.int32), gen.batch_sharding_2d)
    lengths = jax.device_put(np.full(8, 8, np.int32), gen.batch_sharding)
    _, cache = gen._prefill(nnx.state(model), tokens, lengths, jax.random.key(0), gen._cache_def(8))
    leaf = cache[0]  # the cache's leaves, in tree order: layer 0's k first
    assert leaf.shape == (8, 64, 4, 8) and leaf.sharding.spec == P("data", None, "model", None)
    assert {s.data.shape for s in leaf.addressable_shards} == {(2, 64, 2, 8)}
    dp_model, dp = placed("dp.splan")
    assert Generator(dp, dp_model, GenerationConfig(max_len=64, buckets=(8,), max_new_tokens=4)).cache_spec == \
        P("data", None, None, None)


def test_sampling_with_explicit_key():
    model, placement = placed("gpt_tp.splan")
    batch = prompts(8, 5, seed=0)
    greedy = Generator(placement, model, GenerationConfig(64, (8,), 8)).generate(batch).tokens
    top1 = Generator(placement, model, GenerationConfig(64, (8,), 8, temperature=1.0, top_k=1))
    assert top1.generate(batch, key=jax.random.key(1)).tokens == greedy  # top-1 sampling is greedy
    hot = Generator(placement, model, GenerationConfig(64, (8,), 8, temperature=2.0, top_k=20))
    a = hot.generate(batch, key=jax.random.key(1)).tokens
    assert a == hot.generate(batch, key=jax.random.key(1)).tokens  # same key, same tokens
    assert a != hot.generate(batch, key=jax.random.key(2)).tokens
    with pytest.raises(shardplan.PlanApplyError, match="needs a PRNG key"):
        hot.generate(batch)


def test_stops_on_end_token():
    model, placement = placed("gpt_tp.splan")
    batch = prompts(8, 5, seed=0)
    free = Generator(placement, model, GenerationConfig(64, (8,), 8)).generate(batch).tokens
    end = free[0][2]
    stopped = Generator(placement, model, GenerationConfig(64, (8,), 8, end_token=end)).generate(batch).tokens
    for full, cut in zip(free, stopped):
        k = full.index(end) + 1 if end in full else len(full)
        assert cut == full[:k]


def test_bad_prompts():
    model, placement = placed("dp.splan")
    gen = Generator(placement, model, GenerationConfig(max_len=64, buckets=(8, 16), max_new_tokens=8))
    ok = prompts(8, 4, seed=0)
    with pytest.raises(shardplan.PlanApplyError) as info:
        gen.generate([[]] + ok[1:])
    assert info.value.diagnostics[0].code == "empty-prompt" and info.value.diagnostics[0].path == "prompts[0]"
    with pytest.raises(shardplan.PlanApplyError, match="has 17 tokens; the longest bucket is 16"):
        gen.generate([list(range(1, 18))] + ok[1:])
    with pytest.raises(shardplan.PlanApplyError) as info:
        gen.generate(ok[:6])
    assert "6 prompts do not divide over the batch axes data (8 shards)" in str(info.value)
    with pytest.raises(ValueError, match="exceeds max_len"):
        GenerationConfig(max_len=20, buckets=(16,), max_new_tokens=8)


def test_generate_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--plan", str(PLANS / "gpt_tp.splan"),
                        "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step   3:" in r.stdout and "'jit(shardplan_decode)': 1" in r.stdout


# -- any causal LM: the Llama without a cache (plain path) and with one (cache path) ---------------
def llama_reference(factory):
    model = factory(0)
    state = jax.device_put(nnx.state(model), jax.devices()[0])
    gm = nnx.graphdef(model)
    forward = jax.jit(lambda st, seq: nnx.merge(gm, st)(seq))

    def check_greedy(prompt, generated):
        logits = forward(state, jnp.asarray([prompt + generated], jnp.int32))[0]
        want = [int(t) for t in jnp.argmax(logits[len(prompt) - 1:], axis=-1)]
        return want[:len(generated)] == generated

    return check_greedy


@pytest.mark.parametrize("plan_name", ["llama_tp.splan", "dp.splan"])
@pytest.mark.parametrize("factory, mode", [(models.llama_tiny, "plain"), (models.llama_tiny_cached, "cache")])
def test_llama_greedy_with_and_without_a_cache_matches_one_device(plan_name, factory, mode):
    reference = llama_reference(models.llama_tiny)  # the same params: both factories share them
    plan = shardplan.load(PLANS / plan_name)
    model, _, placement = shardplan.init_sharded(plan, lambda: factory(0), None)
    gen = Generator(placement, model, GenerationConfig(max_len=48, buckets=(8, 16), max_new_tokens=12))
    assert gen.mode == mode
    compiles: dict = {}
    for i, length in enumerate((3, 8, 11, 16)):
        batch = [[int(t) for t in np.random.default_rng(i).integers(1, 64, size=length)] for _ in range(8)]
        out = gen.generate(batch)
        assert out.mode == mode
        for name, n in out.compiles.items():
            compiles[name] = compiles.get(name, 0) + n
        for p, toks in zip(batch, out.tokens):
            assert len(toks) == 12 and reference(p, toks), (plan_name, mode, length)
    ours = {k: v for k, v in compiles.items() if "shardplan_" in k}
    if mode == "plain":
        assert ours == {"jit(shardplan_forward)": 2}  # one per bucket, none per token
    else:
        assert ours == {"jit(shardplan_prefill)": 2, "jit(shardplan_decode)": 1}


class _HalfCached(nnx.Module):
    """init_cache, but a plain __call__: half the convention."""

    def __init__(self):
        self.inner = models.llama_tiny(0)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return {"k": jnp.zeros((batch, max_len, 2, 8), dtype)}

    def __call__(self, tokens):
        return self.inner(tokens)


class _NotAnLM(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((4,)))

    def __call__(self, tokens):
        return tokens.sum()


@pytest.mark.parametrize("make, says", [(_HalfCached, "does not take (tokens, positions, mask, cache)"),
                                        (_NotAnLM, "not logits (batch, time, vocab)")])
def test_a_model_that_half_follows_the_convention_is_named_before_any_compile(make, says):
    plan = shardplan.load(PLANS / "dp.splan")
    model, _, placement = shardplan.init_sharded(plan, make, None)
    before = dict(shardplan.runtime.generate.COMPILES)
    with pytest.raises(shardplan.PlanApplyError) as info:
        Generator(placement, model, GenerationConfig(max_len=32, buckets=(8,), max_new_tokens=4))
    assert info.value.diagnostics[0].code == "not-a-causal-lm" and says in str(info.value)
    assert dict(shardplan.runtime.generate.COMPILES) == before


def test_the_plan_says_how_the_cache_is_laid_out(tmp_path):
    """`cache SPEC` decides the layout (Llama's projections are k/v: nothing is read from names)."""
    p = tmp_path / "served.splan"
    p.write_text(f'extends "{PLANS / "llama_tp.splan"}"\ncache (data, _, _, _)\n')
    plan = shardplan.load(p)
    model, _, placement = shardplan.init_sharded(plan, lambda: models.llama_tiny_cached(0), None)
    gen = Generator(placement, model, GenerationConfig(max_len=32, buckets=(8,), max_new_tokens=4))
    assert gen.cache_spec == P("data") and "cache statement (" in gen.cache_origin  # trailing dims whole
    m2, _, p2 = shardplan.init_sharded(shardplan.load(PLANS / "llama_tp.splan"), lambda: models.llama_tiny_cached(0),
                                       None)
    inferred = Generator(p2, m2, GenerationConfig(max_len=32, buckets=(8,), max_new_tokens=4))
    assert inferred.cache_spec == P("data", None, "model", None) and inferred.cache_origin.startswith("inferred")
    reference = llama_reference(models.llama_tiny)
    batch = [[int(t) for t in np.random.default_rng(5).integers(1, 64, size=6)] for _ in range(8)]
    for p_, toks in zip(batch, gen.generate(batch).tokens):
        assert reference(p_, toks)
    with pytest.raises(shardplan.ShardPlanError, match="'cache' given twice"):
        shardplan.loads("mesh d = *\ncache (d)\ncache (d)\n")
    with pytest.raises(shardplan.ShardPlanError, match="unknown-axis|lacks"):
        shardplan.loads("mesh d = *\ncache (e)\n")


# -- a model with its own call and cache, through an adapter ---------------------------------------
# CounterLM (tests/fixtures/gen_models.py) is called as model(tokens, cache) and keeps one position
# counter for the batch: its cache path needs left padding. It cannot be called as model(tokens).
COUNTER_CACHE = GenerationAdapter(
    init_cache=lambda model, batch, max_len: model.new_cache(batch, max_len),
    prefill=lambda model, tokens, cache: (model(tokens, cache), cache),  # written in place
    decode=lambda model, token, cache, position: (model(token, cache), cache),
    padding="left",
)
COUNTER_PLAIN = GenerationAdapter(forward=lambda model, tokens: model(tokens, model.new_cache(*tokens.shape)),
                                  padding="left")
COUNTER_CONFIG = GenerationConfig(max_len=16, buckets=(4, 8), max_new_tokens=6)
# Two calls: prompts of lengths 3 and 7 mixed in one batch (bucket 8), then 2 and 4 (bucket 4).
COUNTER_BATCHES = [[[int(t) for t in np.random.default_rng(10 * c + i).integers(1, 48, size=n)]
                    for i, n in enumerate(lengths)]
                   for c, lengths in enumerate([(3, 7, 7, 3, 7, 3, 3, 7), (2, 4, 4, 2, 2, 4, 4, 2)])]


@pytest.fixture(scope="module")
def counter_greedy():
    """Greedy on one device with no shardplan: the model fed the unpadded prompts (those of one
    length together), then one token at a time through its own cache."""
    model = gen_models.counter_lm(0)
    call = nnx.jit(lambda m, tokens, cache: m(tokens, cache))
    out = {}
    for batch in COUNTER_BATCHES:
        for length in sorted({len(p) for p in batch}):
            rows = [p for p in batch if len(p) == length]
            cache = model.new_cache(len(rows), 16)
            logits = call(model, jnp.asarray(rows, jnp.int32), cache)
            steps = []
            for _ in range(COUNTER_CONFIG.max_new_tokens):
                steps.append(np.asarray(jnp.argmax(logits[:, -1], axis=-1)))
                logits = call(model, jnp.asarray(steps[-1][:, None], jnp.int32), cache)
            for j, p in enumerate(rows):
                out[tuple(p)] = [int(s[j]) for s in steps]
    return out


@pytest.mark.parametrize("adapter", [COUNTER_CACHE, COUNTER_PLAIN], ids=["cache", "plain"])
def test_a_model_with_its_own_cache_generates_through_an_adapter(adapter, counter_greedy):
    """The model also constrains its batch over `data` with a bare PartitionSpec (as models written
    for a mesh do): it runs only under the plan's mesh as the mesh context."""
    plan = shardplan.load(FIXTURES / "gen_tp.splan")
    model, _, placement = shardplan.init_sharded(plan, gen_models.counter_lm_on_mesh, None)
    gen = Generator(placement, model, COUNTER_CONFIG, adapter=adapter)
    assert gen.mode == adapter.mode
    compiles: dict = {}
    for batch in COUNTER_BATCHES:
        out = gen.generate(batch)
        assert out.tokens == [counter_greedy[tuple(p)] for p in batch]
        for name, n in out.compiles.items():
            compiles[name] = compiles.get(name, 0) + n
    ours = {k: v for k, v in compiles.items() if "shardplan_" in k}
    if adapter.mode == "cache":
        assert ours == {"jit(shardplan_prefill)": 2, "jit(shardplan_decode)": 1}  # per bucket; once
    else:
        assert ours == {"jit(shardplan_forward)": 2}


def test_an_adapters_cache_is_placed_leaf_by_leaf(tmp_path):
    """Inferred: k/v over data (batch) and model (kv heads, as wk/wv split), each row's start over
    data, the counter whole. A cache statement lays out the k/v; the smaller leaves keep the rule."""
    plan = shardplan.load(FIXTURES / "gen_tp.splan")
    model, _, placement = shardplan.init_sharded(plan, gen_models.counter_lm, None)
    gen = Generator(placement, model, COUNTER_CONFIG, adapter=COUNTER_CACHE)
    tokens = jax.device_put(np.ones((8, 8), np.int32), gen.batch_sharding_2d)
    last = jax.device_put(np.full(8, 8, np.int32), gen.batch_sharding)
    _, leaves = gen._prefill(nnx.state(model), tokens, last, jax.random.key(0), gen._cache_def(8))
    placed = {(x.shape, x.sharding.spec) for x in leaves}
    assert placed == {((), P()), ((8,), P("data")), ((8, 16, 2, 8), P("data", None, "model", None))}
    assert {s.data.shape for x in leaves if x.ndim == 4 for s in x.addressable_shards} == {(2, 16, 1, 8)}
    assert gen.cache_spec == P("data", None, "model", None) and gen.cache_origin.startswith("inferred")
    p = tmp_path / "served.splan"
    p.write_text(f'extends "{FIXTURES / "gen_tp.splan"}"\ncache (data, _, _, _)\n')
    model, _, placement = shardplan.init_sharded(shardplan.load(p), gen_models.counter_lm, None)
    stated = Generator(placement, model, COUNTER_CONFIG, adapter=COUNTER_CACHE)
    assert sorted(map(str, stated.cache_specs)) == sorted(map(str, [P()] + [P("data")] * 5))
    assert "cache statement (" in stated.cache_origin


def test_per_row_positions_through_an_adapter():
    """Right padding: each row at its own position (the Llama's dict cache, called its own way)."""
    max_len = 32

    def prefill(model, tokens, cache):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return model(tokens, positions, jnp.arange(max_len)[None, None, :] <= positions[:, :, None], cache)

    def decode(model, token, cache, position):
        return model(token, position[:, None], jnp.arange(max_len)[None, None, :] <= position[:, None, None], cache)

    adapter = GenerationAdapter(init_cache=lambda m, b, n: m.init_cache(b, n), prefill=prefill, decode=decode)
    plan = shardplan.load(PLANS / "llama_tp.splan")
    model, _, placement = shardplan.init_sharded(plan, lambda: models.llama_tiny_cached(0), None)
    batch = [[int(t) for t in np.random.default_rng(i).integers(1, 64, size=n)] for i, n in enumerate((3, 8, 5, 2) * 2)]
    out = Generator(placement, model, GenerationConfig(max_len, (8,), 6), adapter=adapter).generate(batch)
    reference = llama_reference(models.llama_tiny)
    assert all(reference(p, toks) for p, toks in zip(batch, out.tokens))
    assert {k: v for k, v in out.compiles.items() if "shardplan_" in k} == {"jit(shardplan_prefill)": 1,
                                                                           "jit(shardplan_decode)": 1}


def _three(a, b, c):
    return a


@pytest.mark.parametrize("make, path, says", [
    (lambda: GenerationAdapter(), "adapter", "has no callables"),
    (lambda: GenerationAdapter(init_cache=_three), "adapter", "lacks prefill, decode"),
    (lambda: GenerationAdapter(forward=lambda m, t: t, decode=COUNTER_CACHE.decode), "adapter",
     "gives forward (the plain path) and decode (the cache path)"),
    (lambda: GenerationAdapter(forward=lambda model: model), "adapter.forward",
     "cannot be called as forward(model, tokens)"),
    (lambda: GenerationAdapter(forward="model.__call__"), "adapter.forward", "is a str, not a function"),
    (lambda: GenerationAdapter(forward=lambda m, t: t, padding="center"), "adapter.padding",
     "neither 'left' nor 'right'"),
])
def test_a_malformed_adapter_is_refused_when_it_is_made(make, path, says):
    with pytest.raises(shardplan.ArgumentError) as info:
        make()
    assert info.value.diagnostics[0].path == path and says in str(info.value)
    assert shardplan.GenerationAdapter is GenerationAdapter  # the public name


@pytest.mark.parametrize("adapter, path, says", [
    ({"forward": COUNTER_PLAIN.forward}, "adapter", "adapter is a dict, not a shardplan.GenerationAdapter"),
    (GenerationAdapter(forward=lambda model, tokens: model(tokens)), "adapter.forward",
     "calling the adapter's forward(model, tokens) failed: TypeError"),
    (GenerationAdapter(forward=lambda model, tokens: model(tokens, model.new_cache(*tokens.shape))[:, -1]),
     "adapter.forward", "returned logits (8, 48), not (8, 2, vocab)"),
    (GenerationAdapter(init_cache=COUNTER_CACHE.init_cache, prefill=COUNTER_CACHE.prefill,
                       decode=lambda model, token, cache, position: model(token, cache)),
     "adapter.decode", "the adapter's decode returned an array (8, 1, 48), not (logits, cache)"),
    (GenerationAdapter(init_cache=COUNTER_CACHE.init_cache, decode=COUNTER_CACHE.decode,
                       prefill=lambda model, tokens, cache: (model(tokens, cache), model.new_cache(len(tokens), 4))),
     "adapter.prefill", "changed a cache array from (8, 16, 2, 8) float32 to (8, 4, 2, 8) float32"),
    (GenerationAdapter(init_cache=COUNTER_CACHE.init_cache, decode=COUNTER_CACHE.decode,
                       prefill=lambda model, tokens, cache: (model(tokens, cache), {"k": cache.k[0][...]})),
     "adapter.prefill", "the cache the adapter's prefill returned is not shaped like init_cache's"),
])
def test_an_adapter_that_does_not_fit_the_model_is_named_before_any_compile(adapter, path, says):
    model, _, placement = shardplan.init_sharded(shardplan.load(PLANS / "dp.splan"), gen_models.counter_lm, None)
    before = dict(shardplan.runtime.generate.COMPILES)
    with pytest.raises(shardplan.ArgumentError) as info:
        Generator(placement, model, COUNTER_CONFIG, adapter=adapter)
    assert info.value.diagnostics[0].path == path and says in str(info.value), str(info.value)
    assert dict(shardplan.runtime.generate.COMPILES) == before


def test_without_an_adapter_the_refusal_says_to_pass_one():
    model, _, placement = shardplan.init_sharded(shardplan.load(PLANS / "dp.splan"), gen_models.counter_lm, None)
    with pytest.raises(shardplan.PlanApplyError) as info:
        Generator(placement, model, COUNTER_CONFIG)
    assert info.value.diagnostics[0].code == "not-a-causal-lm"
    assert "cannot be called as model(tokens)" in str(info.value) and "adapter=GenerationAdapter(" in str(info.value)


def test_the_generation_doc_example_prints_what_the_doc_says():
    doc = (ROOT / "docs" / "generation.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.S)[0]
    shown = re.findall(r"```text\n(.*?)```", doc, re.S)[0]
    r = subprocess.run([sys.executable, "-"], input=code, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == shown
