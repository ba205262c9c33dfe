"""Writing the benchmark results: docs/benchmarks.md (tables) and a PNG plot."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def markdown(path: Path, res: dict, checks: list[dict], command: str) -> None:
    import jax

    r, a, g = res["resolution"], res["apply"], res["generation"]
    lines = [
        "# Benchmarks",
        "",
        f"Measured with `{command}` on {datetime.date.today()}: {jax.device_count()} simulated "
        f"{jax.devices()[0].platform.upper()} devices on a {os.cpu_count()}-core {platform.machine()} machine "
        f"(jax {jax.__version__}). Every ratio is shardplan against the plain-JAX way, measured side by side in "
        "the same run (best of several repeats). Rerun with the same command; `--quick` only proves every "
        "measurement runs.",
        "",
        "## Targets",
        "",
        "| measurement | value | target | met |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c['measurement']} | {c['value']} | {c['target']} | {c['met']} |" for c in checks]
    lines += [
        "",
        "## 1. Plan resolution",
        f"A {r['rules']}-rule plan against a synthetic 64-expert MoE state ({r['params']:,} params with Adam "
        f"mu/nu: {r['leaves']:,} leaves, `ShapeDtypeStruct`s). shardplan: "
        "`shardplan.resolve_model(plan, params, opt_state)` "
        "(each distinct subtree decided once: JAX's C++ flatten without paths, equal subtrees found by structure "
        "and leaf shapes, rule matches told apart by a prefix automaton over the rules, optimizer state "
        "mirrored by walking it beside the params; per-leaf records with paths built on first read). Naive: "
        "jax's flatten with paths, then for each leaf every compiled `re` pattern in turn (first full match). "
        "Floor: the fastest (path, leaf) flattening we have (a plain recursive walk building the paths, or "
        "jax's flatten with paths). Each timed like `timeit` (garbage collector paused during a run), best of "
        "3; the decisions equal the naive loop's for every param.",
        "",
        "| | seconds |",
        "|---|---|",
        f"| shardplan resolve | {r['shardplan_s']:.3f} |",
        f"| naive per-leaf regex loop | {r['naive_s']:.3f} |",
        f"| floor (path walk) | {r['floor_s']:.3f} |",
        "",
        f"With the garbage collector left running (as in a program, where code that allocates a path per leaf "
        f"pays for collections over the whole heap): shardplan {r['shardplan_gc_s']:.3f} s, naive "
        f"{r['naive_gc_s']:.3f} s ({r['speedup_vs_naive_gc']:.1f}x).",
        "",
        "## 2. Apply",
        f"Placing {a['bytes'] / 2**30:.2f} GiB in {a['leaves']:,} leaves (host arrays, FSDP-style `(data)` over "
        f"every leaf): `shardplan.place` {a['shardplan_s']:.3f} s vs `jax.device_put` with prebuilt "
        f"NamedShardings {a['device_put_s']:.3f} s ({a['ratio']:.3f}x).",
        "",
        "## 3. Training step",
        f"The example GPT ({_cfg(res['steps']['config'])}), batch 32, AdamW; ms per step.",
        "",
        "| plan | model | auto | hand-written shardings | shard_map | auto / hand | shard_map / auto | "
        "peak MB auto | peak MB shard_map |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {x['plan']} | {x['model']} | {x['auto_ms']:.1f} | {x['hand_ms']:.1f} | {x['shard_map_ms']:.1f} | "
              f"{x['auto_vs_hand']:.2f} | {x['shard_map_vs_auto']:.2f} | {x['auto_peak'] / 1e6:.2f} | "
              f"{x['shard_map_peak'] / 1e6:.2f} |" for x in res["steps"]["plans"]]
    fl = res["fsdp_llama"]
    lines += [
        "",
        f"The Llama rows use {_cfg(res['steps']['llama_config'])}; 'llama scanned' the same with its layers "
        "stacked and scanned under `nnx.remat`. Peak is per device, from XLA's memory analysis (arguments + "
        "outputs - aliased + temporaries).",
        "auto and hand-written compile to the same optimized HLO (tests/test_apply.py asserts it), so their "
        "ratio is timing noise. The 2-D plans pin the residual stream to the batch split (an `act` rule on the "
        "embedding's output, `axis` rules for the Llama's logical names); their hand-written counterpart adds the "
        "same sharding constraint by hand (`pinned_residual` in benchmarks/run.py). Left free, XLA carried the "
        "embedding's width split (`data`) through every layer and moved activations: the auto step ran 2.2x "
        "(gpt_2d) and 2.7x (llama_scan_2d) slower (measured on 2026-11-30 before the plans pinned it). "
        "The shard_map backend partitions the step's computation itself "
        "(`shardplan/runtime/partition/`): matmuls run on local shards (Megatron column/row parallel "
        "under the TP plans, with the activation's all-reduce after a row-parallel matmul), FSDP weights "
        "are gathered at the op that uses them, and its collectives equal the prediction "
        "(tests/test_shard_map.py). The scanned Llama under FSDP (`fsdp_any_rank`): peak per device "
        + "; ".join(f"batch {b}: {x['partitioned_peak'] / 1e6:.2f} MB vs {x['gather_whole_peak'] / 1e6:.2f} MB "
                    f"for the previous lowering that gathered every param whole ({x['ratio']:.2f}x)"
                    for b, x in fl.items())
        + ". Unscanned, XLA:CPU merges a weight's forward and backward gathers (CSE), so gathered weights "
        "stay alive from the forward to the backward pass, on both backends.",
        "",
        "Data parallel, 8 devices vs 1, by global batch size. " + _crossover(res["scaling"]) +
        f" All on this machine's {os.cpu_count()} CPU cores: XLA runs each simulated device on its own thread, "
        "so 8 devices can use every core where 1 device's step mostly uses one; the figures show where the "
        "gradient all-reduce and per-device overhead stop dominating, not what accelerators would do.",
        "",
        "| batch | 8 devices ms | 1 device ms | speed-up |",
        "|---|---|---|---|",
    ]
    lines += [f"| {x['batch']} | {x['ms_8']:.1f} | {x['ms_1']:.1f} | {x['speedup_8_vs_1']:.2f}x |"
              for x in res["scaling"]]
    lines += [
        "",
        "![8 vs 1 devices](benchmarks.png)",
        "",
        "## 4. Cost model accuracy",
        "Predicted per-device bytes of params + optimizer state (from shapes and specs alone) against the "
        "compiled shard_map step's `memory_analysis()` argument bytes less the batch slice; the specs-only "
        "communication (the gather-whole lowering's all-gather + reduce-scatter + all-reduce bytes, what "
        "`check` prints without --step and `shardplan lower` emits) against that lowering's compiled step; and "
        "the partitioned shard_map step's recorded collectives against its compiled HLO (bytes per kind). "
        "Example GPT (`gpt_small`), Adam.",
        "",
        "| plan | state predicted | state measured | error | gather-whole comm predicted | measured | error | "
        "partitioned predicted | partitioned compiled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def kinds(d: dict) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in sorted(d.items())) or "none"

    lines += [f"| {x['plan']} | {x['predicted_state']:,} | {x['measured_state']:,} | {x['state_error']:.2%} | "
              f"{x['predicted_comm']:,} | {x['measured_comm']:,} | {x['comm_error']:.2%} | "
              f"{kinds(x['partitioned_predicted'])} | {kinds(x['partitioned_compiled'])} |" for x in res["cost"]]
    lines += [
        "",
        "## 5. Generation",
        f"{g['tokens']} tokens (8 prompts for each of the prompt lengths {g['prompt_lengths']}, greedy) under "
        f"`plans/gpt_tp.splan`, compile time included: the padded path (fixed buckets, KV cache, one decode "
        f"compile) {g['padded_tok_s']:.0f} tokens/s; the naive path (whole sequence per token, a new shape and "
        f"compile per length) {g['naive_tok_s']:.0f} tokens/s: {g['speedup']:.1f}x.",
        "",
        f"The Llama under `plans/llama_tp.splan`, the same prompts, both generation paths: plain (no cache, the "
        f"whole fixed-length buffer per step) {g['llama']['plain_tok_s']:.0f} tokens/s, compiles "
        f"{g['llama']['compiles']['plain']}; cache {g['llama']['cache_tok_s']:.0f} tokens/s, compiles "
        f"{g['llama']['compiles']['cache']}; naive {g['llama']['naive_tok_s']:.0f} tokens/s "
        f"({g['llama']['plain_vs_naive']:.1f}x and {g['llama']['cache_vs_naive']:.1f}x).",
        "",
    ]
    lines += _step_cost(res)
    lines += _reshard(res)
    c = res["shape_cache"]
    lines += ["## 8. The shapes cache",
              f"`shardplan check plans/gpt_tp.splan --model examples/models.py:{c['model']}`, whole commands, a fresh "
              f"cache: the first builds the shapes with `nnx.eval_shape` and fills the cache, {c['first_s']:.2f} s; "
              f"the next read them back without importing jax, {c['cached_s']:.2f} s (best of 2).", ""]
    if "lsp" in res:
        ls = res["lsp"]
        lines += ["## 9. The language server",
                  f"`shardplan lsp` over stdio driven by a pygls client: the 40-rule plan of section 1 with "
                  f"`# shardplan: --model moe_model.py:moe`, an NNX model with section 1's params (Adam state "
                  f"derived: {ls['leaves']:,} leaves), on a fresh shapes cache. A first server built the model "
                  f"(`nnx.eval_shape`, {ls['first_open_s']:.1f} s to its first diagnostics) and filled the cache; "
                  f"a second server (a new process) opened the plan in {ls['open_s']:.2f} s (the shapes read back "
                  f"from the cache, the shared trees built); then {ls['edits']} edits (a regex broken and fixed, an "
                  f"axis misspelt and "
                  f"fixed, a spec changed and restored), each timed from the change sent to its diagnostics "
                  f"received: median {ls['edit_median_s'] * 1000:.0f} ms, slowest {ls['edit_max_s'] * 1000:.0f} ms.",
                  ""]
        if "unused_edit_max_s" in ls:
            lines[-1:-1] = [f"The same {ls['unused_edits']} edits with a rule in the plan that matches nothing (an "
                            f"unused-rule warning and its near-miss hint at every edit): median "
                            f"{ls['unused_edit_median_s'] * 1000:.0f} ms, slowest "
                            f"{ls['unused_edit_max_s'] * 1000:.0f} ms."]
    if "recost" in res:
        lines += ["## 10. Re-costing a plan on one trace", "`python -m benchmarks.recost`: a plan search's inner "
                  "loop. The step traced once (`shardplan.api.step_coster`), then other plans costed on that trace "
                  "without tracing again, beside the full fast-mode analysis (trace + cost) of the same plan; every "
                  "re-cost equals the full analysis.", "",
                  "| model | mesh | plan | full analysis | re-cost | equal |", "|---|---|---|---|---|---|"]
        for c in res["recost"]["cases"]:
            mesh = ",".join(f"{k}={v}" for k, v in c["mesh"].items())
            for r in c["rows"]:
                lines.append(f"| {c['model']} | {mesh} | {r['plan']} | {r['full_s'] * 1000:.0f} ms | "
                             f"{r['recost_s'] * 1000:.0f} ms | {r['equal']} |")
        lines.append("")
    if "random_plans" in res:
        rp = res["random_plans"]
        lines += ["## 11. Random plans: fast mode against exact mode on plans and models nobody tuned it for",
                  f"`python -m benchmarks.random_plans --pairs {rp['pairs']}`: seeded random plans (2-3 mesh axes over "
                  "8 devices in any order, param families found from shapes, batch over 1-3 axes or batch x sequence, "
                  "act rules) over the example models and tests/fixtures/engine_models.py (a Llama-style decoder, a "
                  "GShard MoE, a decoder that builds its KV cache in the step); "
                  f"{rp['measured']} pairs measured, {len(rp['exact_failed'])} failed to compile in exact mode. A "
                  "kind's error is |fast - exact| as a share of the step's compiled collective bytes; peak and FLOPs "
                  "relative.", "", "| error | median | p90 | worst |", "|---|---|---|---|"]
        for name, d in rp["distribution"].items():
            lines.append(f"| {name} | {d['median']:.1%} | {d['p90']:.1%} | {d['worst']:.1%} |")
        lines.append("")
    if "moe" in res:
        from benchmarks import moe

        lines += ["## 13. Mixture of experts", "`python -m benchmarks.moe`: the MoE step under each expert plan on "
                  "both backends beside plain data parallel (8 devices, batch 32 x 64), and fast mode against exact "
                  "mode for every expert plan (batch 32 x 32).", "", "```", *moe.report(res["moe"]), "```", ""]
    if "pipeline" in res:
        from benchmarks import pipeline

        lines += ["## 14. Pipelines", "`python -m benchmarks.pipeline`: fast mode against exact mode on the "
                  "pipeline plans (llama_deep_scan, batch 16 x 16, 8 devices), and Llama-2-70B shapes on 2,048 H100s "
                  "(hosts of 8) with a pipeline over the hosts beside the non-pipelined plans, offline in fast mode.",
                  "", "```", *pipeline.report(res["pipeline"]), "```", ""]
    path.write_text("\n".join(lines))


def _reshard(res: dict) -> list[str]:
    r = res["reshard"]
    out = [
        "## 7. Reshard cost: `shardplan diff` against the compiled reshard",
        "For each plan pair, the model's params and AdamW state moved from the first plan's layout to the "
        "second's by `jax.jit(lambda *xs: xs, in_shardings=A, out_shardings=B)` compiled for 8 devices, its "
        "collectives read from the optimized HLO; the prediction is `shardplan diff` (specs and shapes alone). "
        "Bytes per device by collective kind (all-gather: the gathered result); error = sum of per-kind "
        "differences / compiled total.",
        "",
        "| before -> after | model | leaves changed | predicted | compiled | error |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        fmt = lambda d: "; ".join(f"{k} {v:,}" for k, v in d.items()) or "none"
        out.append(f"| {row['before']} -> {row['after']} | {row['model']} | {row['changed']} | {fmt(row['predicted'])} "
                   f"| {fmt(row['compiled'])} | {row['error']:.1%} |")
    d = r["diff_70b"]
    out += ["", f"`shardplan diff gpt_tp.splan gpt_2d.splan --shapes` on `{d['model']}` ({d['leaves']} params, mesh "
            f"{d['mesh']}) from a cached shapes file: {d['seconds']:.2f} s for the whole command (best of 3).", ""]
    return out


def _step_cost(res: dict) -> list[str]:
    rows, sc = res["step_cost"]["rows"], res["step_cost_scale"]
    out = [
        "## 6. Step cost: fast mode against exact mode",
        "`shardplan check --step` on the auto backend, 8 devices, AdamW, batch 32: fast mode (the plan's "
        "shardings propagated through the step's jaxpr, no compile) against exact mode (the step compiled by XLA "
        "for the mesh: HLO collectives, `memory_analysis`, `cost_analysis`, loop iterations added). Every plan "
        "in plans/ x both model families; a family's model is the GPT (`gpt_small`, annotated for the logical "
        "plan) or the Llama (`llama_small`, scanned under remat for the scan plan). Communication is bytes per "
        "device per step by kind (CPU all-reduces that every device only slices counted as reduce-scatters).",
        "Lookups, where XLA's gather partitioner decides (each followed in fast mode, found by reading the "
        "compiled programs and checked on other meshes in tests/test_stepcost.py): a table whose width and the "
        "batch share an axis (the 2-D plans' embedding) has its indices moved onto the table's row axis "
        "(collective-permute), gathered over the rest of the batch axis, then over the rows; a table split over "
        "its rows on the batch axis (the 2-D GPT's position table) has that split moved onto the spare axis, a "
        "masked lookup all-reduced over it, and its gradient permuted back; a residual constrained whole "
        "(gpt_logical on the Llama, whose activation names the plan does not map) gathers the lookup's values "
        "and its fill mask apart. XLA orders its ways of partitioning a gather by a dry-run cost that depends "
        "on the sizes, which fast mode does not reproduce: its notes say so for such lookups. (Under llama_sp "
        "the CPU program sums the embedding's gradient over one axis, then the other, then slices it per "
        "device: exact mode reads that first sum as the reduce-scatter it is, since sums commute.)",
        "",
        "Memory traffic (bytes read and written in device memory per step; no target: fast mode assumes an "
        "accelerator's fusion, and XLA:CPU stores more intermediates; docs/stepcost.md compares it with a GPU's "
        "compiled programs) is shown as fast / exact.",
        "",
        "| plan | model | FLOPs fast / exact | peak fast / exact | memory traffic fast / exact | communication fast / "
        "exact (per kind) |",
        "|---|---|---|---|---|---|",
    ]
    def table_rows(rs: list[dict]) -> list[str]:
        lines = []
        for r in rs:
            comm = "; ".join(f"{k} {c['fast']:,} / {c['exact']:,}" for k, c in r["comm"].items())
            hbm = f"{r['hbm_fast'] / r['hbm_exact']:.2f}" if r.get("hbm_exact") else "-"
            model = r["model"] + (f" ({r['tokens']} tokens)" if r.get("tokens") == "256x64" else "")
            lines.append(f"| {r['plan']} | {model} | {r['flops_fast'] / r['flops_exact']:.3f} | "
                         f"{r['peak_fast']:,} / {r['peak_exact']:,} ({r['peak_fast'] / r['peak_exact']:.2f}) | {hbm} | "
                         f"{comm} |")
        return lines

    out += table_rows([r for r in rows if r.get("target", "cpu") == "cpu"])
    for target in sorted({r["target"] for r in rows if r.get("target", "cpu") != "cpu"}):
        out += ["", f"Told the target, fast mode against the program the target's compiler makes offline (`--target "
                f"{target}`, fast mode with that compiler's rules: docs/stepcost.md), same columns:", "",
                "| plan | model | FLOPs fast / exact | peak fast / exact | memory traffic fast / exact | communication "
                "fast / exact (per kind) |", "|---|---|---|---|---|---|"]
        out += table_rows([r for r in rows if r.get("target") == target])
        misses = [(r, m) for r in rows if r.get("target") == target for m in r.get("misses", [])]
        if misses:
            out += ["", "Where they differ most (per row, by kind and model line; bytes fast / exact, with the ops):", ""]
            out += [f"- {r['plan']} x {r['model']}{' (256x64)' if r.get('tokens') == '256x64' else ''}: {m['kind']} at {Path(m['source']).name}: {m['fast']:,} / "
                    f"{m['exact']:,} ({m['fast_op'] or '-'} / {m['exact_op'] or '-'})" for r, m in misses]
    out += [
        "",
        f"Fast mode on `{sc['model']}` (mesh {sc['mesh']}, the full train step): {sc['fast_s']:.1f} s, against "
        f"{sc['eval_shape_s']:.1f} s for `nnx.eval_shape` of the model alone ({sc['ratio']:.2f}x). shardplan's own "
        "abstract builds skip JAX's search for a tracer's origin (Flax reads `.sharding` on every Variable write; "
        "on a tracer that raises an error whose text JAX builds by walking the whole trace, so an init is "
        f"quadratic): with that, `nnx.eval_shape` takes {sc['eval_shape_quiet_s']:.1f} s "
        f"({sc['fast_s'] / sc['eval_shape_quiet_s']:.1f}x against it; the step's trace itself dominates). It predicts "
        f"{sc['flops_per_device'] / 1e12:,.1f} TFLOP and a peak of {sc['peak_per_device'] / 2**30:,.1f} GiB per "
        "device.",
    ]
    if "exact_64_s" in sc:
        out.append(f"Exact mode for `llama_1b` (1.50B params, scanned) on data=16,model=4 (64 simulated devices), "
                   f"batch 64x2048: {sc['exact_64_s']:.1f} s for the whole `shardplan check --compile` "
                   f"({'ok' if sc['exact_64_ok'] else 'FAILED'}).")
    return out + [""]


def _crossover(rows: list[dict]) -> str:
    faster = [x["batch"] for x in rows if x["speedup_8_vs_1"] > 1.0]
    slower = [x["batch"] for x in rows if x["speedup_8_vs_1"] <= 1.0]
    if not faster:
        return "At every batch size measured, communication and overhead outweigh the gain: 1 device is faster."
    if not slower:
        return "At every batch size measured, 8 devices are faster."
    return (f"At batch {', '.join(map(str, slower))}, communication and per-device overhead outweigh the gain "
            f"(1 device is faster); from batch {min(faster)} on, 8 devices are faster.")


def _cfg(c: dict) -> str:
    return f"d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads, d_ff {c['d_ff']}, vocab {c['vocab']}"


def plot(path: Path, res: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot written")
        return
    rows = res["scaling"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    batches = [x["batch"] for x in rows]
    ax.plot(batches, [x["speedup_8_vs_1"] for x in rows], marker="o", label="8 devices / 1 device")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel("speed-up of the DP step")
    ax.set_title("Data parallel on 8 simulated CPU devices vs 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
