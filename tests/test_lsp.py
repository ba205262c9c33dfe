"""`shardplan lsp` end to end with pytest-lsp: open, edit (an error introduced and fixed),
hover on a rule, completion, go to definition of `extends`, formatting; model code runs only
when the client trusts the workspace, and only from inside it."""

import contextlib
import sys
import time

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient

from shardplan.errors import Diagnostic
from shardplan.lang.fmt import format_text
from shardplan.tools import trust
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


CONFIG = ClientServerConfig(server_command=[sys.executable, "-m", "shardplan", "lsp"])


def init(folders, options) -> types.InitializeParams:
    return types.InitializeParams(
        capabilities=types.ClientCapabilities(), initialization_options=options,
        workspace_folders=[types.WorkspaceFolder(uri=f.as_uri(), name=f.name) for f in folders])


@pytest_lsp.fixture(config=CONFIG)
async def client(lsp_client: LanguageClient):
    # The example models live in the repository: it is the (trusted) workspace.
    await lsp_client.initialize_session(init([ROOT], {"devices": 8, "trustModelCode": True}))
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


# A model whose import and call leave files behind: proof of whether its code ran.
MODEL_PY = """
from pathlib import Path
Path(__file__).with_name("imported.txt").write_text("the model module was imported")
import jax.numpy as jnp
from flax import nnx


class Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 4)))


def tiny():
    Path(__file__).with_name("called.txt").write_text("the factory was called")
    return Tiny()
"""
PLAN = """# shardplan: --model {model} --devices 8
plan "p"
mesh data = *, model = 2
param "w" (_, model)
param "nothing/here" (model, _)
default replicated
"""


@contextlib.asynccontextmanager
async def session(folders, **options):
    """A server of its own, initialized with these workspace folders and options."""
    lsp = await CONFIG.start()
    await lsp.initialize_session(init(folders, options))
    try:
        yield lsp
    finally:
        await lsp.shutdown_session()
        await lsp.stop()


def seen(lsp: LanguageClient, uri: str) -> list[tuple[str, int, types.DiagnosticSeverity]]:
    return [(d.code, d.range.start.line, d.severity) for d in lsp.diagnostics[uri]]


def write_model(folder, name="m.py"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(MODEL_PY)
    return folder / name


@pytest.mark.asyncio
async def test_an_untrusted_workspace_runs_no_model_code_and_says_how_to_enable_it(tmp_path):
    write_model(tmp_path)
    async with session([tmp_path], devices=8) as lsp:  # no trustModelCode: the default
        uri = await opened(lsp, tmp_path / "p.splan", PLAN.format(model="m.py:tiny"))
        assert not (tmp_path / "imported.txt").exists() and not (tmp_path / "called.txt").exists()
        (notice,) = lsp.diagnostics[uri]  # one diagnostic; no unused-rule: not checked against the model
        assert notice.code == "model-not-run" and notice.range.start.line == 0
        assert notice.severity == types.DiagnosticSeverity.Information
        assert '"trustModelCode": true' in notice.message and "Manage Workspace Trust" in notice.message
        hover = await lsp.text_document_hover_async(types.HoverParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(3, 2)))
        assert "not checked against the model" in hover.contents.value
        # Every edit: still nothing run, still that one notice.
        await edit(lsp, uri, 2, PLAN.format(model="m.py:tiny").replace("(_, model)", "(model, _)"))
        assert [d.code for d in lsp.diagnostics[uri]] == ["model-not-run"]
        assert not (tmp_path / "imported.txt").exists()


@pytest.mark.asyncio
async def test_a_trusted_workspace_builds_its_model_and_an_untrusted_one_then_reads_the_cache(tmp_path):
    write_model(tmp_path)
    text = PLAN.format(model="m.py:tiny")
    async with session([tmp_path], devices=8, trustModelCode=True) as lsp:
        uri = await opened(lsp, tmp_path / "p.splan", text)
        assert (tmp_path / "called.txt").exists()  # built: the test above would see it if run untrusted
        assert seen(lsp, uri) == [("unused-rule", 4, types.DiagnosticSeverity.Warning)]
    (tmp_path / "imported.txt").unlink()
    (tmp_path / "called.txt").unlink()
    # Untrusted, the shapes come from the cache the trusted build filled: checked, nothing run.
    async with session([tmp_path], devices=8) as lsp:
        uri = await opened(lsp, tmp_path / "p.splan", text)
        assert seen(lsp, uri) == [("unused-rule", 4, types.DiagnosticSeverity.Warning)]
        assert not (tmp_path / "imported.txt").exists() and not (tmp_path / "called.txt").exists()


@pytest.mark.asyncio
async def test_a_package_module_is_found_in_the_workspace_without_importing_it(tmp_path):
    pkg = tmp_path / "mypkg"
    write_model(pkg, "mod.py")
    (pkg / "__init__.py").write_text("open(__file__ + '.ran', 'w').write('imported')\n")
    text = PLAN.format(model="mypkg.mod:tiny")
    async with session([tmp_path], devices=8) as lsp:
        uri = await opened(lsp, tmp_path / "p.splan", text)
        assert [d.code for d in lsp.diagnostics[uri]] == ["model-not-run"]
        assert list(tmp_path.rglob("*.ran")) == [] and not (pkg / "imported.txt").exists()
    async with session([tmp_path], devices=8, trustModelCode=True) as lsp:
        uri = await opened(lsp, tmp_path / "p.splan", text)
        assert seen(lsp, uri) == [("unused-rule", 4, types.DiagnosticSeverity.Warning)]
        assert (pkg / "called.txt").exists() and (pkg / "__init__.py.ran").exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("model, why", [
    ("../outside/m.py:tiny", "outside the workspace folders"),
    (None, "outside the workspace folders"),  # the same file by its absolute path
    ("json:loads", "is not in the workspace folders"),  # an installed module
])
async def test_a_model_outside_the_workspace_is_refused_even_when_trusted(tmp_path, model, why):
    outside = write_model(tmp_path / "outside")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    async with session([workspace], devices=8, trustModelCode=True) as lsp:
        uri = await opened(lsp, workspace / "p.splan", PLAN.format(model=model or f"{outside}:tiny"))
        (refused,) = lsp.diagnostics[uri]
        assert refused.code == "bad-model-arg" and refused.range.start.line == 0 and why in refused.message
        assert refused.severity == types.DiagnosticSeverity.Error
        assert not (outside.parent / "imported.txt").exists()


def test_a_symlink_out_of_the_workspace_is_refused(tmp_path):
    outside = write_model(tmp_path / "outside")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "m.py").symlink_to(outside)
    got = trust.locate("m.py:tiny", tmp_path / "ws", [(tmp_path / "ws").resolve()])
    assert isinstance(got, Diagnostic) and "outside the workspace folders" in got.message
    ok = trust.locate("m.py:tiny", tmp_path / "outside", [(tmp_path / "outside").resolve()])
    assert not isinstance(ok, Diagnostic) and ok.file == outside.resolve()
