"""The shapes file: a model's leaf shapes as JSON, readable without jax.

``shardplan.dump_shapes`` (runtime) writes one from a training script, so a plan can be
checked where the model code cannot be imported; :func:`load_shapes` reads it.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat

from shardplan.core.leaves import Leaf
from shardplan.core.meshes import closest
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
    if leaf.kind is not None and leaf.kind != "param":
        d["kind"] = leaf.kind
    return d


def shapes_json(params: list[Leaf], opt_state: list[Leaf] | None = None) -> str:
    """The shapes file's text for these leaves."""
    doc: dict = {"format": FORMAT, "params": [leaf_json(leaf) for leaf in params]}
    if opt_state is not None:
        doc["opt_state"] = [leaf_json(leaf) for leaf in opt_state]
    return json.dumps(doc, indent=1)


MAX_SHAPES_BYTES = 256 * 2**20  # a 100k-leaf model's shapes file is ~10 MiB
MAX_DIM = 2**48  # no real array dimension is larger; bigger numbers are a mistake
MAX_ELEMENTS = 2**62


def _bad(where: str, message: str, hint: str = "write the file with shardplan.dump_shapes(model, path)"):
    return PlanCheckError([error("bad-shapes", message, hint, path=where)])


def _read(path: str | os.PathLike) -> str:
    """The file's text: a regular file of at most MAX_SHAPES_BYTES, UTF-8."""
    where = str(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            reason = "not a regular file"
        elif st.st_size > MAX_SHAPES_BYTES:
            reason = f"{st.st_size:,} bytes; a shapes file is at most {MAX_SHAPES_BYTES:,}"
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_SHAPES_BYTES + 1)
            try:
                return data.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
                raise _bad(f"{where}:{line}:{col}", f"not UTF-8 (byte 0x{data[e.start]:02x})") from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
    raise PlanCheckError(
        [
            error(
                "cannot-read",
                f"cannot read shapes file: {reason}",
                "write one with shardplan.dump_shapes(model, path)",
                path=where,
            )
        ]
    )


def _leaf(where: str, item: object) -> Leaf:
    """One leaf record, every field checked: no coercion of floats, strings or booleans."""
    if not isinstance(item, dict):
        raise _bad(where, f"a leaf record is an object {{path, shape, dtype}}, not {type(item).__name__}")
    path, shape, dtype = item.get("path"), item.get("shape"), item.get("dtype")
    if not isinstance(path, str) or not path:
        raise _bad(where + ".path", "'path' must be a non-empty string")
    if not isinstance(shape, list) or len(shape) > 64:
        raise _bad(where + ".shape", "'shape' must be a list of at most 64 dims")
    for i, dim in enumerate(shape):
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            shown = repr(dim)[:40]
            raise _bad(f"{where}.shape[{i}]", f"dim {shown} is not an integer in 0..2**48", "dims are whole numbers")
    if math.prod(shape) > MAX_ELEMENTS:
        raise _bad(where + ".shape", f"{len(shape)} dims of more than 2**62 elements in all")
    if isinstance(dtype, str) and dtype.startswith("key<") and dtype.endswith(">"):
        itemsize = 8  # a typed PRNG key (nnx.Rngs state), as shardplan.runtime.tree counts it
    elif not isinstance(dtype, str) or dtype not in ITEMSIZE:
        shown = repr(dtype)[:40]
        raise _bad(where + ".dtype", f"unknown dtype {shown}", f"dtypes: {', '.join(sorted(ITEMSIZE))}")
    names = item.get("names")
    if names is not None:
        if not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names):
            raise _bad(where + ".names", "'names' must be a list of logical axis names (strings or null)")
        if len(names) > len(shape):
            raise _bad(where + ".names", f"{len(names)} names for an array of rank {len(shape)}")
    kind = item.get("kind")
    if kind is not None and (not isinstance(kind, str) or not kind.isidentifier()):
        raise _bad(where + ".kind", "'kind' must be a Variable kind such as batch_stat or rng_key")
    else:
        itemsize = ITEMSIZE[dtype]
    return Leaf(path, tuple(shape), dtype, itemsize, tuple(names) if names else None, kind)


def load_shapes(path: str | os.PathLike) -> tuple[list[Leaf], list[Leaf] | None]:
    """Read a shapes JSON: (param leaves, optimizer-state leaves or None if not recorded).

    Every field is validated: a located ``bad-shapes`` error names the entry and field
    (``file: params[3].shape[1]``); nothing is coerced.

    Raises:
        PlanCheckError: the file is unreadable or not in the shapes format.
    """
    where = str(path)
    text = _read(path)
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _bad(f"{where}:{e.lineno}:{e.colno}", f"not JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise _bad(where, f"not JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(where, f'not a shapes file (expected "format": "{FORMAT}")')

    def leaves(key: str) -> list[Leaf]:
        items = doc.get(key)
        if not isinstance(items, list):
            raise _bad(f"{where}: {key}", f"'{key}' must be a list of leaves")
        out = [_leaf(f"{where}: {key}[{i}]", it) for i, it in enumerate(items)]
        seen: set[str] = set()
        for i, leaf in enumerate(out):
            if leaf.path in seen:
                raise _bad(f"{where}: {key}[{i}].path", f"path {leaf.path!r} appears twice", "each path once")
            seen.add(leaf.path)
        return out

    params = leaves("params")
    opt = leaves("opt_state") if "opt_state" in doc else None
    return params, opt


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


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
            near = closest(dtype, ITEMSIZE)
            unknown = f"unknown dtype '{dtype}'" + (f", {near}" if near else "") if m and dtype not in ITEMSIZE else ""
            raise as_error(
                [
                    error(
                        "bad-argument",
                        f"cannot read the batch item '{item}'" + (f": {unknown}" if unknown else ""),
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
