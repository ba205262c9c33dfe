"""The shapes cache: a model's abstract shapes, kept so the next check of it skips ``nnx.eval_shape``.

Keyed by everything the shapes can depend on, read without importing the model (nor jax):
the ``--model`` spec (file and factory), the source of every ``.py`` file in the model file's
folder (a model importing a sibling module is covered; any edit there is a new key), the
installed versions of jax, jaxlib, flax and shardplan, and the Python version. A key that
cannot be computed (a ``package.module`` spec whose files cannot be found) means no caching,
never a guess. Entries are shapes files (``shardplan.core.shapes``), written atomically.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from shardplan.core.leaves import Leaf
from shardplan.core.shapes import load_shapes, shapes_json

ENV_DIR = "SHARDPLAN_CACHE_DIR"
PACKAGES = ("jax", "jaxlib", "flax", "shardplan")


def cache_dir() -> Path:
    """$SHARDPLAN_CACHE_DIR, else $XDG_CACHE_HOME/shardplan/shapes, else ~/.cache/shardplan/shapes."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "shardplan" / "shapes"


def installed(packages: tuple[str, ...]) -> str:
    """The installed versions of ``packages`` ("none" for one that is not), as one line."""
    out = []
    for name in packages:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} none")
    return "; ".join(out)


def _versions() -> str:
    return f"python {sys.version_info[:3]}; {installed(PACKAGES)}"


def _model_file(spec: str) -> Path | None:
    target, _, _ = spec.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        return path.resolve() if path.is_file() else None
    try:  # (imports the parent packages of a dotted name, as importing the model would)
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin).resolve() if origin and origin.endswith(".py") else None


def key(spec: str) -> str | None:
    """The cache key of a ``--model`` spec, or None when its sources cannot be found."""
    file = _model_file(spec)
    if file is None:
        return None
    h = hashlib.sha256()
    h.update(f"{spec.rpartition(':')[2]}\n{_versions()}\n{file}\n".encode())
    for source in sorted(file.parent.glob("*.py")):
        try:
            h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
        except OSError:
            return None
    return h.hexdigest()[:32]


def sources(spec: str) -> str | None:
    """The text of the model's source files (what ``key`` hashes), or None when not found."""
    file = _model_file(spec)
    if file is None:
        return None
    out = []
    for source in sorted(file.parent.glob("*.py")):
        try:
            out.append(source.read_text(errors="replace"))
        except OSError:
            return None
    return "\n".join(out)


def read(spec: str) -> list[Leaf] | None:
    """The cached param leaves of a model, or None (no entry, or one that cannot be read)."""
    k = key(spec)
    path = cache_dir() / f"{k}.json" if k else None
    if path is None or not path.is_file():
        return None
    try:
        return load_shapes(path)[0]
    except Exception:  # a damaged entry is a miss; the next write replaces it
        return None


def write(spec: str, params: list[Leaf]) -> Path | None:
    """Store a model's param leaves; returns the entry (None when it cannot be keyed or written)."""
    k = key(spec)
    if k is None:
        return None
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(shapes_json(params))
        os.replace(tmp, folder / f"{k}.json")
    except OSError:
        return None
    return folder / f"{k}.json"


def clear() -> int:
    """Delete every entry; returns how many."""
    n = 0
    for entry in cache_dir().glob("*.json"):
        entry.unlink(missing_ok=True)
        n += 1
    return n
