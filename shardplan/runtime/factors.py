"""Per-primitive factor rules: which operand dim is which result dim, one fact per equation.

A primitive's rule reads one jaxpr equation and says how its dims correspond, as Shardy's
``OpShardingRule`` stores it: the equation's dims are made of *factors*; a dim made of one factor
is that factor (an elementwise op's dims, a matmul's batch dims), a dim made of several is their
product, major first (a reshape of ``heads * head_dim`` into ``heads, head_dim``), and a dim of
no factor relates to nothing (a new dim, a size-1 dim). Factors met only in operands are
``reduced`` (a matmul's contracting dims, a sum's axes: a pending sum where they are split);
``whole`` factors must stay whole (the dim a sort or a cumulative sum runs along); ``indexed``
factors are looked up by index (a gather's rows).

How to lay a value out through an equation is policy, and stays in each engine; what these rules
give every engine is the correspondence, and two derived readings of it: :func:`forward` (the
layouts results take from their operands' layouts) and :func:`backward` (the operand layouts a
wanted result layout needs). Structure (calls, loops, branches, shard_map regions, kernels) is
the walkers' concern: :func:`of` answers None for it.

To add a primitive: a row in ``shardplan.runtime.primitives``, then a rule here (a function of
the equation, in ``_RULES``), or leave it to the walkers' fallbacks; ``tests/test_factors.py``
has one test per rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardplan.runtime.primitives import ELEMENTWISE, REDUCTIONS, named

Dims = tuple[tuple[int, ...], ...]  # per dim: the factors it is made of, major first
Layout = tuple[tuple[str, ...], ...]  # per dim: the mesh axes it is split over (() whole)


@dataclass(frozen=True)
class Factors:
    """One equation's dims as factors (see the module's docstring)."""

    sizes: tuple[int, ...]  # factor -> size
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    reduced: frozenset[int] = frozenset()
    whole: frozenset[int] = frozenset()
    indexed: frozenset[int] = frozenset()

    def occurs(self, factor: int) -> tuple[list[int], list[int]]:
        """The operands and the results with a dim made of ``factor``."""
        ins = [i for i, dims in enumerate(self.operands) if any(factor in d for d in dims)]
        outs = [i for i, dims in enumerate(self.results) if any(factor in d for d in dims)]
        return ins, outs


@dataclass
class _Build:
    sizes: list[int] = field(default_factory=list)

    def new(self, size: int) -> int:
        self.sizes.append(int(size))
        return len(self.sizes) - 1

    def fresh(self, shape: Sequence[int]) -> Dims:
        """Dims of their own: one new factor each (none for a size-1 dim)."""
        return tuple((self.new(s),) if s != 1 else () for s in shape)

    def done(self, operands: Sequence[Dims], results: Sequence[Dims], **kw: Any) -> Factors:
        return Factors(tuple(self.sizes), tuple(operands), tuple(results), **kw)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(getattr(v, "aval", None), "shape", ()))


def _aligned(eqn: Any, sources: Callable[[int], Sequence[int]]) -> Factors:
    """Each result's dims are those of the operands ``sources(k)`` names, dim for dim where the
    ranks and the sizes agree; every other dim is one of its own."""
    b = _Build()
    ins = [list(b.fresh(_shape(v))) for v in eqn.invars]
    outs = []
    for k, v in enumerate(eqn.outvars):
        shape = _shape(v)
        out: list[tuple[int, ...]] = [()] * len(shape)
        for j in sources(k):
            src = _shape(eqn.invars[j])
            if len(src) != len(shape):
                continue
            for d, s in enumerate(shape):
                if s == src[d] and s != 1:
                    if not out[d]:
                        out[d] = ins[j][d]
                    else:
                        ins[j][d] = out[d]
        outs.append(tuple(o if o or s == 1 else (b.new(s),) for o, s in zip(out, shape, strict=True)))
    return b.done([tuple(d) for d in ins], outs)


# Results whose dims are their operands' dims, one for one; ``_ALONG``: along a dim named by a param.
_INTO_OPERAND = named(traits=("into-operand",))
_SAME_SHAPE = (
    ELEMENTWISE
    | named(kinds=("identity", "reshard"))
    | named(kinds=("along",)) - {"top_k"}
    | _INTO_OPERAND
    | {"dynamic_update_slice", "random_wrap", "random_unwrap"}
)
# Results whose dims line up with their operands' where the sizes agree (slices, pads, joins).
_LINED_UP = named(kinds=("slicing",)) - {"stack", "unstack", "dynamic_update_slice"} | {"top_k", "reduce_precision"}
_ALONG_PARAMS = ("axis", "dimension", "dimensions")


def same_shape(eqn: Any) -> Factors:
    """Element by element: result k is operand k for a tuple through (optimization_barrier),
    operand 0 updated for a scatter (the updates' dims are others), every operand otherwise.
    An op along a dim (sort, cumsum, rev) needs that dim whole."""
    name = eqn.primitive.name
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if n_out > 1 and n_out == n_in:
        f = _aligned(eqn, lambda k: [k])
    elif name in _INTO_OPERAND:
        f = _aligned(eqn, lambda k: [0])
    else:
        f = _aligned(eqn, lambda k: range(n_in))
    if eqn.primitive.name in named(kinds=("along",)) and f.results:
        rank = len(f.results[0])
        along = next((eqn.params[p] for p in _ALONG_PARAMS if p in eqn.params), ())
        dims = along if isinstance(along, (tuple, list)) else (along,)
        whole = {x for d in dims if rank for x in f.results[0][int(d) % rank]}
        f = Factors(f.sizes, f.operands, f.results, whole=frozenset(whole))
    return f


def lined_up(eqn: Any) -> Factors:
    """Slices, pads, concatenations, splits, top_k: each operand's dims are the results' where
    the sizes agree (a sliced or joined dim is a new one)."""
    return _aligned(eqn, lambda k: range(len(eqn.invars)))


def reduce(eqn: Any) -> Factors:
    """A reduction: the operand's dims less ``axes``, which are reduced (a pending sum for
    ``reduce_sum``, a partial max for ``reduce_max``)."""
    b = _Build()
    operand = b.fresh(_shape(eqn.invars[0]))
    axes = {int(a) for a in eqn.params["axes"]}
    keep = tuple(d for i, d in enumerate(operand) if i not in axes)
    reduced = frozenset(x for i in axes for x in operand[i])
    return b.done([operand], [keep for _ in eqn.outvars], reduced=reduced)


def dot(eqn: Any) -> Factors:
    """``dot_general``: contracting dims one factor each (reduced), batch dims one factor each
    (first in the result), then the left operand's other dims, then the right's."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    b = _Build()
    lhs, rhs = list(b.fresh(_shape(eqn.invars[0]))), list(b.fresh(_shape(eqn.invars[1])))
    for a, c in zip(lc, rc, strict=True):
        rhs[c] = lhs[a]
    for a, c in zip(lb, rb, strict=True):
        rhs[c] = lhs[a]
    lf = [i for i in range(len(lhs)) if i not in lc and i not in lb]
    rf = [i for i in range(len(rhs)) if i not in rc and i not in rb]
    out = tuple(lhs[a] for a in lb) + tuple(lhs[i] for i in lf) + tuple(rhs[i] for i in rf)
    reduced = frozenset(x for a in lc for x in lhs[a])
    return b.done([tuple(lhs), tuple(rhs)], [out], reduced=reduced)


def transpose(eqn: Any) -> Factors:
    b = _Build()
    operand = b.fresh(_shape(eqn.invars[0]))
    return b.done([operand], [tuple(operand[i] for i in eqn.params["permutation"])])


def squeeze(eqn: Any) -> Factors:
    b = _Build()
    operand = b.fresh(_shape(eqn.invars[0]))
    dropped = {int(d) % max(len(operand), 1) for d in eqn.params["dimensions"]}
    return b.done([operand], [tuple(d for i, d in enumerate(operand) if i not in dropped)])


def broadcast(eqn: Any) -> Factors:
    """``broadcast_in_dim``: result dim ``broadcast_dimensions[k]`` is operand dim k where their
    sizes agree (a size-1 dim broadcast is a new one); the other result dims are new."""
    b = _Build()
    src = _shape(eqn.invars[0])
    operand = b.fresh(src)
    shape = _shape(eqn.outvars[0])
    out: list[tuple[int, ...]] = [()] * len(shape)
    for k, d in enumerate(eqn.params["broadcast_dimensions"]):
        if src[k] == shape[d]:
            out[d] = operand[k]
    return b.done([operand], [tuple(o if o or s == 1 else (b.new(s),) for o, s in zip(out, shape, strict=True))])


def reshape(eqn: Any) -> Factors:
    """``reshape``/``expand_dims``: runs of dims with equal products correspond; a dim split into
    several is made of them (major first), several merged into one likewise; past a run that
    does neither (``(6, 4) -> (4, 6)``), dims are new."""
    b = _Build()
    a, c = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    ins: list[tuple[int, ...]] = [()] * len(a)
    outs: list[tuple[int, ...]] = [()] * len(c)
    ia = [i for i, s in enumerate(a) if s != 1]
    ic = [j for j, s in enumerate(c) if s != 1]
    i = j = 0
    while i < len(ia) and j < len(ic):
        ga, gc = [ia[i]], [ic[j]]
        pa, pc = a[ia[i]], c[ic[j]]
        while pa != pc:
            if pa < pc and i + 1 < len(ia):
                i += 1
                ga.append(ia[i])
                pa *= a[ia[i]]
            elif pc < pa and j + 1 < len(ic):
                j += 1
                gc.append(ic[j])
                pc *= c[ic[j]]
            else:
                break
        if pa != pc:
            break
        if len(ga) > 1 and len(gc) > 1:  # regrouped ((2, 3) -> (3, 2)): related to nothing
            i += 1
            j += 1
            continue
        parts = tuple(b.new(a[k]) for k in ga) if len(ga) > 1 else tuple(b.new(c[k]) for k in gc)
        for k, x in zip(ga if len(ga) > 1 else gc, parts, strict=True):
            (ins if len(ga) > 1 else outs)[k] = (x,)
        (outs if len(ga) > 1 else ins)[gc[0] if len(ga) > 1 else ga[0]] = parts
        i += 1
        j += 1
    ins = [d if d or a[k] == 1 else (b.new(a[k]),) for k, d in enumerate(ins)]
    outs = [d if d or c[k] == 1 else (b.new(c[k]),) for k, d in enumerate(outs)]
    return b.done([tuple(ins)], [tuple(outs)])


def gather(eqn: Any) -> Factors:
    """``gather``: the operand's dims kept whole in each slice are the result's offset dims; the
    indices' batch dims are the result's other dims; the collapsed dims are looked up (indexed)."""
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    b = _Build()
    src, idx_shape, shape = _shape(eqn.invars[0]), _shape(eqn.invars[1]), _shape(eqn.outvars[0])
    operand, idx = b.fresh(src), list(b.fresh(idx_shape))
    out: list[tuple[int, ...]] = [()] * len(shape)
    offset = tuple(dn.offset_dims)
    skipped = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()) or ())
    kept = [d for d in range(len(src)) if d not in skipped]
    for o, d in zip(offset, kept, strict=False):
        if sizes[d] == src[d]:
            out[o] = operand[d]
    batch_out = [i for i in range(len(shape)) if i not in offset]
    for o, d in zip(batch_out, range(len(idx_shape) - 1), strict=False):
        if shape[o] == idx_shape[d]:
            out[o] = idx[d]
    result = tuple(o if o or s == 1 else (b.new(s),) for o, s in zip(out, shape, strict=True))
    indexed = frozenset(x for d in dn.collapsed_slice_dims for x in operand[d])
    return b.done([operand, tuple(idx)], [result], indexed=indexed)


def stack(eqn: Any) -> Factors:
    """``jnp.stack``: each operand's dims are the result's, less the new one at ``axis``."""
    b = _Build()
    shape = _shape(eqn.outvars[0])
    out = b.fresh(shape)
    others = [out[d] for d in range(len(shape)) if d != eqn.params["axis"]]
    operands = [tuple(others) if len(_shape(v)) == len(others) else b.fresh(_shape(v)) for v in eqn.invars]
    return b.done(operands, [out])


def unstack(eqn: Any) -> Factors:
    """``unstack``: each result's dims are the operand's, less the one at ``axis``."""
    b = _Build()
    operand = b.fresh(_shape(eqn.invars[0]))
    axis = int(eqn.params["axis"]) % max(len(operand), 1)
    return b.done([operand], [operand[:axis] + operand[axis + 1 :] for _ in eqn.outvars])


# The rule book: primitive -> rule(eqn) -> Factors. Anything else is structure or a fallback.
_RULES: dict[str, Callable[[Any], Factors]] = {
    **dict.fromkeys(_SAME_SHAPE, same_shape),
    **dict.fromkeys(_LINED_UP, lined_up),
    **dict.fromkeys(REDUCTIONS, reduce),
    "dot_general": dot,
    "transpose": transpose,
    "reshape": reshape,
    "expand_dims": reshape,
    "squeeze": squeeze,
    "broadcast_in_dim": broadcast,
    "gather": gather,
    "stack": stack,
    "unstack": unstack,
}


def rule_book() -> frozenset[str]:
    """The primitives with a factor rule."""
    return frozenset(_RULES)


def of(eqn: Any) -> Factors | None:
    """The equation's factors; None for a primitive without a rule (structure, kernels, creation)."""
    rule = _RULES.get(eqn.primitive.name)
    return rule(eqn) if rule is not None else None


def forward(f: Factors, layouts: Sequence[Layout | None]) -> tuple[tuple[Layout, ...], tuple[str, ...]]:
    """The results' natural layouts from the operands' (None: an operand's layout unknown), and
    the axes of a pending sum (a reduced factor split). A factor takes the axes of the first
    operand dim made of it alone, or, for a dim made of several, the major factor takes that
    dim's axes; a ``whole`` factor takes none."""
    axes_of: dict[int, tuple[str, ...]] = {}
    for dims, layout in zip(f.operands, layouts, strict=True):
        if layout is None:
            continue
        for d, fs in enumerate(dims):
            if fs and layout[d] and fs[0] not in axes_of:
                axes_of[fs[0]] = tuple(layout[d])
    for x in f.whole:
        axes_of.pop(x, None)
    results = tuple(tuple(tuple(a for x in fs for a in axes_of.get(x, ())) for fs in dims) for dims in f.results)
    pending = tuple(dict.fromkeys(a for x in sorted(f.reduced) for a in axes_of.get(x, ())))
    return results, pending


def backward(f: Factors, result: int, layout: Layout) -> tuple[Layout, ...]:
    """The operand layouts that give result ``result`` the layout ``layout`` with no data moved:
    each operand dim made of a factor of the wanted dims takes its axes (a ``whole`` factor none);
    dims of other factors stay whole."""
    axes_of: dict[int, tuple[str, ...]] = {}
    for fs, axes in zip(f.results[result], layout, strict=True):
        if fs and axes and fs[0] not in f.whole:
            axes_of[fs[0]] = tuple(axes)
    return tuple(tuple(axes_of.get(fs[0], ()) if fs else () for fs in dims) for dims in f.operands)
