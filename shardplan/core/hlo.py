"""What a compiled step communicates: collectives read from optimized HLO text.

Jax-free: it reads the text ``compiled.as_text()`` prints. For each collective it gives
the kind, the per-device bytes, how many times it runs per step (a collective inside a
``while`` body, e.g. a scan over layers, runs once per iteration), its device groups and,
given the mesh, the mesh axes it runs over, and where it comes from (the op name and the
innermost source line outside jax/flax/shardplan, from the HLO's stack-frame tables).

Bytes are per device, per execution: for all-reduce and all-to-all the buffer
reduced/exchanged; for all-gather the gathered result; for reduce-scatter the operand
(before scattering); for collective-permute the buffer sent.

XLA:CPU never emits a reduce-scatter for GSPMD programs: it all-reduces and each device
slices its block (an accelerator emits a reduce-scatter for the same program). An
all-reduce whose every use is such a per-device slice is reported with
``as_reduce_scatter=True`` so it can be compared with an accelerator's reduce-scatter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_PARAM_INDEX = re.compile(r"parameter\((\d+)\)")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# Frames in these are library code; the source of a collective is the innermost frame outside.
LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "<frozen ", str(Path(__file__).resolve().parents[1]) + "/")


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled step."""

    kind: str
    shapes: tuple[str, ...]
    bytes: int  # per device, per execution
    group_size: int = 1
    groups: tuple[tuple[int, ...], ...] = ()  # device groups (logical device ids)
    runs: int = 1  # executions per step (trip counts of enclosing while loops)
    name: str = ""
    op_name: str = ""  # jax's op name from the metadata, e.g. jit(step)/transpose(jvp())/dot_general
    source: str = ""  # innermost user source 'file:line' from the stack frames, if any
    as_reduce_scatter: bool = False  # an all-reduce whose every use is a per-device slice
    launch: bool = True  # False: a further array of one combined (tuple) all-reduce, launched with the first
    moves: str = ""  # the jitted function's argument it moves, when it reads one: "sm/blocks/0/attn/query/kernel"
    axes: tuple[str, ...] = field(default=())  # mesh axes, once :func:`with_axes` has named them

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.runs


def _shape_bytes(shape: str) -> tuple[int, tuple[str, ...], int]:
    """(bytes, array shapes, elements of the first array) of an HLO shape string."""
    total, shapes, first = 0, [], -1
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
        first = n if first < 0 else first
    return total, tuple(shapes), first


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array. Commas
    inside layouts (``{1,0:T(8,128)}``) and dims are not separators."""
    text = shape.strip()
    if not text.startswith("("):
        return [text]
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text[1 : text.rindex(")")]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _async_result(op: str, shape: str) -> str:
    """The result of an async collective's ``-start``, from its shape. ``all-reduce-start`` returns
    its result (a tuple of results when XLA combined several); the other starts return
    ``(operands, results, contexts...)``: element 1 (a tuple when combined: XLA:GPU's combined
    all-gathers), not the last array (TPU's collective-permute-start ends in ``u32[]`` contexts)."""
    if op == "all-reduce-start" or not shape.strip().startswith("("):
        return shape
    parts = _elements(shape)
    return parts[1] if len(parts) >= 2 else shape


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _groups(line: str, n_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = _GROUPS_IOTA.search(line)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
        ids = _iota(dims, perm)
        size = shape[-1]
        return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))
    m = _GROUPS_MESH.search(line)
    if m:
        axes = [(a.split("=")[0].strip().strip("'"), int(a.split("=")[1])) for a in m.group(1).split(",") if a]
        over = {a.strip().strip("'") for a in m.group(2).split(",") if a.strip()}
        return _mesh_groups(axes, over)
    m = _GROUPS_LIST.search(line)
    if m:
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = _PAIRS.search(line)
    if m:  # collective-permute: each (source, target) pair exchanges
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([0-9]+,[0-9]+)\}", m.group(1)))
    if n_devices:
        return (tuple(range(n_devices)),)
    return ()


def _iota(dims: list[int], perm: list[int]) -> list[int]:
    """iota(prod(dims)).reshape(dims).transpose(perm).flatten(), without numpy."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    out_strides = [strides[p] for p in perm]
    ids = []
    for flat in range(math.prod(dims)):
        rem, idx = flat, 0
        for d, s in zip(reversed(out_dims), reversed(out_strides), strict=True):
            rem, i = divmod(rem, d)
            idx += i * s
        ids.append(idx)
    return ids


def _mesh_groups(axes: list[tuple[str, int]], over: set[str]) -> tuple[tuple[int, ...], ...]:
    """Groups of the mesh form: device ids are an iota over ``axes``; a group varies along ``over``."""
    sizes = [s for _, s in axes]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    inner = [i for i, (name, _) in enumerate(axes) if name in over]
    outer = [i for i, (name, _) in enumerate(axes) if name not in over]

    def coords(dims: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[]]
        for d in dims:
            out = [c + [k] for c in out for k in range(sizes[d])]
        return out

    groups = []
    for oc in coords(outer):
        base = sum(k * strides[d] for d, k in zip(outer, oc, strict=True))
        groups.append(tuple(base + sum(k * strides[d] for d, k in zip(inner, ic, strict=True)) for ic in coords(inner)))
    return tuple(groups)


@dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo_text.split("\n"):
        c = None if line.startswith(" ") else _COMP.match(line)  # headers are not indented
        if c:
            current = c.group("name")
            comps[current] = []
            if c.group("entry"):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(
                _Instr(m.group("name"), m.group("shape"), m.group("op"), _OPERAND.findall(m.group("args")), line)
            )
    return comps, entry


_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_CONSTANT = re.compile(r"constant\((\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")


def _trip_count(ins: _Instr, comps: dict[str, list[_Instr]]) -> int:
    """A while loop's iterations: its ``known_trip_count`` (XLA:CPU, XLA:GPU), else read from its
    condition as XLA:TPU leaves it, ``counter < N`` on a scalar integer constant (a scan's loop,
    counting from 0); 1 when neither says."""
    trip = _TRIP.search(ins.line)
    if trip:
        return int(trip.group(1))
    cond = _CONDITION.search(ins.line)
    body = comps.get(cond.group(1), []) if cond else []
    defs = {i.name: i for i in body}
    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), None)
    if root is None or root.op != "compare" or "direction=LT" not in root.line or len(root.operands) != 2:
        return 1
    counter, bound = (defs.get(o) for o in root.operands)
    if counter is None or bound is None or counter.op != "get-tuple-element" or bound.op != "constant":
        return 1
    m = _CONSTANT.search(bound.line)
    if not (m and re.match(r"[su](8|16|32|64)\[\]", bound.shape)):
        return 1
    index = _INDEX.search(counter.line)
    if index is None:
        return int(m.group(1))
    start, step = _counter(ins, comps, int(index.group(1)))
    return max(0, -(-(int(m.group(1)) - start) // step))


def _counter(loop: _Instr, comps: dict[str, list[_Instr]], index: int) -> tuple[int, int]:
    """Where a while loop's counter (tuple element ``index``) starts and by how much its body
    steps it: XLA:TPU unrolls its windowed einsums' loops, stepping 2 towards the same bound.
    (0, 1) where the program does not say."""

    def value(name: str, defs: dict[str, _Instr]) -> int | None:
        ins = defs.get(name)
        while ins is not None and ins.op == "copy" and ins.operands:
            ins = defs.get(ins.operands[0])
        m = _CONSTANT.search(ins.line) if ins is not None and ins.op == "constant" else None
        return int(m.group(1)) if m else None

    body = _BODY.search(loop.line)
    instrs = comps.get(body.group(1), []) if body else []
    defs = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.line.lstrip().startswith("ROOT ")), None)
    step = 1
    if root is not None and root.op == "tuple" and index < len(root.operands):
        bump = defs.get(root.operands[index])
        if bump is not None and bump.op == "add" and len(bump.operands) == 2:
            steps = [value(o, defs) for o in bump.operands]
            step = next((v for v in steps if v), 1)
    home = next((c for c in comps.values() if any(i is loop for i in c)), [])
    outer = {i.name: i for i in home}
    init = outer.get(loop.operands[0]) if loop.operands else None
    start = None
    if init is not None and init.op == "tuple" and index < len(init.operands):
        start = value(init.operands[index], outer)
    return start or 0, max(1, step)


def _runs(comps: dict[str, list[_Instr]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (while bodies x trip count)."""
    runs = {entry: 1} if entry else {}
    stack = [entry] if entry else []
    while stack:
        name = stack.pop()
        for ins in comps.get(name, []):
            mult = _trip_count(ins, comps) if ins.op == "while" else 1
            callees = _BODY.findall(ins.line) + _CALLEES.findall(ins.line)
            for b in _BRANCHES.findall(ins.line):
                callees += _OPERAND.findall(b)
            for callee in callees:
                n = runs[name] * (mult if callee in _BODY.findall(ins.line) else 1)
                if callee in comps and runs.get(callee, 0) < n:
                    runs[callee] = n
                    stack.append(callee)
    return runs


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


_ARG_PATH = re.compile(r"\['([^']*)'\]|\[(\d+)\]")
_PASS_THROUGH = ("copy", "bitcast", "transpose", "reshape", "convert", "fusion", "get-tuple-element")


def _argument(ins: _Instr, defs: dict[str, _Instr], depth: int = 8) -> str:
    """The jitted function's argument a collective's operand is (through copies, layout
    changes and one-operand fusions): its path from the parameter's metadata, e.g.
    ``sm['blocks'][0]['attn']['key']['kernel'].value`` -> ``sm/blocks/0/attn/key/kernel``."""
    current = ins
    for _ in range(depth):
        if current.op == "parameter":
            m = _OP_NAME.search(current.line)
            if not m:
                return ""
            name = m.group(1).replace("\\'", "'")
            head = re.match(r"[A-Za-z_]\w*", name)
            parts = [a or b for a, b in _ARG_PATH.findall(name)]
            return "/".join(([head.group(0)] if head else []) + parts)
        operands = [defs[o] for o in current.operands if o in defs and defs[o].op != "constant"]
        if len(operands) != 1 or (current is not ins and not _same_data(current, operands[0])):
            return ""
        current = operands[0]
    return ""


def _same_data(ins: _Instr, operand: _Instr) -> bool:
    """``ins`` only moves, relayouts or casts ``operand``: a pass-through op with the same elements
    (and dtype, but for a convert: XLA:TPU casts f32 params to bf16 before gathering them)."""
    a, b = _ARRAY.findall(ins.shape), _ARRAY.findall(operand.shape)
    return (
        ins.op in _PASS_THROUGH
        and len(a) == len(b) == 1
        and (a[0][0] == b[0][0] or ins.op == "convert")
        and _shape_bytes(ins.shape)[2] == _shape_bytes(operand.shape)[2]
    )


def _is_slice_user(user: _Instr, value: str, elements: int, group: int, comps: dict[str, list[_Instr]]) -> bool:
    """A per-device slice of an all-reduce result ``value``: a dynamic-slice (or a fusion built
    around one) whose result is 1/group of the reduced buffer, or a fusion that only reads a
    1/group slice of it (inside a scan, where the slice is written into the stacked gradient)."""
    if user.op == "get-tuple-element" or group <= 1:
        return False
    by_device = any(o.startswith(("partition-id", "replica-id")) for o in user.operands)
    slicing = user.op == "dynamic-slice" or (user.op == "fusion" and ("dynamic-slice" in user.name or by_device))
    n = _shape_bytes(user.shape)[2]
    if slicing and n > 0 and n * group == elements:
        return True
    called = _CALLS.search(user.line) if user.op == "fusion" else None
    body = comps.get(called.group(1), []) if called else []
    positions = {str(i) for i, o in enumerate(user.operands) if o == value}
    params = {i.name for i in body if i.op == "parameter" and _param_index(i) in positions}
    reads = [i for i in body if params & set(i.operands)]
    return bool(reads) and all(
        i.op in ("dynamic-slice", "slice") and _shape_bytes(i.shape)[2] * group == elements for i in reads
    )


def _sliced(
    user: _Instr, value: str, elements: int, group: int, comps: dict[str, list[_Instr]], users: dict[str, list[_Instr]]
) -> bool:
    """``_is_slice_user``, also through another all-reduce (over other mesh axes) in between:
    sums commute, so a sum whose result is summed again and then only sliced per device (by the
    first sum's group) is that sum's reduce-scatter (an embedding's gradient summed over the
    tokens' two axes, its rows split over one)."""
    if _is_slice_user(user, value, elements, group, comps):
        return True
    if user.op != "all-reduce" or value not in user.operands:
        return False
    tuple_result = user.shape.startswith("(")
    nxt = _element_users(users, user, user.operands.index(value) if tuple_result else None)
    return bool(nxt) and all(_is_slice_user(u, name, elements, group, comps) for u, name in nxt)


def _param_index(ins: _Instr) -> str:
    m = _PARAM_INDEX.search(ins.line)
    return m.group(1) if m else ""


def _element_users(users: dict[str, list[_Instr]], ins: _Instr, index: int | None) -> list[tuple[_Instr, str]]:
    """Users of a collective's result, or of element ``index`` of its tuple result, each with
    the name it reads the value by."""
    if index is None:
        return [(u, ins.name) for u in users.get(ins.name, [])]
    out = []
    for gte in users.get(ins.name, []):
        if gte.op == "get-tuple-element" and re.search(rf"\bindex={index}\b", gte.line):
            out += [(u, gte.name) for u in users.get(gte.name, [])]
    return out


def parse(hlo_text: str, n_devices: int | None = None) -> list[CollectiveOp]:
    """Every collective instruction in optimized HLO (async ``-start`` halves counted once).

    One collective may be written several times: XLA:TPU's async collective fusions repeat the
    collective in flight (its ``channel_id`` and result) in the start fusion and in each
    continuation fusion that computes while it moves (a weight gathered during three matmuls
    is written three times). Instructions of one kind in those fusions that share a channel id
    are one collective, counted once."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    frames = _tables(hlo_text)
    users: dict[str, list[_Instr]] = {}
    defs: dict[str, _Instr] = {}
    for instrs in comps.values():
        for ins in instrs:
            defs[ins.name] = ins
            for o in ins.operands:
                users.setdefault(o, []).append(ins)
    ops = []
    channels: set[tuple[str, str]] = set()
    # The fusions XLA:TPU writes an async collective's copies in (its start, continuation and done
    # fusions); its reduce-scatter fusions (``all-reduce-scatter.N``) are one collective each, and
    # several share a channel id (measured: three gradient reduce-scatters, channel 1 each).
    fused = {
        m.group(1)
        for instrs in comps.values()
        for i in instrs
        if i.op == "fusion"
        and (m := _CALLS.search(i.line))
        and (i.name.startswith("async-collective") or m.group(1).startswith("async_collective_fusion"))
    }
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = ins.op[:-6] if ins.op.endswith("-start") else ins.op
            if kind not in KINDS:
                continue
            channel = _CHANNEL.search(ins.line) if comp in fused else None
            if channel:  # within fusions only: XLA:CPU's shard_map collectives may share one
                if (kind, channel.group(1)) in channels:
                    continue
                channels.add((kind, channel.group(1)))
            shape = ins.shape
            if ins.op.endswith("-start"):  # async start: count its result (the operands are in its tuple too)
                shape = _async_result(ins.op, shape)
            nbytes, shapes, elements = _shape_bytes(shape)
            groups = _groups(ins.line, n_devices)
            group = len(groups[0]) if groups else 1
            if kind == "reduce-scatter":
                nbytes *= group
            op_name = _OP_NAME.search(ins.line)
            frame = _FRAME.search(ins.line)
            base = CollectiveOp(
                kind,
                shapes,
                nbytes,
                group,
                groups,
                runs.get(comp, 1),
                ins.name,
                op_name.group(1) if op_name else "",
                frames.source(int(frame.group(1))) if frame else "",
            )
            moves = _argument(ins, defs) if comp == entry else ""
            if kind == "all-reduce":
                # One entry per reduced array (XLA combines several into one tuple all-reduce),
                # each checked for being only sliced per device: a reduce-scatter on an accelerator.
                arrays = [f"{d}[{dims}]" for d, dims in _ARRAY.findall(shape) if d in _DTYPE_BYTES]
                tuple_result = len(arrays) > 1 or shape.startswith("(")
                for i, text in enumerate(arrays):
                    b, _, n = _shape_bytes(text)
                    us = _element_users(users, ins, i if tuple_result else None)
                    rs = bool(us) and all(_sliced(u, name, n, group, comps, users) for u, name in us)
                    ops.append(
                        replace(
                            base,
                            shapes=(text,),
                            bytes=b,
                            as_reduce_scatter=rs,
                            moves="" if tuple_result else moves,
                            launch=i == 0,
                        )
                    )
                continue
            ops.append(replace(base, moves=moves))
    return ops


# What XLA's cost analysis (HloCostAnalysis::HandleElementwiseOp) counts as one flop per output
# element: its transcendentals (exp, log, power, sqrt, rsqrt, tanh, atan2, ...) are counted apart,
# and a conversion is elementwise.
_ELEMENTWISE_FLOP = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "compare",
    "select",
    "negate",
    "abs",
    "and",
    "or",
    "xor",
    "not",
    "remainder",
    "clamp",
    "sign",
    "floor",
    "ceil",
    "round-nearest-even",
    "round-nearest-afz",
    "is-finite",
    "convert",
    "reduce-precision",
}
# An all-reduce: one flop per element of its result (HandleAllReduce: "we assume 2 replicas").
_ALL_REDUCE = {"all-reduce", "all-reduce-start"}
# A reduce, scatter or reduce-window's reducer (its flops per element reduced: ``_instr_flops``).
_TO_APPLY = re.compile(r"\bto_apply=%([\w.\-]+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(line: str) -> dict[str, list[int]]:
    """A convolution's ``window={size=.. stride=.. pad=.. lhs_dilate=.. rhs_dilate=..}``, per
    spatial dim (``pad``: low and high per dim, flattened)."""
    m = _WINDOW.search(line)
    out: dict[str, list[int]] = {}
    for part in m.group(1).split() if m else []:
        key, _, value = part.partition("=")
        out[key] = [int(x) for x in re.split(r"[x_]", value) if x.lstrip("-").isdigit()]
    return out


def _taps(size: int, out: int, window: int, stride: int, lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """How many (output position, window position) pairs of one spatial dim read an input element,
    not a hole of the input's dilation or its padding, as XLA's cost analysis counts them. XLA:TPU
    writes a batched matmul as a convolution whose window spans the batch with the input dilated by
    the window's size: one pair in ``window`` reads data there."""
    dilated = (size - 1) * lhs_dilate + 1 if size > 0 else 0
    if out * window > 4_000_000:  # too many to count one by one: the share a dilation leaves
        return out * -(-window // lhs_dilate)
    return sum(
        1
        for k in range(window)
        for o in range(out)
        if 0 <= (p := o * stride + k * rhs_dilate - lo) < dilated and p % lhs_dilate == 0
    )


def _conv_flops(ins: _Instr, lhs: list[int], labels: re.Match[str]) -> float:
    """A convolution's FLOPs as XLA's cost analysis counts them: 2 x (output elements over its
    spatial positions) x input features per group x the (output, window) pairs that read data."""
    lhs_labels, _, out_labels = labels.groups()
    out = _dims_of(ins.shape)
    features = math.prod(d for d, c in zip(lhs, lhs_labels, strict=False) if c == "f")
    groups = re.search(r"feature_group_count=(\d+)", ins.line)
    features //= int(groups.group(1)) if groups else 1
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    w = _window(ins.line)
    per_position = math.prod(out) // max(1, math.prod(out[out_labels.index(c)] for c in spatial))
    taps = 1
    for i, c in enumerate(spatial):
        size, o = lhs[lhs_labels.index(c)], out[out_labels.index(c)]
        window = w.get("size", [1] * len(spatial))[i]
        stride = w.get("stride", [1] * len(spatial))[i]
        lo = w.get("pad", [0] * 2 * len(spatial))[2 * i]
        taps *= _taps(
            size,
            o,
            window,
            stride,
            lo,
            w.get("lhs_dilate", [1] * len(spatial))[i],
            w.get("rhs_dilate", [1] * len(spatial))[i],
        )
    return 2.0 * per_position * features * taps


def _dims_of(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _bodies(comps: dict[str, list[_Instr]]) -> set[str]:
    return {
        body.group(1)
        for instrs in comps.values()
        for ins in instrs
        if ins.op == "while" and (body := _BODY.search(ins.line)) and body.group(1) in comps
    }


def program_flops(hlo_text: str) -> float:
    """A program's FLOPs per step counted from its HLO (every loop body times its runs), for a
    compiler that gives no cost analysis (XLA:GPU): matmuls (in fusions too, as XLA:GPU's gemm
    fusions hold them; XLA:TPU's convolutions) 2*M*N*K, elementwise ops and reductions one per
    element."""
    return loop_flops(hlo_text, whole=True)


def _instr_flops(
    ins: _Instr, defs: dict[str, _Instr], comps: dict[str, list[_Instr]], memo: dict[str, float], stack: frozenset[str]
) -> float:
    """FLOPs of one instruction and the fused or called computations it runs (not while bodies),
    as XLA's cost analysis counts them: matmuls 2*M*N*K, elementwise ops one per element (not
    transcendentals), reductions, scatters and reduce-windows their reducer's flops per element
    reduced, all-reduces one per element. ``memo``: per computation."""
    n = _shape_bytes(ins.shape)[2] if _ARRAY.search(ins.shape) else 0
    total = 0.0
    if ins.op == "dot":
        lhs = defs.get(ins.operands[0]) if ins.operands else None
        m = _CONTRACT.search(ins.line)
        k = math.prod(_dims_of(lhs.shape)[int(i)] for i in _ints(m.group(1))) if lhs and m else 1
        total += 2.0 * max(n, 0) * k
    elif ins.op == "convolution":  # XLA:TPU writes its matmuls as convolutions
        lhs = defs.get(ins.operands[0]) if ins.operands else None
        labels = _DIM_LABELS.search(ins.line)
        if lhs is not None and labels:
            total += _conv_flops(ins, _dims_of(lhs.shape), labels)
    elif ins.op in _ELEMENTWISE_FLOP:
        total += max(n, 0)
    elif ins.op in ("reduce", "scatter", "reduce-window") and ins.operands:
        # the reducer's flops per element reduced (a sum: 1; an argmax's compare-and-select: more)
        reducer = _TO_APPLY.search(ins.line)
        per = _comp_flops(reducer.group(1), comps, memo, stack) if reducer and reducer.group(1) in comps else 1.0
        if ins.op == "reduce":
            src = defs.get(ins.operands[0])
            total += per * max(_shape_bytes(src.shape)[2] - max(n, 1), 0) if src else 0
        elif ins.op == "reduce-window":  # each output element reduces its window: size - 1 steps
            total += per * (math.prod(_window(ins.line).get("size", [1])) - 1) * max(n, 0)
        else:
            updates = defs.get(ins.operands[-1])
            total += per * _shape_bytes(updates.shape)[2] if updates else 0
    elif ins.op in _ALL_REDUCE:
        total += sum(math.prod(_dims_of(array)) for array in _shape_bytes(ins.shape)[1])
    if ins.op in ("fusion", "call", "conditional"):
        for callee in _CALLS.findall(ins.line):
            if callee in comps and callee not in stack:
                total += _comp_flops(callee, comps, memo, stack)
    return total


def _comp_flops(name: str, comps: dict[str, list[_Instr]], memo: dict[str, float], stack: frozenset[str]) -> float:
    if name not in memo:
        defs = {i.name: i for i in comps[name]}
        memo[name] = sum(_instr_flops(i, defs, comps, memo, stack | {name}) for i in comps[name])
    return memo[name]


def loop_flops(hlo_text: str, entry_only: bool = False, whole: bool = False) -> float:
    """FLOPs that XLA's cost analysis leaves out: it counts a ``while`` body once, but the body
    runs once per iteration. Returns each body's own FLOPs x (its runs per step - 1) summed over
    loops, a body nested in another loop running trip x the outer body's runs (counted as the cost
    analysis counts: :func:`_instr_flops`). ``whole``: the program's own count instead
    (:func:`program_flops`)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    memo: dict[str, float] = {}

    def own(name: str, stack: frozenset[str]) -> float:
        """FLOPs of one execution of ``name`` and what it calls, except nested while bodies."""
        return _comp_flops(name, comps, memo, stack) if name in comps else 0.0

    if entry_only:
        return own(entry, frozenset())
    if whole:
        return own(entry, frozenset()) + sum(runs.get(b, 1) * own(b, frozenset()) for b in sorted(_bodies(comps)))
    bodies = {
        body.group(1)
        for instrs in comps.values()
        for ins in instrs
        if ins.op == "while"
        and _trip_count(ins, comps) > 1
        and (body := _BODY.search(ins.line))
        and body.group(1) in comps
    }
    return sum((runs.get(b, 1) - 1) * own(b, frozenset()) for b in sorted(bodies))


# Instructions that move no data in memory themselves (their callees are counted where they run).
_NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "copy-start",
    "async-update",
    "domain",
    "add-dependency",
    "opt-barrier",
}
_PARAM_INDEX = re.compile(r"\bparameter\((\d+)\)")
_SLICING = ("dynamic-slice", "slice", "gather")


def memory_bytes(hlo_text: str) -> float:
    """Bytes a program reads and writes in device memory per run: each instruction outside fused
    computations (a fusion is one kernel) reads its operands and writes its result, times the runs
    of its computation (a ``while`` body once per iteration; XLA's cost analysis counts it once
    and leaves out library calls such as cuBLAS matmuls). As XLA's cost analysis does, a fusion
    operand read only through slices counts the slices, and a fusion that updates a slice of an
    operand in place (``dynamic-update-slice``) writes the update, not the buffer."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    total = 0.0
    for name in _control_flow(comps, entry):
        defs = {i.name: i for i in comps[name]}
        for ins in comps[name]:
            if ins.op in _NO_TRAFFIC or ins.op.endswith("-done"):  # an async op counts at its start
                continue
            total += runs.get(name, 1) * _instr_traffic(ins, defs, comps)
    return total


def kernel_count(hlo_text: str) -> float:
    """Kernels a program launches per run: the instructions outside fused computations that move
    data (a fusion is one kernel; an async collective counts at its start), times the runs of
    their computation (a ``while`` body once per iteration)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    return float(
        sum(
            runs.get(name, 1)
            for name in _control_flow(comps, entry)
            for ins in comps[name]
            if ins.op not in _NO_TRAFFIC and not ins.op.endswith("-done")
        )
    )


def _control_flow(comps: dict[str, list[_Instr]], entry: str) -> list[str]:
    """The computations that run as instructions of their own: the entry, loop bodies and
    conditions, conditional branches and called computations (not fusions or reducers)."""
    out, stack = [], [entry] if entry in comps else []
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.append(name)
        for ins in comps[name]:
            callees: list[str] = []
            if ins.op == "while":
                callees = re.findall(r"\b(?:body|condition)=%([\w.\-]+)", ins.line)
            elif ins.op == "conditional":
                callees = re.findall(r"\b(?:true_computation|false_computation)=%([\w.\-]+)", ins.line)
                for b in _BRANCHES.findall(ins.line):
                    callees += _OPERAND.findall(b)
            elif ins.op == "call":
                callees = _TO_APPLY.findall(ins.line)
            stack += [c for c in callees if c in comps]
    return out


def _instr_traffic(ins: _Instr, defs: dict[str, _Instr], comps: dict[str, list[_Instr]]) -> float:
    size = {o: float(_shape_bytes(defs[o].shape)[0]) for o in ins.operands if o in defs}
    reads = [size.get(o, 0.0) for o in ins.operands]
    write = float(_shape_bytes(ins.shape)[0])
    if ins.op == "dynamic-update-slice" and len(reads) > 1:  # in place: the update is read and written
        return 2 * reads[1] + sum(reads[2:])
    if ins.op in ("dynamic-slice", "slice", "gather") and reads:  # reads of the operand what it returns
        return 2 * write + sum(reads[1:])
    if ins.op.endswith("-start") and ins.op != "fusion-start" and ins.shape.startswith("("):
        # An async op's result tuple holds its operands (and a context) beside its result.
        if ins.op[:-6] in KINDS:  # a collective: its results (several when combined)
            write = float(_shape_bytes(_async_result(ins.op, ins.shape))[0])
        else:
            write = max((float(_shape_bytes(f"{d}[{dims}]")[0]) for d, dims in _ARRAY.findall(ins.shape)), default=0.0)
    body = next(iter(_CALLS.findall(ins.line)), None) if ins.op in ("fusion", "fusion-start") else None
    if body is None or body not in comps:
        return sum(reads) + write
    if ins.op == "fusion-start":  # its result is (operands, output, context): the fused computation's root says
        write = 0.0
    fused = comps[body]
    params = {int(m.group(1)): i.name for i in fused if (m := _PARAM_INDEX.search(i.line)) and i.op == "parameter"}
    users: dict[str, list[_Instr]] = {}
    for i in fused:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = next((i for i in fused if i.line.lstrip().startswith("ROOT")), fused[-1] if fused else None)
    roots = (
        [next((i for i in fused if i.name == o), None) for o in root.operands]
        if root and root.op == "tuple"
        else [root]
    )
    in_place: set[str] = set()
    outs = 0.0
    for r in roots:
        if r is not None and r.op == "dynamic-update-slice" and r.operands and r.operands[0] in params.values():
            in_place.add(r.operands[0])
            upd = next((i for i in fused if i.name == r.operands[1]), None) if len(r.operands) > 1 else None
            outs += float(_shape_bytes(upd.shape)[0]) if upd else 0.0
        elif r is not None:
            outs += float(_shape_bytes(r.shape)[0])
    total = outs
    for k, o in enumerate(ins.operands):
        p = params.get(k)
        if p is None or p in in_place:
            continue
        us = users.get(p, [])
        if us and all(u.op in _SLICING and u.operands and u.operands[0] == p for u in us):
            total += sum(float(_shape_bytes(u.shape)[0]) for u in us)
        else:
            total += size.get(o, 0.0)
    return total


@dataclass(frozen=True)
class Step:
    """A compiled program's instructions in the order its schedule runs them (the order the
    optimized HLO prints a scheduled module in): kernels, collectives (a synchronous one, or the
    start and the done of an asynchronous one, which runs while the kernels between them run),
    and loops. Consecutive kernels are one ``work`` step (their FLOPs, bytes and count summed)."""

    kind: str  # "work", "sync", "start", "done" or "loop"
    flops: float = 0.0
    bytes: float = 0.0  # read and written in device memory
    kernels: int = 0
    collective: str = ""  # a collective's kind
    axes: tuple[str, ...] = ()  # its mesh axes
    moved: int = 0  # its bytes per device (as ``CollectiveOp.bytes``)
    key: str = ""  # a start's name, that its done names
    trips: int = 1  # a loop's iterations
    body: tuple[Step, ...] = ()  # a loop's (or a called computation's) steps


def schedule(hlo_text: str, ops: list[CollectiveOp]) -> tuple[Step, ...]:
    """The entry computation's :class:`Step` s in schedule order (``ops``: :func:`parse`'s
    collectives of the same program, :func:`with_axes` applied). A ``while`` is a loop of its
    body's steps; a call or conditional is its callee's (the branch with the most FLOPs)."""
    comps, entry = _computations(hlo_text)
    named: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for op in ops:
        kind, axes, moved = named.get(op.name, (op.kind, op.axes, 0))
        named[op.name] = (kind, axes, moved + op.bytes)
    inside = {  # an async computation -> the collective it runs
        comp: next((named[i.name] for i in instrs if i.name in named), None) for comp, instrs in comps.items()
    }
    memo: dict[str, float] = {}

    def steps(name: str, stack: frozenset[str]) -> tuple[Step, ...]:
        out: list[Step] = []
        defs = {i.name: i for i in comps.get(name, [])}

        def work(flops: float, nbytes: float) -> None:
            if out and out[-1].kind == "work":
                last = out.pop()
                out.append(replace(last, flops=last.flops + flops, bytes=last.bytes + nbytes, kernels=last.kernels + 1))
            else:
                out.append(Step("work", flops, nbytes, 1))

        for ins in comps.get(name, []):
            callees = [c for c in _CALLS.findall(ins.line) if c in comps]
            coll = named.get(ins.name) or (inside.get(callees[0]) if ins.op == "async-start" and callees else None)
            if ins.op == "while":
                body = _BODY.search(ins.line)
                if body and body.group(1) in comps and body.group(1) not in stack:
                    out.append(Step("loop", trips=_trip_count(ins, comps), body=steps(body.group(1), stack | {name})))
            elif ins.op in ("call", "conditional"):
                targets = re.findall(r"\b(?:to_apply|true_computation|false_computation)=%([\w.\-]+)", ins.line)
                for b in _BRANCHES.findall(ins.line):
                    targets += _OPERAND.findall(b)
                targets = [t for t in targets if t in comps and t not in stack]
                if targets:
                    best = max(targets, key=lambda t: _comp_flops(t, comps, memo, stack))
                    out.append(Step("loop", body=steps(best, stack | {name})))
            elif coll is not None and (ins.op.endswith("-start") or ins.op == "async-start"):
                out.append(Step("start", kernels=1, collective=coll[0], axes=coll[1], moved=coll[2], key=ins.name))
            elif coll is not None:
                out.append(Step("sync", kernels=1, collective=coll[0], axes=coll[1], moved=coll[2]))
            elif ins.op.endswith("-done") or ins.op == "async-done":
                if ins.operands:
                    out.append(Step("done", key=ins.operands[0]))
            elif ins.op not in _NO_TRAFFIC:
                work(_instr_flops(ins, defs, comps, memo, stack | {name}), _instr_traffic(ins, defs, comps))
        return tuple(out)

    return steps(entry, frozenset()) if entry in comps else ()


def with_axes(ops: list[CollectiveOp], mesh: dict[str, int]) -> list[CollectiveOp]:
    """Name each collective's mesh axes: the axes along which the devices of its first group
    differ (logical device id = position in the mesh's row-major device order)."""
    names, sizes = list(mesh), list(mesh.values())
    total = math.prod(sizes)
    out = []
    for op in ops:
        axes: tuple[str, ...] = ()
        if op.groups:
            ids = [i for i in op.groups[0] if i < total]
            coords = [_unravel(i, sizes) for i in ids]
            axes = tuple(n for k, n in enumerate(names) if len({c[k] for c in coords}) > 1)
            if op.kind == "collective-permute":  # pairs: the union over every pair
                varying = set()
                for g in op.groups:
                    cs = [_unravel(i, sizes) for i in g if i < total]
                    varying |= {k for k in range(len(names)) if len({c[k] for c in cs}) > 1}
                axes = tuple(names[k] for k in sorted(varying))
        out.append(replace(op, axes=axes))
    return out


def _unravel(i: int, sizes: list[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        i, r = divmod(i, s)
        out.append(r)
    return tuple(reversed(out))


def summarize(ops: list[CollectiveOp], *, reduce_scatter_on_cpu: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count": executions per step, "bytes": per-device bytes per step}} for every kind.

    ``reduce_scatter_on_cpu``: count an all-reduce that every device only slices as the
    reduce-scatter an accelerator would run (same bytes: the reduce-scatter's operand)."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for op in ops:
        kind = "reduce-scatter" if reduce_scatter_on_cpu and op.as_reduce_scatter else op.kind
        out[kind]["count"] += op.runs
        out[kind]["bytes"] += op.bytes_per_step
    return out


def report(compiled: Any) -> dict[str, dict[str, int]]:
    """The collectives summary of a compiled jax function (``.lower(...).compile()``)."""
    return summarize(parse(compiled.as_text()))
