"""The installed shardplan version (``0.0.0+local`` in a source tree that is not installed)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version


def version() -> str:
    try:
        return _dist_version("shardplan")
    except PackageNotFoundError:
        return "0.0.0+local"
