"""Predicted step time against the measured one, on the accelerator this runs on.

    python -m benchmarks.device [--chip h200] [--quick] [--json FILE] [--hlo DIR]

For each model configuration (bf16, sized to keep one accelerator busy): the example LM step
under plans/dp.splan on every local device (shardplan's auto backend, the same step as
`python examples/train.py`), timed after warm-up; beside it, in the same run,
- fast mode's prediction (`shardplan check --step`, no compile) and the step time the chip
  preset gives for it (`--chip`),
- what XLA compiled for this accelerator: its cost analysis (FLOPs, bytes accessed) and memory
  analysis, and the peak the device's allocator saw,
- the chip's measured ceilings: a bf16 8192^3 matmul and an on-device copy.
Each configuration runs in its own process (fresh allocator peak). `--quick` (CI, CPU) runs one
tiny configuration only to prove the script runs; its times say nothing about a chip.

    python -m benchmarks.device --offline device.json [--hlo DIR]

(here, no accelerator) sets those measurements beside the offline compile: each configuration's
step compiled for the chip's target by this machine's XLA:GPU (``shardplan[gpu]``, exact mode:
its peak, memory traffic, kernels, and the step time the chip preset gives for its program), and
beside fast mode run here (the pinned jax, which may differ from the accelerator's). With
``--hlo`` (the programs the device run wrote) it counts the device program's kernels too.
Results on one H200 are in docs/stepcost.md ("Measured on a GPU"); the last run's rows are in
benchmarks/measured/ (``--offline`` reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (family, config, global batch)
CONFIGS = {
    "gpt_124m": ("GPT", dict(vocab=32000, d_model=768, n_heads=12, d_ff=3072, n_layers=12, max_len=1024), 16),
    "llama_1b_scan": ("Llama", dict(vocab=32000, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=5632, n_layers=16,
                                    max_len=2048, scan_layers=True, remat="full"), 8),
    "llama_1b": ("Llama", dict(vocab=32000, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=5632, n_layers=16,
                               max_len=2048), 4),
    # The same Llama on cuDNN's flash attention (fast mode's fused-attention rule against the chip).
    "llama_1b_cudnn": ("Llama", dict(vocab=32000, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=5632, n_layers=16,
                                     max_len=2048, attention="cudnn"), 4),
}
QUICK = {"gpt_tiny": ("GPT", dict(vocab=256, d_model=64, n_heads=4, d_ff=128, n_layers=2, max_len=32), 8)}
KIND_TO_CHIP = {"H200": "h200", "H100": "h100", "A100": "a100-80gb", "B200": "b200", "TPU v4": "tpu-v4",
                "TPU v5 lite": "tpu-v5e", "TPU v5e": "tpu-v5e", "TPU v5p": "tpu-v5p", "TPU v6": "tpu-v6e"}


def _config(name: str):
    from examples import models

    family, kw, batch = {**CONFIGS, **QUICK}[name]
    if family == "GPT":
        return models.GPT, models.GPTConfig(**kw, dtype="bfloat16"), batch
    return models.Llama, models.LlamaConfig(**kw, dtype="bfloat16"), batch


def _factory(name: str):
    from flax import nnx

    family, cfg, _ = _config(name)
    return family(cfg, nnx.Rngs(0))


# Module-level factories for fast mode's FILE:FACTORY (one per configuration).
def gpt_124m():
    return _factory("gpt_124m")


def llama_1b_scan():
    return _factory("llama_1b_scan")


def llama_1b():
    return _factory("llama_1b")


def llama_1b_cudnn():
    return _factory("llama_1b_cudnn")


def gpt_tiny():
    return _factory("gpt_tiny")


def ceilings(quick: bool) -> dict:
    """A bf16 matmul's FLOP/s and an on-device copy's bytes/s (read + written), best of 10."""
    import jax
    import jax.numpy as jnp

    n = 512 if quick else 8192
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    words = (1 << 20) if quick else (1 << 30)  # 4 GiB of f32 on an accelerator
    x = jax.random.normal(key, (words,), jnp.float32)
    cp = jax.jit(lambda x: x * 1.0001)

    def best(f, *args):
        f(*args).block_until_ready()
        out = float("inf")
        for _ in range(10):
            t = time.perf_counter()
            f(*args).block_until_ready()
            out = min(out, time.perf_counter() - t)
        return out

    return {"matmul_flops": 2 * n**3 / best(mm, a, b), "copy_bytes_s": 2 * words * 4 / best(cp, x)}


def one(name: str, chip_name: str, hlo_dir: str | None) -> dict:
    """One configuration: measured step, XLA's view of it, fast mode's prediction."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import shardplan
    from examples import train as example
    from shardplan.core import chips, timing

    _, cfg, batch = _config(name)
    n = len(jax.devices())
    plan = shardplan.load(ROOT / "plans" / "dp.splan")
    plan = shardplan.with_mesh(plan, {"data": n})
    row: dict = {"config": name, "devices": n, "device_kind": jax.devices()[0].device_kind, "batch": batch,
                 "seq": cfg.max_len, "tokens": batch * cfg.max_len}

    _progress(f"{name}: building")
    mesh = shardplan.make_mesh(plan)
    model, optimizer, placement = shardplan.init_sharded(plan, lambda: _factory(name), optax.adamw(1e-3), mesh=mesh)
    row["params"] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    data = example.synthetic_batch(np.random.default_rng(0), cfg.vocab, batch, cfg.max_len)
    step = shardplan.train_step(placement, example.lm_loss, model, optimizer)
    placed = step.place(data)
    _progress(f"{name}: compiling")
    t = time.perf_counter()
    compiled = step.fn.lower(nnx.state(model), nnx.state(optimizer), placed).compile()
    row["compile_s"] = time.perf_counter() - t
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    row["xla"] = {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
                  "transcendentals": float(ca.get("transcendentals", 0.0))}
    m = compiled.memory_analysis()
    if m is not None:
        row["xla"]["peak"] = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                                 + m.temp_size_in_bytes)
        row["xla"]["temp"] = int(m.temp_size_in_bytes)
    from shardplan.core import hlo

    row["xla"]["memory_bytes"] = hlo.memory_bytes(compiled.as_text())  # every kernel, library calls too
    if hlo_dir:
        import gzip

        with gzip.open(Path(hlo_dir) / f"{name}.hlo.txt.gz", "wt") as f:
            f.write(compiled.as_text())

    def run(k: int):
        loss = None
        for _ in range(k):
            sm, so, loss = compiled(nnx.state(model), nnx.state(optimizer), placed)  # no second compile
            nnx.update(model, sm)
            nnx.update(optimizer, so)
        return float(loss)

    _progress(f"{name}: running")
    row["loss_first"] = run(2)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run(5)
        times.append((time.perf_counter() - t) / 5)
    row["measured_s"] = min(times)
    row["measured_all_s"] = times
    stats = jax.devices()[0].memory_stats() or {}
    row["device_peak"] = int(stats.get("peak_bytes_in_use", 0))
    _progress(f"{name}: measured; fast mode")
    import signal

    def _late(*_):
        raise TimeoutError("fast mode took over 120 s")

    signal.signal(signal.SIGALRM, _late)
    signal.alarm(120)
    try:
        t = time.perf_counter()
        cost = shardplan.api.analyze(plan, model=f"{Path(__file__).resolve()}:{name}",
                                     step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", mode="fast",
                                     batch=[f"{k}=int32[{batch},{cfg.max_len}]" for k in ("tokens", "labels")])
        row["fast_s"] = time.perf_counter() - t
        row["fast"] = {"flops": cost.flops, "peak": cost.memory.peak, "hbm_bytes": cost.hbm_bytes,
                       "comm_bytes": sum(cost.bytes_by_kind().values())}
        st = timing.step_time(cost, plan, chips.lookup(chip_name))
        row["predicted"] = st.to_json()
    except Exception as e:  # recorded, not fatal: the measurement stands on its own
        row["fast_error"] = f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    return row


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _print(row: dict, ceil: dict | None, on_chip: bool) -> None:
    meas = row["measured_s"]
    if "predicted" not in row:
        print(f"{row['config']}: {row['params'] / 1e6:,.0f}M params, batch {row['batch']}x{row['seq']} on "
              f"{row['devices']} x {row['device_kind']}: measured {meas * 1e3:.1f} ms/step; no prediction "
              f"({row.get('fast_error')}); XLA bytes accessed {row['xla']['bytes_accessed']:.4g}; allocator peak "
              f"{row['device_peak'] / 2**30:.2f} GiB")
        return
    p = row["predicted"]
    line = (f"{row['config']}: {row['params'] / 1e6:,.0f}M params, batch {row['batch']}x{row['seq']} on "
            f"{row['devices']} x {row['device_kind']}: measured {meas * 1e3:.1f} ms/step; predicted "
            f"{p['chip']} {p['overlapped_s'] * 1e3:.1f}..{p['serial_s'] * 1e3:.1f} ms "
            f"(measured / predicted {meas / p['serial_s']:.2f}..{meas / p['overlapped_s']:.2f})")
    print(line)
    x = row["xla"]
    f = row["fast"]
    print(f"  predicted: compute {p['compute_s'] * 1e3:.1f} ms + memory {p.get('memory_s', 0.0) * 1e3:.1f} ms + "
          f"communication {p['comm_s'] * 1e3:.1f} ms; measured MFU (fast FLOPs) "
          f"{f['flops'] / meas / _peak(p['chip']):.1%}")
    mem = x.get("memory_bytes", 0.0)
    print(f"  memory traffic per device: fast {f.get('hbm_bytes', 0.0):.4g} B, this device's compiled program "
          f"{mem:.4g} B (fast / compiled {f.get('hbm_bytes', 0.0) / mem if mem else float('nan'):.2f}); XLA's cost "
          f"analysis {x['bytes_accessed']:.4g} B (library matmuls and loop iterations left out)")
    if on_chip and ceil:
        at_ceilings = f["flops"] / ceil["matmul_flops"] + mem / ceil["copy_bytes_s"]
        print(f"  at this device's measured ceilings ({ceil['matmul_flops'] / 1e12:.0f} TFLOP/s, "
              f"{ceil['copy_bytes_s'] / 1e12:.2f} TB/s) the FLOPs and the compiled program's bytes take "
              f"{at_ceilings * 1e3:.1f} ms (measured / that {meas / at_ceilings:.2f})")
    print(f"  peak memory per device: fast {row['fast']['peak'] / 2**30:.2f} GiB, XLA {x.get('peak', 0) / 2**30:.2f} "
          f"GiB, allocator {row['device_peak'] / 2**30:.2f} GiB; compile {row['compile_s']:.1f} s, fast mode "
          f"{row['fast_s']:.1f} s")


def offline(doc: dict, hlo_dir: str | None) -> list[dict]:
    """Each measured row of a device run beside its step compiled offline here for the chip's target
    (XLA:GPU or XLA:TPU without the accelerator) and beside fast mode run here."""
    import gzip

    import shardplan
    from shardplan.core import chips, hlo, targets, timing

    chip = chips.lookup(doc["chip"])
    out = []
    for row in doc["rows"]:
        name, n = row["config"], row["devices"]
        _, cfg, batch = _config(name)
        plan = shardplan.with_mesh(shardplan.load(ROOT / "plans" / "dp.splan"), {"data": n})
        target = targets.parse(f"{doc['chip']}:{n}").name
        kw = dict(model=f"{Path(__file__).resolve()}:{name}", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
                  batch=[f"{k}=int32[{batch},{cfg.max_len}]" for k in ("tokens", "labels")])
        _progress(f"{name}: compiling for {target} offline")
        t = time.perf_counter()
        exact = shardplan.api.analyze(plan, mode="exact", target=target, **kw)
        compile_s = time.perf_counter() - t
        fast = shardplan.api.analyze(plan, mode="fast", target=target, **kw)
        got = {"config": name, "target": target, "measured_s": row["measured_s"], "compile_s": compile_s,
               "offline": {"step": timing.step_time(exact, plan, chip).to_json(), "flops": exact.flops,
                           "peak": exact.memory.peak, "memory_bytes": exact.hbm_bytes, "kernels": exact.kernels},
               "fast_here": {"step": timing.step_time(fast, plan, chip).to_json(), "flops": fast.flops,
                             "peak": fast.memory.peak, "hbm_bytes": fast.hbm_bytes, "kernels": fast.kernels},
               "device": {"xla_peak": row["xla"].get("peak", 0), "allocator_peak": row["device_peak"],
                          "memory_bytes": row["xla"]["memory_bytes"]}}
        if hlo_dir and (Path(hlo_dir) / f"{name}.hlo.txt.gz").exists():
            with gzip.open(Path(hlo_dir) / f"{name}.hlo.txt.gz", "rt") as f:
                text = f.read()
            got["device"]["kernels"] = hlo.kernel_count(text)
            got["device"]["flops"] = hlo.program_flops(text)
        out.append(got)
        _print_offline(got, row)
    return out


def _print_offline(got: dict, row: dict) -> None:
    meas, off, here, dev = got["measured_s"], got["offline"], got["fast_here"], got["device"]
    pred = row.get("predicted", {}).get("serial_s")
    print(f"{got['config']} on {got['target']}: measured {meas * 1e3:.1f} ms/step; fast mode there "
          + (f"{pred * 1e3:.1f} ms ({meas / pred:.2f}); " if pred else "failed; ")
          + f"fast mode here {here['step']['serial_s'] * 1e3:.1f} ms ({meas / here['step']['serial_s']:.2f}); "
          f"the offline compile's program at the preset {off['step']['serial_s'] * 1e3:.1f} ms "
          f"({meas / off['step']['serial_s']:.2f})")
    kern = (f"; kernels offline {off['kernels']:.0f}, device {dev['kernels']:.0f}, fast {here['kernels']:.0f}"
            if "kernels" in dev else "")
    print(f"  peak per device: offline compile {off['peak'] / 2**30:.2f} GiB, device's compile "
          f"{dev['xla_peak'] / 2**30:.2f} GiB, allocator {dev['allocator_peak'] / 2**30:.2f} GiB, fast "
          f"{here['peak'] / 2**30:.2f} GiB; memory traffic offline {off['memory_bytes']:.4g} B, device's program "
          f"{dev['memory_bytes']:.4g} B (offline / device {off['memory_bytes'] / dev['memory_bytes']:.2f}), fast "
          f"{here['hbm_bytes']:.4g} B{kern}; FLOPs offline / fast {off['flops'] / here['flops']:.3f}; offline "
          f"compile {got['compile_s']:.1f} s", flush=True)


def _peak(chip: str) -> float:
    from shardplan.core import chips

    return chips.lookup(chip).peak_flops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device")
    ap.add_argument("--chip", default=None, help="chip preset to predict for (default: from the device kind)")
    ap.add_argument("--quick", action="store_true", help="one tiny configuration (CI: proves the script runs)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--hlo", default=None, help="write each compiled program here (gzip)")
    ap.add_argument("--only", default=None, help="comma-separated configurations")
    ap.add_argument("--offline", default=None, metavar="JSON",
                    help="a device run's --json: compare it with the step compiled offline here for its chip")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.offline:
        doc = json.loads(Path(args.offline).read_text())
        if args.only:
            doc["rows"] = [r for r in doc["rows"] if r["config"] in args.only.split(",")]
        rows = offline(doc, args.hlo)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    if args.one:
        print("ROW " + json.dumps(one(args.one, args.chip, args.hlo)), flush=True)
        return 0
    names = list(QUICK) if args.quick else (args.only.split(",") if args.only else list(CONFIGS))
    unknown = [n for n in names if n not in CONFIGS and n not in QUICK]
    if unknown:
        print(f"--only: unknown configuration(s) {', '.join(unknown)}; known: {', '.join([*CONFIGS, *QUICK])}",
              file=sys.stderr)
        return 2
    import jax

    kind = jax.devices()[0].device_kind
    chip = args.chip or next((c for k, c in KIND_TO_CHIP.items() if k in kind), None)
    on_chip = chip is not None and jax.devices()[0].platform != "cpu"
    chip = chip or "h200"
    print(f"jax {jax.__version__} on {len(jax.devices())} x {kind}; predicting for chip '{chip}'"
          + ("" if on_chip else " (not this device: the comparison says nothing)"), flush=True)
    ceil = ceilings(args.quick)
    print(f"measured ceilings: bf16 matmul {ceil['matmul_flops'] / 1e12:.1f} TFLOP/s, copy "
          f"{ceil['copy_bytes_s'] / 1e12:.2f} TB/s (read + written)", flush=True)
    rows = []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for name in names:
        cmd = [sys.executable, "-m", "benchmarks.device", "--one", name, "--chip", chip]
        if args.hlo:
            Path(args.hlo).mkdir(parents=True, exist_ok=True)
            cmd += ["--hlo", args.hlo]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            print(f"{name}: timed out after {args.timeout:.0f} s\n{err[-2000:]}", flush=True)
            continue
        got = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not got:
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(got[-1])
        rows.append(row)
        _print(row, ceil, on_chip)
        if args.json:
            import flax

            Path(args.json).write_text(json.dumps({"chip": chip, "on_chip": on_chip, "ceilings": ceil,
                                                   "jax": jax.__version__, "flax": flax.__version__,
                                                   "rows": rows}, indent=1))
    return 0 if len(rows) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
