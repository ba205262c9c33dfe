"""XLA's own layouts, offline: Shardy's propagation run from jaxlib over a traced step.

XLA lays out every value of a step by Shardy's propagation before it partitions the step. jaxlib
ships Shardy's passes, so the same propagation runs here, without compiling, without devices and
at any mesh size (Shardy's mesh is axis names and sizes). Three stages, each pure:

1. :func:`lowered`: the traced jaxpr lowered to StableHLO with every equation named by its path
   (its index in its jaxpr, after the indices of the calls around it: ``p12_3``), nested calls
   inlined in place (XLA's call inliner does the same before Shardy runs). The arguments carry
   whole layouts as placeholders; a plan's come in stage 3.
2. :func:`imported`: the module as XLA's Shardy pass receives it. XLA converts the module to HLO
   and back before Shardy imports it, and the graph changes on the way (reshapes, constants,
   calls); the same converters run here (``mlir_module_to_xla_computation``,
   ``hlo_to_stablehlo``). Then what XLA's round-trip import pipeline does, where jaxlib does not
   register its passes: constants become ``sdy.constant`` (folding them is not propagation's
   business), sharding custom calls become ``sdy.sharding_constraint``, a while loop's operands
   that its body passes through unchanged are read from outside the loop and each such free
   variable gets an open constraint (XLA's ``OpenWhileFreeVarsSharding``); the frontend
   attributes' shardings are read by the pass jaxlib does register
   (``xla-sdy-round-trip-import-shardy-attrs``).
3. :meth:`Propagator.layouts`: per plan, the arguments' and results' layouts set on a copy of
   that module, ``sdy-propagation-pipeline`` run, and each op's result layouts read back by the
   path of the equation that made it.

Measured against XLA:CPU's own programs (``tests/test_shardy.py``: its post-Shardy HLO read by
``core.hlo.shardings``), stage 3 gives XLA's layouts. What it does not give is what XLA's
partitioner then does with them (the collectives, the memory): that stays fast mode's rules.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Dims = tuple[tuple[str, ...], ...]  # per dim: the mesh axes it is split over
Path = tuple[int, ...]  # an equation's index in its jaxpr, after those of the calls around it

_NAME = re.compile(r'loc\("([^"]*)"')
_STEP = re.compile(r"(?<![\w])p(\d+(?:_\d+)*)(?=/|$)")
_PER_VALUE = re.compile(r"<@\w+, \[(.*?)\]>")
_DIM = re.compile(r"\{([^{}]*)\}")
_AXIS = re.compile(r'"(\w+)"')
_CONSTANT = re.compile(r"= stablehlo\.constant\b")


@dataclass(frozen=True)
class Op:
    """One op of an equation's lowering, as propagated: its kind, and per result its shape and
    layout (None where Shardy split a dim over part of an axis, which no plan writes)."""

    kind: str
    shapes: tuple[tuple[int, ...] | None, ...]
    dims: tuple[Dims | None, ...]


def result_layout(ops: Sequence[Op], shape: tuple[int, ...]) -> Dims | None:
    """The layout of an equation's result of ``shape``: the last of its ops to make a value of
    that shape (an equation lowered to several ops makes its result last)."""
    for op in reversed(ops):
        for s, d in zip(op.shapes, op.dims, strict=True):
            if s == shape and d is not None:
                return d
    return None


# -- stage 1: lowering ------------------------------------------------------------------------
def _renamed(jaxpr: Any, at: Path = ()) -> Any:
    """``jaxpr`` with each equation's name stack its whole path (``p12_3``: its index, after those
    of the equations whose bodies hold it), nested jaxprs the same. The whole path, because some
    lowerings (a ``shard_map``'s body) do not put the caller's name before their equations'."""
    from jax._src import source_info_util

    eqns = []
    for k, eqn in enumerate(jaxpr.eqns):
        path = (*at, k)
        several = len(_bodies(eqn)) > 1
        count = iter(range(1 << 30))
        params = {name: _renamed_param(v, path, count if several else None) for name, v in eqn.params.items()}
        name = "p" + "_".join(map(str, path))
        info = eqn.source_info.replace(name_stack=source_info_util.new_name_stack(name))
        eqns.append(eqn.replace(params=params, source_info=info))
    return jaxpr.replace(eqns=eqns)


def _renamed_param(v: Any, at: Path, count: Iterator[int] | None) -> Any:
    """A param's jaxprs renamed under ``at``; where an equation has several (a while's condition
    and body, a cond's branches), each under its own index after ``at`` (``count``, in the order
    :func:`_bodies` lists them)."""
    from jax._src import core

    if isinstance(v, core.ClosedJaxpr):
        return v.replace(jaxpr=_renamed(v.jaxpr, at if count is None else (*at, next(count))))
    if isinstance(v, core.Jaxpr):
        return _renamed(v, at if count is None else (*at, next(count)))
    if isinstance(v, tuple) and v and all(isinstance(x, (core.ClosedJaxpr, core.Jaxpr)) for x in v):
        return tuple(_renamed_param(x, at, count) for x in v)
    return v


def _bodies(eqn: Any) -> list[Any]:
    """The jaxprs an equation runs (open), in its params' order, a tuple's (a cond's branches) in
    turn: one (a call, a remat, a custom derivative's primal, a scan's body) names its equations
    under the equation's path, several each under an index of its own after it."""
    from jax._src import core

    out = []
    for v in eqn.params.values():
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, (core.ClosedJaxpr, core.Jaxpr)):
                out.append(getattr(x, "jaxpr", x))
    return out


def path_of(name: str) -> Path:
    """The equation path an op's name (its name stack) carries: the last one written in it
    (``()`` for an op no equation names)."""
    found = _STEP.findall(name)
    return tuple(int(k) for k in found[-1].split("_")) if found else ()


def _inline_call(ctx: Any, *args: Any, jaxpr: Any = None, call_jaxpr: Any = None, **_: Any) -> Any:
    """A call lowered in place, under the caller's name stack (jax lowers a nested jit once, as a
    function every caller calls: its ops would carry no caller's path)."""
    from jax._src import core
    from jax._src.interpreters import mlir

    closed = jaxpr if jaxpr is not None else call_jaxpr
    if not isinstance(closed, core.ClosedJaxpr):
        closed = core.ClosedJaxpr(closed, ())
    consts = [mlir.ir_constant(c) for c in closed.consts]
    out, tokens = mlir.jaxpr_subcomp(
        ctx.module_context,
        closed.jaxpr,
        ctx.name_stack,
        ctx.tokens_in,
        consts,
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        outer_traceback=ctx.traceback,
    )
    ctx.set_tokens_out(tokens)
    return out


_LOWERING = threading.Lock()


@contextlib.contextmanager
def _calls_inlined() -> Iterator[None]:
    """jit and closed_call lowered in place for the length of one lowering (then as before)."""
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.pjit import jit_p

    with _LOWERING:
        saved = {p: mlir._lowerings.get(p) for p in (jit_p, core.closed_call_p)}
        try:
            for p in saved:
                mlir._lowerings[p] = mlir.LoweringRuleEntry(_inline_call, True)
            yield
        finally:
            for p, rule in saved.items():
                if rule is None:
                    mlir._lowerings.pop(p, None)
                else:
                    mlir._lowerings[p] = rule


def lowered(closed: Any, abstract_mesh: Any) -> str:
    """Stage 1: ``closed`` (a traced step) as StableHLO text, each op named by its equation's
    path, every argument and result whole (placeholders for a plan's layouts)."""
    import jax
    from jax._src import core
    from jax.sharding import NamedSharding, PartitionSpec

    renamed = closed.replace(jaxpr=_renamed(closed.jaxpr))
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    whole = NamedSharding(abstract_mesh, PartitionSpec())
    fn = jax.jit(
        core.jaxpr_as_fun(renamed),
        in_shardings=[whole] * len(avals),
        out_shardings=[whole] * len(closed.jaxpr.outvars),
        keep_unused=True,
    )
    with _calls_inlined(), jax.sharding.use_abstract_mesh(abstract_mesh):
        low = fn.trace(*avals).lower(lowering_platforms=("cpu",))
    return low.as_text(debug_info=True)


# -- stage 2: what XLA imports -----------------------------------------------------------------
def _context() -> Any:
    from jax._src.interpreters import mlir

    return mlir.make_ir_context()


def _ops(op: Any) -> Iterator[Any]:
    """Every op nested in ``op``, in program order."""
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                yield o.operation
                yield from _ops(o.operation)


def _run(module: Any, pipeline: str) -> None:
    from jaxlib.mlir import passmanager

    passmanager.PassManager.parse(f"builtin.module({pipeline})").run(module.operation)


def _constraints(module: Any) -> int:
    """``custom_call @Sharding`` (a sharding constraint after the HLO round trip) as
    ``sdy.sharding_constraint`` with the sharding its frontend attribute holds."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import sdy

    calls = [
        o
        for o in _ops(module.operation)
        if o.name == "stablehlo.custom_call" and str(o.attributes["call_target_name"]) == '"Sharding"'
    ]
    for o in calls:
        held = str(ir.DictAttr(o.attributes["mhlo.frontend_attributes"])["xla.sdy.sharding"])
        inner = held.strip('"').replace("\\22", '"')
        one = _PER_VALUE.search(inner)
        if one is None:
            continue
        mesh = re.search(r"<(@\w+),", inner)
        sharding = ir.Attribute.parse(f"#sdy.sharding<{mesh.group(1) if mesh else '@mesh'}, [{one.group(1)}]>")
        with ir.InsertionPoint(o), o.location:
            c = sdy.ShardingConstraintOp(o.operands[0], sharding)
        o.results[0].replace_all_uses_with(c.result)
        o.erase()
    return len(calls)


def _loops(module: Any) -> list[Any]:
    return [o for o in _ops(module.operation) if o.name == "stablehlo.while"]


def _invariants_outside(module: Any) -> int:
    """A while loop's operands that its body returns unchanged, read from outside the loop (in
    its condition, its body and after it), as XLA's import leaves them: free variables."""
    from jaxlib.mlir import ir

    moved = 0
    for loop in _loops(module):
        cond, body = loop.regions[0].blocks[0], loop.regions[1].blocks[0]
        ret = list(body.operations)[-1]
        for i, outer in enumerate(loop.operands):
            back = ret.operands[i]
            if not (isinstance(back.owner, ir.Block) and back.owner == body and ir.BlockArgument(back).arg_number == i):
                continue
            for block in (cond, body):
                for use in list(block.arguments[i].uses):
                    if use.owner != ret:
                        use.owner.operands[use.operand_number] = outer
            for use in list(loop.results[i].uses):
                use.owner.operands[use.operand_number] = outer
            moved += 1
    return moved


def _within(op: Any, outer: Any) -> bool:
    while op is not None and op.name != "builtin.module":
        if op == outer:
            return True
        op = op.parent
    return False


def _free_opened(module: Any, mesh: str) -> int:
    """Each value a while loop reads from outside that carries a sharding, read inside through an
    open constraint (XLA's ``OpenWhileFreeVarsSharding``: the loop may lay it out otherwise)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import sdy

    opened = 0
    for loop in _loops(module):
        free: dict[Any, list[tuple[Any, int]]] = {}
        for o in _ops(loop):
            for i, v in enumerate(o.operands):
                owner = v.owner
                if isinstance(owner, ir.Block):
                    holder = owner.owner
                    if holder == loop or _within(holder, loop):
                        continue
                    attrs = ir.ArrayAttr(holder.attributes["arg_attrs"]) if "arg_attrs" in holder.attributes else None
                    if attrs is None or "sdy.sharding" not in ir.DictAttr(attrs[ir.BlockArgument(v).arg_number]):
                        continue
                elif _within(owner, loop) or "sdy.sharding" not in owner.attributes:
                    continue
                free.setdefault(v, []).append((o, i))
        for v, uses in free.items():
            rank = len(v.type.shape)
            dims = [sdy.DimensionShardingAttr.get([], is_closed=False) for _ in range(rank)]
            with ir.InsertionPoint(loop), loop.location:
                c = sdy.ShardingConstraintOp(v, sdy.TensorShardingAttr.get(mesh, dims))
            for o, i in uses:
                o.operands[i] = c.result
            opened += 1
    return opened


def _frontend(op: Any, key: str) -> Any:
    """An attribute XLA's round trip keeps as text in an op's frontend attributes, parsed."""
    from jaxlib.mlir import ir

    held = str(ir.DictAttr(op.attributes["mhlo.frontend_attributes"])[key]).strip('"')
    return ir.Attribute.parse(held.replace("\\22", '"'))


def _parts(value: Any) -> list[Any]:
    """The values a tuple-typed result unpacks to (its ``get_tuple_element`` users, by index), or
    the value itself."""
    if "tuple" not in str(value.type):
        return [value]
    parts: dict[int, Any] = {}
    for use in value.uses:
        if use.owner.name == "stablehlo.get_tuple_element":
            parts[int(str(use.owner.attributes["index"]).split(":")[0])] = use.owner.results[0]
    return [parts[k] for k in sorted(parts)]


def _target(op: Any) -> str:
    """A custom call's target ('' for any other op)."""
    return str(op.attributes["call_target_name"]).strip('"') if op.name == "stablehlo.custom_call" else ""


def _manual_regions(module: Any) -> int:
    """XLA's shard_map import, which jaxlib does not register: ``GlobalToLocalShape``, a call of
    the region's body and ``LocalToGlobalShape`` (the round trip's form of a ``shard_map``)
    become one ``sdy.manual_computation`` holding the body. One region at a time, the module
    read afresh after each (moving and erasing ops invalidates what was read before)."""
    done = 0
    while _one_manual_region(module):
        done += 1
    return done


def _one_manual_region(module: Any) -> bool:
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import sdy

    funcs = {
        str(o.operation.attributes["sym_name"]).strip('"'): o.operation
        for o in module.body.operations
        if o.operation.name == "func.func"
    }
    for enter in [o for o in _ops(module.operation) if _target(o) == "xla.sdy.GlobalToLocalShape"]:
        local = _parts(enter.results[0])
        calls = {use.owner for v in local for use in v.uses}
        if len(calls) != 1:
            continue
        call = calls.pop()
        body = funcs.get(str(call.attributes["callee"]).lstrip("@"))
        exits = list({use.owner for r in call.results for use in r.uses})
        if body is None or len(exits) != 1 or _target(exits[0]) != "xla.sdy.LocalToGlobalShape":
            continue
        if list(call.operands) != local:  # (the body reads only the region's operands)
            continue
        leave = exits[0]
        outs = _parts(leave.results[0])
        with ir.InsertionPoint(leave), leave.location:
            region = sdy.ManualComputationOp(
                [v.type for v in outs],
                list(enter.operands),
                _frontend(enter, "xla.sdy.in_shardings"),
                _frontend(leave, "xla.sdy.out_shardings"),
                _frontend(enter, "xla.sdy.manual_axes"),
            )
        block = region.regions[0].blocks.append(*[v.type for v in local])
        inner = body.regions[0].blocks[0]
        for arg, new in zip(inner.arguments, block.arguments, strict=True):
            arg.replace_all_uses_with(new)
        ops = list(inner.operations)
        with ir.InsertionPoint(block), call.location:
            back = sdy.ReturnOp(list(ops[-1].operands))
        for o in ops[:-1]:
            o.operation.move_before(back)
        for old, new in zip(outs, region.results, strict=True):
            old.replace_all_uses_with(new)
        unpacked_out = [v.owner for v in outs if v.owner != leave]
        unpacked_in = [v.owner for v in local if v.owner != enter]
        for o in [*unpacked_out, leave, call, *unpacked_in, enter]:  # (each after its users)
            o.erase()
        if not any(True for _ in _callers(module, str(body.attributes["sym_name"]).strip('"'))):
            body.erase()
        return True
    return False


def _callers(module: Any, name: str) -> Iterator[Any]:
    for o in _ops(module.operation):
        if o.name == "func.call" and str(o.attributes["callee"]).lstrip("@") == name:
            yield o


def imported(text: str) -> str:
    """Stage 2: the lowered module (``lowered``) as XLA's Shardy pass imports it, as text."""
    from jaxlib import _jax
    from jaxlib.mlir import ir

    with _context():
        from jax._src.interpreters import mlir

        code = mlir.module_to_bytecode(ir.Module.parse(text))
    hlo = _jax.mlir.mlir_module_to_xla_computation(code, use_tuple_args=False, return_tuple=False)
    back = _jax.mlir.hlo_to_stablehlo(hlo.as_serialized_hlo_module_proto())
    with _context(), ir.Location.unknown():
        module = ir.Module.parse(back)
        _run(module, "symbol-dce")
        module = ir.Module.parse(_CONSTANT.sub("= sdy.constant", str(module.operation.get_asm(enable_debug_info=True))))
        _constraints(module)
        _manual_regions(module)
        _run(module, "xla-sdy-round-trip-import-shardy-attrs,symbol-dce")
        meshes = [o for o in module.body.operations if o.operation.name == "sdy.mesh"]
        mesh = str(meshes[0].operation.attributes["sym_name"]).strip('"') if meshes else "mesh"
        _invariants_outside(module)
        _free_opened(module, mesh)
        return str(module.operation.get_asm(enable_debug_info=True))


# -- stage 3: a plan's layouts ------------------------------------------------------------------
def _dims(text: str) -> Dims | None:
    out = []
    for d in _DIM.findall(text):
        d = d.replace("?", "").strip().rstrip(",").strip()
        if ":" in d:  # a sub-axis (``"data":(1)2``)
            return None
        out.append(tuple(_AXIS.findall(d)))
    return tuple(out)


class Propagator:
    """A traced step made ready for Shardy's propagation once (stages 1 and 2); :meth:`layouts`
    per plan. ``closed``: the step's closed jaxpr; ``abstract_mesh``: the mesh it was traced under."""

    def __init__(self, closed: Any, abstract_mesh: Any):
        from jaxlib.mlir import ir

        self.ctx = _context()
        with self.ctx:
            self.module = ir.Module.parse(imported(lowered(closed, abstract_mesh)))
        with self.ctx:
            meshes = [o for o in self.module.body.operations if o.operation.name == "sdy.mesh"]
        self.mesh = str(meshes[0].operation.attributes["sym_name"]).strip('"') if meshes else "mesh"

    def layouts(self, args: Sequence[Dims], results: Sequence[Dims | None]) -> dict[Path, tuple[Op, ...]]:
        """Per equation path, its ops as propagated with the step's arguments laid out as ``args``
        and its results as ``results`` (in the jaxpr's order; None: a result propagation lays out,
        as ``jax.jit`` without ``out_shardings``)."""
        from jaxlib.mlir import ir

        def sharding(dims: Dims) -> Any:
            body = ", ".join("{" + ", ".join(f'"{a}"' for a in d) + "}" for d in dims)
            return ir.Attribute.parse(f"#sdy.sharding<@{self.mesh}, [{body}]>")

        with self.ctx, ir.Location.unknown():
            module = self.module.operation.clone()
            main = next(
                o.operation
                for o in module.regions[0].blocks[0].operations
                if o.operation.name == "func.func" and str(o.operation.attributes["sym_name"]) == '"main"'
            )
            for key, given in (("arg_attrs", args), ("res_attrs", results)):
                main.attributes[key] = ir.ArrayAttr.get(
                    [ir.DictAttr.get({} if d is None else {"sdy.sharding": sharding(d)}) for d in given]
                )
            _run(module, "sdy-propagation-pipeline")
            got: dict[Path, list[Op]] = {}
            for o in _ops(module):
                if not len(o.results) or o.name.startswith("sdy."):  # (reshards Shardy inserted)
                    continue
                name = _NAME.search(str(o.location))
                if name is None:
                    continue
                shapes = tuple(tuple(r.type.shape) if hasattr(r.type, "shape") else None for r in o.results)
                if "sdy.sharding" in o.attributes:
                    dims = tuple(_dims(p) for p in _PER_VALUE.findall(str(o.attributes["sdy.sharding"])))
                else:  # no sharding: whole
                    dims = tuple(tuple(() for _ in s) if s is not None else None for s in shapes)
                op = Op(o.name, shapes, dims)
                for part in name.group(1).split(";"):  # (ops jax merged carry both names)
                    path = path_of(part)
                    if path:
                        got.setdefault(path, []).append(op)
        return {p: tuple(ops) for p, ops in got.items()}


class Failed(Exception):
    """Shardy's propagation could not run over a step; the message says why (:func:`reason`)."""


def given(jaxpr: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> tuple[list[Dims], list[Dims]]:
    """The step's arguments' and results' layouts for :meth:`Propagator.layouts`, from the plan's
    decisions (``inputs``: params, optimizer state and batch, in the jaxpr's order; ``outputs``:
    params and optimizer state, which the step's outputs keep): each spec padded to its value's
    rank; the loss and any further output whole."""

    def padded(spec: Any, rank: int) -> Dims:
        dims = tuple(tuple(d) for d in spec.dims)[:rank]
        return dims + ((),) * (rank - len(dims))

    args = [padded(d.spec, len(v.aval.shape)) for d, v in zip(inputs, jaxpr.invars, strict=True)]
    results = [padded(d.spec, len(v.aval.shape)) for d, v in zip(outputs, jaxpr.outvars, strict=False)]
    results += [((),) * len(getattr(v.aval, "shape", ())) for v in jaxpr.outvars[len(results) :]]
    return args, results


def claims(jaxpr: Any, laid_out: dict[Path, tuple[Op, ...]], at: Path = ()) -> dict[Any, Dims]:
    """Each array result of ``jaxpr``'s equations, and of the bodies they run in place, with the
    layout :meth:`Propagator.layouts` gave it, by variable (fast mode's walker takes these as
    the layouts XLA's partitioner is handed: ``runtime.fast.costing``). A shard_map region's
    values are per device (laid out by hand: none); a body two equations share keeps its first."""
    out: dict[Any, Dims] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        path = (*at, k)
        if eqn.primitive.name == "shard_map":
            continue
        bodies = _bodies(eqn)
        for i, body in enumerate(bodies):
            for var, inner in claims(body, laid_out, path if len(bodies) == 1 else (*path, i)).items():
                out.setdefault(var, inner)
        if eqn.primitive.name == "scan" and len(bodies) == 1:
            # a scanned body's slices of its stacked operands: the slices the loop's lowering makes
            # (named by the scan's path), by shape where one layout has it
            made: dict[tuple, set] = {}
            for op in laid_out.get(path, ()):
                for shp, dims in zip(op.shapes, op.dims, strict=True):
                    if shp is not None and dims is not None:
                        made.setdefault(tuple(shp), set()).add(dims)
            for var in bodies[0].invars:
                shape = tuple(getattr(var.aval, "shape", ()))
                got = made.get(shape, set())
                if shape and len(got) == 1:
                    out.setdefault(var, next(iter(got)))
        ops = () if bodies else laid_out.get(path, ())
        for var in eqn.outvars if ops else ():
            shape = tuple(getattr(var.aval, "shape", ()))
            dims = result_layout(ops, shape) if shape else None
            if dims is not None:
                out.setdefault(var, dims)
    return out


def reason(err: Exception) -> str:
    """What an MLIR pass failure says, without the op's location (a call stack of every frame):
    the words after the last location of its first error line (a shard_map region: "Shardy
    propagation doesn't support tuples", XLA's shard_map import not being in jaxlib)."""
    text = str(err)
    line = next((ln for ln in text.splitlines() if "error:" in ln), text.splitlines()[0] if text else "")
    words = line.rsplit(")): ", 1)[-1] if ")): " in line else line
    return f"{type(err).__name__}: {words.strip()[:240]}"


# -- the step's values, laid out ---------------------------------------------------------------
@dataclass(frozen=True)
class Value:
    """One equation's result as XLA lays it out: where the user's code makes it, the primitive,
    its shape and element size, its layout, whether it is in the backward pass, whether it is
    computed from literals alone, and whether it is an activation of the forward pass."""

    source: str
    op: str
    shape: tuple[int, ...]
    itemsize: int
    dims: Dims
    backward: bool
    constant: bool = False  # computed from literals alone (a mask, positions): no act rule reaches it
    activation: bool = False  # the forward pass makes it from the batch (not a weight's copy, not the update)

    def local_bytes(self, mesh: dict[str, int]) -> int:
        """Bytes each device holds of it."""
        n = self.itemsize
        for size, axes in zip(self.shape, self.dims, strict=True):
            split = 1
            for a in axes:
                split *= mesh[a]
            n *= -(-size // split)
        return n


def values(
    jaxpr: Any,
    laid_out: dict[Path, tuple[Op, ...]],
    batch: frozenset = frozenset(),
    at: Path = (),
    caller: str = "",
    fixed: frozenset = frozenset(),
) -> list[Value]:
    """Every array result of ``jaxpr``'s equations and of the bodies they run in place, in program
    order, with the layout :meth:`Propagator.layouts` gave it (values it gave none are left out).
    An equation inside library code is placed where the user's code calls it (``caller``);
    ``batch``: ``jaxpr``'s inputs that the step's batch feeds; ``fixed``: those computed from
    literals alone."""
    from shardplan.runtime.primitives import itemsize
    from shardplan.runtime.sources import eqn_source

    out: list[Value] = []
    constant, fed = set(fixed), set(batch)
    for k, eqn in enumerate(jaxpr.eqns):
        path = (*at, k)
        given = [hasattr(x, "val") or x in constant for x in eqn.invars]
        feeds = [not hasattr(x, "val") and x in fed for x in eqn.invars]
        if eqn.primitive.name == "shard_map":  # its body's values are per device, laid out by hand
            continue
        bodies = _bodies(eqn)
        if len(bodies) == 1:  # its operands are its body's inputs, in order
            (body,) = bodies
            inner = frozenset(v for v, c in zip(body.invars, given, strict=False) if c and eqn.primitive.name != "scan")
            inner_fed = frozenset(v for v, f in zip(body.invars, feeds, strict=False) if f)
            out += values(body, laid_out, inner_fed, path, eqn_source(eqn) or caller, inner)
        for i, body in enumerate(bodies if len(bodies) > 1 else ()):  # a while, a cond: inputs fed if any is
            inner_fed = frozenset(body.invars) if any(feeds) else frozenset()
            out += values(body, laid_out, inner_fed, (*path, i), eqn_source(eqn) or caller)
        if bodies:
            if any(feeds):
                fed.update(eqn.outvars)
            continue
        if all(given) and eqn.primitive.name not in ("scan", "while"):
            constant.update(eqn.outvars)
        if any(feeds):
            fed.update(eqn.outvars)
        ops = laid_out.get(path)
        if not ops:
            continue
        stack = str(getattr(eqn.source_info, "name_stack", ""))
        backward = "transpose(" in stack
        forward = "jvp(" in stack and not backward
        for var in eqn.outvars:
            shape = tuple(getattr(var.aval, "shape", ()))
            dims = result_layout(ops, shape) if shape else None
            if dims is not None:
                where = eqn_source(eqn) or caller
                kind = eqn.primitive.name
                fwd = forward and var in fed
                out.append(Value(where, kind, shape, itemsize(var.aval), dims, backward, var in constant, fwd))
    return out
