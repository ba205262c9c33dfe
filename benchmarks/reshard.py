"""Section 7: `shardplan diff`'s reshard prediction against the compiled reshard.

For each plan pair, the model's params and AdamW state are resharded from plan A's layout to
plan B's by ``jax.jit(lambda *xs: xs, in_shardings=A, out_shardings=B)``, compiled for 8
devices (abstract inputs, nothing allocated), and its collectives read from the optimized HLO
(``shardplan.core.hlo``); the prediction is ``shardplan.api.diff`` (specs and shapes alone).
Also: `shardplan diff` on the Llama-2-70B shapes from a cached shapes file, end to end.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
MODELS = ROOT / "examples" / "models.py"

GPT_PAIRS = [("dp", "fsdp"), ("fsdp", "dp"), ("fsdp", "gpt_tp"), ("gpt_tp", "fsdp"), ("gpt_tp", "gpt_2d"),
             ("gpt_2d", "gpt_tp"), ("gpt_2d", "dp"), ("dp", "gpt_2d"), ("gpt_2d", "fsdp"), ("fsdp", "gpt_2d"),
             ("gpt_tp", "dp"), ("gpt_logical", "gpt_2d")]
LLAMA_PAIRS = [("llama_tp", "fsdp"), ("fsdp", "llama_tp"), ("llama_tp", "dp"), ("llama_scan_2d", "dp")]


def compiled(a: Path, b: Path, factory) -> collections.Counter:
    import jax
    import optax

    import shardplan
    from shardplan.core import hlo
    from shardplan.runtime import mesh as mesh_mod
    from shardplan.runtime import model as model_mod
    from shardplan.runtime import specs

    pa, pb = shardplan.load(a), shardplan.load(b)
    m, o = model_mod.abstract_model_and_optimizer(factory, optax.adamw(1e-3))
    ra, rb = specs.resolve_model(pa, m, o, devices=8), specs.resolve_model(pb, m, o, devices=8)
    ma, mb = mesh_mod.make_mesh(pa), mesh_mod.make_mesh(pb)
    da, db = ra[0].decisions + ra[1].decisions, rb[0].decisions + rb[1].decisions
    args = [jax.ShapeDtypeStruct(d.shape, d.dtype) for d in da]
    f = jax.jit(lambda *xs: xs, in_shardings=[jax.NamedSharding(ma, specs.pspec(d.spec)) for d in da],
                out_shardings=tuple(jax.NamedSharding(mb, specs.pspec(d.spec)) for d in db))
    out: collections.Counter = collections.Counter()
    for op in hlo.parse(f.lower(*args).compile().as_text(), 8):
        out[op.kind] += op.bytes_per_step
    return out


def run(quick: bool) -> dict:
    import shardplan
    from examples import models

    size = "tiny" if quick else "small"
    pairs = [(f"gpt_{size}", a, b) for a, b in (GPT_PAIRS[:3] if quick else GPT_PAIRS)]
    pairs += [] if quick else [(f"llama_{size}", a, b) for a, b in LLAMA_PAIRS]
    rows = []
    for model, a, b in pairs:
        name = model + ("_annotated" if "logical" in a + b else "") + ("_scan" if "scan" in a + b else "")
        pa, pb = PLANS / f"{a}.splan", PLANS / f"{b}.splan"
        t = time.perf_counter()
        d = shardplan.api.diff(pa, pb, model=f"{MODELS}:{name}", optimizer="adamw", devices=8)
        predict_s = time.perf_counter() - t
        predicted: collections.Counter = collections.Counter()
        for mv in d.moves:
            predicted[mv.kind] += mv.bytes
        got = compiled(pa, pb, getattr(models, name))
        kinds = sorted(set(predicted) | set(got))
        total = sum(got.values())
        error = sum(abs(predicted[k] - got[k]) for k in kinds) / total if total else float(sum(predicted.values()) > 0)
        rows.append({"model": name, "before": a, "after": b, "changed": len(d.changed),
                     "predicted": {k: predicted[k] for k in kinds}, "compiled": {k: got[k] for k in kinds},
                     "error": error, "predict_s": predict_s})
    return {"rows": rows, "diff_70b": _diff_70b(quick)}


def _diff_70b(quick: bool) -> dict:
    """`shardplan diff` from cached Llama-2-70B shapes (80 layers), a whole CLI run, best of 3."""
    from flax import nnx

    import shardplan
    from examples import models

    name = "gpt_small" if quick else "llama2_70b"
    mesh = "data=4,model=2" if quick else "data=32,model=8"
    with tempfile.TemporaryDirectory() as tmp:
        shapes = Path(tmp) / "shapes.json"
        with nnx.use_eager_sharding(False):
            shardplan.dump_shapes(nnx.eval_shape(getattr(models, name)), shapes)
        cmd = [sys.executable, "-m", "shardplan", "diff", str(PLANS / "gpt_tp.splan"), str(PLANS / "gpt_2d.splan"),
               "--shapes", str(shapes), "--mesh", mesh]
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            best = min(best, time.perf_counter() - t)
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
        params = len(json.loads(shapes.read_text())["params"])
    return {"model": name, "mesh": mesh, "seconds": best, "leaves": params}
