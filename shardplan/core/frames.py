"""Where in the user's code an exception was raised: the innermost frame outside jax, flax and shardplan."""

from __future__ import annotations

import traceback
from types import TracebackType

from shardplan.core.hlo import LIBRARY_PATHS


def user_frame(tb: TracebackType | None) -> str:
    """'file:line' of the innermost traceback frame in the user's code (not jax, flax or shardplan), or ''."""
    frames = [f for f in traceback.extract_tb(tb) if not any(p in f.filename for p in LIBRARY_PATHS)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
