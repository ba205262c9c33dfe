"""shardplan's benchmarks, measured side by side with the plain-JAX way in one run.

    python -m benchmarks            # full run: prints the table, writes docs/benchmarks.md + .png
    python -m benchmarks --quick    # CI: small sizes, runs every measurement once
    python -m benchmarks --quick --only steps,cost   # some sections (SECTIONS below)

Each line prints a ratio with its target and whether it was met. A target is a timing (machine-
and load-dependent, meaningless at quick mode's sizes) or deterministic (bytes, counts, errors
against a compiled program): quick mode must meet every deterministic one (tests/test_benchmarks.py).
Runs on 8 simulated CPU devices unless --devices 0 (the real devices).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup(devices: int) -> None:
    sys.path.insert(0, str(ROOT))
    if devices:
        from shardplan.runtime.devices import simulate

        simulate(devices)


def block(tree):
    import jax

    jax.block_until_ready(tree)
    return tree


# -- 2. apply --------------------------------------------------------------------------------
def bench_apply(quick: bool) -> dict:
    import jax
    import numpy as np

    import shardplan
    from benchmarks.resolution import best_of
    from shardplan import place

    n, shape = (200, (64, 256)) if quick else (2000, (256, 512))  # full: 2,000 x 512 KiB = 1 GiB
    rng = np.random.default_rng(0)
    tree = {"layers": {str(i): {"w": rng.standard_normal(shape, dtype=np.float32)} for i in range(n)}}
    plan = shardplan.loads('mesh data = *\nparam ".*" (data)\n', "apply.splan")
    mesh = shardplan.make_mesh(plan)
    shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")), tree)
    repeat = 2 if quick else 5
    block(jax.device_put(tree, shardings))  # warm up transfers
    t_jax = best_of(lambda: block(jax.device_put(tree, shardings)), repeat)
    t_ours = best_of(lambda: block(place(plan, tree, mesh)), repeat)
    nbytes = n * int(np.prod(shape)) * 4
    return {"leaves": n, "bytes": nbytes, "device_put_s": t_jax, "shardplan_s": t_ours, "ratio": t_ours / t_jax}


# -- 3. training step -------------------------------------------------------------------------
PINNED = ("gpt_2d.splan", "llama_scan_2d.splan")  # plans that pin the residual stream (act + axis rules)


def pinned_residual(loss_fn, mesh):
    """The plain-JAX way of what the 2-D plans' activation rules do: a sharding constraint on the
    output of the model's ``embed`` module (the batch split over `data`), and Flax's logical-axis
    rules under the mesh for models that constrain logical names."""
    import jax
    from flax import linen as nn
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rules = [("activation_batch", "data"), ("activation_length", None), ("activation_embed", None)]

    def loss(model, batch):
        embed = model.embed
        cls = type(embed)
        orig = cls.__call__

        def call(self, *a, **k):
            out = orig(self, *a, **k)
            return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P("data"))) if self is embed else out

        cls.__call__ = call
        try:
            with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return loss_fn(model, batch)
        finally:
            cls.__call__ = orig

    return loss


def _step_setup(plan_name: str, backend: str, cfg, batch: int, devices=None, hand=False):
    import jax
    import numpy as np
    from flax import nnx

    import shardplan
    from examples import train as example

    plan, mesh, placement, template = _initial(plan_name, cfg, devices is not None and len(devices) == 1)
    # Each variant trains its own copy (the steps donate their state); one init serves them all.
    model, optimizer = (nnx.merge(nnx.graphdef(x), jax.device_put(nnx.state(x), sh, may_alias=False))
                        for x, sh in zip(template, (placement.model_shardings(), placement.opt_shardings())))
    data = example.synthetic_batch(np.random.default_rng(0), cfg.vocab, batch, cfg.max_len)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend=backend)
    if not hand:
        placed = step.place(data)
        return lambda: step.fn(nnx.state(model), nnx.state(optimizer), placed), step, model, optimizer, data
    # By hand: the plain NNX step, NamedShardings built from the spec trees directly.
    sh_m, sh_o = placement.model_shardings(), placement.opt_shardings()
    loss = pinned_residual(example.lm_loss, mesh) if plan_name in PINNED else example.lm_loss
    gm, go = nnx.graphdef(model), nnx.graphdef(optimizer)

    def pure_step(sm, so, batch):
        m, o = nnx.merge(gm, sm), nnx.merge(go, so)
        value, grads = nnx.value_and_grad(loss)(m, batch)
        o.update(m, grads)
        return nnx.state(m), nnx.state(o), value

    fn = jax.jit(pure_step,
                 out_shardings=(sh_m, sh_o, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
                 donate_argnums=(0, 1))
    batch_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*plan.batch.dims[0][:1] or (None,)))
    placed = jax.device_put(data, batch_sh)
    return lambda: fn(nnx.state(model), nnx.state(optimizer), placed), fn, model, optimizer, data


@functools.cache
def _initial(plan_name: str, cfg, one_device: bool):
    """The plan, its mesh (8 devices, or 1 with every axis of size 1), its placement and the model
    and AdamW optimizer built under it by `shardplan.init_sharded`, once per (plan, config, mesh):
    each init compiles (seconds even for the tiny models), and the variants start from one state."""
    import jax
    import optax
    from flax import nnx

    import shardplan
    from examples import models

    plan = shardplan.load(ROOT / "plans" / plan_name)
    if one_device:
        plan = shardplan.with_mesh(plan, {a: 1 for a in plan.axis_names})
    mesh = shardplan.make_mesh(plan, devices=jax.devices()[:1] if one_device else None)
    family = models.Llama if isinstance(cfg, models.LlamaConfig) else models.GPT
    model, optimizer, placement = shardplan.init_sharded(plan, lambda: family(cfg, nnx.Rngs(0)),
                                                         optax.adamw(1e-3), mesh=mesh)
    return plan, mesh, placement, (model, optimizer)


def _time_steps(setups: list, steps: int, repeat: int) -> list[float]:
    """Seconds per step for each setup, measured in interleaved rounds (so drift in the
    machine's speed hits every variant alike); the best round of each is kept."""
    from flax import nnx

    def run_steps(setup, k):
        run, _, model, optimizer, _ = setup
        loss = None
        for _ in range(k):
            sm, so, loss = run()
            nnx.update(model, sm)
            nnx.update(optimizer, so)
        block(loss)

    for setup in setups:
        run_steps(setup, 1)  # compile
    best = [float("inf")] * len(setups)
    for _ in range(repeat):
        for i, setup in enumerate(setups):
            t = time.perf_counter()
            run_steps(setup, steps)
            best[i] = min(best[i], (time.perf_counter() - t) / steps)
    return best


def _peak_checked(plan: str) -> bool:
    """Plans whose step rows check peak memory (shard_map against auto): FSDP and 2-D."""
    return "fsdp" in plan or "2d" in plan


def _gpt_config(quick: bool):
    from examples import models

    return models.TINY if quick else models.GPTConfig(vocab=256, d_model=128, n_heads=8, d_ff=512, n_layers=4,
                                                      max_len=64)


def bench_steps(quick: bool) -> dict:
    from examples import models

    cfg = _gpt_config(quick)
    steps, repeat = (1, 1) if quick else (10, 5)
    llama = models.LLAMA_TINY if quick else models.LLAMA_SMALL
    llama_scan = models.LlamaConfig(**{**llama.__dict__, "scan_layers": True})
    # Quick mode (CI) proves each measurement runs, once: one row, of the kind whose every branch
    # runs (a pinned residual by hand, peaks measured).
    if quick:
        pairs = [("gpt", cfg, "gpt_2d.splan")]
    else:
        pairs = [("gpt", cfg, p) for p in ("dp.splan", "fsdp.splan", "gpt_tp.splan", "gpt_2d.splan")]
        pairs += [("llama", llama, p) for p in ("dp.splan", "fsdp.splan", "llama_tp.splan")]
        pairs += [("llama scanned", llama_scan, p) for p in ("fsdp_any_rank.splan", "llama_scan_2d.splan")]
    rows = []
    for family, c, plan in pairs:
        setups = [_step_setup(plan, "auto", c, 32), _step_setup(plan, "auto", c, 32, hand=True),
                  _step_setup(plan, "shard_map", c, 32)]
        t_auto, t_hand, t_sm = _time_steps(setups, steps, repeat)
        mem = {"auto": None, "shard_map": None}
        if not quick or _peak_checked(plan):  # quick mode measures the peaks its checks read
            for name, setup in (("auto", setups[0]), ("shard_map", setups[2])):
                _, step, model, optimizer, data = setup
                mem[name] = _peak(step.lower(model, optimizer, data).compile())
        rows.append({"plan": plan, "model": family, "auto_ms": 1e3 * t_auto, "hand_ms": 1e3 * t_hand,
                     "shard_map_ms": 1e3 * t_sm, "auto_vs_hand": t_auto / t_hand, "shard_map_vs_auto": t_sm / t_auto,
                     "auto_peak": mem["auto"], "shard_map_peak": mem["shard_map"],
                     "peak_ratio": mem["shard_map"] / mem["auto"] if mem["auto"] else None})
    return {"plans": rows, "config": cfg.__dict__, "llama_config": llama.__dict__}


def bench_fsdp_llama(quick: bool) -> dict:
    """The Llama under FSDP (scanned layers, each param split over `data`): the partitioned step's
    peak vs the gather-whole lowering it replaced; one sequence per device (weights dominate, as
    in large models) and the step rows' batch 32 (activations weigh more). Quick mode compiles
    the full run's model at batch 8 (the row its check reads; the tiny Llama's weights are too
    small to dominate: 0.52x there)."""
    from examples import models
    from shardplan.runtime.backends import shard_map as sm_backend

    llama_scan = models.LlamaConfig(**{**models.LLAMA_SMALL.__dict__, "scan_layers": True})
    out = {}
    for batch in (8,) if quick else (8, 32):
        _, step, model, optimizer, data = _step_setup("fsdp_any_rank.splan", "shard_map", llama_scan, batch)
        placed = step.place(data)
        whole = sm_backend.gather_whole_step(step.placement, example_loss(), model, optimizer, placed)
        whole_peak = _peak(whole.lower(nnx_state(model), nnx_state(optimizer), placed).compile())
        part = _peak(step.lower(model, optimizer, data).compile())
        out[str(batch)] = {"partitioned_peak": part, "gather_whole_peak": whole_peak, "ratio": part / whole_peak}
    return out


def bench_scaling(quick: bool) -> list[dict]:
    """The data-parallel step on 8 devices vs 1, by global batch size."""
    import jax

    cfg, (steps, repeat) = _gpt_config(quick), ((1, 1) if quick else (10, 5))
    scaling = []
    for batch in ((8,) if quick else (8, 32, 128, 512)):
        big = batch >= 512
        t8, t1 = _time_steps([_step_setup("dp.splan", "auto", cfg, batch),
                              _step_setup("dp.splan", "auto", cfg, batch, devices=jax.devices()[:1])],
                             3 if big else steps, 2 if big else repeat)
        scaling.append({"batch": batch, "ms_8": 1e3 * t8, "ms_1": 1e3 * t1, "speedup_8_vs_1": t1 / t8})
    return scaling


def _peak(compiled) -> int:
    """Per-device peak bytes: XLA:CPU's peak_memory_in_bytes leaves temporaries out, so arguments +
    outputs - aliased + temporaries (as exact mode reads it)."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def example_loss():
    from examples import train as example

    return example.lm_loss


def nnx_state(x):
    from flax import nnx

    return nnx.state(x)


# -- 4. cost model accuracy -------------------------------------------------------------------
def bench_cost_model(quick: bool) -> list[dict]:
    import numpy as np
    import optax
    from flax import nnx

    import shardplan
    from examples import models
    from examples import train as example
    from shardplan.core import cost, hlo

    rows = []
    base = models.TINY if quick else models.SMALL
    # Quick: a 2-D plan (every kind of collective) and the logical one (the annotated model).
    names = ("dp.splan", "fsdp.splan", "gpt_tp.splan", "gpt_2d.splan", "gpt_logical.splan")
    for plan_name in names[3:] if quick else names:
        plan = shardplan.load(ROOT / "plans" / plan_name)
        cfg = base.__class__(**{**base.__dict__, "annotate": "logical" in plan_name})
        build = lambda cfg=cfg: models.GPT(cfg, nnx.Rngs(0))
        model, optimizer, placement = shardplan.init_sharded(plan, build, optax.adam(1e-3))
        predicted_state = placement.params.bytes_per_device() + placement.opt.bytes_per_device()
        predicted_comm = cost.communication(plan, placement.params)["totals"]
        data = example.synthetic_batch(np.random.default_rng(0), model.cfg.vocab, 32, model.cfg.max_len)
        step = shardplan.train_step(placement, example.lm_loss, model, optimizer, backend="shard_map")
        compiled = step.lower(model, optimizer, data).compile()
        mem = compiled.memory_analysis()
        placed = step.place(data)
        batch_bytes = sum(int(np.prod(s.data.shape)) * s.data.dtype.itemsize
                          for leaf in placed.values() for s in leaf.addressable_shards[:1])
        # memory_analysis counts per-device argument buffers (state + this device's batch slice).
        measured_state = mem.argument_size_in_bytes - batch_bytes
        # The specs-only figure describes the gather-whole lowering (shardplan lower's module): its
        # compiled step is what it predicts. The partitioned shard_map step: its record vs XLA's.
        from shardplan.runtime.backends import shard_map as sm_backend

        whole = sm_backend.gather_whole_step(placement, example.lm_loss, model, optimizer, placed)
        got = hlo.report(whole.lower(nnx.state(model), nnx.state(optimizer), placed).compile())
        measured_comm = sum(got[k]["bytes"] for k in ("all-reduce", "all-gather", "reduce-scatter"))
        predicted_total = sum(predicted_comm.values())
        part = hlo.report(compiled)
        record = step.fn.record(placed).summary()
        rows.append({"plan": plan_name, "predicted_state": predicted_state, "measured_state": measured_state,
                     "state_error": abs(measured_state - predicted_state) / predicted_state,
                     "predicted_comm": predicted_total, "measured_comm": measured_comm,
                     "comm_error": abs(measured_comm - predicted_total) / max(predicted_total, 1),
                     "partitioned_predicted": {k: v["bytes"] for k, v in record.items() if v["bytes"]},
                     "partitioned_compiled": {k: v["bytes"] for k, v in part.items() if v["bytes"]}})
    return rows


# -- 5. generation ----------------------------------------------------------------------------
def bench_generation(quick: bool) -> dict:
    import numpy as np
    from flax import nnx

    import shardplan
    from examples import models
    from shardplan import GenerationConfig, Generator

    cfg = models.GPTConfig(max_len=64)
    plan = shardplan.load(ROOT / "plans" / "gpt_tp.splan")
    model, _, placement = shardplan.init_sharded(plan, lambda: models.GPT(cfg, nnx.Rngs(0)), None)
    new = 2 if quick else 32  # quick: a prefill, then decode steps (and 4 naive compiles, not 160)
    rng = np.random.default_rng(0)
    lengths = (3, 5) if quick else (3, 5, 8, 11, 16)
    batches = [[list(map(int, rng.integers(1, cfg.vocab, size=n))) for _ in range(8)] for n in lengths]

    gen = Generator(placement, model, GenerationConfig(max_len=64, buckets=(8, 16), max_new_tokens=new))
    t = time.perf_counter()
    compiles: dict[str, int] = {}
    for b in batches:
        for name, n in gen.generate(b).compiles.items():
            compiles[name] = compiles.get(name, 0) + n
    t_padded = time.perf_counter() - t

    t_naive = _naive_generation_s(model, batches, new)
    tokens = len(batches) * 8 * new
    return {"tokens": tokens, "padded_tok_s": tokens / t_padded, "naive_tok_s": tokens / t_naive,
            "speedup": t_naive / t_padded, "prompt_lengths": list(lengths), "new_tokens": new, "compiles": compiles,
            "llama": _bench_generation_paths(batches, new)}


def _naive_generation_s(model, batches, new: int) -> float:
    """Seconds for the naive loop: no cache, no padding, the whole sequence each step (a new
    shape, so a compile, per length)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    gm, state = nnx.graphdef(model), nnx.state(model)
    forward = jax.jit(lambda st, seq: nnx.merge(gm, st)(seq)[:, -1].argmax(-1))
    t = time.perf_counter()
    for b in batches:
        seq = jnp.asarray(b, jnp.int32)
        for _ in range(new):
            seq = jnp.concatenate([seq, forward(state, seq)[:, None].astype(jnp.int32)], axis=1)
        block(seq)
    return time.perf_counter() - t


def _bench_generation_paths(batches, new: int) -> dict:
    """Both generation paths on the Llama (the same params: `llama_tiny` has no cache, so it takes
    the plain path; `llama_tiny_cached` the cache path) under plans/llama_tp.splan, against the
    naive loop (a new shape, and compile, per length). Compile time included in every rate."""

    import shardplan
    from examples import models
    from shardplan import GenerationConfig, Generator

    plan = shardplan.load(ROOT / "plans" / "llama_tp.splan")
    out, models_ = {}, {}
    for name, factory in (("plain", models.llama_tiny), ("cache", models.llama_tiny_cached)):
        model, _, placement = shardplan.init_sharded(plan, lambda f=factory: f(0), None)
        models_[name] = model
        gen = Generator(placement, model, GenerationConfig(max_len=16 + new, buckets=(8, 16), max_new_tokens=new))
        assert gen.mode == name
        compiles: dict[str, int] = {}
        t = time.perf_counter()
        for b in batches:
            for k, n in gen.generate(b).compiles.items():
                compiles[k] = compiles.get(k, 0) + n
        out[f"{name}_s"] = time.perf_counter() - t
        out[f"{name}_compiles"] = {k: v for k, v in compiles.items() if "shardplan_" in k}
    naive_s = _naive_generation_s(models_["plain"], batches, new)  # generating leaves the params as they were
    tokens = len(batches) * 8 * new
    return {"tokens": tokens, "naive_tok_s": tokens / naive_s,
            **{f"{k}_tok_s": tokens / out[f"{k}_s"] for k in ("plain", "cache")},
            **{f"{k}_vs_naive": naive_s / out[f"{k}_s"] for k in ("plain", "cache")},
            "compiles": {k: out[f"{k}_compiles"] for k in ("plain", "cache")}}


# -- 6. step cost: fast mode vs exact mode -----------------------------------------------------
def _factory(family: str, plan: str, quick: bool) -> str:
    size = "tiny" if quick else "small"
    if family == "gpt":
        return f"gpt_{size}_annotated" if "logical" in plan else f"gpt_{size}"
    return f"llama_{size}_scan" if "scan" in plan else f"llama_{size}"


def bench_step_cost(quick: bool) -> dict:
    """Fast mode (jaxpr) against exact mode (XLA's compiled program), auto backend, 8 devices:
    every plan in plans/ x both model families (GPT, Llama)."""
    import shardplan

    # the MoE plans' rows are benchmarks/moe.py's (section 13), on the MoE model; the pipeline plans'
    # benchmarks/pipeline.py's (section 14), on a scanned Llama deep enough for them
    plans = ["gpt_tp.splan"] if quick else sorted(p.name for p in (ROOT / "plans").glob("*.splan")
                                                  if not p.name.startswith("moe") and "_pp" not in p.name)
    seq = 16 if quick else 32
    batch = [f"tokens=int32[32,{seq}],labels=int32[32,{seq}]"]
    rows = []
    for plan in plans:
        for family in ("gpt", "llama"):
            rows.append(_fast_vs_exact(plan, _factory(family, plan, quick), batch, "cpu"))
    # Per target compiler installed here (the test extra brings XLA:TPU; XLA:GPU with
    # 'shardplan[gpu]'): fast mode told the target against that compiler's program, on the small
    # models (XLA:TPU pads dims under 128 to its tiles, which fast mode does not count).
    tplans = ["dp.splan", "fsdp.splan", "gpt_tp.splan", "gpt_2d.splan", "llama_tp.splan"]
    batch = ["tokens=int32[32,32],labels=int32[32,32]"]
    for target in [] if quick else _installed_targets(every_generation=True):
        for plan in tplans:
            for family in ("gpt", "llama"):
                rows.append(_fast_vs_exact(plan, f"{family}_small", batch, target))
    # Models wide enough that what a compiler holds for the backward pass shows in its peak (the
    # small models' peaks are set by XLA:GPU's split-matmul workspaces and XLA:TPU's tiles and
    # on-chip memory). Quick mode: one row per target compiler installed here, each the cheapest
    # to compile of those its rules were measured on (XLA:TPU: gpt_tp on gpt_small, 7 s; XLA:GPU:
    # fsdp on swiglu_wide, 6 s; XLA:TPU takes 45 s for that one).
    wide = ROOT / "tests" / "fixtures" / "wide_models.py"
    wide_batch = ["tokens=int32[32,256],labels=int32[32,256]"]
    if quick:
        for target in _installed_targets():
            if target.startswith("tpu"):
                rows.append(_fast_vs_exact("gpt_tp.splan", "gpt_small", batch, target))
            else:
                rows.append(_fast_vs_exact("fsdp.splan", "swiglu_wide", wide_batch, target,
                                           model_ref=f"{wide}:swiglu_wide", step=f"{wide}:loss"))
        return {"rows": rows}
    # The same plans at 16x the tokens (256 x 64): rules tuned on 32 x 32 must hold where the
    # activations outweigh the weights (a 2-D embedding's lookup changes way past the table's bytes;
    # XLA:TPU keeps up to its VMEM's worth of activations off the HBM peak, which fast mode does not
    # model: docs/stepcost.md, "The same rows at 16x the tokens").
    big = ["tokens=int32[256,64],labels=int32[256,64]"]
    for target in ["cpu", *_installed_targets()]:
        for plan in tplans:
            for family in ("gpt", "llama"):
                rows.append(_fast_vs_exact(plan, f"{family}_small", big, target))
    for target in ["cpu", *_installed_targets()]:
        for plan, model in (("fsdp.splan", "swiglu_wide"), ("dp.splan", "gelu_wide")):
            rows.append(_fast_vs_exact(plan, model, wide_batch, target, model_ref=f"{wide}:{model}",
                                       step=f"{wide}:loss"))
    return {"rows": rows}


def _installed_targets(every_generation: bool = False) -> list[str]:
    """The target compilers installed here, 8 devices each: XLA:TPU as v5e (and, with
    ``every_generation``, as v5p and v6e, whose memory-space assignment differs) and XLA:GPU."""
    from shardplan.core import targets
    from shardplan.errors import ShardPlanError

    tpus = ("tpu-v5e:2x4", "tpu-v5p:2x2x2", "tpu-v6e:2x4") if every_generation else ("tpu-v5e:2x4",)
    out = []
    for name in (*tpus, "h100:8"):
        try:
            targets.require_compiler(targets.parse(name))
        except ShardPlanError:  # target-compiler-missing
            continue
        out.append(name)
    return out


def _fast_vs_exact(plan: str, factory: str, batch: list[str], target: str, model_ref: str | None = None,
                   step: str | None = None) -> dict:
    import shardplan

    model = model_ref or f"{ROOT / 'examples' / 'models.py'}:{factory}"
    step = step or f"{ROOT / 'examples' / 'train.py'}:lm_loss"
    kw = dict(model=model, step=step, batch=batch, devices=8, target=target)
    fast = shardplan.api.analyze(ROOT / "plans" / plan, mode="fast", **kw)
    exact = shardplan.api.analyze(ROOT / "plans" / plan, mode="exact", **kw)
    from benchmarks.random_plans import differences

    fk, ek = fast.bytes_by_kind(), exact.bytes_by_kind()
    comm = {k: {"fast": fk[k], "exact": ek[k], "error": abs(fk[k] - ek[k]) / ek[k] if ek[k] else
                (0.0 if fk[k] == 0 else float("inf"))} for k in ek if ek[k] or fk[k]}
    # where the two differ most: the collectives by kind and model line, with their ops
    tokens = re.search(r"tokens=\w+\[(\d+),(\d+)\]", batch[0])
    return {"plan": plan, "model": factory, "target": target, "tokens": "x".join(tokens.groups()) if tokens else "",
            "comm": comm, "misses": differences(fast, exact),
            "peak_fast": fast.memory.peak, "peak_exact": exact.memory.peak,
            "peak_error": abs(fast.memory.peak - exact.memory.peak) / exact.memory.peak,
            "flops_fast": fast.flops, "flops_exact": exact.flops,
            "flops_error": abs(fast.flops - exact.flops) / exact.flops,
            "hbm_fast": fast.hbm_bytes, "hbm_exact": exact.hbm_bytes,
            "fast_s": fast.seconds, "exact_s": exact.seconds}


def bench_step_cost_scale(quick: bool) -> dict:
    """Fast mode on the Llama-2-70B shapes (80 layers, data=32,model=8, full train step) against
    nnx.eval_shape of the model alone, side by side; exact mode on 64 simulated devices for a
    1.5B-param model (full runs only)."""
    import subprocess

    from flax import nnx

    import shardplan
    from examples import models

    model = "llama2_70b" if not quick else "gpt_small"
    mesh = {"data": 32, "model": 8} if not quick else {"data": 4, "model": 2}
    factory = getattr(models, model)
    t = time.perf_counter()
    with nnx.use_eager_sharding(False):
        nnx.eval_shape(factory)
    t_eval = time.perf_counter() - t
    # The same with the workaround shardplan's own abstract builds use (JAX's tracer-origin search
    # skipped: quadratic over an init), reported beside the target so the ratio can be read both ways.
    from shardplan.runtime.model import quiet_tracer_origins

    t = time.perf_counter()
    with nnx.use_eager_sharding(False), quiet_tracer_origins():
        nnx.eval_shape(factory)
    t_eval_quiet = time.perf_counter() - t
    t = time.perf_counter()
    seq = 4096 if not quick else 32
    cost = shardplan.api.analyze(ROOT / "plans" / "gpt_tp.splan", model=f"{ROOT / 'examples' / 'models.py'}:{model}",
                                 step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", mode="fast", mesh=mesh,
                                 batch=[f"tokens=int32[{mesh['data'] * 4},{seq}],"
                                        f"labels=int32[{mesh['data'] * 4},{seq}]"])
    t_fast = time.perf_counter() - t
    out = {"model": model, "mesh": mesh, "eval_shape_s": t_eval, "fast_s": t_fast, "ratio": t_fast / t_eval,
           "eval_shape_quiet_s": t_eval_quiet,
           "flops_per_device": cost.flops, "peak_per_device": cost.memory.peak,
           "comm_per_device": cost.bytes_by_kind()}
    if not quick:
        cmd = [sys.executable, "-m", "shardplan", "check", str(ROOT / "plans" / "llama_scan_2d.splan"), "--model",
               f"{ROOT / 'examples' / 'models.py'}:llama_1b", "--mesh", "data=16,model=4", "--step",
               f"{ROOT / 'examples' / 'train.py'}:lm_loss", "--batch",
               "tokens=int32[64,2048],labels=int32[64,2048]", "--compile", "--format", "json"]
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        out["exact_64_s"] = time.perf_counter() - t
        out["exact_64_ok"] = r.returncode == 0
    return out


def bench_shape_cache(quick: bool) -> dict:
    """`shardplan check --model` twice on the Llama-2-70B shapes: the first builds them
    (nnx.eval_shape) and fills the shapes cache, the second reads them back; whole commands."""
    import subprocess
    import tempfile

    model = "gpt_small" if quick else "llama2_70b"
    mesh = "data=4,model=2" if quick else "data=32,model=8"
    cmd = [sys.executable, "-m", "shardplan", "check", str(ROOT / "plans" / "gpt_tp.splan"), "--model",
           f"{ROOT / 'examples' / 'models.py'}:{model}", "--mesh", mesh]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "SHARDPLAN_CACHE_DIR": tmp}
        times = []
        for _ in range(3):
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            times.append(time.perf_counter() - t)
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
    return {"model": model, "first_s": times[0], "cached_s": min(times[1:])}


# -- the runner -------------------------------------------------------------------------------
def _bench_resolution(quick: bool) -> dict:
    from benchmarks import resolution

    return resolution.run(quick)


def _bench_reshard(quick: bool) -> dict:
    from benchmarks import reshard

    return reshard.run(quick)


def _bench_recost(quick: bool) -> dict:
    from benchmarks import recost

    return recost.run(quick)


def _bench_random_plans(quick: bool) -> dict:
    from benchmarks import random_plans

    return random_plans.run(quick)


def _bench_suggest(quick: bool) -> dict:
    from benchmarks import suggest

    return suggest.run(quick)


def _bench_moe(quick: bool) -> dict:
    from benchmarks import moe

    return moe.run(quick)


def _bench_pipeline(quick: bool) -> dict:
    from benchmarks import pipeline

    return pipeline.run(quick)


def _bench_lsp(quick: bool) -> dict:
    from benchmarks import lsp

    return lsp.run(quick)


# Every section, in the order it runs and is written: (name, what it measures, function(quick)).
# Its figures go to res[name].
SECTIONS = [
    ("resolution", "1. resolution", _bench_resolution),
    ("apply", "2. apply", bench_apply),
    ("steps", "3. training steps", bench_steps),
    ("fsdp_llama", "3. FSDP Llama peak", bench_fsdp_llama),
    ("scaling", "3. 8 devices vs 1", bench_scaling),
    ("cost", "4. cost model", bench_cost_model),
    ("generation", "5. generation", bench_generation),
    ("step_cost", "6. step cost", bench_step_cost),
    ("step_cost_scale", "6. step cost at scale", bench_step_cost_scale),
    ("reshard", "7. reshard", _bench_reshard),
    ("shape_cache", "8. shapes cache", bench_shape_cache),
    ("lsp", "9. language server", _bench_lsp),
    ("recost", "10. re-cost on one trace", _bench_recost),
    ("random_plans", "11. random plans, fast vs exact", _bench_random_plans),
    ("suggest", "12. suggest vs the shipped plans", _bench_suggest),
    ("moe", "13. mixture of experts", _bench_moe),
    ("pipeline", "14. pipelines", _bench_pipeline),
]


def standalone(doc: str, argv=None) -> argparse.Namespace:
    """A section's own command line (``python -m benchmarks.NAME [--quick] [--json OUT]``): its
    arguments read, the repository importable, 8 simulated devices (before jax is imported)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shardplan.runtime.devices import simulate

    simulate(8)
    return args


def section_main(doc: str, run_fn, report_fn, checks_fn, argv=None) -> int:
    """A section module's ``main``: its command line read, its run, its report and target rows printed."""
    args = standalone(doc, argv)
    res = run_fn(args.quick)
    for line in report_fn(res):
        print(line)
    return finish(res, checks_fn(res), args.json)


def finish(res: dict, rows: list[dict], json_path: str | None) -> int:
    """A section's command line ends: its target rows printed, its figures written to ``json_path``."""
    for row in rows:
        print(f"{row['measurement']}: {row['value']} (target {row['target']}) {row['met']}")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1, default=str))
    return 0


def fast_vs_exact(fast, exact) -> dict:
    """Fast mode's step cost against exact mode's: per collective kind the bytes of each and the
    error, the peak and the FLOPs (the figures sections 13 and 14 report for their plans)."""
    fk, ek = fast.bytes_by_kind(), exact.bytes_by_kind()
    comm = {k: {"fast": fk.get(k, 0), "exact": ek.get(k, 0),
                "error": abs(fk.get(k, 0) - ek.get(k, 0)) / ek[k] if ek.get(k) else
                (0.0 if not fk.get(k) else float("inf"))} for k in sorted(set(fk) | set(ek))
            if fk.get(k) or ek.get(k)}
    return {"comm": comm, "peak_fast": fast.memory.peak, "peak_exact": exact.memory.peak,
            "peak_error": abs(fast.memory.peak - exact.memory.peak) / exact.memory.peak,
            "flops_fast": fast.flops, "flops_exact": exact.flops,
            "flops_error": abs(fast.flops - exact.flops) / exact.flops}


def fast_vs_exact_checks(name: str, r: dict) -> list[dict]:
    """The engine's targets on one fast-vs-exact row: each kind's bytes within 10%, peak 15%, FLOPs 2%."""
    out = [_check(f"{name}: {kind} bytes error", c["error"], 0.10, "<=", "{:.1%}") for kind, c in r["comm"].items()]
    out.append(_check(f"{name}: peak memory error", r["peak_error"], 0.15, "<=", "{:.1%}"))
    out.append(_check(f"{name}: FLOPs error", r["flops_error"], 0.02, "<=", "{:.2%}"))
    return out


def fast_vs_exact_lines(r: dict) -> list[str]:
    lines = [f"  {kind:18} fast {c['fast'] / 1024:9.1f} KiB   exact {c['exact'] / 1024:9.1f} KiB"
             f"   error {c['error']:.0%}" for kind, c in r["comm"].items()]
    lines.append(f"  peak               fast {r['peak_fast'] / 2**20:9.2f} MiB   exact "
                 f"{r['peak_exact'] / 2**20:9.2f} MiB   error {r['peak_error']:.0%}")
    lines.append(f"  FLOPs              fast {r['flops_fast']:.3g}   exact {r['flops_exact']:.3g}   error "
                 f"{r['flops_error']:.1%}")
    return lines


def _check(name, value, target, op, fmt="{:.2f}x", timing=False) -> dict:
    """One target. ``timing``: the figure is a time or a rate, so it depends on the machine and
    its load (quick mode's sizes are too small for it to mean anything); every other figure
    (bytes, counts, errors against a compiled program) is deterministic."""
    met = value >= target if op == ">=" else value <= target if op == "<=" else value < target
    return {"measurement": name, "value": fmt.format(value), "target": f"{op} {fmt.format(target)}",
            "met": "yes" if met else "NO (missed)", "timing": timing}


def checks(res: dict) -> list[dict]:
    """The targets of the sections in ``res`` (those that ran), in the table's order."""
    out = []
    if "resolution" in res:
        r = res["resolution"]
        out += [_check(f"resolve {r['leaves']:,} leaves, {r['rules']} rules: speed-up vs naive re loop",
                       r["speedup_vs_naive"], 10.0, ">=", timing=True),
                _check("resolve: time / floor (plain path walk)", r["ratio_to_floor"], 3.0, "<=", timing=True)]
        out += [_check(*t, timing=True) for t in r.get("targets", [])]  # rows benchmarks/resolution.py adds
    if "apply" in res:
        a = res["apply"]
        out.append(_check(f"apply {a['bytes'] / 2**30:.2f} GiB, {a['leaves']} leaves: shardplan / device_put",
                          a["ratio"], 1.05, "<=", timing=True))
    for row in res.get("steps", {}).get("plans", []):
        out.append(_check(f"step {row['plan']} x {row['model']}: auto / hand-written shardings", row["auto_vs_hand"],
                          1.05, "<=", timing=True))
    for row in res.get("cost", []):
        out.append(_check(f"cost model {row['plan']}: state bytes error", row["state_error"], 0.05, "<=", "{:.2%}"))
        out.append(_check(f"cost model {row['plan']}: gather-whole lowering, communication bytes error",
                          row["comm_error"], 0.05, "<=", "{:.2%}"))
        pp, pc = row["partitioned_predicted"], row["partitioned_compiled"]
        err = max(abs(pp.get(k, 0) - pc.get(k, 0)) / max(pc.get(k, 0), 1) for k in set(pp) | set(pc))
        out.append(_check(f"cost model {row['plan']}: partitioned shard_map step, communication bytes error "
                          "(worst kind)", err, 0.0, "<=", "{:.2%}"))
    if "generation" in res:
        g = res["generation"]
        out.append(_check(f"generation: padded tokens/s vs recompile-per-length ({g['tokens']} tokens)",
                          g["speedup"], 1.0, ">=", timing=True))
        for path in ("plain", "cache"):
            out.append(_check(f"generation, Llama, {path} path: tokens/s vs recompile-per-length",
                              g["llama"][f"{path}_vs_naive"], 1.0, ">=", timing=True))
    for row in res.get("step_cost", {}).get("rows", []):
        name = f"{row['plan']} x {row['model']}" + (f" on {row['target']}" if row.get("target", "cpu") != "cpu" else "")
        name += f" ({row['tokens']} tokens)" if row.get("tokens") == "256x64" else ""
        for kind, c in row["comm"].items():
            out.append(_check(f"fast vs exact {name}: {kind} bytes error", c["error"], 0.10, "<=", "{:.1%}"))
        out.append(_check(f"fast vs exact {name}: peak memory error", row["peak_error"], 0.15, "<=", "{:.1%}"))
        out.append(_check(f"fast vs exact {name}: FLOPs error", row["flops_error"], 0.02, "<=", "{:.2%}"))
    for row in res.get("steps", {}).get("plans", []):
        name = f"{row['plan']} x {row['model']}"
        out.append(_check(f"step time shard_map / auto, {name}", row["shard_map_vs_auto"], 1.15, "<=", timing=True))
        if _peak_checked(row["plan"]):
            out.append(_check(f"peak memory shard_map / auto, {name}", row["peak_ratio"], 1.10, "<="))
    if "fsdp_llama" in res:
        out.append(_check("peak memory, Llama (scanned) under FSDP, one sequence per device: partitioned "
                          "shard_map step / gather-whole step", res["fsdp_llama"]["8"]["ratio"], 0.5, "<"))
    if "step_cost_scale" in res:
        sc = res["step_cost_scale"]
        out.append(_check(f"fast mode {sc['model']} full step / nnx.eval_shape of the model", sc["ratio"], 2.0, "<=",
                          timing=True))
    for row in res.get("reshard", {}).get("rows", []):
        out.append(_check(f"reshard {row['before']} -> {row['after']} x {row['model']}: predicted vs compiled bytes",
                          row["error"], 0.05, "<=", "{:.1%}"))
    if "shape_cache" in res:
        sc8 = res["shape_cache"]
        out.append(_check(f"re-check {sc8['model']} through the shapes cache (first {sc8['first_s']:.1f} s), seconds",
                          sc8["cached_s"], 1.0, "<=", "{:.2f} s", timing=True))
    if "lsp" in res:
        ls = res["lsp"]
        out.append(_check(f"language server: diagnostics after an edit, 40 rules x {ls['leaves']:,} cached leaves "
                          f"(slowest of {ls['edits']}), seconds", ls["edit_max_s"], 0.2, "<=", "{:.3f} s",
                          timing=True))
        if "unused_edit_max_s" in ls:
            out.append(_check(f"language server: the same edits with a rule that matches nothing (slowest of "
                              f"{ls['unused_edits']}), seconds", ls["unused_edit_max_s"], 0.2, "<=", "{:.3f} s",
                              timing=True))
    if "recost" in res:
        from benchmarks import recost

        out += recost.checks(res["recost"])
    if "random_plans" in res:
        from benchmarks import random_plans

        out += random_plans.checks(res["random_plans"])
    if "suggest" in res:
        from benchmarks import suggest

        out += suggest.checks(res["suggest"])
    if "moe" in res:
        from benchmarks import moe

        out += moe.checks(res["moe"])
    if "pipeline" in res:
        from benchmarks import pipeline

        out += pipeline.checks(res["pipeline"])
    if "reshard" in res:
        d70 = res["reshard"]["diff_70b"]
        out.append(_check(f"shardplan diff {d70['model']} ({d70['leaves']} params) from cached shapes, seconds",
                          d70["seconds"], 1.0, "<=", "{:.2f} s", timing=True))
    return out


def main(argv=None) -> int:
    names = [name for name, _, _ in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes; only proves every measurement runs")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: the real devices)")
    p.add_argument("--write", action="store_true", help="write docs/benchmarks.md and .png (default on full runs)")
    p.add_argument("--json", help="also write every figure and check (JSON) here")
    p.add_argument("--only", help=f"comma-separated sections to run (default: all): {', '.join(names)}")
    args = p.parse_args(argv)
    only = names if args.only is None else args.only.split(",")
    unknown = sorted(set(only) - set(names))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(names)}")
    if args.write and set(only) != set(names):
        p.error("--write writes every section: run them all (leave out --only)")
    _setup(args.devices)

    import jax
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"shardplan benchmarks ({'quick' if args.quick else 'full'}) on {jax.device_count()} "
                  f"{jax.devices()[0].platform} devices, {os.cpu_count()} cores, "
                  f"{platform.processor() or platform.machine()}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    res: dict = {}
    for name, title, bench in SECTIONS:
        if name in only:
            t, cpu = time.perf_counter(), time.process_time()
            res[name] = bench(args.quick)
            # CPU seconds of this process (its threads; not child processes) beside the wall time: a
            # shared machine shows as wall time well above it.
            console.print(f"{title} done in {time.perf_counter() - t:.0f} s (CPU {time.process_time() - cpu:.0f} s; "
                          f"{time.perf_counter() - t0:.0f} s in all)")
    checks_ = checks(res)

    table = Table(title="shardplan vs plain JAX", header_style="bold")
    for col in ("measurement", "value", "target", "met"):
        table.add_column(col)
    for c in checks_:
        table.add_row(c["measurement"], c["value"], c["target"], c["met"])
    console.print(table)
    info = Table(title="reported (no target)", header_style="bold")
    for col in ("measurement", "value"):
        info.add_column(col)
    if "resolution" in res:
        r = res["resolution"]
        info.add_row("resolve: shardplan / naive / floor seconds",
                     f"{r['shardplan_s']:.3f} / {r['naive_s']:.3f} / {r['floor_s']:.3f}")
        info.add_row("resolve, garbage collector running: shardplan / naive seconds",
                     f"{r['shardplan_gc_s']:.3f} / {r['naive_gc_s']:.3f} ({r['speedup_vs_naive_gc']:.1f}x)")
    for row in res.get("steps", {}).get("plans", []):
        info.add_row(f"step {row['plan']} x {row['model']}: auto / hand / shard_map ms",
                     f"{row['auto_ms']:.1f} / {row['hand_ms']:.1f} / {row['shard_map_ms']:.1f} "
                     f"(shard_map / auto {row['shard_map_vs_auto']:.2f}x)")
    for row in res.get("scaling", []):
        info.add_row(f"dp step, batch {row['batch']}: 8 devices vs 1", f"{row['ms_8']:.1f} ms vs {row['ms_1']:.1f} ms "
                     f"(speed-up {row['speedup_8_vs_1']:.2f}x)")
    if "generation" in res:
        g = res["generation"]
        info.add_row("generation tokens/s: padded / naive", f"{g['padded_tok_s']:.0f} / {g['naive_tok_s']:.0f}")
    console.print(info)
    missed = [c["measurement"] for c in checks_ if c["met"] != "yes"]
    console.print(f"{len(checks_) - len(missed)} of {len(checks_)} targets met" +
                  (f"; missed: {'; '.join(missed)}" if missed else ""))
    console.print(f"total {time.perf_counter() - t0:.0f} s (CPU {time.process_time() - cpu0:.0f} s)")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"results": res, "checks": checks_}, default=str))
    if args.write or (not args.quick and args.only is None):
        from benchmarks import write

        command = " ".join(["python -m benchmarks", *(argv or sys.argv[1:])])
        write.markdown(ROOT / "docs" / "benchmarks.md", res, checks_, command)
        write.plot(ROOT / "docs" / "benchmarks.png", res)
        console.print("wrote docs/benchmarks.md and docs/benchmarks.png")
    return 0
