"""Sharded generation with fixed shapes: no compile per token, for any causal LM a plan places.

Two paths, chosen up front from what the model (or its adapter) offers (``Generator.mode``):

- ``cache`` (the model follows the KV-cache convention below): prompts are padded to the
  smallest length bucket that fits; one prefill compile per bucket fills a cache of fixed
  maximum length; each decode step feeds one token per sequence at its own position, one
  decode compile in all.
- ``plain`` (the model only maps ``tokens (batch, time) -> logits (batch, time, vocab)``): each
  step runs the whole buffer of fixed length ``bucket + max_new_tokens`` (a causal model's
  logits at a position never see the padding after it) and writes the next token in
  place: one compile per bucket, whatever the step.

A model with ``init_cache`` whose calls do not fit the convention is an error that names what is
missing, found with ``jax.eval_shape`` before anything compiles.

The KV-cache convention: ``model.init_cache(batch, max_len, dtype)`` returns the cache pytree
(leaves (batch, max_len, kv_heads, head_dim)), and ``model(tokens, positions, mask, cache) ->
(logits, cache)`` with tokens/positions (batch, time) and mask (batch, time, max_len), True where
a query may attend.

A model with its own call and cache takes a ``GenerationAdapter`` instead: ``forward(model,
tokens)`` for the plain path, or ``init_cache(model, batch, max_len)``, ``prefill(model, tokens,
cache)`` and ``decode(model, token, cache, position)`` over the model's own cache (any pytree, or
NNX objects whose Variables hold its arrays, written in place or returned anew). Both conventions
above are such adapters, built in. ``padding`` says where a prompt sits in its bucket: ``right``
(slot 0 on, each row then at its own position) or ``left`` (ending at the bucket's last slot,
every row at the same slot each step: a cache with one position counter for the batch). Each
decode step passes ``position`` (batch,), the slot the fed token takes. The adapter is checked
where it enters: its callables' parameters when it is made, their results with ``jax.eval_shape``
when the ``Generator`` is (``ArgumentError``, nothing compiled).

Placement follows the plan: params as resolved, prompt batches per the ``batch`` spec, and the
cache leaf by leaf: a leaf with at least as many dims as the plan's ``cache`` spec (or
``cache_spec=``) takes it; otherwise a (batch, max_len, kv_heads, head_dim) leaf is split over the batch axes on
dim 0 and, on dim 2, over the mesh axes that split the output dim of 2-D params whose output
width is kv_heads x head_dim (the key/value projections, found by shape, not by name) when
exactly one such split exists and the head count divides; any other leaf over the batch axes on
the dim that grows with the batch (found with ``jax.eval_shape`` at two batch sizes), or whole
(a position counter). Adapter calls are traced under the plan's mesh as the mesh context, so
model code that names mesh axes (``out_sharding=P(...)``) runs.
"""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import ArgumentError, Diagnostic, PlanApplyError, error
from shardplan.runtime.placement import Placement
from shardplan.runtime.specs import constrain, entry, pspec

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


Padding = Literal["left", "right"]

# What each adapter callable is called with (the module docstring says what each is).
SIGNATURES: dict[str, tuple[str, ...]] = {
    "forward": ("model", "tokens"),
    "init_cache": ("model", "batch", "max_len"),
    "prefill": ("model", "tokens", "cache"),
    "decode": ("model", "token", "cache", "position"),
}
CACHE_CALLS = ("init_cache", "prefill", "decode")
_PATHS = (
    "GenerationAdapter(forward=...) for the plain path, or GenerationAdapter(init_cache=..., prefill=..., "
    "decode=...) for the cache path"
)


@dataclass(frozen=True)
class GenerationAdapter:
    """How ``Generator`` calls a model with its own call and cache (see the module docstring).

    Args:
        forward: ``forward(model, tokens) -> logits`` (batch, time, vocab): the plain path.
        init_cache: ``init_cache(model, batch, max_len) -> cache``: a pytree of arrays, or NNX
            objects (their Variables are the cache).
        prefill: ``prefill(model, tokens, cache) -> (logits, cache)``, logits (batch, time, vocab).
        decode: ``decode(model, token, cache, position) -> (logits, cache)``: token (batch, 1),
            position (batch,) int32 (the slot the token takes); logits (batch, 1, vocab) or
            (batch, vocab).
        padding: ``"right"``: prompts start at slot 0, each row at its own position;
            ``"left"``: prompts end at the bucket's last slot, every row at the same slot (one
            position counter). Padded slots hold ``GenerationConfig.pad_token``.

    Raises:
        ArgumentError: neither path or both, a cache path missing a callable, a callable that
            cannot take its arguments, an unknown padding.
    """

    forward: Callable[[Any, jax.Array], Any] | None = None
    init_cache: Callable[[Any, int, int], Any] | None = None
    prefill: Callable[[Any, jax.Array, Any], Any] | None = None
    decode: Callable[[Any, jax.Array, Any, jax.Array], Any] | None = None
    padding: Padding = "right"

    def __post_init__(self):
        problems = adapter_problems(self)
        if problems:
            raise ArgumentError(problems)

    @property
    def mode(self) -> str:
        return "plain" if self.forward is not None else "cache"


def _bad_adapter(field_name: str, message: str, hint: str) -> Diagnostic:
    return error("bad-argument", message, hint, path=f"adapter.{field_name}" if field_name else "adapter")


def _takes(fn: Callable, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True where Python cannot tell)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        sig.bind(*range(n))
        return True
    except TypeError:
        return False


def _call(name: str) -> str:
    return f"{name}({', '.join(SIGNATURES[name])})"


def adapter_problems(adapter: GenerationAdapter) -> list[Diagnostic]:
    """Everything wrong with an adapter that shows without calling it."""
    given = [f for f in SIGNATURES if getattr(adapter, f) is not None]
    cache = [f for f in given if f in CACHE_CALLS]
    out = []
    if not given:
        out.append(_bad_adapter("", "the generation adapter has no callables", f"pass {_PATHS}"))
    elif "forward" in given and cache:
        out.append(
            _bad_adapter(
                "",
                f"the generation adapter gives forward (the plain path) and {', '.join(cache)} (the cache path)",
                f"give one path: {_PATHS}",
            )
        )
    elif cache and len(cache) < len(CACHE_CALLS):
        missing = [f for f in CACHE_CALLS if f not in cache]
        out.append(
            _bad_adapter(
                "",
                f"the cache path needs init_cache, prefill and decode; the adapter lacks {', '.join(missing)}",
                "pass " + ", ".join(f"{f}=<{_call(f)}>" for f in missing) + " (or forward= alone for the plain path)",
            )
        )
    for f in given:
        fn = getattr(adapter, f)
        if not callable(fn):
            out.append(_bad_adapter(f, f"{f} is a {type(fn).__name__}, not a function", f"pass a function {_call(f)}"))
        elif not _takes(fn, len(SIGNATURES[f])):
            name = getattr(fn, "__name__", type(fn).__name__)
            out.append(
                _bad_adapter(
                    f,
                    f"{f} ({name}{_signature(fn)}) cannot be called as {_call(f)}",
                    f"give it {len(SIGNATURES[f])} parameters: {', '.join(SIGNATURES[f])}",
                )
            )
    if adapter.padding not in ("left", "right"):
        out.append(
            _bad_adapter(
                "padding",
                f"padding {adapter.padding!r} is neither 'left' nor 'right'",
                "'right': prompts from slot 0, each row at its own position; 'left': prompts end together, one "
                "position counter for the batch",
            )
        )
    return out


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _attends(positions: jax.Array, max_len: int) -> jax.Array:
    """(batch, time, max_len): True where the query at ``positions`` may attend (causal)."""
    return jnp.arange(max_len)[None, None, :] <= positions[:, :, None]


def builtin_adapter(mode: str, max_len: int, dtype) -> GenerationAdapter:
    """The two conventions of the module docstring as adapters (right-padded, per-row positions)."""
    if mode == "plain":
        return GenerationAdapter(forward=lambda model, tokens: model(tokens))

    def prefill(model, tokens, cache):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return model(tokens, positions, _attends(positions, max_len), cache)

    def decode(model, token, cache, position):
        return model(token, position[:, None], _attends(position[:, None], max_len), cache)

    return GenerationAdapter(
        init_cache=lambda model, batch, n: model.init_cache(batch, n, dtype), prefill=prefill, decode=decode
    )


def _as_adapter(adapter: Any) -> GenerationAdapter:
    if not isinstance(adapter, GenerationAdapter):
        raise ArgumentError(
            [
                _bad_adapter(
                    "",
                    f"adapter is a {type(adapter).__name__}, not a shardplan.GenerationAdapter",
                    f"pass adapter={_PATHS}",
                )
            ]
        )
    return adapter


CacheDef = tuple[Any, Any]  # (the cache's nnx GraphDef, the treedef of its state): rebuilds it from leaves


def cache_def(model: Any, adapter: GenerationAdapter, batch: int, max_len: int) -> tuple[CacheDef, list]:
    """The cache ``adapter.init_cache`` makes for ``batch`` rows, abstractly: how to rebuild it
    from its leaves, and the leaves (ShapeDtypeStructs). Nothing runs."""
    init = adapter.init_cache
    assert init is not None
    gm, state = nnx.split(model)
    found: list[CacheDef] = []

    def build(s):  # split inside the trace: a pytree cache's leaves are arrays only there
        cdef, leaves = _take_apart(init(nnx.merge(gm, s), batch, max_len))
        found.append(cdef)
        return leaves

    leaves = jax.eval_shape(build, state)
    return found[0], leaves


def _rebuild(cdef: CacheDef, leaves: Sequence[jax.Array]) -> Any:
    return nnx.merge(cdef[0], jax.tree.unflatten(cdef[1], list(leaves)))


def _take_apart(cache: Any) -> tuple[CacheDef, list]:
    gd, state = nnx.split(cache)
    leaves, treedef = jax.tree.flatten(state)
    return (gd, treedef), leaves


def check_adapter(model: Any, adapter: GenerationAdapter, max_len: int, mesh, batch: int) -> None:
    """Trace each of the adapter's calls once with ``jax.eval_shape`` (nothing compiles) and check
    what it returns: logits (batch, time, vocab), and a cache shaped like ``init_cache``'s.
    ``batch``: the rows traced (the batch shard count, so model code may split them)."""
    gm, state = nnx.split(model)
    b = batch

    def traced(name: str, fn: Callable, *args):
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.eval_shape(fn, state, *args)
        except ArgumentError:
            raise
        except Exception as e:  # the adapter's (or the model's) own error, at trace time
            raise ArgumentError(
                [
                    _bad_adapter(
                        name,
                        f"calling the adapter's {_call(name)} failed: {type(e).__name__}: {str(e)[:300]}",
                        f"{name} is called as {_call(name)}; see GenerationAdapter's docstring",
                    )
                ]
            ) from None

    def logits_ok(name: str, out: Any, want: tuple[tuple[int, ...], ...]) -> None:
        shape = getattr(out, "shape", None)
        if shape is None or not any(tuple(shape[: len(w)]) == w and len(shape) == len(w) + 1 for w in want):
            got = jax.tree.map(lambda x: tuple(x.shape), out)
            raise ArgumentError(
                [
                    _bad_adapter(
                        name,
                        f"the adapter's {name} returned logits {got}, not "
                        + " or ".join(f"({', '.join(map(str, w))}, vocab)" for w in want),
                        "return the logits for every position fed (batch, time, vocab)",
                    )
                ]
            )

    tokens = jax.ShapeDtypeStruct((b, 2), jnp.int32)
    if adapter.forward is not None:
        forward = adapter.forward
        out = traced("forward", lambda s, t: forward(nnx.merge(gm, s), t), tokens)
        logits_ok("forward", out, ((b, 2),))
        return
    cdef, leaves = _init_shapes(model, adapter, max_len, b, mesh)
    prefill, decode = adapter.prefill, adapter.decode
    assert prefill is not None and decode is not None

    def pair(name: str, out: Any) -> Any:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ArgumentError(
                [
                    _bad_adapter(
                        name,
                        f"the adapter's {name} returned {_described(out)}, not (logits, cache)",
                        "return the cache beside the logits (the same object, if the model writes it in place)",
                    )
                ]
            )
        return out

    def run(name: str, fn: Callable) -> Callable:
        def body(s, x, cache_leaves, *rest):
            out = pair(name, fn(nnx.merge(gm, s), x, _rebuild(cdef, cache_leaves), *rest))
            got, new = _take_apart(out[1])
            if got != cdef:
                raise ArgumentError(
                    [
                        _bad_adapter(
                            name,
                            f"the cache the adapter's {name} returned is not shaped like init_cache's",
                            "return the cache init_cache made, written (or rebuilt with the same structure)",
                        )
                    ]
                )
            return out[0], new

        return body

    logits, new = traced("prefill", run("prefill", prefill), tokens, leaves)
    logits_ok("prefill", logits, ((b, 2),))
    _same_leaves("prefill", leaves, new)
    token = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    position = jax.ShapeDtypeStruct((b,), jnp.int32)
    logits, new = traced("decode", run("decode", decode), token, leaves, position)
    logits_ok("decode", logits, ((b, 1), (b,)))
    _same_leaves("decode", leaves, new)


def _described(out: Any) -> str:
    shape = getattr(out, "shape", None)
    return f"an array {tuple(shape)}" if shape is not None else f"a {type(out).__name__}"


def _init_shapes(model: Any, adapter: GenerationAdapter, max_len: int, batch: int, mesh) -> tuple[CacheDef, list]:
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            cdef, leaves = cache_def(model, adapter, batch, max_len)
    except Exception as e:
        raise ArgumentError(
            [
                _bad_adapter(
                    "init_cache",
                    f"calling the adapter's {_call('init_cache')} failed: {type(e).__name__}: {str(e)[:300]}",
                    "init_cache(model, batch, max_len) returns the cache: a pytree of arrays or NNX objects",
                )
            ]
        ) from None
    if not leaves:
        raise ArgumentError(
            [_bad_adapter("init_cache", "the adapter's init_cache returned no arrays", "return the cache's arrays")]
        )
    return cdef, leaves


def _same_leaves(name: str, before: Sequence, after: Sequence) -> None:
    diff = [
        (a.shape, a.dtype, b.shape, b.dtype) for a, b in zip(before, after) if (a.shape, a.dtype) != (b.shape, b.dtype)
    ]
    if diff:
        (s0, d0, s1, d1) = diff[0]
        raise ArgumentError(
            [
                _bad_adapter(
                    name,
                    f"the adapter's {name} changed a cache array from {s0} {d0} to {s1} {d1}",
                    "write into the fixed-length cache (e.g. jax.lax.dynamic_update_slice); keep its shapes and dtypes",
                )
            ]
        )


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
    return P(entry(batch), None, entry(heads), None)


def _batch_dim(small: Any, large: Any, n: int) -> int | None:
    """The dim of a cache leaf that is n at batch n and 2n at batch 2n (none: not per row)."""
    return next((i for i, (a, b) in enumerate(zip(small.shape, large.shape)) if (a, b) == (n, 2 * n)), None)


def _typed_spec(leaf: Any) -> P | None:
    """The spec a leaf's type carries when the model made it with explicit mesh axes
    (``jnp.zeros(..., out_sharding=...)`` under an explicit mesh), else None."""
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(e is None for e in spec):
        return None
    return P(*spec)


def cache_layout(
    placement: Placement, small: Sequence, large: Sequence, n: int, max_len: int, cache_spec: P | None
) -> tuple[list[P], str]:
    """A PartitionSpec per cache leaf (module docstring), from the leaves at batch n and 2n, and
    where the layout comes from."""
    plan = placement.plan
    explicit: Callable[[int], P | None] | None = None
    if cache_spec is not None:
        given = cache_spec
        explicit = lambda rank: given if len(given) <= rank else None
        origin = "cache_spec= argument"
    elif plan.cache is not None:
        spec = plan.cache

        def explicit(rank: int) -> P | None:
            concrete = spec.for_rank(rank) if spec.open else spec if len(spec.dims) <= rank else None
            return None if concrete is None else pspec(concrete)

        span = plan.cache_span
        origin = f"the plan's cache statement ({span.file}:{span.line})" if span else "the plan"
    else:
        origin = "inferred: batch axes, and the split of the params as wide as kv_heads x head_dim"
    batch = entry(plan.batch_dim0_axes)
    out = []
    typed = 0
    for a, b in zip(small, large):
        rank, dim = len(a.shape), _batch_dim(a, b, n)
        spec_ = explicit(rank) if explicit is not None else None
        if spec_ is None and explicit is None:
            spec_ = _typed_spec(a)  # the model typed it with explicit axes: its own layout
            typed += spec_ is not None
        if spec_ is None and explicit is None and rank == 4 and dim == 0 and a.shape[1] == max_len:
            spec_ = cache_spec_for(placement, a.shape[2], a.shape[3])
        if spec_ is None:
            spec_ = P(*[batch if i == dim else None for i in range(rank)]) if dim is not None else P()
        out.append(spec_)
    if typed:
        origin = "the model's own types (explicit mesh axes)" + (
            "" if typed == len(out) else f" for {typed} of {len(out)} leaves; the rest {origin}"
        )
    return out, origin


def _not_causal_lm(message: str, hint: str) -> PlanApplyError:
    return PlanApplyError([error("not-a-causal-lm", message, hint, path="model")])


def _fits(fn: Callable, *args) -> bool:
    try:
        inspect.signature(fn).bind(*args)
        return True
    except (TypeError, ValueError):
        return False


def convention(
    model: Any, max_len: int, dtype=jnp.float32, *, cache_layout_given: bool = False, mesh=None, batch: int = 1
) -> str:
    """``"cache"`` or ``"plain"`` (module docstring), checked with ``jax.eval_shape``: nothing
    compiles. A model that half-follows the cache convention is an error naming what is missing.
    ``mesh``: the mesh context to trace under; ``batch``: the rows traced.
    """
    gd, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((batch, 2), jnp.int32)

    def under_mesh(fn, *args):
        if mesh is None:
            return jax.eval_shape(fn, *args)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.eval_shape(fn, *args)

    def run(fn, *args):
        try:
            return under_mesh(fn, state, *args)
        except Exception as e:  # the model's own error, at trace time
            raise _not_causal_lm(
                f"calling {type(model).__name__} for generation failed: {type(e).__name__}: {str(e)[:300]}",
                "follow the call convention (README: Generate with a sharded model), or pass adapter="
                "GenerationAdapter(...) saying how to call the model",
            ) from None

    init = getattr(model, "init_cache", None)
    if init is None:
        if not _fits(model.__call__, tokens):
            raise _not_causal_lm(
                f"{type(model).__name__} has no init_cache and cannot be called as model(tokens)",
                "pass adapter=GenerationAdapter(forward=lambda model, tokens: <logits (batch, time, vocab)>), or "
                "GenerationAdapter(init_cache=..., prefill=..., decode=...) over the model's own cache",
            )
        out = run(lambda s, t: nnx.merge(gd, s)(t), tokens)
        if not (hasattr(out, "shape") and len(out.shape) == 3 and out.shape[:2] == (batch, 2)):
            raise _not_causal_lm(
                f"{type(model).__name__}(tokens) returned {jax.tree.map(lambda x: x.shape, out)}, not logits "
                "(batch, time, vocab)",
                "return the logits for every position",
            )
        return "plain"
    if not callable(init) or not _fits(init, batch, max_len, dtype):
        raise _not_causal_lm(
            f"{type(model).__name__}.init_cache does not take (batch, max_len, dtype)",
            "define init_cache(self, batch, max_len, dtype) returning the cache pytree",
        )
    cache = run(lambda s: nnx.merge(gd, s).init_cache(batch, max_len, dtype))
    positions = jax.ShapeDtypeStruct((batch, 2), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, 2, max_len), jnp.bool_)
    if not _fits(model.__call__, tokens, positions, mask, cache):
        raise _not_causal_lm(
            f"{type(model).__name__} has init_cache, but its __call__ does not take (tokens, positions, mask, cache)",
            "give __call__ the cache convention, or pass adapter=GenerationAdapter(init_cache=..., prefill=..., "
            "decode=...) saying how to call it",
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
        adapter: how to call a model with its own call and cache (``GenerationAdapter``);
            without it the model follows one of the conventions above.
        cache_spec: PartitionSpec for the cache's leaves (default: from the plan, see above).
        cache_dtype: the cache's dtype (the convention's ``init_cache``; an adapter picks its own).

    Raises:
        ArgumentError: an adapter that is not a ``GenerationAdapter`` or whose calls do not
            return what they should.
        PlanApplyError: no adapter, and the model follows neither convention.
    """

    def __init__(
        self,
        placement: Placement,
        model: Any,
        config: GenerationConfig,
        *,
        adapter: GenerationAdapter | None = None,
        cache_spec: P | None = None,
        cache_dtype=jnp.float32,
    ):
        _count_compiles()
        self.placement = placement
        self.config = config
        self.gm = nnx.graphdef(model)
        self.model = model
        self.cache_dtype = cache_dtype
        mesh = placement.mesh
        self.batch_axes = tuple(placement.plan.batch_dim0_axes)
        if adapter is None:
            given = cache_spec is not None
            self.mode = convention(
                model, config.max_len, cache_dtype, cache_layout_given=given, mesh=mesh, batch=self._shards()
            )
            self.adapter = builtin_adapter(self.mode, config.max_len, cache_dtype)
        else:
            self.adapter = _as_adapter(adapter)
            self.mode = self.adapter.mode
            check_adapter(model, self.adapter, config.max_len, mesh, self._shards())
        self.padding: Padding = self.adapter.padding
        batch_entry = entry(self.batch_axes)
        self.cache_specs: list[P] = []
        if self.mode == "cache":
            n = self._shards()
            _, small = _init_shapes(model, self.adapter, config.max_len, n, mesh)
            _, large = _init_shapes(model, self.adapter, config.max_len, 2 * n, mesh)
            self.cache_specs, self.cache_origin = cache_layout(placement, small, large, n, config.max_len, cache_spec)
            top = max(len(x.shape) for x in small)
            self.cache_spec = next(s for s, x in zip(self.cache_specs, small) if len(x.shape) == top)
        else:
            self.cache_spec = P()
            self.cache_origin = "no cache (plain path)"
        self.cache_shardings = [NamedSharding(mesh, s) for s in self.cache_specs]
        self.cache_sharding = NamedSharding(mesh, self.cache_spec)  # the cache's k/v arrays (highest rank)
        self.batch_sharding = NamedSharding(mesh, P(batch_entry))
        self.batch_sharding_2d = NamedSharding(mesh, P(batch_entry, None))
        self._cache_defs: dict[int, CacheDef] = {}
        if self.mode == "cache":
            out = (self.batch_sharding, self.cache_shardings)
            self._prefill = jax.jit(self._prefill_fn(), out_shardings=out, static_argnums=(4,))
            self._decode = jax.jit(self._decode_fn(), out_shardings=out, static_argnums=(5,), donate_argnums=(3,))
        else:
            self._forward = jax.jit(
                self._forward_fn(), out_shardings=(self.batch_sharding, self.batch_sharding_2d), donate_argnums=(1,)
            )

    def _shards(self) -> int:
        """How many blocks the plan cuts the batch into."""
        return math.prod(self.placement.mesh_shape[a] for a in self.batch_axes)

    def _cache_def(self, batch: int) -> CacheDef:
        if batch not in self._cache_defs:
            self._cache_defs[batch] = _init_shapes(
                self.model, self.adapter, self.config.max_len, batch, self.placement.mesh
            )[0]
        return self._cache_defs[batch]

    def _under_mesh(self):
        """The plan's mesh as the mesh context while the model is traced (model code may name its axes)."""
        return jax.sharding.use_abstract_mesh(self.placement.mesh.abstract_mesh)

    # -- the jitted programs -----------------------------------------------------------------
    def _prefill_fn(self) -> Callable:
        gm, cfg, shardings, adapter, mesh = self.gm, self.config, self.cache_shardings, self.adapter, self._under_mesh
        init, prefill = adapter.init_cache, adapter.prefill
        assert init is not None and prefill is not None

        def shardplan_prefill(state, tokens, position, key, cdef):
            model = nnx.merge(gm, state)
            with mesh():
                _, leaves = _take_apart(init(model, tokens.shape[0], cfg.max_len))
                leaves = [constrain(x, s) for x, s in zip(leaves, shardings)]
                logits, cache = prefill(model, tokens, _rebuild(cdef, leaves))
            last = jnp.take_along_axis(logits, (position - 1)[:, None, None], axis=1)[:, 0]
            return sample(last, key, cfg.temperature, cfg.top_k), _take_apart(cache)[1]

        return shardplan_prefill

    def _forward_fn(self) -> Callable:
        gm, cfg, forward, mesh = self.gm, self.config, self.adapter.forward, self._under_mesh
        assert forward is not None

        def shardplan_forward(state, buf, position, key):
            model = nnx.merge(gm, state)
            with mesh():
                logits = forward(model, buf)
            last = jnp.take_along_axis(logits, (position - 1)[:, None, None], axis=1)[:, 0]
            tok = sample(last, key, cfg.temperature, cfg.top_k)
            hit = jnp.arange(buf.shape[1])[None, :] == position[:, None]
            return tok, jnp.where(hit, tok[:, None], buf)

        return shardplan_forward

    def _decode_fn(self) -> Callable:
        gm, cfg, decode, mesh = self.gm, self.config, self.adapter.decode, self._under_mesh
        assert decode is not None

        def shardplan_decode(state, token, position, cache, key, cdef):
            model = nnx.merge(gm, state)
            with mesh():
                logits, cache = decode(model, token[:, None], _rebuild(cdef, cache), position)
            last = logits[:, -1] if logits.ndim == 3 else logits
            return sample(last, key, cfg.temperature, cfg.top_k), _take_apart(cache)[1]

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
        n = self._shards()
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
        tokens, position = pad_prompts(prompts, bucket, cfg.pad_token, self.padding)
        state = nnx.state(self.model)
        if self.mode == "plain":
            return self._generate_plain(state, tokens, position, key, before, bucket, on_token)
        cdef = self._cache_def(b)
        tok, cache = self._prefill(
            state,
            jax.device_put(tokens, self.batch_sharding_2d),
            jax.device_put(position, self.batch_sharding),
            jax.random.fold_in(key, 0),
            cdef,
        )
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        for step in range(cfg.max_new_tokens):
            _collect(np.asarray(tok), out, done, cfg.end_token)
            if on_token is not None:
                on_token(step, np.asarray(tok))
            if done.all() or step == cfg.max_new_tokens - 1:
                break
            tok, cache = self._decode(
                state,
                tok,
                jax.device_put(position, self.batch_sharding),
                cache,
                jax.random.fold_in(key, step + 1),
                cdef,
            )
            position = position + 1
        return Generation(out, bucket, _compiles_since(before), self.mode)

    def _generate_plain(self, state, tokens, start, key, before, bucket, on_token) -> Generation:
        cfg = self.config
        b = len(start)
        buf = np.full((b, bucket + cfg.max_new_tokens), cfg.pad_token, np.int32)
        buf[:, :bucket] = tokens
        buf_dev = jax.device_put(buf, self.batch_sharding_2d)
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        position = start.copy()
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


def pad_prompts(
    prompts: Sequence[Sequence[int]], bucket: int, pad_token: int, padding: Padding
) -> tuple[np.ndarray, np.ndarray]:
    """Prompts in a (batch, bucket) array, right- or left-padded, and each row's first free slot
    (its length, or the bucket for every row)."""
    tokens = np.full((len(prompts), bucket), pad_token, np.int32)
    for i, p in enumerate(prompts):
        if padding == "left":
            tokens[i, bucket - len(p) :] = p
        else:
            tokens[i, : len(p)] = p
    if padding == "left":
        return tokens, np.full(len(prompts), bucket, np.int32)
    return tokens, np.array([len(p) for p in prompts], np.int32)


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
    adapter: GenerationAdapter | None = None,
) -> Generation:
    """One-shot helper: ``Generator(placement, model, config, adapter=adapter).generate(prompts, key=key)``."""
    return Generator(placement, model, config, adapter=adapter).generate(prompts, key=key)
