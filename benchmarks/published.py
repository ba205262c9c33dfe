"""The step-time estimate against published training runs (docs/stepcost.md).

    python -m benchmarks.published [--compile]

MaxText on Cloud TPU v6e-256 (FSDP over the 256 chips, bf16, scanned layers):
- Llama 2 70B, sequence 4096, 1024 sequences per step: 17.373 s per step, 943 tokens/s/device
  (AI-Hypercomputer/tpu-recipes, training/trillium/Llama2-70B-MaxText/README.md; MaxText's
  docs/reference/models/tiering.md lists it at 43.8% MFU, ~900 tokens/s/device);
- Llama 3.1 8B, sequence 8192, 4 sequences per device: 4.546 s per step, 7,207 tokens/s/device
  (tpu-recipes, training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md; 45.46% MFU in MaxText's
  tiering.md).
Each is costed in fast mode as the recipe runs it (our Llama with the same shapes: RoPE, GQA,
SwiGLU; the recipe's per-device batch, remat policy and flash-attention block sizes, the kernel
being jax's Pallas TPU flash attention) and, beside it, with naive attention; each is timed on
the tpu-v6e preset and the ratio predicted / published tokens/s is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
PLAN = '''plan "fsdp-scanned"
mesh data = *
batch (data, _)
param "layers/.*/kernel" (_, data, _)
param "embed/embedding" (data, _)
param "lm_head/kernel" (data, _)
default replicated
'''


def _llama2_70b(attention: str):
    from examples.models import Llama, LlamaConfig

    # MaxText's llama2-70b-4096 on v6e: remat "full", flash attention, sa_block_q 1024, sa_block_q_dkv
    # and sa_block_q_dq 2048, key/value blocks at MaxText's default 512.
    return Llama(LlamaConfig(vocab=32000, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, n_layers=80,
                             max_len=4096, scan_layers=True, remat="full", dtype="bfloat16", attention=attention,
                             attention_blocks=(1024, 512, 2048)), nnx.Rngs(0))


def _llama31_8b(attention: str):
    from examples.models import Llama, LlamaConfig

    # MaxText's llama3_1-8b-8192 on v6e: remat "custom" keeping the q/k/v/out projections and each
    # layer's input (offloaded to host memory there, kept in HBM here), flash attention, all blocks 2048.
    return Llama(LlamaConfig(vocab=128256, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, n_layers=32,
                             max_len=8192, rope_theta=500000.0, scan_layers=True, remat="qkvo", dtype="bfloat16",
                             attention=attention, attention_blocks=(2048, 2048, 2048)), nnx.Rngs(0))


def llama2_70b_bf16():
    return _llama2_70b("flash")


def llama2_70b_bf16_naive():
    return _llama2_70b("naive")


def llama31_8b_bf16():
    return _llama31_8b("flash")


def llama31_8b_bf16_naive():
    return _llama31_8b("naive")


# (factory, sequence, sequences per device, published tokens/s/device, published s/step or None)
RUNS = [("llama2_70b_bf16", 4096, 4, 943.086, 17.373), ("llama31_8b_bf16", 8192, 4, 7207.336, 4.546)]


def run() -> list[dict]:
    import shardplan
    from shardplan.core import chips, timing

    # as the recipes run: MaxText's logical-axis rules pin the activations' batch dim (PINNED, below)
    plan = shardplan.loads(PINNED, "fsdp-scanned.splan", mesh={"data": 256})
    chip = chips.lookup("tpu-v6e")
    rows = []
    for name, seq, per_device, tokens_s, step_s in RUNS:
        for attention, factory in (("flash", name), ("naive", f"{name}_naive")):
            cost = shardplan.api.analyze(plan, model=f"{Path(__file__).resolve()}:{factory}",
                                         step=f"{ROOT / 'examples' / 'train.py'}:lm_loss", mode="fast",
                                         batch=[f"tokens=int32[{256 * per_device},{seq}],"
                                                f"labels=int32[{256 * per_device},{seq}]"])
            t = timing.step_time(cost, plan, chip)
            tokens = per_device * seq
            rows.append({"run": name, "attention": attention, "tokens_per_device_step": tokens,
                         "published_tokens_s": tokens_s, "published_step_s": step_s,
                         "predicted_step_s": (t.overlapped_s, t.serial_s),
                         "predicted_tokens_s": (tokens / t.serial_s, tokens / t.overlapped_s),
                         "ratio_tokens_s": (tokens / t.serial_s / tokens_s, tokens / t.overlapped_s / tokens_s),
                         "compute_s": t.compute_s, "memory_s": t.memory_s, "comm_s": t.comm_s,
                         "flops": cost.flops, "hbm_bytes": cost.hbm_bytes})
    return rows


# MaxText's logical-axis rules also pin the activations' batch dim to the FSDP axis; with the
# weights' and the batch's placement alone XLA:TPU partitions the scanned backward pass otherwise
# (it gathers whole-batch activations) and refuses the 70B step (250 GB of temporaries on 31 GiB).
PINNED = PLAN.replace(
    "default replicated",
    "axis activation_batch  -> data\naxis activation_length -> _\naxis activation_embed  -> _\ndefault replicated",
)


def compiled(target: str = "tpu-v6e:16x16") -> list[dict]:
    """Each run as configured (flash attention) compiled by the TPU compiler offline for the slice
    it ran on: does the step fit the chip's memory, and its step time at datasheet rates from the
    compiled program's FLOPs and collectives, beside fast mode told the target and the published
    step; also the plan without the activation rules (the compiler's answer to it). Minutes per
    run on 2 cores; needs XLA:TPU (the test extra)."""
    import shardplan
    from shardplan.core import chips, timing
    from shardplan.errors import ShardPlanError

    chip = chips.lookup("tpu-v6e")
    rows = []
    for name, seq, per_device, tokens_s, step_s in RUNS:
        batch = [f"tokens=int32[{256 * per_device},{seq}],labels=int32[{256 * per_device},{seq}]"]
        kw = dict(model=f"{Path(__file__).resolve()}:{name}", step=f"{ROOT / 'examples' / 'train.py'}:lm_loss",
                  batch=batch, target=target)
        row: dict = {"run": name, "published_step_s": step_s, "published_tokens_s": tokens_s}
        for label, text in (("pinned", PINNED), ("unpinned", PLAN)):
            plan = shardplan.loads(text, f"{label}.splan", mesh={"data": 256})
            for mode in ("fast", "exact"):
                try:
                    cost = shardplan.api.analyze(plan, mode=mode, timeout_s=3600, **kw)
                except ShardPlanError as err:
                    row[f"{label}_{mode}"] = {"error": str(err).splitlines()[0][:300]}
                    continue
                t = timing.step_time(cost, plan, chip)
                row[f"{label}_{mode}"] = {"peak": cost.memory.peak, "fits": cost.memory.peak <= chip.hbm_bytes,
                                          "step_s": (t.overlapped_s, t.serial_s), "flops": cost.flops,
                                          "by_kind": cost.bytes_by_kind(), "seconds": cost.seconds}
        rows.append(row)
    return rows


def main() -> int:
    sys.path.insert(0, str(ROOT))
    if "--compile" in sys.argv[1:]:
        for r in compiled():
            print(f"{r['run']} on tpu-v6e:16x16, published {r['published_step_s']} s/step:")
            for key in ("pinned_fast", "pinned_exact", "unpinned_fast", "unpinned_exact"):
                c = r[key]
                if "error" in c:
                    print(f"  {key}: {c['error']}")
                    continue
                gib = {k: round(v / 2**30, 1) for k, v in c["by_kind"].items() if v}
                print(f"  {key}: peak {c['peak'] / 2**30:.2f} GiB ({'fits' if c['fits'] else 'does not fit'} "
                      f"31.25 GiB), step {c['step_s'][0]:.2f}..{c['step_s'][1]:.2f} s at datasheet rates, "
                      f"{c['flops'] / 1e12:,.1f} TFLOP, collectives GiB {gib} ({c['seconds']:.0f} s)")
        return 0
    for r in run():
        lo, hi = r["ratio_tokens_s"]
        print(f"{r['run']} ({r['attention']} attention): predicted {r['predicted_tokens_s'][0]:,.0f}.."
              f"{r['predicted_tokens_s'][1]:,.0f} tokens/s/device (step {r['predicted_step_s'][0]:.2f}.."
              f"{r['predicted_step_s'][1]:.2f} s: compute {r['compute_s']:.2f} s, memory {r['memory_s']:.2f} s, "
              f"communication {r['comm_s']:.2f} s; {r['hbm_bytes']:.3e} B), published "
              f"{r['published_tokens_s']:,.0f} ({r['published_step_s']} s): predicted / published {lo:.2f}..{hi:.2f} "
              f"({'within' if max(abs(lo - 1), abs(hi - 1)) <= 0.25 else 'NOT within'} 25%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
