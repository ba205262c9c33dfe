"""The shapes file: a model's leaf shapes as JSON, readable without jax.

``shardplan.dump_shapes`` (runtime) writes one from a training script, so a plan can be
checked where the model code cannot be imported; :func:`load_shapes` reads it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from shardplan.core.leaves import Leaf
from shardplan.errors import PlanCheckError, as_error, error

FORMAT = "shardplan-shapes/1"
ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
}


def leaf_json(leaf: Leaf) -> dict:
    d: dict = {"path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype}
    if leaf.names:
        d["names"] = list(leaf.names)
    return d


def shapes_json(params: list[Leaf], opt_state: list[Leaf] | None = None) -> str:
    """The shapes file's text for these leaves."""
    doc: dict = {"format": FORMAT, "params": [leaf_json(leaf) for leaf in params]}
    if opt_state is not None:
        doc["opt_state"] = [leaf_json(leaf) for leaf in opt_state]
    return json.dumps(doc, indent=1)


def load_shapes(path: str | os.PathLike) -> tuple[list[Leaf], list[Leaf] | None]:
    """Read a shapes JSON: (param leaves, optimizer-state leaves or None if not recorded).

    Raises:
        PlanCheckError: the file is unreadable or not in the shapes format.
    """
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanCheckError(
            [
                error(
                    "cannot-read",
                    f"cannot read shapes file: {e.strerror}",
                    "write one with shardplan.dump_shapes(model, path)",
                    path=where,
                )
            ]
        ) from None
    except json.JSONDecodeError as e:
        raise PlanCheckError(
            [
                error(
                    "bad-shapes",
                    f"not JSON (line {e.lineno}, column {e.colno}): {e.msg}",
                    "write the file with shardplan.dump_shapes(model, path)",
                    path=where,
                )
            ]
        ) from None

    def leaves(items, key) -> list[Leaf]:
        out = []
        if not isinstance(items, list):
            raise PlanCheckError(
                [
                    error(
                        "bad-shapes",
                        f"'{key}' must be a list of leaves",
                        "write the file with shardplan.dump_shapes",
                        path=where,
                    )
                ]
            )
        for i, it in enumerate(items):
            try:
                shape = tuple(int(s) for s in it["shape"])
                dtype = str(it["dtype"])
                names = it.get("names")
                if any(s < 0 for s in shape) or dtype not in ITEMSIZE or not isinstance(it["path"], str):
                    raise ValueError
                out.append(Leaf(it["path"], shape, dtype, ITEMSIZE[dtype], tuple(names) if names else None))
            except (KeyError, TypeError, ValueError):
                raise PlanCheckError(
                    [
                        error(
                            "bad-shapes",
                            f"{key}[{i}] is not a leaf record {{path, shape, dtype}} with a known dtype",
                            f"fix entry {i}; dtypes: {', '.join(sorted(ITEMSIZE))}",
                            path=where,
                        )
                    ]
                ) from None
        return out

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanCheckError(
            [
                error(
                    "bad-shapes",
                    f'not a shapes file (expected "format": "{FORMAT}")',
                    "write the file with shardplan.dump_shapes(model, path)",
                    path=where,
                )
            ]
        )
    params = leaves(doc.get("params"), "params")
    opt = leaves(doc["opt_state"], "opt_state") if "opt_state" in doc else None
    return params, opt


_BRACKET_ITEM = re.compile(r"^(?P<name>[^=\s]+)=(?P<dtype>\w+)\[(?P<dims>[0-9, ]*)\]$")
_X_ITEM = re.compile(r"^(?P<name>[^=\s]+)=(?P<dims>[0-9x]+)(?::(?P<dtype>\w+))?$")


def _split_items(items: list[str]) -> list[str]:
    """Each argument may hold several items separated by commas outside brackets."""
    out = []
    for arg in items:
        depth, start = 0, 0
        for i, ch in enumerate(arg):
            depth += ch == "["
            depth -= ch == "]"
            if ch == "," and depth == 0:
                out.append(arg[start:i].strip())
                start = i + 1
        out.append(arg[start:].strip())
    return [x for x in out if x]


def parse_batch_arg(items: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Input shapes from the command line -> {name: (shape, dtype)}.

    Either form, comma-separated or repeated: ``tokens=int32[256,4096]`` or
    ``tokens=256x4096:int32`` (dtype default float32).

    Raises:
        ArgumentError: an item is malformed, a dim is not positive, or the dtype unknown.
    """
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for item in _split_items(items or []):
        m = _BRACKET_ITEM.match(item) or _X_ITEM.match(item)
        dims: list[str] = []
        dtype = ""
        if m:
            sep = "," if "[" in item else "x"
            dims = [d.strip() for d in m.group("dims").split(sep)]
            dtype = m.group("dtype") or "float32"
        if not m or dtype not in ITEMSIZE or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise as_error(
                [
                    error(
                        "bad-argument",
                        f"cannot read the batch item '{item}'",
                        "write NAME=DTYPE[D0,D1,...] (e.g. tokens=int32[256,4096]) or NAME=D0xD1:DTYPE, "
                        f"with positive dims; dtypes: {', '.join(sorted(ITEMSIZE))}",
                        path="--batch",
                    )
                ]
            )
        if m.group("name") in out:
            raise as_error(
                [
                    error(
                        "bad-argument", f"batch input '{m.group('name')}' given twice", "give each once", path="--batch"
                    )
                ]
            )
        out[m.group("name")] = (tuple(int(d) for d in dims), dtype)
    return out
