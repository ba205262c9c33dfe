"""Example Flax NNX models that the plans in plans/ are written for.

- ``GPT``: token (+ learned position) embedding, causal self-attention with
  query/key/value/out projections (grouped KV heads allowed), SwiGLU MLP (up, gate,
  down), pre-norm (LayerNorm or RMSNorm), tied or untied head.
- ``Llama``: a Llama-style decoder: RMSNorm, rotary position embeddings, grouped-query
  attention (``q``/``k``/``v``/``o``), SwiGLU (``gate``/``up``/``down``), no biases. With
  ``scan_layers`` its blocks are stacked with ``nnx.vmap`` and run with ``nnx.scan`` under
  ``nnx.remat`` (each param gets a leading layer dimension), as large models are built.
- ``MLP``: a stack of Linear layers.
- ``MoE``: a decoder whose feed-forward layers are top-k routed experts (renormalised weights,
  a load-balancing loss, an optional shared expert; capacity or dropless dispatch), returning
  ``(logits, aux)`` (``examples/train.py:moe_lm_loss``).
- ``TypedLM``: a decoder written the explicit-sharding way (JAX's sharding in types): its own
  code passes ``out_sharding=`` to every matmul and to the embedding lookup, naming the mesh axes
  ``data`` and ``model`` where the mesh in context has them (``plans/typed_tp.splan``). Param
  paths: ``embed``, ``blocks/<i>/(qkv|out|up|down)``, ``blocks/<i>/(norm1|norm2)/scale``,
  ``norm/scale``, ``head``.

Param paths (what plan regexes match): ``embed/embedding``, ``pos_embed/embedding``,
``blocks/<i>/attn/(query|key|value|out)/kernel``, ``blocks/<i>/mlp/(up|gate|down)/kernel``,
``blocks/<i>/(ln1|ln2)/scale``, ``ln_f/scale``, ``head/kernel`` (untied only).

Llama param paths: ``embed/embedding``, ``layers/<i>/attn/(q|k|v|o)/kernel``,
``layers/<i>/mlp/(gate|up|down)/kernel``, ``layers/<i>/(attn_norm|mlp_norm)/scale``,
``norm/scale``, ``lm_head/kernel``; scanned (``scan_layers``): the same without ``<i>/``,
each with a leading layer dimension (``layers/attn/q/kernel`` is (L, d_model, q_dim)).

Factories with no required arguments (``gpt_tiny``, ``gpt_small``, ``mlp_small``,
``llama2_70b``, ``llama2_70b_scan``, ``llama_tiny``, ``llama_tiny_scan``, ``llama_deep_scan``, ``llama_1b``, ``moe_tiny``,
``moe_small``, ``moe_tiny_dropless``, ``moe_tiny_shared``, ``mixtral_8x7b``, ``deepseek_v3``, ``typed_tiny``) are what
``shardplan check --model examples/models.py:FACTORY`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import linen as nn
from flax import nnx


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads
    d_ff: int = 64
    n_layers: int = 2
    max_len: int = 16
    tied: bool = False
    norm: str = "layer"  # "layer" or "rms"
    learned_pos: bool = True
    use_bias: bool = False
    annotate: bool = False  # carry Flax logical-axis annotations (nnx.with_partitioning)
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


def _init(cfg: GPTConfig, base, names):
    return nnx.with_partitioning(base, names) if cfg.annotate else base


def _linear(cfg: GPTConfig, din: int, dout: int, names, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=cfg.use_bias, rngs=rngs, param_dtype=jnp.dtype(cfg.dtype),
                      kernel_init=_init(cfg, nnx.initializers.normal(0.02), names))


def _norm(cfg: GPTConfig, rngs: nnx.Rngs):
    init = _init(cfg, nnx.initializers.ones_init(), ("embed",))
    if cfg.norm == "rms":
        return nnx.RMSNorm(cfg.d_model, rngs=rngs, scale_init=init, param_dtype=jnp.dtype(cfg.dtype))
    return nnx.LayerNorm(cfg.d_model, rngs=rngs, scale_init=init, use_bias=cfg.use_bias,
                         param_dtype=jnp.dtype(cfg.dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        hd = cfg.head_dim
        self.query = _linear(cfg, cfg.d_model, cfg.n_heads * hd, ("embed", "heads"), rngs)
        self.key = _linear(cfg, cfg.d_model, cfg.kv_heads * hd, ("embed", "kv_heads"), rngs)
        self.value = _linear(cfg, cfg.d_model, cfg.kv_heads * hd, ("embed", "kv_heads"), rngs)
        self.out = _linear(cfg, cfg.n_heads * hd, cfg.d_model, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, cache: dict | None = None,
                 positions: jax.Array | None = None):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.query(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = self.key(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = self.value(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        if cache is not None:
            k, v, cache = _write_cache(cache, k, v, positions)
        rep = cfg.n_heads // cfg.kv_heads
        if rep > 1:
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(x.dtype)
        scores = jnp.where(mask[:, None, :, :], scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return self.out(y) if cache is None else (self.out(y), cache)


def _write_cache(cache: dict, k: jax.Array, v: jax.Array, positions: jax.Array):
    """Write this call's keys/values into the fixed-length cache at ``positions``.

    One token per sequence (decode): an elementwise one-hot select at each sequence's own
    position, which keeps the cache's sharding. Several tokens (prefill): a contiguous
    block starting at ``positions[0, 0]`` (the generator prefills every row from 0).
    """
    if k.shape[1] == 1:
        hit = (jnp.arange(cache["k"].shape[1])[None, :] == positions[:, :1])[:, :, None, None]
        ck = jnp.where(hit, k.astype(cache["k"].dtype), cache["k"])
        cv = jnp.where(hit, v.astype(cache["v"].dtype), cache["v"])
    else:
        start = positions[0, 0]
        ck = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), start, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), start, axis=1)
    return ck, cv, {"k": ck, "v": cv}


class SwiGLU(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.up = _linear(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.gate = _linear(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.down = _linear(cfg, cfg.d_ff, cfg.d_model, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.ln1 = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _norm(cfg, rngs)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, cache: dict | None = None,
                 positions: jax.Array | None = None):
        if cache is None:
            x = x + self.attn(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))
        y, cache = self.attn(self.ln1(x), mask, cache, positions)
        x = x + y
        return x + self.mlp(self.ln2(x)), cache


class GPT(nnx.Module):
    """A small GPT-style causal LM: ``model(tokens) -> logits``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs, param_dtype=dt,
                               embedding_init=_init(cfg, nnx.initializers.normal(0.02), ("vocab", "embed")))
        if cfg.learned_pos:
            self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, rngs=rngs, param_dtype=dt,
                                       embedding_init=_init(cfg, nnx.initializers.normal(0.02),
                                                            (None, "embed")))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _norm(cfg, rngs)
        if not cfg.tied:
            self.head = _linear(cfg, cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict:
        """A zero KV cache: per block, keys and values of shape (batch, max_len, kv_heads, head_dim)."""
        shape = (batch, max_len, self.cfg.kv_heads, self.cfg.head_dim)
        return {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                for i in range(self.cfg.n_layers)}

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 mask: jax.Array | None = None, cache: dict | None = None):
        """Logits for ``tokens`` (batch, time).

        With ``cache`` (from ``init_cache``), keys/values are written at ``positions`` and
        attention runs over the whole cache under ``mask`` (batch, time, max_len); returns
        ``(logits, cache)``. This is the call convention ``shardplan.Generator`` drives.
        """
        b, t = tokens.shape
        x = self.embed(tokens)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if self.cfg.learned_pos:
            x = x + self.pos_embed(positions)
        if mask is None:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        new_cache = {}
        for i, block in enumerate(self.blocks):
            if cache is None:
                x = block(x, mask)
            else:
                x, new_cache[str(i)] = block(x, mask, cache[str(i)], positions)
        x = self.ln_f(x)
        logits = self.embed.attend(x) if self.cfg.tied else self.head(x)
        return logits if cache is None else (logits, new_cache)


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 64
    n_layers: int = 2
    max_len: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    scan_layers: bool = False  # nnx.vmap-stacked blocks run by nnx.scan, each under nnx.remat
    # with scan_layers: "full" (save nothing), "dots" (save matmul outputs), "qkvo" (save the attention
    # projections' outputs and each block's input, as MaxText's "custom" policy), "none"
    remat: str = "full"
    dtype: str = "float32"
    # "naive": scores materialized (any backend); "cudnn": jax.nn.dot_product_attention on cuDNN's
    # flash attention (NVIDIA GPUs, bf16/fp16); "flash": jax's Pallas TPU flash-attention kernel
    # (keys and values in blocks, the scores kept on chip), run per device in jax.shard_map with the
    # batch split over the mesh axes in ``attention_axes`` and the heads over ``attention_head_axes``
    # (those the mesh has), as MaxText does. The kernel traces anywhere (fast mode costs it) but
    # runs only on TPU.
    attention: str = "naive"
    attention_axes: tuple[str, ...] = ("data",)
    attention_head_axes: tuple[str, ...] = ("model",)
    attention_blocks: tuple[int, int, int] = (512, 512, 512)  # flash: query, key/value, backward query block

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embeddings on (batch, time, heads, head_dim), rotating half-dim pairs."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * freqs  # (batch, time, half)
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _dense(cfg: LlamaConfig, din: int, dout: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, rngs=rngs, param_dtype=jnp.dtype(cfg.dtype),
                      kernel_init=nnx.initializers.normal(0.02))


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        hd = cfg.head_dim
        self.q = _dense(cfg, cfg.d_model, cfg.n_heads * hd, rngs)
        self.k = _dense(cfg, cfg.d_model, cfg.n_kv_heads * hd, rngs)
        self.v = _dense(cfg, cfg.d_model, cfg.n_kv_heads * hd, rngs)
        self.o = _dense(cfg, cfg.n_heads * hd, cfg.d_model, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
                 cache: dict | None = None):
        cfg = self.cfg
        b, t, _ = x.shape
        q = rope(_tag(self.q(x)).reshape(b, t, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(_tag(self.k(x)).reshape(b, t, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = _tag(self.v(x)).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        if cache is not None:  # keys and values over the whole fixed-length cache
            k, v, cache = _write_cache(cache, k, v, positions)
        elif cfg.attention == "flash" and mask is None:
            return _tag(self.o(_flash_attention(cfg, q, k, v).reshape(b, t, cfg.n_heads * cfg.head_dim)))
        elif cfg.attention == "cudnn" and mask is None:  # cuDNN's flash attention; jax splits it by batch and heads
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return _tag(self.o(y.reshape(b, t, cfg.n_heads * cfg.head_dim)))
        # Grouped-query attention: each group of n_heads / n_kv_heads query heads shares one kv head.
        q = q.reshape(b, t, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / jnp.sqrt(cfg.head_dim).astype(x.dtype)
        allowed = jnp.tril(jnp.ones((t, t), bool)) if mask is None else mask[:, None, None, :, :]
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return _tag(self.o(y)) if cache is None else (self.o(y), cache)


def _tag(x: jax.Array) -> jax.Array:
    """An attention projection's output, named for the "qkvo" remat policy (an identity elsewhere)."""
    return checkpoint_name(x, "attn_proj")


def _flash_attention(cfg: LlamaConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention by the Pallas TPU flash kernel on (batch, time, heads, head_dim), kv heads
    repeated to the query heads; per device in shard_map over the batch's mesh axes."""
    from jax.experimental.pallas.ops.tpu.flash_attention import BlockSizes, flash_attention

    group = cfg.n_heads // cfg.n_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)

    def attend(q, k, v):
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # the kernel's (batch, heads, time, dim)
        bq, bkv, bq_bwd = (min(n, q.shape[2]) for n in cfg.attention_blocks)
        blocks = BlockSizes(block_q=bq, block_k_major=bkv, block_k=bkv, block_b=1, block_q_major_dkv=bq_bwd,
                            block_k_major_dkv=bkv, block_k_dkv=bkv, block_q_dkv=bq_bwd, block_k_major_dq=bkv,
                            block_k_dq=bkv, block_q_dq=bq_bwd)
        out = flash_attention(q, k, v, causal=True, sm_scale=cfg.head_dim ** -0.5, block_sizes=blocks)
        return out.transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in cfg.attention_axes if a in mesh.axis_names)
    heads = tuple(a for a in cfg.attention_head_axes if a in mesh.axis_names and a not in batch)
    if not batch and not heads:
        return attend(q, k, v)
    spec = jax.sharding.PartitionSpec(batch or None, None, heads or None, None)  # (batch, time, heads, dim)
    return jax.shard_map(attend, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate = _dense(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.up = _dense(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.down = _dense(cfg, cfg.d_ff, cfg.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


# The residual stream's logical axes (the names MaxText uses): a no-op unless the step runs under
# logical-axis rules and a mesh, as shardplan sets up from a plan's `axis` rules
# (plans/llama_sp.splan splits the sequence over `model` here).
RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


def residual(x: jax.Array) -> jax.Array:
    return nn.with_logical_constraint(x, RESIDUAL)


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, param_dtype=dt)
        self.attn = LlamaAttention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, param_dtype=dt)
        self.mlp = LlamaMLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
                 cache: dict | None = None):
        if cache is None:
            x = checkpoint_name(x, "layer_input")
            x = residual(x + self.attn(self.attn_norm(x), positions))
            return residual(x + self.mlp(self.mlp_norm(x)))
        h, cache = self.attn(self.attn_norm(x), positions, mask, cache)
        x = residual(x + h)
        return residual(x + self.mlp(self.mlp_norm(x))), cache


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "qkvo": jax.checkpoint_policies.save_only_these_names("attn_proj", "layer_input"),
}


class Llama(nnx.Module):
    """A Llama-style causal LM: ``model(tokens) -> logits``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs, param_dtype=dt,
                               embedding_init=nnx.initializers.normal(0.02))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs: nnx.Rngs) -> LlamaBlock:
                return LlamaBlock(cfg, rngs)

            self.layers = stack(rngs)
        else:
            self.layers = nnx.List([LlamaBlock(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, param_dtype=dt)
        self.lm_head = _dense(cfg, cfg.d_model, cfg.vocab, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = residual(self.embed(tokens))
        if self.cfg.scan_layers:
            def apply(block: LlamaBlock, x: jax.Array) -> jax.Array:
                return block(x, positions)

            if self.cfg.remat != "none":
                apply = nnx.remat(apply, policy=_REMAT_POLICIES[self.cfg.remat])

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x: jax.Array, block: LlamaBlock) -> jax.Array:
                return apply(block, x)

            x = run(x, self.layers)
        else:
            for block in self.layers:
                x = block(x, positions)
        return self.lm_head(self.norm(x))


class LlamaCached(Llama):
    """The Llama with a KV cache: ``init_cache`` and ``model(tokens, positions, mask, cache) ->
    (logits, cache)``, the convention ``shardplan.Generator``'s cache path drives (unscanned
    layers). Plain ``model(tokens) -> logits`` still works, for training."""

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict:
        shape = (batch, max_len, self.cfg.n_kv_heads, self.cfg.head_dim)
        return {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                for i in range(self.cfg.n_layers)}

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 mask: jax.Array | None = None, cache: dict | None = None):
        if cache is None:
            return super().__call__(tokens)
        x = self.embed(tokens)
        new_cache = {}
        for i, block in enumerate(self.layers):
            x, new_cache[str(i)] = block(x, positions, mask, cache[str(i)])
        return self.lm_head(self.norm(x)), new_cache


class MLP(nnx.Module):
    """A plain MLP: ``layers/<i>/kernel`` and ``layers/<i>/bias``."""

    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.relu(x)
        return x


TINY = GPTConfig()
SMALL = GPTConfig(vocab=256, d_model=128, n_heads=8, d_ff=512, n_layers=4, max_len=64)
LLAMA2_70B = GPTConfig(vocab=32000, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, n_layers=80,
                       max_len=4096, norm="rms", learned_pos=False, tied=False)


LLAMA_TINY = LlamaConfig()
LLAMA_SMALL = LlamaConfig(vocab=256, d_model=128, n_heads=8, n_kv_heads=4, d_ff=384, n_layers=4, max_len=64)
# Llama-3.2-1B shapes: 16 layers, d_model 2048, 32/8 heads, SwiGLU 8192, vocab 128256; its head is
# untied here, so 1.50B params (1.24B with the tied head of the original).
LLAMA_1B = LlamaConfig(vocab=128256, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192, n_layers=16,
                       max_len=2048, rope_theta=500000.0, scan_layers=True)


def llama_tiny(seed: int = 0) -> Llama:
    return Llama(LLAMA_TINY, nnx.Rngs(seed))


def llama_tiny_cached(seed: int = 0) -> LlamaCached:
    """The tiny Llama with a KV cache for generation (same params as ``llama_tiny``)."""
    return LlamaCached(LLAMA_TINY, nnx.Rngs(seed))


def llama_tiny_scan(seed: int = 0) -> Llama:
    """The tiny Llama with its blocks stacked (nnx.vmap) and scanned under nnx.remat."""
    return Llama(LlamaConfig(scan_layers=True), nnx.Rngs(seed))


def llama_deep_scan(seed: int = 0) -> Llama:
    """The tiny Llama's widths with 8 stacked, scanned layers: enough layers for a pipeline of
    4 stages x 2 repeats (plans/llama_pp.splan)."""
    return Llama(LlamaConfig(scan_layers=True, n_layers=8), nnx.Rngs(seed))


def llama_small(seed: int = 0) -> Llama:
    return Llama(LLAMA_SMALL, nnx.Rngs(seed))


def llama_small_scan(seed: int = 0) -> Llama:
    return Llama(LlamaConfig(**{**LLAMA_SMALL.__dict__, "scan_layers": True}), nnx.Rngs(seed))


def llama_1b(seed: int = 0) -> Llama:
    """Llama-3.2-1B-shaped (scanned layers). Build it abstractly: ``nnx.eval_shape(llama_1b)``."""
    return Llama(LLAMA_1B, nnx.Rngs(seed))


def gpt_tiny(seed: int = 0) -> GPT:
    return GPT(TINY, nnx.Rngs(seed))


def gpt_tiny_annotated(seed: int = 0) -> GPT:
    return GPT(GPTConfig(annotate=True), nnx.Rngs(seed))


def gpt_small(seed: int = 0) -> GPT:
    return GPT(SMALL, nnx.Rngs(seed))


def gpt_small_annotated(seed: int = 0) -> GPT:
    return GPT(GPTConfig(**{**SMALL.__dict__, "annotate": True}), nnx.Rngs(seed))


def mlp_small(seed: int = 0) -> MLP:
    return MLP((64, 256, 256, 16), nnx.Rngs(seed))


LLAMA2_70B_SCAN = LlamaConfig(vocab=32000, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, n_layers=80,
                              max_len=4096, scan_layers=True)


def llama2_70b_scan(seed: int = 0) -> Llama:
    """Llama-2-70B shapes with its 80 blocks stacked and scanned (each under nnx.remat): the step
    compiles like one layer's, so exact mode reaches it at pod size (``--compile --target``).
    Build it abstractly only."""
    return Llama(LLAMA2_70B_SCAN, nnx.Rngs(seed))


def llama2_70b(seed: int = 0) -> GPT:
    """Llama-2-70B shapes (80 layers, d_model 8192, 64/8 heads, SwiGLU 28672, vocab 32000).

    Build it abstractly only: ``nnx.eval_shape(llama2_70b)`` (or ``shardplan check``).
    """
    return GPT(LLAMA2_70B, nnx.Rngs(seed))


# -- mixture of experts ------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    max_len: int = 16
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 64
    # "capacity": GShard's one-hot dispatch and combine einsums, each batch row one group, at most
    # capacity_factor * tokens * top_k / n_experts tokens per expert and group (the rest dropped);
    # "dropless": the tokens sorted by expert and run through jax.lax.ragged_dot (grouped matmul)
    dispatch: str = "capacity"
    capacity_factor: float = 2.0
    shared_expert: bool = False  # one expert every token also goes through (DeepSeek's)
    aux_weight: float = 0.01  # the load-balancing loss's weight (moe_lm_loss in examples/train.py)
    dtype: str = "float32"


EXPERT_TOKENS = ("activation_expert", "activation_group", None, "activation_embed")


class MoEFeedForward(nnx.Module):
    """A top-k routed mixture of SwiGLU-less (GELU) experts, weights stacked ``(experts, d, f)``."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        dt = jnp.dtype(cfg.dtype)
        self.router = nnx.Linear(cfg.d_model, cfg.n_experts, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (cfg.n_experts, cfg.d_model, cfg.d_expert), dt))
        self.w_out = nnx.Param(init(rngs.params(), (cfg.n_experts, cfg.d_expert, cfg.d_model), dt))
        self.shared = (
            nnx.Sequential(nnx.Linear(cfg.d_model, cfg.d_expert, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs),
                           jax.nn.gelu,
                           nnx.Linear(cfg.d_expert, cfg.d_model, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs))
            if cfg.shared_expert else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        e, k = cfg.n_experts, cfg.top_k
        gates = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)  # (g, s, E)
        weights, index = jax.lax.top_k(gates, k)  # (g, s, k)
        weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(x.dtype)
        # Load balancing (Switch Transformer): E * sum_e (share of first choices on e) * (mean gate of e)
        first = jax.nn.one_hot(index[..., 0], e, dtype=jnp.float32)
        aux = e * jnp.sum(jnp.mean(first, axis=(0, 1)) * jnp.mean(gates, axis=(0, 1)))
        y = self._capacity(x, weights, index) if cfg.dispatch == "capacity" else self._dropless(x, weights, index)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, aux

    def _capacity(self, x, weights, index):
        cfg = self.cfg
        g, s, _ = x.shape
        e, k = cfg.n_experts, cfg.top_k
        cap = max(1, int(cfg.capacity_factor * s * k / e))
        combine = jnp.zeros((g, s, e, cap), x.dtype)
        taken = jnp.zeros((g, 1, e), x.dtype)  # slots filled per expert by earlier choices
        for i in range(k):  # first choices get their slots before second choices
            mask = jax.nn.one_hot(index[..., i], e, dtype=x.dtype)  # (g, s, E)
            pos = jnp.cumsum(mask, axis=1) - mask + taken
            mask = mask * (pos < cap)
            taken = taken + jnp.sum(mask, axis=1, keepdims=True)
            slot = jax.nn.one_hot(jnp.sum(pos * mask, axis=-1).astype(jnp.int32), cap, dtype=x.dtype)  # (g, s, C)
            combine = combine + (weights[..., i] * jnp.sum(mask, -1))[..., None, None] * mask[..., None] * slot[
                :, :, None, :]
        dispatch = (combine > 0).astype(x.dtype)
        # The dispatched tokens by expert: a plan's `axis activation_expert -> expert` puts each
        # expert's tokens where its weights are (the dispatch and combine become all-to-alls);
        # without axis rules a no-op.
        xe = nn.with_logical_constraint(jnp.einsum("gsec,gsd->egcd", dispatch, x), EXPERT_TOKENS)
        h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", xe, self.w_in[...]))
        ye = nn.with_logical_constraint(jnp.einsum("egcf,efd->egcd", h, self.w_out[...]), EXPERT_TOKENS)
        return jnp.einsum("gsec,egcd->gsd", combine, ye)

    def _dropless(self, x, weights, index):
        cfg = self.cfg
        g, s, d = x.shape
        k = cfg.top_k
        flat = x.reshape(g * s, d)
        expert = index.reshape(-1)  # (T * k,)
        order = jnp.argsort(expert)
        token = order // k
        sizes = jnp.bincount(expert, length=cfg.n_experts).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(flat[token], self.w_in[...], sizes))
        ye = jax.lax.ragged_dot(h, self.w_out[...], sizes) * weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(flat).at[token].add(ye).reshape(g, s, d)


class MoEBlock(nnx.Module):
    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        gcfg = GPTConfig(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_expert,
                         max_len=cfg.max_len, norm="rms", dtype=cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.attn = Attention(gcfg, rngs)
        self.moe_norm = nnx.RMSNorm(cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.moe = MoEFeedForward(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, cache: dict | None = None,
                 positions: jax.Array | None = None):
        if cache is None:
            x = x + self.attn(self.attn_norm(x), mask)
        else:
            y, cache = self.attn(self.attn_norm(x), mask, cache, positions)
            x = x + y
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux, cache


class MoE(nnx.Module):
    """A decoder whose feed-forward layers are routed experts: ``model(tokens) -> (logits, aux)``,
    ``aux`` the load-balancing loss summed over layers. Param paths: ``embed/embedding``,
    ``blocks/<i>/attn/(query|key|value|out)/kernel``, ``blocks/<i>/moe/router/kernel``,
    ``blocks/<i>/moe/(w_in|w_out)`` ``(experts, d, f)`` / ``(experts, f, d)``,
    ``blocks/<i>/moe/shared/layers/(0|2)/kernel`` (with a shared expert), norms, ``head/kernel``."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict:
        """A zero KV cache: per block, keys and values of shape (batch, max_len, heads, head_dim)."""
        shape = (batch, max_len, self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads)
        return {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                for i in range(self.cfg.n_layers)}

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None,
                 cache: dict | None = None) -> tuple[jax.Array, Any]:
        """``(logits, aux)``; with ``cache`` (from ``init_cache``) keys and values are written at
        ``positions``, attention runs over the cache under ``mask`` (batch, time, max_len) and the
        result is ``(logits, cache)``: the convention ``shardplan.Generator`` drives. Each batch row
        is one dispatch group, so a row's experts never see another row's tokens."""
        b, t = tokens.shape
        x = self.embed(tokens)
        if mask is None:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        aux = jnp.zeros((), jnp.float32)
        new_cache = {}
        for i, block in enumerate(self.blocks):
            x, a, layer = block(x, mask, None if cache is None else cache[str(i)], positions)
            aux = aux + a
            new_cache[str(i)] = layer
        logits = self.head(self.norm(x))
        return (logits, aux) if cache is None else (logits, new_cache)


MOE_TINY = MoEConfig()
MOE_SMALL = MoEConfig(vocab=256, d_model=128, n_heads=8, n_layers=2, max_len=64, n_experts=8, top_k=2, d_expert=256)
# Shapes for offline checks (`shardplan check --model examples/models.py:mixtral_8x7b ...`): Mixtral
# 8x7B (32 layers, d_model 4096, 8 experts of 14336, top-2; its attention's 8 kv heads are 32 here)
# and DeepSeek-V3 (61 layers, d_model 7168, 256 experts of 2048, top-8, a shared expert; its
# multi-head latent attention is plain attention with 128 heads here).
MIXTRAL_8X7B = MoEConfig(vocab=32000, d_model=4096, n_heads=32, n_layers=32, max_len=4096, n_experts=8, top_k=2,
                         d_expert=14336, dtype="bfloat16")
DEEPSEEK_V3 = MoEConfig(vocab=129280, d_model=7168, n_heads=128, n_layers=61, max_len=4096, n_experts=256, top_k=8,
                        d_expert=2048, shared_expert=True, dispatch="dropless", dtype="bfloat16")


def moe_tiny(seed: int = 0) -> MoE:
    return MoE(MOE_TINY, nnx.Rngs(seed))


def moe_small(seed: int = 0) -> MoE:
    return MoE(MOE_SMALL, nnx.Rngs(seed))


def moe_tiny_dropless(seed: int = 0) -> MoE:
    return MoE(MoEConfig(dispatch="dropless", shared_expert=True), nnx.Rngs(seed))


def moe_tiny_shared(seed: int = 0) -> MoE:
    """moe_tiny with a shared expert beside the routed ones (capacity dispatch)."""
    return MoE(MoEConfig(shared_expert=True), nnx.Rngs(seed))


def mixtral_8x7b(seed: int = 0) -> MoE:
    """Build it abstractly only (``shardplan check``)."""
    return MoE(MIXTRAL_8X7B, nnx.Rngs(seed))


def deepseek_v3(seed: int = 0) -> MoE:
    """Build it abstractly only (``shardplan check``)."""
    return MoE(DEEPSEEK_V3, nnx.Rngs(seed))


# -- typed by explicit mesh axes ------------------------------------------------------------------
def _axis(name: str) -> str | None:
    """``name`` when the mesh in context has it (the model runs on meshes without a model axis)."""
    return name if name in jax.sharding.get_abstract_mesh().axis_names else None


class TypedBlock(nnx.Module):
    """Pre-norm attention and a GELU MLP, each matmul told its output's sharding: heads and the
    MLP's hidden width over ``model``, the batch over ``data``, the residual stream whole."""

    def __init__(self, d: int, heads: int, d_ff: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.heads = heads
        self.norm1 = nnx.RMSNorm(d, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Param(init(rngs.params(), (d, 3, heads, d // heads)))
        self.out = nnx.Param(init(rngs.params(), (heads, d // heads, d)))
        self.up = nnx.Param(init(rngs.params(), (d, d_ff)))
        self.down = nnx.Param(init(rngs.params(), (d_ff, d)))

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        data, model = _axis("data"), _axis("model")
        P = jax.sharding.PartitionSpec
        qkv = jnp.einsum("btd,dkhe->kbthe", self.norm1(x), self.qkv[...], out_sharding=P(None, data, None, model))
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k, out_sharding=P(data, model)) / jnp.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhe->bqhe", probs, v, out_sharding=P(data, None, model))
        x = x + jnp.einsum("bqhe,hed->bqd", y, self.out[...], out_sharding=P(data))
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", self.norm2(x), self.up[...], out_sharding=P(data, None, model)))
        return x + jnp.einsum("btf,fd->btd", h, self.down[...], out_sharding=P(data))


class TypedLM(nnx.Module):
    def __init__(self, vocab: int, d: int, heads: int, d_ff: int, layers: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (vocab, d)))
        self.blocks = nnx.List([TypedBlock(d, heads, d_ff, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Param(init(rngs.params(), (d, vocab)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        P = jax.sharding.PartitionSpec
        data = _axis("data")
        x = self.embed[...].at[tokens].get(out_sharding=P(data))
        t = tokens.shape[1]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jnp.einsum("btd,dv->btv", self.norm(x), self.head[...], out_sharding=P(data))


def typed_tiny(seed: int = 0) -> TypedLM:
    """A TypedLM as small as gpt_tiny (vocab 64, d_model 64, 4 heads, 2 layers). Its code names
    mesh axes, so it runs under a mesh context (``shardplan`` sets one for plans with explicit
    axes; plain JAX: ``jax.set_mesh``)."""
    return TypedLM(64, 64, 4, 256, 2, nnx.Rngs(seed))
