"""Where in the user's code a traced equation comes from: both engines label what they record with it."""

from __future__ import annotations

from typing import Any

from jax._src import source_info_util

from shardplan.core.hlo import LIBRARY_PATHS


def eqn_source(eqn: Any) -> str:
    """'file:line' of the innermost frame of an equation's traceback in the user's code, or ''."""
    try:
        frames = source_info_util.user_frames(eqn.source_info.traceback)
        for frame in frames:
            if not any(p in frame.file_name for p in LIBRARY_PATHS):
                return f"{frame.file_name}:{frame.start_line}"
    except (AttributeError, TypeError):  # no traceback recorded
        pass
    return ""


# The named scope of the constraints shardplan itself writes into a step (a pipeline's buffers):
# they are not the user's, so reports neither list them nor take them out to show what the
# user's constraints change.
INTERNAL_SCOPE = "shardplan-internal"
