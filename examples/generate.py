"""Generate from the example GPT under a plan: fixed-length padded prompts, one decode compile.

    python examples/generate.py --plan plans/gpt_tp.splan                       # random init
    python examples/generate.py --plan plans/gpt_tp.splan --checkpoint-dir ckpt  # trained by train.py

Tokens print as they come, one line per decode step (one token per prompt).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True)
    p.add_argument("--model", default="gpt_tiny", help="a factory in examples/models.py, or your own causal LM: "
                   "FILE.py:FACTORY or package.module:FACTORY")
    p.add_argument("--max-len", type=int, help="longest sequence (bucket + new tokens); default: the longest "
                   "bucket + --max-new-tokens")
    p.add_argument("--checkpoint-dir", help="restore the latest checkpoint's model from here")
    p.add_argument("--prompts", type=int, default=8, help="how many prompts (a multiple of the batch shards)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--buckets", default="4,8", help="prompt length buckets, comma-separated")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-devices", type=int, default=8)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train import load_factory, setup_devices, vocab_of

    setup_devices(args.simulate_devices)
    import jax
    import numpy as np
    from rich.console import Console

    import shardplan
    from shardplan import GenerationConfig, Generator, print_diagnostics

    console = Console()
    try:
        plan = shardplan.load(args.plan)
        model, _, placement = shardplan.init_sharded(plan, load_factory(args.model, args.seed), None)
        if args.checkpoint_dir:
            from shardplan import checkpoint

            step = checkpoint.Checkpointer(args.checkpoint_dir, placement, create=False).restore(model)
            console.print(f"restored the model from step {step} of {args.checkpoint_dir}")
        buckets = tuple(int(x) for x in args.buckets.split(","))
        max_len = args.max_len or max(buckets) + args.max_new_tokens
        config = GenerationConfig(max_len=max_len, buckets=buckets, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k)
        gen = Generator(placement, model, config)
        console.print(f"generation path: {gen.mode} (" + ("KV cache: one prefill compile per bucket, one decode "
                      "compile" if gen.mode == "cache" else "no cache: the whole fixed-length buffer per step, one "
                      "compile per bucket") + ")")
        rng = np.random.default_rng(args.seed)
        n = jax.device_count()  # a token batch every split of the plan's divides
        vocab = vocab_of(model, placement, n, n)
        prompts = []
        for i in range(args.prompts):  # the training data's rule: x[t+1] = (3 x[t] + 1) mod vocab
            x = [int(rng.integers(0, vocab))]
            while len(x) < 1 + i % buckets[-1]:
                x.append((3 * x[-1] + 1) % vocab)
            prompts.append(x)
        console.print(f"mesh {placement.mesh_shape}, cache spec {gen.cache_spec} ({gen.cache_origin}), prompt lengths "
                      f"{[len(x) for x in prompts]}")
        result = gen.generate(prompts, key=jax.random.key(args.seed),
                              on_token=lambda step, toks: console.print(f"step {step:3d}: {' '.join(map(str, toks))}"))
        console.print(f"bucket {result.bucket}; XLA compiles this call: {result.compiles}")
        for x, out in zip(prompts, result.tokens):
            console.print(f"{x} -> {out}")
        return 0
    except (shardplan.ShardPlanError, ValueError, OSError) as e:
        if isinstance(e, shardplan.ShardPlanError):
            print_diagnostics(Console(stderr=True), e.diagnostics)
        else:
            Console(stderr=True).print(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
