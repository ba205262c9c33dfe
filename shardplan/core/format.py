"""How shapes, byte counts and layer-grouped paths are written, everywhere shardplan prints them."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

# A path segment that is a decimal number: a layer / expert index (``blocks/3/...``).
LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/|$)|^\d+(?=/)")


def fmt_shape(shape: Sequence[int]) -> str:
    """``(8,)``, ``(8, 16)``: Python's tuple notation."""
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def fmt_count(n: int, noun: str) -> str:
    """``1 plan``, ``23 plans``: a count and its noun, plural unless the count is one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def fmt_bytes(n: float) -> str:
    """``512 B``, ``4.00 MiB``, ``1.50 GiB`` (binary units)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``512MiB``, ``1e9B`` -> bytes. A unit is required.

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B?)?\s*", text)
    if not m:
        raise ValueError(f"cannot read a size from '{text}' (write e.g. 80GB or 16GiB)")
    try:
        value = float(m.group(1))
    except ValueError:
        raise ValueError(f"cannot read a size from '{text}' (write e.g. 80GB or 16GiB)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"'{text}' is not a size (a finite, non-negative number)")
    if not m.group(2):  # '80' is 80 bytes to a machine and 80 GB to a person: say which
        raise ValueError(f"'{text}' has no unit: write e.g. {text.strip()}GB, {text.strip()}GiB or {text.strip()}B")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}.get(
        unit
    )
    if scale is None:
        raise ValueError(f"unknown unit in '{text}'")
    if not value * scale < 2**80:  # 1e308TB: finite before the unit, not after
        raise ValueError(f"'{text}' is not a size a device could have (at most about 10^24 bytes)")
    return int(value * scale)


def layer_group(path: str) -> str:
    """The path with layer indices replaced by ``*``: the key that groups identical layers."""
    return LAYER_INDEX.sub("*", path)


def fmt_seconds(t: float) -> str:
    """``1.25 s``, ``12.5 ms``, ``40.0 us``."""
    if t >= 1:
        return f"{t:,.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.1f} us"


_WRAPPERS = re.compile(r"^[\w.-]*\(|\)$")


def fmt_op(name: str) -> str:
    """A jax op name as a person reads it: its primitive, and "backward" for the transpose of a
    derivative (``jit(step)/transpose(jvp())/dot_general:...`` -> ``dot_general (backward)``)."""
    if not name or " " in name:  # empty, or written for a person already ("act rule f:8 on m")
        return name
    parts = [p for p in name.split(":", 1)[0].split("/") if p]
    base = parts[-1] if parts else name
    while _WRAPPERS.search(base):  # jvp(x), remat(x): the primitive inside
        base = _WRAPPERS.sub("", base)
    backward = "transpose(" in name
    return f"{base or name} (backward)" if backward else base or name
