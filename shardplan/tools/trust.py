"""Which model code the language server may run: a plan's ``--model``, located without importing it.

A plan's ``# shardplan: --model ...`` comment names code to import and call, and a plan can come
from anyone (a cloned repository, a pull request). The language server builds a model only when
the client said the workspace is trusted (``trustModelCode``), and only from a file inside one of
the workspace folders, trusted or not. Everything here reads the file system only: a model is
located, and its shapes cache entry keyed, without importing it or its parent packages.

- ``FILE.py:FACTORY`` (or any path with a separator): relative to the plan's folder; the file,
  symlinks resolved, must lie inside a workspace folder.
- ``package.module:FACTORY``: searched for in the workspace folders only (as ``import`` would find
  it with that folder first on ``sys.path``, but without running any ``__init__.py``); an
  installed package, or one found outside the workspace, is refused. When trusted it is imported
  with its workspace folder first on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardplan.errors import Diagnostic, Span, as_error, error

OPTION = "trustModelCode"  # the initialization option that allows model builds


@dataclass(frozen=True)
class ModelSource:
    """A located ``--model``: what to build, and what keys its shapes cache entry."""

    spec: str  # what api.model_leaves builds: an absolute FILE.py:FACTORY or package.module:FACTORY
    file: Path  # the module's source file, symlinks resolved
    root: Path  # the workspace folder holding it
    cache_spec: str  # FILE.py:FACTORY of that file: the same shapes cache key, computed without importing


def _inside(path: Path, roots: Sequence[Path]) -> Path | None:
    return next((r for r in roots if path == r or path.is_relative_to(r)), None)


def _unreadable(spec: str, span: Span | None) -> Diagnostic:
    return error(
        "bad-model-arg", f"cannot read --model '{spec}'", "write FILE.py:FACTORY or package.module:FACTORY", span=span
    )


def _refuse(spec: str, why: str, hint: str, span: Span | None) -> Diagnostic:
    return error("bad-model-arg", f"the language server does not build --model '{spec}': {why}", hint, span=span)


def _find_module(dotted: str, root: Path) -> list[Path] | None:
    """The source files ``import dotted`` would run with ``root`` first on sys.path (parent
    packages' ``__init__.py`` first, the module last), or None when it is not found there."""
    search: list[str] | None = [str(root)]
    files: list[Path] = []
    parts = dotted.split(".")
    for i in range(len(parts)):
        if search is None:  # a parent that is a module, not a package
            return None
        found = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if found is None:
            return None
        if found.origin and found.has_location:  # a namespace package has no file of its own
            files.append(Path(found.origin).resolve())
        search = list(found.submodule_search_locations) if found.submodule_search_locations is not None else None
    return files or None


def locate(spec: str, base: Path, roots: Sequence[Path], span: Span | None = None) -> ModelSource | Diagnostic:
    """Where ``spec`` (a ``--model`` value) lives, or a diagnostic saying why it may not be built.

    Args:
        spec: ``FILE.py:FACTORY`` (relative to ``base``) or ``package.module:FACTORY``.
        base: the plan's folder.
        roots: the workspace folders (resolved); a model outside all of them is refused.
        span: where the diagnostic points (the plan's directive line).
    """
    target, sep, factory = spec.rpartition(":")
    if not sep or not target or not factory.isidentifier():
        return _unreadable(spec, span)
    where = "the workspace folders: " + (", ".join(str(r) for r in roots) if roots else "none (no folder is open)")
    if target.endswith(".py") or os.sep in target:
        file = (base / target).resolve()
        if not file.is_file():
            return error("bad-model-arg", f"no such file: {file}", "check the path to the model file", span=span)
        root = _inside(file, roots)
        if root is None:
            return _refuse(spec, f"{file} is outside {where}", "move the model into the workspace", span)
        return ModelSource(str(file) + ":" + factory, file, root, f"{file}:{factory}")
    if not all(part.isidentifier() for part in target.split(".")):
        return _unreadable(spec, span)
    for root in roots:
        files = _find_module(target, root)
        if files is None:
            continue
        outside = [f for f in files if _inside(f, roots) is None]
        if outside:
            why = f"importing '{target}' from {root} runs {outside[0]}, outside {where}"
            return _refuse(spec, why, "keep the package's files inside the workspace", span)
        if files[-1].suffix != ".py":
            return _refuse(spec, f"{files[-1]} is not Python source", "name a .py module", span)
        return ModelSource(spec, files[-1], root, f"{files[-1]}:{factory}")
    return _refuse(
        spec,
        f"module '{target}' is not in {where} (installed packages are not imported)",
        "name a module inside the workspace, or write FILE.py:FACTORY",
        span,
    )


@contextlib.contextmanager
def importable(source: ModelSource, span: Span | None = None) -> Iterator[None]:
    """While a trusted ``package.module`` model is built: its workspace folder first on sys.path.

    Raises:
        ShardPlanError: the package's top name is already imported from elsewhere, so importing
            it would not run the workspace's file.
    """
    target = source.spec.rpartition(":")[0]
    if target.endswith(".py") or os.sep in target:  # a file: load_factory imports it by path
        yield
        return
    top = sys.modules.get(target.split(".")[0])
    origin = getattr(top, "__file__", None)
    if top is not None and (origin is None or _inside(Path(origin).resolve(), [source.root]) is None):
        why = f"'{top.__name__}' is already imported from {origin or 'elsewhere'}, not from {source.root}"
        raise as_error([_refuse(source.spec, why, "restart the language server", span)])
    sys.path.insert(0, str(source.root))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(source.root))
