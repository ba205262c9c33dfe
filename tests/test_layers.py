"""The package's architecture and hygiene, checked by the tools CI relies on: import-linter
(layers and forbidden imports), ruff (lint and format) and mypy, all clean on shardplan/."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

BIN = Path(sys.executable).parent


def tool(name: str, *args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = BIN / name
    if not exe.exists():
        pytest.fail(f"{name} is not installed: pip install '.[test]'")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_import_contracts_are_kept():
    r = tool("lint-imports")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("core/spec.py", "from shardplan.runtime import tree  # noqa", "layers"),  # core -> runtime: a back-edge
        ("lang/checker.py", "from shardplan.api import check  # noqa", "layers"),  # lang -> api
        ("runtime/mesh.py", "from shardplan.lang import parser  # noqa", "layers"),  # siblings stay independent
        ("core/plan.py", "import jax  # noqa", "never import jax"),
        ("runtime/tree.py", "import lark  # noqa", "only the language imports Lark"),
        ("runtime/sharding.py", "from shardplan.errors import error  # noqa", "the sharding floor and the primitive"),
        ("runtime/primitives.py", "from shardplan.runtime import fast  # noqa", "the sharding floor and the primitive"),
    ],
)
def test_a_deliberate_back_edge_breaks_the_contract(tmp_path, module, line, contract):
    """The check can fail: a copy of the package with one forbidden import is rejected."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "shardplan", copy / "shardplan")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = copy / "shardplan" / module
    target.write_text(target.read_text() + f"\n{line}\n")
    env = {"PYTHONPATH": str(copy), "PATH": str(BIN)}
    r = tool("lint-imports", "--config", str(tmp_path / "pyproject.toml"), cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BROKEN" in r.stdout and contract in r.stdout


def test_ruff_lint_and_format_are_clean():
    r = tool("ruff", "check", "shardplan")
    assert r.returncode == 0, r.stdout + r.stderr
    r = tool("ruff", "format", "--check", "shardplan")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = tool("mypy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout


def test_every_registered_backend_has_a_runtime_module_a_fast_cost_and_a_template():
    import importlib
    import inspect
    from importlib import resources

    from shardplan.core.backends import BACKENDS
    from shardplan.runtime import backends

    for name, info in BACKENDS.items():
        assert callable(backends.get(name).build), name
        module, function = info.fast_cost.split(":")
        cost = getattr(importlib.import_module(module), function)
        assert list(inspect.signature(cost).parameters)[:3] == ["tracer", "plan", "mesh"], name
        assert resources.files("shardplan.tools").joinpath("templates", info.template).is_file(), name


def test_the_cli_and_the_checker_read_the_backend_registry():
    import shardplan
    from shardplan.core import backends
    from shardplan.tools.cli import build_parser

    lower = build_parser()._subparsers._group_actions[0].choices["lower"]  # type: ignore[union-attr]
    choices = next(a.choices for a in lower._actions if a.dest == "backend")
    assert tuple(choices) == backends.NAMES
    with pytest.raises(shardplan.PlanCheckError) as info:
        shardplan.loads("mesh data = *\nbackend nope\ndefault replicated")
    assert info.value.diagnostics[0].hint.endswith("backends: " + ", ".join(backends.NAMES))


def test_architecture_md_lists_every_module():
    """docs/architecture.md's listing names every module of the package (by file name)."""
    listing = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    missing = [
        str(f.relative_to(ROOT / "shardplan"))
        for f in sorted((ROOT / "shardplan").rglob("*.py"))
        if f.name != "__init__.py" and not re.search(r"(?<![\w.])" + re.escape(f.name) + r"\b", listing)
    ]
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_no_import_cycle_of_any_kind():
    """No module of the package imports, directly or through others, a module that imports it back,
    function-level imports included (grimp reads them all)."""
    import grimp

    graph = grimp.build_graph("shardplan")
    cycles = []
    for importer in sorted(graph.modules):
        if not importer.startswith("shardplan"):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported.startswith("shardplan") and imported != importer:
                back = graph.find_shortest_chain(importer=imported, imported=importer)
                if back:
                    cycles.append(" -> ".join((importer, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles[:10])
