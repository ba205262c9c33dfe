"""`shardplan lsp` end to end with pytest-lsp: open, edit (an error introduced and fixed),
hover on a rule, completion, go to definition of `extends`, formatting."""

import sys
import time

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient

from shardplan.lang.fmt import format_text
from tests.helpers import PLANS, ROOT

MODEL = f"{ROOT / 'examples' / 'models.py'}:gpt_tiny"
TEXT = f'''# shardplan: --model {MODEL}
plan "tp"
mesh data = *, model = 2
batch (data, _)
param "blocks/\\d+/attn/(query|key|value)/kernel"  (_, model)
param "blocks/\\d+/mlp/(up|gate)/kernel" (_, model)
default replicated
'''


@pytest_lsp.fixture(config=ClientServerConfig(server_command=[sys.executable, "-m", "shardplan", "lsp"]))
async def client(lsp_client: LanguageClient):
    await lsp_client.initialize_session(types.InitializeParams(capabilities=types.ClientCapabilities(),
                                                               initialization_options={"devices": 8}))
    yield
    await lsp_client.shutdown_session()


async def opened(client: LanguageClient, path, text: str) -> str:
    uri = path.as_uri()
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id="splan", version=1, text=text)))
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    return uri


async def edit(client: LanguageClient, uri: str, version: int, text: str) -> float:
    t = time.perf_counter()
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
        content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)]))
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    return time.perf_counter() - t


@pytest.mark.asyncio
async def test_diagnostics_as_you_type(client: LanguageClient, tmp_path):
    uri = await opened(client, tmp_path / "p.splan", TEXT)
    assert [d.code for d in client.diagnostics[uri] if d.severity == types.DiagnosticSeverity.Error] == []
    await edit(client, uri, 2, TEXT.replace("(_, model)\nparam", "(_, modle)\nparam"))
    (d,) = [d for d in client.diagnostics[uri] if d.code == "unknown-axis"]
    assert d.range.start.line == 4 and "did you mean 'model'" in d.message
    await edit(client, uri, 3, TEXT)
    assert [d for d in client.diagnostics[uri] if d.severity == types.DiagnosticSeverity.Error] == []
    # Against the model: a rule that matches nothing is a warning at its line.
    await edit(client, uri, 4, TEXT.replace("mlp/(up|gate)", "ffn/(up|gate)"))
    assert [(d.code, d.range.start.line) for d in client.diagnostics[uri]] == [("unused-rule", 5)]


@pytest.mark.asyncio
async def test_hover_completion_definition_formatting(client: LanguageClient, tmp_path):
    uri = await opened(client, tmp_path / "p.splan", TEXT)
    hover = await client.text_document_hover_async(types.HoverParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(4, 2)))
    assert "decides 6 arrays" in hover.contents.value and "blocks/*/attn/query/kernel" in hover.contents.value
    items = await client.text_document_completion_async(types.CompletionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(4, 60)))
    labels = {i.label for i in items.items}
    assert {"model", "data", "param", "replicated"} <= labels
    child = tmp_path / "child.splan"
    child_uri = await opened(client, child, f'extends "{PLANS / "gpt_tp.splan"}"\nmesh data = *, model = 4\n')
    loc = await client.text_document_definition_async(types.DefinitionParams(
        text_document=types.TextDocumentIdentifier(uri=child_uri), position=types.Position(0, 3)))
    assert loc.uri == (PLANS / "gpt_tp.splan").resolve().as_uri()
    edits = await client.text_document_formatting_async(types.DocumentFormattingParams(
        text_document=types.TextDocumentIdentifier(uri=uri), options=types.FormattingOptions(2, True)))
    assert len(edits) == 1 and edits[0].new_text == format_text(TEXT)
