"""The language server as an editor drives it: `shardplan lsp` over stdio, the 40-rule MoE plan
checked against the 99,092-leaf MoE state (params from a shapes file, Adam state derived),
timed from each edit sent to its diagnostics received."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from benchmarks.resolution import moe_state, plan_text
from shardplan.core.shapes import shapes_json
from shardplan.runtime import tree

EDITS = 12


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


async def _session(folder: Path, layers: int) -> dict:
    params, _ = moe_state(layers, 64)
    leaves, _ = tree.flatten(params)
    (folder / "moe.json").write_text(shapes_json(leaves))
    text = "# shardplan: --shapes moe.json --devices 32 --optimizer adam\n" + plan_text()
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
        await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities()))
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
        times, codes = [], []
        for version, (what, new) in enumerate(_edits(text), start=2):
            t = time.perf_counter()
            client.text_document_did_change(
                types.DidChangeTextDocumentParams(
                    text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
                    content_changes=[types.TextDocumentContentChangeWholeDocument(text=new)],
                )
            )
            done, diags = await asyncio.wait_for(got.get(), 120)
            times.append(done - t)
            codes.append((what, sorted({str(d.code) for d in diags})))
        await client.shutdown_async(None)
        client.exit(None)
    finally:
        await client.stop()
    # The edits must have been seen: each broken version reports its problem, each fix clears it.
    for what, c in codes:
        want = {"unused rule": ["unused-rule"], "unknown axis": ["unknown-axis"]}.get(what, [])
        assert c == want, (what, c)
    return {
        "leaves": len(leaves) * 3 + 2,
        "open_s": open_s,
        "edit_median_s": statistics.median(times),
        "edit_max_s": max(times),
        "edits": len(times),
    }


def run(quick: bool) -> dict:
    """Open once (reads the shapes, builds the shared trees), then time every edit."""
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_session(Path(tmp), 4 if quick else 101))
