"""What each param dim *is*, read from the step's computation, not from names (for the plan
search, ``shardplan suggest``).

One walk over the traced step's jaxpr joins array dims that must be the same logical dimension:
the operand and result dims of elementwise ops, a matmul's contracting dims with each other and
its batch dims with the result's, a transpose's permuted dims, the dims a reshape keeps, the dims
a call, loop or branch passes through. A reshape that splits one dim into several (``heads *
head_dim`` into ``heads, head_dim``) records the whole as made of its parts, so two dims made of
the same parts are one dimension too. Params whose paths differ only in list indices (the layers
of a list) share their dims. What is left is a handful of classes, the model's logical axes
(embedding width, heads, MLP width, vocabulary, stacked layers, experts) found from the
computation, and each param dim tagged by how the step uses it:

- ``contract``: a matmul contracts it with an activation (the weight's input side);
- ``free``: it survives a matmul into the result (the weight's output side);
- ``batch``: a matmul batches over it (a stacked expert dim);
- ``rows``: a gather looks rows up along it (an embedding table's vocabulary);
- ``stack``: a ``scan`` iterates over it (stacked layers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardplan.runtime import factors
from shardplan.runtime.primitives import CALLS, named

# The primitives whose results are their operand's dims laid out again with no copy made (a
# param seen through them is still that param: its dims keep their tags).
_VIEWS = named(kinds=("identity",)) | {
    "convert_element_type",
    "copy",
    "copy_p",
    "sharding_constraint",
    "transpose",
    "squeeze",
    "broadcast_in_dim",
    "reshape",
    "expand_dims",
}


@dataclass(frozen=True)
class ParamDims:
    path: str
    shape: tuple[int, ...]
    classes: tuple[int, ...]  # the logical dimension of each dim
    units: tuple[int, ...]  # what decides each dim's split: its class's major finest part
    tags: tuple[frozenset[str], ...]  # how the step uses each dim (TAGS)


@dataclass(frozen=True)
class Roles:
    params: tuple[ParamDims, ...]
    sizes: dict[int, int]  # class -> size
    inputs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # input path, shape, classes
    opt_prefixes: tuple[str, ...] = ()  # what optimizer-state paths put before the param path they mirror
    # A mixture of experts' routing, read from the computation: each top-k over a dim (experts,
    # k, the tokens choosing: its operand's other dims), and each matmul batched over a stacked
    # param's dim against an activation (experts, the activation's free dims' product: the slots
    # each expert's buffer holds, capacity-style dispatch; a grouped matmul has none).
    routers: tuple[tuple[int, int, int], ...] = ()
    expert_slots: tuple[tuple[int, int], ...] = ()


def template(path: str) -> str:
    """A path with its list indices generalised (``layers/3/mlp`` -> ``layers/\\d+/mlp``)."""
    return "/".join(r"\d+" if part.isascii() and part.isdigit() else re.escape(part) for part in path.split("/"))


class _Walk:
    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.merges: list[tuple[int, tuple[int, ...]]] = []  # a whole dim made of these parts
        self.tags: dict[tuple[int, int], set[str]] = {}  # (param, dim) -> tags
        self.views: dict[Any, tuple[int, tuple[int | None, ...]]] = {}  # var -> (param, param dim per dim)
        self.first: dict[tuple[int, str], int] = {}  # (param, use) -> the var of its first use
        self.parts: dict[int, tuple[int, ...]] = {}  # whole -> its parts (settle)
        self.routers: set[tuple[int, int, int]] = set()  # (experts, k, tokens) of each top-k
        self.slots: set[tuple[int, int]] = set()  # (experts, slots) of each matmul batched over a param's dim
        self.argmaxes: dict[tuple[int, int], int] = {}  # (size, tokens) -> argmaxes over a dim of that size
        self.expert_params: dict[int, set[int]] = {}  # experts -> the params batched over them

    def new(self, size: int) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb or self.size[ra] != self.size[rb] or self.size[ra] == 1:
            return False
        self.parent[max(ra, rb)] = min(ra, rb)
        return True

    def fresh(self, aval: Any) -> list[int]:
        return [self.new(int(s)) for s in getattr(aval, "shape", ())]

    def tag(self, var: Any, dim: int, what: str, use: str, eqn: Any) -> None:
        """Tag the param dim behind ``var``'s dim ``dim``, from the param's first use by ``use``
        (a matmul, a gather, a scan): the forward pass's; the backward pass uses the weight again
        (a matmul contracting its output side)."""
        view = None if hasattr(var, "val") else self.views.get(var)
        pdim = None if view is None else view[1][dim]
        if view is None or pdim is None:
            return
        first = self.first.setdefault((view[0], use), id(eqn))
        if first == id(eqn):
            self.tags.setdefault((view[0], pdim), set()).add(what)

    def view(self, out: Any, src: Any, dims: Sequence[int | None]) -> None:
        """``out``'s dims are ``src``'s dims ``dims`` (None: not a dim of it), when ``src`` is a param's view."""
        v = None if hasattr(src, "val") else self.views.get(src)
        if v is not None:
            self.views[out] = (v[0], tuple(None if d is None else v[1][d] for d in dims))

    # -- the walk --
    def run(self, jaxpr: Any, ins: list[list[int]]) -> list[list[int]]:
        env: dict[Any, list[int]] = {}
        for v in jaxpr.constvars:
            env[v] = self.fresh(v.aval)
        for v, nodes in zip(jaxpr.invars, ins, strict=True):
            env[v] = nodes

        def read(x: Any) -> list[int]:
            return env[x] if not hasattr(x, "val") else self.fresh(x.aval)

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(x) for x in eqn.invars])
            for v, nodes in zip(eqn.outvars, outs, strict=True):
                env[v] = nodes
        return [read(x) for x in jaxpr.outvars]

    def call(self, inner: Any, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        jaxpr = inner.jaxpr if hasattr(inner, "jaxpr") else inner
        for outer, v in zip(eqn.invars, jaxpr.invars, strict=False):
            if not hasattr(outer, "val") and outer in self.views:
                self.views[v] = self.views[outer]
        outs = self.run(jaxpr, ins[: len(jaxpr.invars)])
        return self._shaped(eqn, outs)

    def _shaped(self, eqn: Any, outs: list[list[int]]) -> list[list[int]]:
        got = []
        for v, nodes in zip(eqn.outvars, outs, strict=False):
            shape = tuple(getattr(v.aval, "shape", ()))
            got.append(nodes if tuple(self.size[n] for n in nodes) == shape else self.fresh(v.aval))
        return got + [self.fresh(v.aval) for v in eqn.outvars[len(got) :]]

    def eqn(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        """One equation by the roles' rule book (``_RULES``); a call of a primitive the catalogue
        does not name is walked; anything else is ``fallback``."""
        return _RULES.get(eqn.primitive.name, _Walk.body_call)(self, eqn, ins)

    def fallback(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        """Anything else (a fused attention kernel, a custom call, a collective): new dims, but a
        result shaped like the first operand is laid out like it (attention's output is the queries')."""
        out_avals = [v.aval for v in eqn.outvars]
        outs = [self.fresh(a) for a in out_avals]
        if ins and outs and tuple(self.size[n] for n in ins[0]) == tuple(getattr(out_avals[0], "shape", ())):
            outs[0] = list(ins[0])
        return outs

    def fresh_results(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        """New dims, related to nothing (a kernel's or a shard_map region's results)."""
        return [self.fresh(v.aval) for v in eqn.outvars]

    def body_call(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        """A call: its body walked (``fallback`` when it has none)."""
        inner = _body(eqn)
        return self.call(inner, eqn, ins) if inner is not None else self.fallback(eqn, ins)

    def while_loop(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        p = eqn.params
        nb, nc = p["body_nconsts"], p["cond_nconsts"]
        carry = ins[nc + nb :]
        outs = self.run(p["body_jaxpr"].jaxpr, ins[nc : nc + nb] + carry)
        for after, before in zip(outs, carry, strict=False):
            self._align(after, before)
        return [list(c) for c in carry]

    def cond(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        first: list[list[int]] | None = None
        for branch in eqn.params["branches"]:
            took = self.run(branch.jaxpr, ins[1:])
            if first is None:
                first = took
            else:
                for x, y in zip(first, took, strict=True):
                    self._align(x, y)
        return first or []

    def _align(self, a: list[int], b: list[int]) -> None:
        if len(a) == len(b):
            for x, y in zip(a, b, strict=True):
                self.union(x, y)

    def factored(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        """One equation by its factor rule (``shardplan.runtime.factors``): dims made of one
        factor are one dimension; a dim made of several is a whole made of those parts; a
        matmul's operand dims are tagged by their factor (contracted, batched, or free), a
        gather's looked-up dims as rows; a view of a param stays that param."""
        f = factors.of(eqn)
        assert f is not None, eqn.primitive.name
        nodes = [self.new(s) for s in f.sizes]
        for dims, got in zip(f.operands, ins, strict=False):
            for d, fs in enumerate(dims):
                if len(fs) == 1:
                    self.union(got[d], nodes[fs[0]])
                elif fs:
                    self.merges.append((got[d], tuple(nodes[x] for x in fs)))
        outs = []
        for v, dims in zip(eqn.outvars, f.results, strict=True):
            out = []
            for d, fs in enumerate(dims):
                if len(fs) == 1:
                    out.append(self.find(nodes[fs[0]]))
                else:
                    out.append(self.new(int(v.aval.shape[d])))
                    if fs:
                        self.merges.append((out[-1], tuple(nodes[x] for x in fs)))
            outs.append(out)
        name = eqn.primitive.name
        if name in _VIEWS:
            tuple_through = len(eqn.outvars) > 1 and len(eqn.outvars) == len(eqn.invars)
            for k, v in enumerate(eqn.outvars):
                src = k if tuple_through else 0
                at = {fs[0]: d for d, fs in enumerate(f.operands[src]) if len(fs) == 1}
                self.view(v, eqn.invars[src], [at.get(fs[0]) if len(fs) == 1 else None for fs in f.results[k]])
        if name == "top_k":
            shape = tuple(int(n) for n in eqn.invars[0].aval.shape)
            self.routers.add((shape[-1], int(eqn.params["k"]), math.prod(shape[:-1])))
        if name == "argmax" and len(eqn.params["axes"]) == 1:  # one choice of a chain (GShard's top-2)
            shape = tuple(int(n) for n in eqn.invars[0].aval.shape)
            (axis,) = eqn.params["axes"]
            key = (shape[axis], math.prod(shape) // shape[axis])
            self.argmaxes[key] = self.argmaxes.get(key, 0) + 1
        if name == "dot_general":
            self.expert_buffers(eqn, f)
            for i, x in enumerate(eqn.invars):
                for d, fs in enumerate(f.operands[i]):
                    if len(fs) != 1:
                        continue
                    where, into = f.occurs(fs[0])
                    what = "contract" if fs[0] in f.reduced else "batch" if len(where) > 1 else "free"
                    if what == "contract" or into:
                        self.tag(x, d, what, "dot", eqn)
        for d, fs in enumerate(f.operands[0] if f.indexed else ()):
            if set(fs) & f.indexed:
                self.tag(eqn.invars[0], d, "rows", "gather", eqn)
        return outs

    def is_param(self, x: Any) -> bool:
        return not hasattr(x, "val") and x in self.views

    def expert_buffers(self, eqn: Any, f: Any) -> None:
        """A matmul batched over a dim of a param (stacked experts' weights) against an activation
        (the tokens dispatched to them): (the batch dims' size, the activation's free dims'
        product, the slots each expert's buffer holds)."""
        for i, (x, y) in enumerate(zip(eqn.invars, eqn.invars[::-1], strict=True)):
            if not self.is_param(x) or self.is_param(y):
                continue

            def role(fs: tuple[int, ...]) -> str:
                if any(k in f.reduced for k in fs):
                    return "contract"
                return "batch" if any(len(f.occurs(k)[0]) > 1 for k in fs) else "free"

            batch = [d for d, fs in enumerate(f.operands[i]) if fs and role(fs) == "batch"]
            if not batch:
                continue
            free = [d for d, fs in enumerate(f.operands[1 - i]) if fs and role(fs) == "free"]
            experts = math.prod(int(x.aval.shape[d]) for d in batch)
            self.slots.add((experts, math.prod(int(y.aval.shape[d]) for d in free)))
            self.expert_params.setdefault(experts, set()).add(self.views[x][0])

    def scan(self, eqn: Any, ins: list[list[int]]) -> list[list[int]]:
        p = eqn.params
        body = p["jaxpr"].jaxpr
        nc, nk = p["num_consts"], p["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        for outer, v in zip(eqn.invars[:nc], body.invars[:nc], strict=False):
            if not hasattr(outer, "val") and outer in self.views:
                self.views[v] = self.views[outer]
        for k, (outer, v) in enumerate(zip(eqn.invars[nc + nk :], body.invars[nc + nk :], strict=False)):
            if not hasattr(outer, "val") and outer in self.views:
                self.tag(outer, 0, "stack", "scan", eqn)
                self.view(v, outer, list(range(1, len(xs[k]))))
        outs = self.run(body, consts + carry + [x[1:] for x in xs])
        for a, b in zip(outs[:nk], carry, strict=True):
            self._align(a, b)
        length = self.new(int(p["length"]))
        for x in xs:
            if x:
                self.union(x[0], length)
        return [list(c) for c in carry] + [[length] + y for y in outs[nk:]]

    def atoms(self, c: int, depth: int = 0) -> tuple[int, ...]:
        """A dim as the finest parts it is known to be made of, major first (itself if none)."""
        parts = self.parts.get(self.find(c))
        if parts is None or depth > 32:
            return (self.find(c),)
        return tuple(a for p in parts for a in self.atoms(p, depth + 1))

    def settle(self) -> None:
        """Dims made of the same finest parts are one dimension, to a fixed point: ``heads *
        head_dim`` split as ``(heads, head_dim)`` in one place and ``(kv_heads, groups,
        head_dim)`` in another, with ``heads`` split as ``(kv_heads, groups)``."""
        changed = True
        while changed:
            changed = False
            self.parts = {}
            for whole, parts in self.merges:
                w = self.find(whole)
                if w not in self.parts or len(parts) > len(self.parts[w]):
                    self.parts[w] = parts
            seen: dict[tuple[int, ...], int] = {}
            for w in list(self.parts):
                key = self.atoms(w)
                if key in seen:
                    changed |= self.union(seen[key], w)
                else:
                    seen[key] = w

    def major(self, c: int) -> int:
        """The dim that decides how ``c`` splits: its first (major) finest part."""
        return self.atoms(c)[0]


def _body(eqn: Any) -> Any:
    """The sub-jaxpr a call runs (None: not a call)."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is not None and hasattr(inner if not hasattr(inner, "jaxpr") else inner.jaxpr, "eqns"):
            return inner
    return None


_W = _Walk
# The roles' rule book: primitive -> rule(walk, eqn, operands' dim classes) -> results' dim classes.
_RULES: dict[str, Callable[[_Walk, Any, list[list[int]]], list[list[int]]]] = {
    **dict.fromkeys(factors.rule_book(), _W.factored),
    **dict.fromkeys(CALLS, _W.body_call),
    "shard_map": _W.fresh_results,  # a region the step runs as written
    "pallas_call": _W.fresh_results,
    "scan": _W.scan,
    "while": _W.while_loop,
    "cond": _W.cond,
}
# Declared fallbacks (``_Walk.fallback``): values made from no operand dims (iota, random bits),
# cuDNN's fused attention, collectives (met only inside a user's shard_map region), and a
# bitcast to another dtype.
_FALLBACKS = named(kinds=("creation", "random", "kernel", "collective")) - set(_RULES) | {
    "bitcast_convert_type",
    "ragged_dot_general",  # a grouped matmul: its operands' dims take no role from it
}


def rule_book() -> tuple[frozenset[str], frozenset[str]]:
    """The roles' primitives with a rule, and its declared fallbacks (for the coverage test)."""
    return frozenset(_RULES), _FALLBACKS


def roles(closed: Any, paths: list[str], n_params: int, input_paths: list[str], opt_paths: Sequence[str] = ()) -> Roles:
    """The dims of the first ``n_params`` invars of the traced step ``closed`` (params, with
    ``paths``), and of its last ``len(input_paths)`` invars (the batch's leaves); ``opt_paths``:
    the optimizer state's, to read the prefixes its leaves put before the params they mirror."""
    jaxpr = closed.jaxpr
    w = _Walk()
    ins = [w.fresh(v.aval) for v in jaxpr.invars]
    for i, v in enumerate(jaxpr.invars[:n_params]):
        w.views[v] = (i, tuple(range(len(ins[i]))))
    # layers of a list: params whose paths differ only in list indices share their dims
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, path in enumerate(paths[:n_params]):
        key = (template(path), tuple(jaxpr.invars[i].aval.shape))
        j = first.setdefault(key, i)
        for a, b in zip(ins[i], ins[j], strict=True):
            w.union(a, b)
    w.run(jaxpr, ins)
    # a param's tags hold for every layer of its list
    for i, path in enumerate(paths[:n_params]):
        j = first[(template(path), tuple(jaxpr.invars[i].aval.shape))]
        for d in range(len(ins[i])):
            t = w.tags.get((i, d))
            if t and j != i:
                w.tags.setdefault((j, d), set()).update(t)
    w.settle()
    params = []
    for i, path in enumerate(paths[:n_params]):
        j = first[(template(path), tuple(jaxpr.invars[i].aval.shape))]
        shape = tuple(int(s) for s in jaxpr.invars[i].aval.shape)
        classes = tuple(w.find(n) for n in ins[i])
        units = tuple(w.major(c) for c in classes)
        tags = tuple(frozenset(w.tags.get((j, d), set()) | w.tags.get((i, d), set())) for d in range(len(shape)))
        params.append(ParamDims(path, shape, classes, units, tags))
    start = len(jaxpr.invars) - len(input_paths)
    inputs = tuple(
        (path, tuple(int(s) for s in jaxpr.invars[start + k].aval.shape), tuple(w.find(n) for n in ins[start + k]))
        for k, path in enumerate(input_paths)
    )
    used = {c for p in params for c in p.classes + p.units} | {c for _, _, cs in inputs for c in cs}
    names = set(paths[:n_params])
    prefixes = set()
    for op in opt_paths:
        parts = op.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[k:]) in names:
                prefixes.add("/".join(parts[:k]) + "/")
                break
    return Roles(
        tuple(params),
        {c: w.size[c] for c in sorted(used)},
        inputs,
        tuple(sorted(prefixes)),
        tuple(sorted(w.routers | _argmax_routers(w, paths))),
        tuple(sorted(w.slots)),
    )


def _argmax_routers(w: _Walk, paths: list[str]) -> set[tuple[int, int, int]]:
    """Routers made of argmax chains (GShard's top-2: an argmax, then another with the first
    choice masked out), as (experts, k, tokens): ``k`` the argmaxes over the experts' dim per
    layer of experts, the layers counted as the experts' params over the distinct paths they
    take up to list indices (``layers/0/ffn/wi`` and ``layers/1/ffn/wi``: one path, two layers;
    a scanned layer's stacked params: one layer in the walk, as its argmaxes are). Where the
    argmaxes do not divide evenly over the layers, none (the tokens routed unknown)."""
    out = set()
    for experts, held in w.expert_params.items():
        layers, kinds = len(held), len({template(paths[i]) for i in held if i < len(paths)})
        if not kinds or layers % kinds:
            continue
        layers //= kinds
        for (size, tokens), n in w.argmaxes.items():
            if size == experts and n % layers == 0 and not any(e == experts for e, _, _ in w.routers):
                out.add((experts, n // layers, tokens))
    return out
