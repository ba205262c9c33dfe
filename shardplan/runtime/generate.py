"""Sharded generation with fixed shapes: no compile per token, for any causal LM a plan places.

Two paths, chosen up front from what the model offers (``Generator.mode`` says which):

- ``cache`` (the model follows the KV-cache convention below): prompts are right-padded to the
  smallest length bucket that fits; one prefill compile per bucket fills a cache of fixed
  maximum length; each decode step feeds one token per sequence at its own position, one
  decode compile in all.
- ``plain`` (the model only maps ``tokens (batch, time) -> logits (batch, time, vocab)``): each
  step runs the whole buffer of fixed length ``bucket + max_new_tokens`` (right-padded; a causal
  model's logits at a position never see the padding after it) and writes the next token in
  place: one compile per bucket, whatever the step.

A model with ``init_cache`` whose calls do not fit the convention is an error that names what is
missing, found with ``jax.eval_shape`` before anything compiles.

The KV-cache convention: ``model.init_cache(batch, max_len, dtype)`` returns the cache pytree
(leaves (batch, max_len, kv_heads, head_dim)), and ``model(tokens, positions, mask, cache) ->
(logits, cache)`` with tokens/positions (batch, time) and mask (batch, time, max_len), True where
a query may attend.

Placement follows the plan: params as resolved, prompt batches per the ``batch`` spec, and the
cache split over the batch axes on dim 0 and, on dim 2 (kv heads), over the mesh axes that split
the output dim of 2-D params whose output width is kv_heads x head_dim (the key/value
projections, found by shape, not by name) when exactly one such split exists and the head count
divides. Pass ``cache_spec`` to choose it.
"""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import PlanApplyError, error
from shardplan.runtime.placement import Placement
from shardplan.runtime.specs import pspec

# Real XLA compiles, counted by jitted-function name (jax.monitoring's compile event). The
# listener is registered when the first Generator is made, not when this module is imported.
COMPILES: collections.Counter = collections.Counter()
_LISTENING = [False]


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[str(kwargs.get("fun_name", ""))] += 1


def _count_compiles() -> None:
    if not _LISTENING[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _LISTENING[0] = True


@dataclass(frozen=True)
class GenerationConfig:
    """Fixed shapes for generation.

    Args:
        max_len: the KV cache length: prompt bucket + new tokens must fit.
        buckets: prompt lengths to pad to (each prompt goes to the smallest that fits);
            one prefill compile per bucket used.
        max_new_tokens: tokens to generate per prompt (at most).
        temperature: 0 for greedy; otherwise softmax sampling at this temperature.
        top_k: sample among the k most likely tokens only.
        end_token: stop a sequence when it produces this token.
        pad_token: what padded positions hold (never attended to).
    """

    max_len: int
    buckets: tuple[int, ...] = (8, 16)
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    end_token: int | None = None
    pad_token: int = 0

    def __post_init__(self):
        b = tuple(sorted(self.buckets))
        object.__setattr__(self, "buckets", b)
        if not b or b[0] <= 0:
            raise ValueError("buckets must be positive prompt lengths, e.g. (8, 16, 32)")
        if b[-1] + self.max_new_tokens > self.max_len:
            raise ValueError(
                f"the longest bucket ({b[-1]}) + max_new_tokens ({self.max_new_tokens}) exceeds "
                f"max_len ({self.max_len}): raise max_len or lower one of them"
            )
        if self.temperature < 0 or (self.top_k is not None and self.top_k <= 0):
            raise ValueError("temperature must be >= 0 and top_k positive")


@dataclass(frozen=True)
class Generation:
    tokens: list[list[int]]  # generated tokens per prompt (up to and including end_token)
    bucket: int
    compiles: dict[str, int] = field(default_factory=dict)  # real compiles during this call
    mode: str = "cache"  # which path ran: "cache" or "plain" (see the module docstring)


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """Greedy (temperature 0) or temperature / top-k sampling from (batch, vocab) logits."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def cache_spec_for(placement: Placement, kv_heads: int, head_dim: int) -> P:
    """(batch axes, _, heads axes, _) derived from the plan (see module docstring)."""
    plan, mesh = placement.plan, placement.mesh_shape
    batch = plan.batch_dim0_axes
    width = kv_heads * head_dim
    found = {
        tuple(a for a in d.spec.dims[-1] if a not in batch)
        for d in placement.params.decisions
        if d.role == "param" and len(d.shape) == 2 and d.shape[-1] == width and len(d.spec.dims) == 2
    } - {()}
    heads = found.pop() if len(found) == 1 else ()  # one way to split that width, or none
    if heads and kv_heads % math.prod(mesh[a] for a in heads):
        heads = ()
    entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return P(entry(batch), None, entry(heads), None)


def _not_causal_lm(message: str, hint: str) -> PlanApplyError:
    return PlanApplyError([error("not-a-causal-lm", message, hint, path="model")])


def _fits(fn: Callable, *args) -> bool:
    try:
        inspect.signature(fn).bind(*args)
        return True
    except (TypeError, ValueError):
        return False


def convention(model: Any, max_len: int, dtype=jnp.float32, *, cache_layout_given: bool = False) -> str:
    """``"cache"`` or ``"plain"`` (module docstring), checked with ``jax.eval_shape``: nothing
    compiles. A model that half-follows the cache convention is an error naming what is missing.
    """
    gd, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)

    def run(fn, *args):
        try:
            return jax.eval_shape(fn, state, *args)
        except Exception as e:  # the model's own error, at trace time
            raise _not_causal_lm(
                f"calling {type(model).__name__} for generation failed: {type(e).__name__}: {str(e)[:300]}",
                "see the call convention in the README (Generate with a sharded model)",
            ) from None

    init = getattr(model, "init_cache", None)
    if init is None:
        if not _fits(model.__call__, tokens):
            raise _not_causal_lm(
                f"{type(model).__name__} has no init_cache and cannot be called as model(tokens)",
                "a causal LM maps tokens (batch, time) to logits (batch, time, vocab); or add the cache convention",
            )
        out = run(lambda s, t: nnx.merge(gd, s)(t), tokens)
        if not (hasattr(out, "shape") and len(out.shape) == 3 and out.shape[:2] == (1, 2)):
            raise _not_causal_lm(
                f"{type(model).__name__}(tokens) returned {jax.tree.map(lambda x: x.shape, out)}, not logits "
                "(batch, time, vocab)",
                "return the logits for every position",
            )
        return "plain"
    if not callable(init) or not _fits(init, 1, max_len, dtype):
        raise _not_causal_lm(
            f"{type(model).__name__}.init_cache does not take (batch, max_len, dtype)",
            "define init_cache(self, batch, max_len, dtype) returning the cache pytree",
        )
    cache = jax.eval_shape(lambda: init(1, max_len, dtype))
    positions = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 2, max_len), jnp.bool_)
    if not _fits(model.__call__, tokens, positions, mask, cache):
        raise _not_causal_lm(
            f"{type(model).__name__} has init_cache, but its __call__ does not take (tokens, positions, mask, cache)",
            "give __call__ the cache convention, or remove init_cache to generate without a cache",
        )
    out = run(lambda s, t, p, m, c: nnx.merge(gd, s)(t, p, m, c), tokens, positions, mask, cache)
    ok = isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape") and len(out[0].shape) == 3
    if not ok or str(jax.tree.structure(out[1])) != str(jax.tree.structure(cache)):
        raise _not_causal_lm(
            f"{type(model).__name__}(tokens, positions, mask, cache) must return (logits, cache) with the cache "
            "shaped like init_cache's",
            "return the updated cache beside the logits",
        )
    leaves = jax.tree.leaves(cache)
    if not cache_layout_given and (not leaves or any(len(x.shape) != 4 for x in leaves)):
        raise _not_causal_lm(
            "init_cache must return leaves of shape (batch, max_len, kv_heads, head_dim)",
            "or pass cache_spec= to place a cache of another layout",
        )
    return "cache"


class Generator:
    """Prefill + decode for a placed causal LM.

    Args:
        placement: from ``shardplan.init_sharded`` / ``shard_model`` (params placed).
        model: the placed model (see the call convention above).
        config: fixed shapes and sampling.
        cache_spec: PartitionSpec for every cache leaf (default: derived from the plan).
        cache_dtype: the cache's dtype.
    """

    def __init__(
        self,
        placement: Placement,
        model: Any,
        config: GenerationConfig,
        *,
        cache_spec: P | None = None,
        cache_dtype=jnp.float32,
    ):
        _count_compiles()
        self.placement = placement
        self.config = config
        self.gm = nnx.graphdef(model)
        self.model = model
        self.cache_dtype = cache_dtype
        self.mode = convention(model, config.max_len, cache_dtype, cache_layout_given=cache_spec is not None)
        mesh = placement.mesh
        if self.mode == "cache":
            plan = placement.plan
            if cache_spec is not None:
                self.cache_origin = "cache_spec= argument"
            elif plan.cache is not None:
                abstract = jax.eval_shape(lambda: model.init_cache(1, config.max_len, cache_dtype))
                concrete = plan.cache.for_rank(len(jax.tree.leaves(abstract)[0].shape)) or plan.cache
                cache_spec = pspec(concrete)
                span = plan.cache_span
                self.cache_origin = f"the plan's cache statement ({span.file}:{span.line})" if span else "the plan"
            else:
                abstract = jax.eval_shape(lambda: model.init_cache(1, config.max_len, cache_dtype))
                _, _, kv_heads, head_dim = jax.tree.leaves(abstract)[0].shape
                cache_spec = cache_spec_for(placement, kv_heads, head_dim)
                self.cache_origin = "inferred: batch axes, and the split of the params as wide as kv_heads x head_dim"
            self.cache_spec = cache_spec
            batch_entry = self.cache_spec[0] if len(self.cache_spec) else None
        else:
            self.cache_spec = P()
            self.cache_origin = "no cache (plain path)"
            axes = placement.plan.batch_dim0_axes
            batch_entry = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
        self.cache_sharding = NamedSharding(mesh, self.cache_spec)
        self.batch_sharding = NamedSharding(mesh, P(batch_entry))
        self.batch_sharding_2d = NamedSharding(mesh, P(batch_entry, None))
        self.batch_axes = (
            () if batch_entry is None else (batch_entry,) if isinstance(batch_entry, str) else tuple(batch_entry)
        )
        if self.mode == "cache":
            self._prefill = jax.jit(self._prefill_fn(), out_shardings=(self.batch_sharding, self.cache_sharding))
            self._decode = jax.jit(
                self._decode_fn(), out_shardings=(self.batch_sharding, self.cache_sharding), donate_argnums=(3,)
            )
        else:
            self._forward = jax.jit(
                self._forward_fn(), out_shardings=(self.batch_sharding, self.batch_sharding_2d), donate_argnums=(1,)
            )

    # -- the two jitted programs ------------------------------------------------------------
    def _prefill_fn(self) -> Callable:
        gm, cfg, cache_sh, dtype = self.gm, self.config, self.cache_sharding, self.cache_dtype

        def shardplan_prefill(state, tokens, lengths, key):
            model = nnx.merge(gm, state)
            b, t = tokens.shape
            cache = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, cache_sh), model.init_cache(b, cfg.max_len, dtype)
            )
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            mask = jnp.arange(cfg.max_len)[None, None, :] <= positions[:, :, None]
            logits, cache = model(tokens, positions, mask, cache)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            return sample(last, key, cfg.temperature, cfg.top_k), cache

        return shardplan_prefill

    def _forward_fn(self) -> Callable:
        gm, cfg = self.gm, self.config

        def shardplan_forward(state, buf, lengths, key):
            model = nnx.merge(gm, state)
            logits = model(buf)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            tok = sample(last, key, cfg.temperature, cfg.top_k)
            hit = jnp.arange(buf.shape[1])[None, :] == lengths[:, None]
            return tok, jnp.where(hit, tok[:, None], buf)

        return shardplan_forward

    def _decode_fn(self) -> Callable:
        gm, cfg = self.gm, self.config

        def shardplan_decode(state, token, position, cache, key):
            model = nnx.merge(gm, state)
            mask = jnp.arange(cfg.max_len)[None, None, :] <= position[:, None, None]
            logits, cache = model(token[:, None], position[:, None], mask, cache)
            return sample(logits[:, 0], key, cfg.temperature, cfg.top_k), cache

        return shardplan_decode

    # -- input checks ----------------------------------------------------------------------
    def _bucket(self, prompts: Sequence[Sequence[int]]) -> int:
        cfg = self.config
        diags = []
        if not prompts:
            raise PlanApplyError(
                [error("empty-batch", "no prompts given", "pass a list of token lists", path="prompts")]
            )
        for i, p in enumerate(prompts):
            if len(p) == 0:
                diags.append(
                    error(
                        "empty-prompt",
                        f"prompt {i} is empty",
                        "give every prompt at least one token (e.g. a BOS token)",
                        path=f"prompts[{i}]",
                    )
                )
            elif len(p) > cfg.buckets[-1]:
                diags.append(
                    error(
                        "prompt-too-long",
                        f"prompt {i} has {len(p)} tokens; the longest bucket is {cfg.buckets[-1]}",
                        "truncate the prompt, or add a longer bucket (and raise max_len to fit it plus max_new_tokens)",
                        path=f"prompts[{i}]",
                    )
                )
        n = math.prod(self.placement.mesh_shape[a] for a in self.batch_axes)
        if len(prompts) % n:
            diags.append(
                error(
                    "indivisible",
                    f"{len(prompts)} prompts do not divide over the batch axes "
                    f"{', '.join(self.batch_axes)} ({n} shards)",
                    f"pass a multiple of {n} prompts (pad the batch with dummy prompts)",
                    path="prompts",
                )
            )
        if diags:
            raise PlanApplyError(diags)
        longest = max(len(p) for p in prompts)
        return next(b for b in cfg.buckets if b >= longest)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array | None = None,
        on_token: Callable[[int, np.ndarray], None] | None = None,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` per prompt; ``on_token(step, tokens)`` sees each step's
        tokens (one per prompt) as they come. ``key`` is required when sampling."""
        cfg = self.config
        if cfg.temperature > 0 and key is None:
            raise PlanApplyError(
                [
                    error(
                        "no-key",
                        "sampling (temperature > 0) needs a PRNG key",
                        "pass key=jax.random.key(seed)",
                        path="key",
                    )
                ]
            )
        key = jax.random.key(0) if key is None else key
        before = dict(COMPILES)
        bucket = self._bucket(prompts)
        b = len(prompts)
        tokens = np.full((b, bucket), cfg.pad_token, np.int32)
        lengths = np.array([len(p) for p in prompts], np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        state = nnx.state(self.model)
        if self.mode == "plain":
            return self._generate_plain(state, tokens, lengths, key, before, bucket, on_token)
        tok, cache = self._prefill(
            state,
            jax.device_put(tokens, self.batch_sharding_2d),
            jax.device_put(lengths, self.batch_sharding),
            jax.random.fold_in(key, 0),
        )
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        position = lengths.copy()
        for step in range(cfg.max_new_tokens):
            _collect(np.asarray(tok), out, done, cfg.end_token)
            if on_token is not None:
                on_token(step, np.asarray(tok))
            if done.all() or step == cfg.max_new_tokens - 1:
                break
            tok, cache = self._decode(
                state, tok, jax.device_put(position, self.batch_sharding), cache, jax.random.fold_in(key, step + 1)
            )
            position = position + 1
        return Generation(out, bucket, _compiles_since(before), self.mode)

    def _generate_plain(self, state, tokens, lengths, key, before, bucket, on_token) -> Generation:
        cfg = self.config
        b = len(lengths)
        buf = np.full((b, bucket + cfg.max_new_tokens), cfg.pad_token, np.int32)
        buf[:, :bucket] = tokens
        buf_dev = jax.device_put(buf, self.batch_sharding_2d)
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        position = lengths.copy()
        for step in range(cfg.max_new_tokens):
            tok, buf_dev = self._forward(
                state, buf_dev, jax.device_put(position, self.batch_sharding), jax.random.fold_in(key, step)
            )
            _collect(np.asarray(tok), out, done, cfg.end_token)
            if on_token is not None:
                on_token(step, np.asarray(tok))
            if done.all():
                break
            position = position + 1
        return Generation(out, bucket, _compiles_since(before), self.mode)


def _collect(host: np.ndarray, out: list[list[int]], done: np.ndarray, end_token: int | None) -> None:
    """Append this step's token to every sequence not yet ended; mark those that end now."""
    for i in range(len(out)):
        if not done[i]:
            out[i].append(int(host[i]))
            done[i] = end_token is not None and host[i] == end_token


def _compiles_since(before: dict[str, int]) -> dict[str, int]:
    return {name: COMPILES[name] - before.get(name, 0) for name in COMPILES if COMPILES[name] != before.get(name, 0)}


def generate(
    placement: Placement,
    model: Any,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    *,
    key: jax.Array | None = None,
) -> Generation:
    """One-shot helper: ``Generator(placement, model, config).generate(prompts, key=key)``."""
    return Generator(placement, model, config).generate(prompts, key=key)
