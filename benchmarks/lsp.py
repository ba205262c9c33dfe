"""The language server as an editor drives it: `shardplan lsp` over stdio, the 40-rule MoE plan
checked against the 99,092-leaf MoE state (an NNX model whose params are section 1's, Adam state
derived) read back from the shapes cache, timed from each edit sent to its diagnostics received;
then the same edits while the plan also holds a rule that matches nothing (its unused-rule warning
on every check). The servers are told the workspace (the model's folder) is trusted."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from benchmarks.resolution import moe_state, plan_text
from shardplan.runtime import tree

EDITS = 12

# The MoE of section 1 as an NNX model (the same param paths and shapes), for `--model`.
MODEL = """
import jax.numpy as jnp
from flax import nnx

LAYERS, EXPERTS = {layers}, 64


class Scale(nnx.Module):
    def __init__(self, n):
        self.scale = nnx.Param(jnp.ones((n,)))


class Attention(nnx.Module):
    def __init__(self, rngs):
        for name in ("query", "key", "value", "out"):
            setattr(self, name, nnx.Linear(1024, 1024, use_bias=False, rngs=rngs))


class Expert(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(1024, 512, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(1024, 512, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(512, 1024, use_bias=False, rngs=rngs)
        self.up_bias = nnx.Param(jnp.zeros((512,)))
        self.down_bias = nnx.Param(jnp.zeros((1024,)))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = Attention(rngs)
        self.ln1, self.ln2 = Scale(1024), Scale(1024)
        self.router = nnx.Linear(1024, EXPERTS, use_bias=False, rngs=rngs)
        self.experts = nnx.List([Expert(rngs) for _ in range(EXPERTS)])


class MoE(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32000, 1024, rngs=rngs)
        self.ln_f = Scale(1024)
        self.head = nnx.Linear(1024, 32000, use_bias=False, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])


def moe():
    return MoE(nnx.Rngs(0))
"""


# A plausible rule that matches nothing in this model (no fused qkv projection): on every check.
UNUSED = 'param "blocks/\\d+/attn/qkv/kernel" (_, model)\n'


def _edits(text: str) -> list[tuple[str, str]]:
    """What a user does while typing: an axis name misspelt and fixed, a rule's regex broken so
    it matches nothing and fixed, a spec changed and restored."""
    broken = text.replace("router/kernel", "routr/kernel")
    typo = text.replace('"blocks/\\d+/attn/out/kernel" (model, _)', '"blocks/\\d+/attn/out/kernel" (modle, _)')
    spec = text.replace('"head/kernel" (_, model)', '"head/kernel" (model, _)')
    out = []
    for _ in range(EDITS // 6 + 1):
        out += [
            ("unused rule", broken),
            ("fixed", text),
            ("unknown axis", typo),
            ("fixed", text),
            ("spec changed", spec),
            ("fixed", text),
        ]
    return out[:EDITS]


async def _timed(client: LanguageClient, got: asyncio.Queue, uri: str, version: int, edits: list) -> tuple[list, list]:
    """Each edit sent, timed to its diagnostics; the codes each edit got."""
    times, codes = [], []
    for v, (what, new) in enumerate(edits, start=version):
        t = time.perf_counter()
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=v),
                content_changes=[types.TextDocumentContentChangeWholeDocument(text=new)],
            )
        )
        done, diags = await asyncio.wait_for(got.get(), 120)
        times.append(done - t)
        codes.append((what, sorted({str(d.code) for d in diags})))
    return times, codes


async def _session(folder: Path, layers: int) -> dict:
    """One server: opened (its first check), then every edit timed; then the same edits with a
    rule that matches nothing in the plan."""
    text = "# shardplan: --model moe_model.py:moe --devices 32 --optimizer adam\n" + plan_text()
    plan = folder / "moe.splan"
    plan.write_text(text)
    uri = plan.as_uri()
    client = LanguageClient("shardplan-bench", "1")
    got: asyncio.Queue = asyncio.Queue()

    @client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def _diagnostics(params: types.PublishDiagnosticsParams) -> None:
        got.put_nowait((time.perf_counter(), params.diagnostics))

    await client.start_io(sys.executable, "-m", "shardplan", "lsp")
    try:
        await client.initialize_async(
            types.InitializeParams(
                capabilities=types.ClientCapabilities(),
                workspace_folders=[types.WorkspaceFolder(uri=folder.as_uri(), name="bench")],
                initialization_options={"trustModelCode": True},  # the model is built by the first server
            )
        )
        client.initialized(types.InitializedParams())
        t = time.perf_counter()
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(
                text_document=types.TextDocumentItem(uri=uri, language_id="splan", version=1, text=text)
            )
        )
        done, first = await asyncio.wait_for(got.get(), 600)
        open_s = done - t
        assert not [d for d in first if d.severity == types.DiagnosticSeverity.Error], first
        times, codes = await _timed(client, got, uri, 2, _edits(text))
        with_unused = text.replace("default replicated\n", UNUSED + "default replicated\n")
        assert with_unused != text
        await _timed(client, got, uri, 2 + EDITS, [("unused rule", with_unused)])  # its first check, untimed
        unused_times, unused_codes = await _timed(client, got, uri, 3 + EDITS, _edits(with_unused))
        await client.shutdown_async(None)
        client.exit(None)
    finally:
        await client.stop()
    # The edits must have been seen: each broken version reports its problem, each fix clears it.
    for what, c in codes:
        want = {"unused rule": ["unused-rule"], "unknown axis": ["unknown-axis"]}.get(what, [])
        assert c == want, (what, c)
    for what, c in unused_codes:  # reported after every edit the plan checks against the model after
        want = {"unknown axis": ["unknown-axis"]}.get(what, ["unused-rule"])
        assert c == want, (what, c)
    return {"open_s": open_s, "edit_median_s": statistics.median(times), "edit_max_s": max(times),
            "edits": len(times), "unused_edit_median_s": statistics.median(unused_times),
            "unused_edit_max_s": max(unused_times), "unused_edits": len(unused_times)}


def run(quick: bool) -> dict:
    """Two servers on a fresh shapes cache: the first builds the model (nnx.eval_shape) and fills
    the cache; the second, a new process, reads the shapes back; each edit of the second is timed."""
    layers = 4 if quick else 101
    params, _ = moe_state(layers, 64)
    leaves = len(tree.flatten(params)[0])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "moe_model.py").write_text(MODEL.format(layers=layers))
        cache = folder / "cache"
        old = os.environ.get("SHARDPLAN_CACHE_DIR")
        os.environ["SHARDPLAN_CACHE_DIR"] = str(cache)  # the servers inherit it
        try:
            first = asyncio.run(_session(folder, layers))
            assert list(cache.glob("*.json")), "the first check wrote no shapes cache entry"
            out = asyncio.run(_session(folder, layers))
        finally:
            if old is None:
                os.environ.pop("SHARDPLAN_CACHE_DIR", None)
            else:
                os.environ["SHARDPLAN_CACHE_DIR"] = old
    return {**out, "leaves": leaves * 3 + 2, "first_open_s": first["open_s"]}
