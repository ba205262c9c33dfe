"""The compile cache: what exact mode reads from a compiled step, kept so that checking the same
program for the same target again skips the compile (minutes for a pod-scale model).

Keyed by the lowered program's text (the step, the plan's shardings and the mesh as XLA receives
them), the target, the devices' order, the compiler flags in the environment (``XLA_FLAGS``,
``LIBTPU_INIT_ARGS``), a GPU target's description and the installed versions of jax, jaxlib, the
TPU and GPU compilers and shardplan: a program that any of them changes is a miss, never stale.
An entry holds the compiled program's HLO text, its memory analysis and its cost analysis (the
figures exact mode reads; everything else is recomputed from them), gzip-compressed and written
atomically. A compile that fails (out of memory, a kernel) is never cached.

``$SHARDPLAN_CACHE_DIR/compiled`` (else ``$XDG_CACHE_HOME/shardplan/compiled``, else
``~/.cache/shardplan/compiled``); ``SHARDPLAN_COMPILE_CACHE=0`` (``--no-cache`` on the command
line) bypasses it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardplan.core.shapecache import installed

ENV_OFF = "SHARDPLAN_COMPILE_CACHE"
PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "shardplan")
FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


@dataclass(frozen=True)
class Program:
    """What exact mode reads from a compiled step."""

    text: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    costs: dict[str, float] = field(default_factory=dict)  # XLA's cost analysis (none from XLA:GPU)
    cached: bool = False  # read from the cache, not compiled now


def cache_dir() -> Path:
    if os.environ.get("SHARDPLAN_CACHE_DIR"):
        return Path(os.environ["SHARDPLAN_CACHE_DIR"]) / "compiled"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "shardplan" / "compiled"


def key(lowered_text: str, target: str, devices: list[int], description: str = "") -> str:
    """The cache key of a lowered program compiled for ``target`` on ``devices`` (their ids, in the
    mesh's order); ``description``: what else the target's compiler is given (a GPU's)."""
    h = hashlib.sha256()
    flags = "\n".join(f"{name}={os.environ.get(name, '')}" for name in FLAGS)
    h.update(f"{target}\n{devices}\n{description}\n{flags}\n{installed(PACKAGES)}\n".encode())
    h.update(lowered_text.encode())
    return h.hexdigest()[:40]


def _read(path: Path) -> Program | None:
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()))
        return Program(**{**doc, "cached": True})
    except (OSError, ValueError, TypeError, EOFError):  # missing, torn or from another layout: a miss
        return None


def _write(path: Path, program: Program) -> None:
    doc = {k: v for k, v in program.__dict__.items() if k != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(gzip.compress(json.dumps(doc).encode(), compresslevel=3))
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache folder: the result stands, uncached
        pass


def compiled(lowered: Any, target: str, devices: list[int], description: str = "") -> Program:
    """``lowered.compile()`` read as a :class:`Program`, or the cached one of the same key. The
    compile's own errors propagate (and nothing is cached)."""
    use = os.environ.get(ENV_OFF, "1") != "0"
    path = cache_dir() / f"{key(lowered.as_text(), target, devices, description)}.json.gz" if use else None
    if path is not None:
        hit = _read(path)
        if hit is not None:
            return hit
    exe = lowered.compile()
    mem = exe.memory_analysis()
    costs = exe.cost_analysis()
    costs = (costs[0] if isinstance(costs, list) else costs) or {}  # XLA:GPU gives none
    program = Program(
        text=exe.as_text(),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        peak_bytes=int(mem.peak_memory_in_bytes),
        costs={k: float(v) for k, v in costs.items() if isinstance(v, int | float)},
    )
    if path is not None:
        _write(path, program)
    return program
