"""``FILE.py:NAME`` and ``package.module:NAME`` references (a model factory, a loss, a step),
checked before anything heavy is imported: the file exists, the module can be found, the name is
defined at the file's top level, each with a did-you-mean. Reads the file's syntax tree only; the
module is not run (its own errors are named where it is imported, later).

Jax-free, so a mistyped flag is reported in about a second instead of after jax and the model load.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from shardplan.core.meshes import closest
from shardplan.errors import as_error, error


def _fail(what: str, message: str, hint: str) -> None:
    raise as_error([error("bad-model-arg", message, hint, path=what)])


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module's top level binds (defs, classes, assignments, imports), or None when it may
    bind others at run time (``from m import *``, a module ``__getattr__``, ``globals()`` writes)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, _DEFS):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif not isinstance(node, (ast.Expr, ast.Pass)):
            # if/try/with/for blocks at the top level: what they bind, wherever it is
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
            names.update(n.name for n in ast.walk(node) if isinstance(n, _DEFS))
    if "__getattr__" in names or "globals" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
        return None
    return names


def _check_name(what: str, name: str, where: str, source: str) -> None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return  # the import names the line, with Python's own message
    names = top_level_names(tree)
    if names is not None and name not in names:
        defs = (n for n in tree.body if isinstance(n, _DEFS))
        callables = sorted((n.name for n in defs if not n.name.startswith("_")), key=lambda n: (n[0].isupper(), n))
        near = closest(name, names)
        _fail(
            what,
            f"{where} defines no '{name}'" + (f"; {near}" if near else ""),
            f"name a function or class defined there ({', '.join(callables[:12])}"
            + (", ..." if len(callables) > 12 else "")
            + ")"
            if callables
            else "name a function or class defined there",
        )


def check_ref(spec: str, what: str) -> None:
    """``spec`` (``FILE.py:NAME`` or ``package.module:NAME``) names something that exists.

    Raises:
        ShardPlanError: malformed, no such file or module, or no such name in it.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        kind = "FACTORY" if what == "--model" else "FN"
        _fail(what, f"cannot read {what} '{spec}'", f"write FILE.py:{kind} or package.module:{kind}")
    if target.endswith(".py") or os.sep in target:
        file = Path(target)
        if not file.is_file():
            folder = file.parent if file.parent.is_dir() else None
            near = closest(file.name, [p.name for p in folder.glob("*.py")]) if folder is not None else ""
            _fail(
                what,
                f"no such file: {target}" + (f"; {near}" if near else ""),
                "check the path to the file" if folder is not None else f"no folder {file.parent}: check the path",
            )
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            _fail(what, f"cannot read {target}: {e}", "give a readable Python file")
        _check_name(what, name, target, source)
        return
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does (and the loader later)
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(target) if all(p.isidentifier() for p in target.split(".")) else None
    except (ImportError, ValueError):
        found = None
    if found is None:
        _fail(
            what,
            f"no module '{target}' (from the working directory {os.getcwd()})",
            "give FILE.py:NAME, or a module importable from here (package.module:NAME)",
        )
    origin = getattr(found, "origin", None)
    if origin and origin.endswith(".py"):
        try:
            _check_name(what, name, f"module {target} ({origin})", Path(origin).read_text(encoding="utf-8"))
        except OSError:
            pass
