"""Where an instruction comes from: the HLO's stack-frame tables, read to the innermost source
line outside jax, flax and shardplan (``LIBRARY_PATHS``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Frames in these are library code; the source of a collective is the innermost frame outside.
LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "<frozen ", str(Path(__file__).resolve().parents[2]) + "/")


@dataclass(frozen=True)
class _Frames:
    files: dict[int, str]
    locations: dict[int, tuple[int, int]]  # id -> (file id, line)
    frames: dict[int, tuple[int, int]]  # id -> (location id, parent frame id)

    def source(self, frame_id: int) -> str:
        """The innermost frame outside libraries: the user's model or step code."""
        seen = set()
        fid = frame_id
        while fid > 0 and fid not in seen:
            seen.add(fid)
            loc, parent = self.frames.get(fid, (0, 0))
            file_id, line = self.locations.get(loc, (0, 0))
            path = self.files.get(file_id, "")
            if path and not any(p in path for p in LIBRARY_PATHS):
                return f"{path}:{line}"
            fid = parent - 1  # parent_frame_id is one past the parent's id (0: no parent)
        return ""


def _tables(hlo_text: str) -> _Frames:
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    frames: dict[int, tuple[int, int]] = {}
    section = None
    for line in hlo_text.split("\n"):
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = head
            continue
        if not head or not head[0].isdigit():
            if head and section and not head[0].isdigit():
                section = None
            continue
        num, _, rest = head.partition(" ")
        if section == "FileNames":
            files[int(num)] = rest.strip().strip('"')
        elif section == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            ln = re.search(r"\bline=(\d+)", rest)
            locations[int(num)] = (int(f.group(1)) if f else 0, int(ln.group(1)) if ln else 0)
        elif section == "StackFrames":
            loc = re.search(r"file_location_id=(\d+)", rest)
            par = re.search(r"parent_frame_id=(\d+)", rest)
            frames[int(num)] = (int(loc.group(1)) if loc else 0, int(par.group(1)) if par else 0)
    return _Frames(files, locations, frames)
