"""Fast mode's interpreter: one walk over a jaxpr's equations by the rule book (``rules``), with
nested jaxprs walked in place, and observers on the same walk: each equation's memory traffic
and the bytes its results hold at once (the peak).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardplan.core.stepcost import Constrained
from shardplan.core.timing import COMBINE_BYTES
from shardplan.runtime import splitk
from shardplan.runtime.fast.claims import _claims_back, _spread, passed_layouts, reshaped_back
from shardplan.runtime.fast.memory import _fused_outputs, _kernels, _last_wide_readers, _readers, _recomputed
from shardplan.runtime.fast.opsets import _IN_PLACE, _VIEWS
from shardplan.runtime.fast.priority import early_values
from shardplan.runtime.fast.values import (
    _NONE,
    _T,
    Dims,
    Val,
    _Boundary,
    _contracted,
    _Ctx,
    _Frame,
    _is_float,
    _norm,
    _reads_narrow,
    _replicated,
    scatter_onto,
)
from shardplan.runtime.gather_reuse import Share
from shardplan.runtime.kernels import FUSED_ATTENTION
from shardplan.runtime.primitives import ELEMENTWISE, TRANSCENDENTAL, itemsize, ragged_dense
from shardplan.runtime.primitives import subjaxpr as _subjaxpr
from shardplan.runtime.sharding import constraint_target, permuted
from shardplan.runtime.sources import eqn_source

# rule(walker, eqn, operands' layouts, multiplicity) -> results' layouts (None: not modelled here)
Rule = Callable[["Walker", Any, list[Val], int], "list[Val] | None"]

# Primitives whose FLOPs are matmuls' (``StepCost.matmul_flops``, by source line).
MATMULS = frozenset({"dot_general", "ragged_dot_general", "conv_general_dilated"})


@dataclass(frozen=True)
class RuleBook:
    """What the walker applies to an equation: ``elementwise`` to every elementwise primitive (most
    equations: asked first), else its primitive's rule, and for a call of a primitive the
    catalogue does not name, ``call`` (its body walked in place)."""

    elementwise: Callable[[Walker, Any, list[Val], int], Val]
    rules: Mapping[str, Rule]
    call: Rule
    # asked before ``elementwise`` in the run loop, without ``Walker.eqn``'s bookkeeping (its
    # source line, its pass): the result where nothing moves and nothing is recorded, else None
    quick: Callable[[Walker, Any, list[Val], int], Val | None] = lambda walk, eqn, ins, mult: None


class Walker:
    """Shardings through one jaxpr (recursing into nested jaxprs), by a rule book
    (``rules.RULE_BOOK``)."""

    def __init__(
        self,
        rules: RuleBook,
        ctx: _Ctx,
        names: dict[Any, str],
        ignore_constraints: bool = False,
        free: dict[Any, Dims] | None = None,
    ):
        self.rules = rules
        self.ctx = ctx
        self.ignore_constraints = ignore_constraints  # propagate as if the step constrained nothing
        self.names = names  # top-level invar -> leaf path (for 'moves')
        # A scanned body's slices of stacked params and gradients -> their path: what the ledger's
        # rows say they move (``scan``); the layouts and the memory read ``names`` alone.
        self.labels: dict[Any, str] = {}
        self.updates: dict[Any, str] = {}  # a value -> the param it updates (a gradient's sums name it)
        self.updated: dict[str, int] = {}  # a param -> the step's outputs its update writes (it, its state)
        self.hints: dict[Any, Dims] = {}
        self.claimed: dict[Any, Dims] = {}  # values a closed sharding constraint lays out (see _claims)
        # Every value's layout is XLA's own in ``claimed`` (``costing.cost(propagation="xla")``): the
        # rules say what XLA's partitioner moves to give each value its layout (``xla_claims``).
        self.xla_claims = False
        self.back: dict[Any, Dims] = {}  # layouts propagated back from those (see claims._claims_back, back_claim)
        self.wants: dict[Any, Dims] = {}  # splits readers want (see _wants)
        # A loop body's values that flow into its carry through pass-through ops and matmuls: the
        # carry's layout, which XLA's propagation gives them (see ``carry_wants``)
        self.carried: dict[Any, Dims] = {}
        self.sum_wants: dict[Any, Dims] = {}  # contraction splits weights give their matmuls' inputs (seed_sum_wants)
        # Whole values an elementwise op met with split ones (XLA's propagation would have computed
        # them split: slicing a whole value is free); a second propagation takes them as ``free``.
        self.slices: dict[Any, Dims] = {}
        # Matmul results XLA computes whole and slices after (``matmul._whole_where_split_further``),
        # and the transposes that alone read them: whole by XLA's choice, never a ``slices`` entry
        self.kept_whole: set[Any] = set()
        self.free: dict[Any, Dims] = dict(free or {})
        # Values Shardy's first propagation phase lays out (elementwise ops only, both ways, from
        # the step's split inputs): a matmul computing one computes in that layout (``claims.passed_layouts``)
        self.passed: dict[Any, Dims] = {}
        self.constant: set[Any] = set()  # values computed from literals alone (XLA keeps them whole)
        # A broadcast's result -> (its operand, the operand's layout, broadcast_dimensions): where an
        # elementwise op moves it, XLA moves the operand at its own size.
        self.expanded: dict[Any, tuple[Any, Val, tuple[int, ...]]] = {}
        self.memo: dict[Any, tuple] = {}  # what depends on the trace alone, kept between plans (see cost)
        # A value holding a pending sum -> (op, source) of the equation that made it: the collective
        # that completes the sum is that op's (a gradient's all-reduce belongs to the model line whose
        # matmul's transpose made it, not to the optimizer's read of it).
        # where each pending sum was made: (primitive, source, elements a matmul contracted or 0)
        # a pending sum -> (the op that made it, its source, the elements it contracts, the axes
        # each contracted dim is split over where several dims are: ``Compiler.sums_per_dim``)
        self.sum_origin: dict[Any, tuple[str, str, int, tuple[frozenset[str], ...]]] = {}
        self.sum_dims: dict[Any, tuple[frozenset[str], ...]] = {}  # a matmul's result -> those axes
        # a matmul's pending sum -> the dim its operands' rows (an operand's leading dim) went to,
        # None where they went nowhere (the experts' dim leads a dispatched buffer)
        self.rows: dict[Any, int | None] = {}
        # A matmul's result all-reduced over these axes (see ``resolve``): read in a layout that splits
        # one of its split dims further over them, XLA gathers that dim first (``reshard``).
        self.dot_reduced: dict[Any, tuple[frozenset[str], int]] = {}  # -> (summed axes, batch dims)
        self.dot_batch: dict[Any, int] = {}  # a batched matmul's summed result -> its batch dims (leading)
        self.stand_ins: dict[Any, dict[str, str]] = {}  # a matmul's result -> {idle axis: the summed one it stands for}
        self.peak = 0  # most bytes of intermediates alive at once in the jaxpr being run
        # A matmul's result held as its split contraction's float32 partials (``matmul._split_k``)
        self.widened: dict[Any, int] = {}
        # Copies of a value a rule says the compiler holds beside it until the value's last reader
        # (XLA:GPU's grouped matmul rows masked per group, ``grouped_rule``): var -> bytes
        self.copied: dict[Any, int] = {}
        # A scanned body's stacked results whose pending sum the loop reduce-scatters in every
        # trip (a layer's weight gradient under FSDP) -> the layout it is scattered onto (``scan``;
        # elsewhere a gradient's own layout, ``hints``: see ``_scattered_cut``)
        self.scattered: dict[Any, Dims] = {}
        self.aliased: set[Any] = set()  # step outputs written into their donated input buffers
        self.inlined: Any = None  # the last call walked in place (``inline``)
        # a call's result -> the layout of a value already made that an elementwise reader of the
        # result adds it to (GSPMD's propagation gives the producer that layout; ``scatter``)
        self.siblings: dict[Any, Dims] = {}
        self.inlined_peak = 0  # that call's peak less its results (held by the caller from then)
        self.peak_without_outputs = 0  # the last jaxpr run's peak, less its outputs held then
        self.virtual_outs: set[int] | frozenset[int] = set()  # outputs of the last run jaxpr that are broadcasts
        self.depth = 0
        # Loop bodies being run (scan, while), and the values Shardy's first round lays out
        # (``priority.early_values``, once per trace): inside a body they decide a matmul's clash.
        self.loops = 0
        self.early: frozenset = frozenset()
        self.late: frozenset = frozenset()
        self.backward = False  # in the backward pass (a transpose's equations): for ``Compiler.gather_cse``
        # (id of a matmul, the step input it reads) -> the gather that read uses (``gather_reuse``)
        self.shares: dict[tuple[int, Any], Share] = {}
        # Layouts only (no memory traffic, no sum origins for the collectives' labels): a pass
        # whose collectives and traffic are thrown away, run only for what it finds (``slices``).
        self.layouts_only = False
        # Memory traffic: the jaxpr being run, and the last one run (a call's body, read back by
        # its caller: XLA inlines calls, so fused chains cross them).
        self.frame: _Frame | None = None
        self.last_frame: _Frame | None = None
        self.constrained: list[Constrained] = []  # activations with a set layout, in program order
        # A call's inner variables stand for the outer ones they are bound to (and its outer
        # results for the inner ones): XLA inlines calls and does each reshard of a value once.
        self.origin: dict[Any, Any] = {}
        # The step's own inputs (params, optimizer state, batch): their layouts are the jit's
        # argument shardings, which XLA's propagation does not change (see ``fixed``).
        self.inputs: set[Any] = set()
        self.call_source = ""  # the source line of the call being run (for library code inside it)
        self.runs = 0  # jaxpr runs so far
        self.defined: dict[Any, int] = {}  # variable -> the run that last defined it
        # A scan's loop-invariant operands -> the runs outside the loop: XLA hoists their reshards out
        # of the while body (measured: a weight closed over by a scanned body is gathered once).
        self.invariant: dict[Any, int] = {}
        # Where given, each equation's results as the last full pass laid them out, in program
        # order: (its source line, its primitive, the results) (``costing.chosen``).
        self.seen: list[tuple[str, str, list[Val]]] | None = None

    def root(self, var: Any) -> Any:
        while var in self.origin:
            var = self.origin[var]
        return var

    def fixed(self, var: Any) -> bool:
        """Whether ``var``'s layout is one XLA's propagation leaves as it is: one of the step's
        inputs (a jit argument's sharding), passed through calls or not. Any value the step
        computes (a cast, a scanned layer's slice of a stacked weight) is open: propagation gives
        its whole dims the splits its readers and writers have."""
        return not hasattr(var, "val") and self.root(var) in self.inputs

    def key(self, var: Any) -> tuple[int, int | None]:
        """A value's identity for the reshard cache: its root variable and the run that defined it
        (a jaxpr called from several places, e.g. one ``jnp.where`` per layer, reuses its variables)."""
        root = self.root(var)
        return id(root), self.defined.get(root)

    # -- equations -------------------------------------------------------------------------
    def run(self, jaxpr: Any, env: dict[Any, Val], mult: int, boundary: _Boundary | None = None) -> list[Val]:
        """Propagate through ``jaxpr``; also track the bytes its intermediates hold at once
        (``self.peak``: the most live at any point, on top of its inputs) and the memory traffic
        of its kernels (``boundary``: where ``jaxpr`` is a call's body, what its caller holds)."""
        self._hints(jaxpr)
        self._wants(jaxpr)
        top = self.depth == 0
        if top:
            self.inputs = set(jaxpr.invars)
            self.sum_wants = {}
            self.seed_sum_wants(jaxpr, env, set(jaxpr.invars))
            hit = self.memo.get(("early", id(jaxpr)))
            if hit is None or hit[0] is not jaxpr:
                hit = self.memo[("early", id(jaxpr))] = (jaxpr, early_values(jaxpr))
            self.early, self.late = hit[1]
            seeds = frozenset((x, env[x].dims) for x in jaxpr.invars if x in env and any(env[x].dims))
            hit = self.memo.get(("passed", id(jaxpr), seeds))
            if hit is None or hit[0] is not jaxpr:
                hit = self.memo[("passed", id(jaxpr), seeds)] = (jaxpr, passed_layouts(jaxpr, dict(seeds)))
            self.passed = hit[1]
        self.depth += 1
        last, uses, keep, fused, (fused_v, soft, shared) = self._structure(jaxpr, boundary)
        live = peak = peak_ex = out_live = 0
        results = {x for x in jaxpr.outvars if not hasattr(x, "val")}
        held: dict[Any, int] = {}
        narrow = self.ctx.book.matmul_itemsize or 4
        # Values in memory (not fused away): a jaxpr's inputs, unless a call's caller fused them.
        stored = (set(jaxpr.invars) if boundary is None else set(boundary.stored)) | set(jaxpr.constvars)
        frame = _Frame(jaxpr, env, stored, fused_v, shared, soft, {} if boundary is None else dict(boundary.reads))
        outer_frame, self.frame = self.frame, frame
        self.runs += 1
        this_run = self.runs
        if top and self.seen is not None:
            self.seen.clear()  # (a second pass's layouts replace the first's)
        copies: dict[Any, int] = {}  # the narrow copies of the jaxpr's inputs its matmuls read
        steps = self._steps(jaxpr, last, keep)
        if self.layouts_only:  # no memory observers: the layouts alone
            self._layouts(steps, env, mult, this_run)
            steps = []
        quick = self.rules.quick
        for eqn, literals, variables, dying, narrowing, copying, simple in steps:
            ins = self._enter(eqn, literals, variables, env, this_run)
            outer_peak, self.peak = self.peak, 0
            self.virtual_outs = _NONE
            out = quick(self, eqn, ins, mult) if simple else None
            outs = [out] if out is not None else self.eqn(eqn, ins, mult)
            inner, self.peak = self.peak, outer_peak
            if self.seen is not None:
                self.seen.append((self.source_of(eqn) or self.call_source, eqn.primitive.name, outs))
            virtual = (
                {eqn.outvars[i] for i in self.virtual_outs if i < len(eqn.outvars)} if self.virtual_outs else _NONE
            )
            self.traffic(frame, eqn, outs, virtual, mult)
            if out is None:  # (the quick rule's results carry no pending sum)
                self._sum_origins(eqn, outs)
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
                wide = self.widened.pop(var, 0) if self.widened else 0  # (only a GPU book's split matmuls)
                if not wide and self.widened and eqn.primitive.name in splitk.VIEWS and eqn.invars[0] in self.widened:
                    wide = self.widened[eqn.invars[0]]  # a view of a split matmul's result: its partials
                if wide:
                    self.widened[var] = wide
                if var not in fused and var not in self.aliased and var not in virtual:
                    held[var] = max(self.ctx.held(val), wide)
                    live += held[var]
                    out_live += held[var] if var in results else 0
            if self.copied:
                for x, n in self.copied.items():
                    if x in held and n > copies.get(x, 0):
                        live += n - copies.get(x, 0)
                        copies[x] = n
                self.copied = {}
            for x in copying:
                # made for its first matmul, where the weight is read in place (not gathered: then
                # the cast is gathered around its uses, ``Compiler.gather_cse``)
                if x not in copies and not any(a in self.ctx.batch_axes for a in env[x].axes):
                    copies[x] = self.ctx.held(env[x]) * narrow // 4
                    live += copies[x]
            # An update in place (a scatter into zeros, a slice written into a cache) shares its
            # operand's buffer where this is the operand's last reader: one buffer, not two.
            in_place = eqn.primitive.name in _IN_PLACE or (
                eqn.primitive.name == "transpose" and self.ctx.book.transposes_in_place
            )
            shared = held.get(eqn.invars[0], 0) if in_place and eqn.invars[0] in dying else 0
            if self.inlined is eqn:  # a call's body holds its results, which the caller now holds: once
                inner = self.inlined_peak
            # a large gradient's sum scattered as it is made (``Compiler.scatters_early``): whole
            # only at the op that makes it (a call's body held it whole, not the caller)
            cuts = [(v, self._scattered_cut(v, env, held)) for v in eqn.outvars] if self.ctx.book.scatters_early else []
            if self.inlined is eqn:
                live, out_live = self._cut(cuts, held, live, out_live, results)
                cuts = []
            # Gathered weights stay alive for their reuse in the backward pass (XLA's CSE).
            peak = max(peak, live - shared + inner + (self.ctx.gathered_now if top else 0))
            peak_ex = max(peak_ex, live - shared - out_live + inner)
            if cuts:
                live, out_live = self._cut(cuts, held, live, out_live, results)
            if top and self.ctx.reducing:  # the first gradient reduced: the combined one's moment
                self.ctx.reducing = False
                if self.ctx.reduced_from is None:
                    self.ctx.reduced_from = live + inner
            for x in dying:
                if x in held:
                    out_live -= held[x] if x in results else 0
                    live -= held.pop(x)
                if copies and x in copies:  # the weight's last reader (the optimizer's update)
                    live -= copies.pop(x)
            for x in narrowing:  # read by default-precision matmuls alone from here: their narrow copy
                if x in held:
                    cut = held[x] - held[x] * narrow // 4
                    held[x] -= cut
                    live -= cut
        self.last_frame, self.frame = frame, outer_frame
        self.peak = max(self.peak, peak)
        self.peak_without_outputs = peak_ex
        # Outputs that are broadcasts (a call's jvp residuals, masks): recomputed where used.
        self.virtual_outs = {i for i, x in enumerate(jaxpr.outvars) if x in fused}
        self.depth -= 1
        return [self._read(env, x) for x in jaxpr.outvars]

    @staticmethod
    def _cut(
        cuts: list[tuple[Any, int]], held: dict[Any, int], live: int, out_live: int, results: set
    ) -> tuple[int, int]:
        """``held`` less ``cuts`` (value, bytes freed); ``live`` and ``out_live`` with them."""
        for var, cut in cuts:
            if cut:
                held[var] -= cut
                live -= cut
                out_live -= cut if var in results else 0
        return live, out_live

    def _scattered_cut(self, var: Any, env: dict[Any, Val], held: dict[Any, int]) -> int:
        """The bytes a gradient's reduce-scatter frees as soon as its sum is made
        (``Compiler.scatters_early``): where it is larger than the combine threshold
        (``COMBINE_BYTES``; smaller ones wait, whole, for the reduce-scatter they are combined
        into) and its layout (a scanned layer's stacked result's, ``scattered``; a gradient's
        update's, ``hints``) splits a dim over an axis it sums."""
        target = self.scattered.get(var, self.hints.get(var))
        if target is None or var not in held or not env[var].partial or held[var] <= COMBINE_BYTES:
            return 0  # (a smaller one waits for the collective the compiler combines it into)
        v = env[var]
        dims, _ = scatter_onto(v, target, self.ctx.split)
        after = self.ctx.held(Val(v.shape, v.itemsize, tuple(tuple(d) for d in dims)))
        return max(0, held[var] - after)

    def run_loop(self, body: Any, env: dict[Any, Val], mult: int) -> list[Val]:
        """:meth:`run` for a loop's body (a scan's, a while's): ``laid_first`` applies inside it."""
        self.loops += 1
        try:
            return self.run(body, env, mult)
        finally:
            self.loops -= 1

    def _enter(self, eqn: Any, literals: tuple, variables: tuple, env: dict[Any, Val], this_run: int) -> list[Val]:
        """An equation's operands' layouts, its results defined in this run, and whether they are
        computed from literals alone (``constant``; a scan's never: its body runs per trip)."""
        for var in eqn.outvars:
            self.defined[var] = this_run
            self.origin.pop(var, None)
        if self.constant.issuperset(variables) and eqn.primitive.name != "scan":
            self.constant.update(eqn.outvars)
        else:
            self.constant.difference_update(eqn.outvars)
        return [env[x] if lit is None else lit for x, lit in zip(eqn.invars, literals, strict=True)]

    def _layouts(self, steps: list[tuple], env: dict[Any, Val], mult: int, this_run: int) -> None:
        """``run``'s loop for the layouts alone (``layouts_only``): each equation's rule, its
        results' layouts bound, what the rules read of the run kept (definitions, constants)."""
        quick = self.rules.quick
        for eqn, literals, variables, *_, simple in steps:
            ins = self._enter(eqn, literals, variables, env, this_run)
            out = quick(self, eqn, ins, mult) if simple else None
            for var, val in zip(eqn.outvars, [out] if out is not None else self.eqn(eqn, ins, mult), strict=True):
                env[var] = val

    def traffic(self, frame: _Frame, eqn: Any, outs: list[Val], virtual: set | frozenset, mult: int) -> None:
        """Memory traffic of one equation, as XLA's fusion leaves it (see ``_kernels``): a result
        fused into its readers costs nothing where it is computed; an equation whose results are
        stored is a kernel that reads the values in memory its fused producers read (each once)
        and writes its results. A result several kernels read is stored when computing it reads
        more bytes than it holds (XLA's fusion weighs the same). Reshapes of stored values are
        views; a call's body counts for itself (see ``eqn``)."""
        name = eqn.primitive.name
        if name in ("scan", "while", "cond", "shard_map", "pallas_call") or name in FUSED_ATTENTION:
            # results stored (a loop's or branch's body, a kernel, counts its own traffic)
            frame.stored.update(v for v in eqn.outvars if v not in virtual)
            return
        if self.body(eqn) is not None:
            return
        if name in _VIEWS and eqn.invars[0] in frame.stored:
            frame.stored.update(eqn.outvars)
            return
        fused_away = all(v in frame.fused or v in virtual for v in eqn.outvars)
        if fused_away and not any(v in frame.shared and v not in virtual for v in eqn.outvars):
            return  # computed inside its readers: they count what it reads
        reads = frozenset().union(*(self.closure(frame, x) for x in eqn.invars))
        # A value computed from literals alone (zeros a scatter adds into) takes its reader's split
        # (GSPMD shards it like its user): written there, not where it was held whole.
        nbytes = 0
        for x, v in reads:
            n = self._read_bytes(v, outs)
            if x in self.constant and x not in frame.written:  # written once, at its first reader's split
                frame.written.add(x)
                n *= 2
            nbytes += n
        if fused_away:
            for v, val in zip(eqn.outvars, outs, strict=True):
                if v in frame.shared and v not in virtual and nbytes > self.ctx.local(val):
                    frame.stored.add(v)
                    self.ctx.hbm += (nbytes + self.ctx.local(val)) * mult
            return
        stored = False
        for var, val in zip(eqn.outvars, outs, strict=True):
            if var not in frame.fused and var not in virtual:
                frame.stored.add(var)
                stored = True
                nbytes += 0 if var in self.constant else self.ctx.local(val)
        self.ctx.hbm += nbytes * mult
        if stored:
            self.ctx.launches += mult

    def closure(self, frame: _Frame, x: Any) -> frozenset:
        """The values in memory (each with its layout) a kernel reading ``x`` reads: ``x`` if it is
        stored, else what its fused producers read (across calls: a call's body is inlined)."""
        if hasattr(x, "val"):
            return frozenset()
        if x in frame.stored:
            return frozenset(((x, frame.env[x]),))
        hit = frame.closures.get(x)
        if hit is None:
            if x not in frame.fused:
                return frozenset()
            producer = frame.jaxpr.eqns[frame.fused[x]]
            hit = frozenset().union(*(self.closure(frame, y) for y in producer.invars))
            frame.closures[x] = hit
        return hit

    def _read_bytes(self, v: Val, outs: list[Val]) -> int:
        """Bytes a kernel reads of ``v``: an operand of an output's shape is read where that output
        is computed (a value held whole, say zeros from a literal, is read in its split part)."""
        n = self.ctx.local(v)
        return min([n] + [self.ctx.local(o) * v.itemsize // o.itemsize for o in outs if o.shape == v.shape])

    def _read(self, env: dict[Any, Val], x: Any) -> Val:
        if hasattr(x, "val"):  # a literal
            shape = tuple(getattr(x.aval, "shape", ()))
            return Val(shape, itemsize(x.aval), ((),) * len(shape))
        return env[x]

    def _hints(self, jaxpr: Any) -> None:
        """Backward pass: an elementwise chain ending in a value of known layout wants that layout
        (so a partial gradient is reduce-scattered straight into an FSDP-split update)."""
        if not self.ignore_constraints:
            self._claims(jaxpr)
        for eqn in reversed(jaxpr.eqns):
            if eqn.primitive.name == "transpose":
                # (a matmul's result transposed into a layout wanted: the matmul wants it permuted)
                out = self.hints.get(eqn.outvars[0])
                x = eqn.invars[0]
                if out is not None and not hasattr(x, "val") and len(out) == len(eqn.params["permutation"]):
                    self.hints.setdefault(x, permuted(out, eqn.params["permutation"]))
                continue
            if eqn.primitive.name in ("reshape", "squeeze", "expand_dims"):
                # (the leading dims both shapes share keep their wanted axes)
                out = self.hints.get(eqn.outvars[0])
                x = eqn.invars[0]
                if out is None or hasattr(x, "val"):
                    continue
                back = reshaped_back(tuple(x.aval.shape), tuple(eqn.outvars[0].aval.shape), out)
                if any(back):
                    self.hints.setdefault(x, back)
                continue
            if eqn.primitive.name not in ELEMENTWISE:
                continue
            out = self.hints.get(eqn.outvars[0])
            if out is None:
                continue
            for x in eqn.invars:
                if not hasattr(x, "val") and tuple(x.aval.shape) == tuple(eqn.outvars[0].aval.shape):
                    self.hints.setdefault(x, out)

    def _claims(self, jaxpr: Any) -> None:
        """Shardy gives a fully closed sharding constraint's layout to the op computing its operand
        (its import pass ``apply-sharding-constraints``), unless the operand is an input or another
        constraint reads it with another layout. See ``elementwise`` for what that changes. What
        the constraints claim and what that claims back are the trace's alone (memoised: the
        trace fixes the act rules and the mesh)."""
        key = ("closed", id(jaxpr))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            hit = self.memo[key] = (jaxpr, _closed_constraints(jaxpr), _made(jaxpr))
        _, closed, made = hit
        for x, target in closed.items():
            self.claimed.setdefault(x, target)
        # Seeds: this jaxpr's values laid out already (its constraints', a caller's); none, no walk.
        seeds = {}
        for o in made:
            t = self.claimed.get(o, self.back.get(o))
            if t is not None:
                seeds[o] = t
        if not seeds:
            return
        back_key = ("claims back", id(jaxpr), frozenset(seeds.items()))
        back = self.memo.get(back_key)
        if back is None or back[0] is not jaxpr:
            back = self.memo[back_key] = (jaxpr, _claims_back(jaxpr, seeds, self.ctx.split_dims))
        for x, target in back[1].items():
            if x not in self.claimed:
                self.back.setdefault(x, target)

    def _wants(self, jaxpr: Any) -> None:
        """Backward pass: the splits a value's readers want, from constrained activations back
        through elementwise and layout ops and matmuls (XLA's propagation runs both ways), so a
        pending sum is reduce-scattered onto a split its readers keep (the gradient of keys and
        values gathered over a split sequence). Only where a pending sum is resolved."""
        self._spread(jaxpr, self.wants, None if self.ignore_constraints else "seed")
        if self.carried:
            self._spread(jaxpr, self.carried, None)
        if self.free:
            self._spread(jaxpr, self.free, "stop")

    def carry_wants(self, body: Any, carries: dict[Any, Dims]) -> None:
        """A loop body's carried results (``carries``: each with the layout its carry enters
        with) and what they are computed from: the loop's carry keeps one layout, so XLA's
        propagation lays them out as it (read by :func:`matmul._contraction_moves`)."""
        for var, dims in carries.items():
            if any(dims):
                self.carried.setdefault(var, dims)
        self._spread(body, self.carried, None)

    def seed_sum_wants(self, jaxpr: Any, env: dict[Any, Val], inputs: set[Any]) -> None:
        """Backward pass: a matmul reading one of ``inputs`` (the step's inputs: its weights; a
        scanned layer's slices of them) split on a contracting dim wants its other operand split
        there the same way, carried back through elementwise and layout ops and calls of
        elementwise ops (``jax.nn.silu``'s): a pending sum resolved on the way is reduce-scattered
        onto that split (``relayout.resolve``), as XLA's propagation lays it out from the weight (a
        gate projection's sum over the model width, read by the down projection whose rows are
        split over the summed axis)."""
        table: dict[Any, Dims] = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "dot_general":
                continue
            (lc, rc), _ = eqn.params["dimension_numbers"]
            lx, rx = eqn.invars
            for w, wc, x, xc in ((rx, rc, lx, lc), (lx, lc, rx, rc)):
                if w in inputs and not hasattr(x, "val") and x not in inputs:
                    split: list[tuple[str, ...]] = [()] * len(x.aval.shape)
                    for i, j in zip(xc, wc, strict=True):
                        split[i] = tuple(env[w].dims[j])
                    if any(split):
                        table.setdefault(x, tuple(split))
        if not table:
            return
        key = ("sum wants", id(jaxpr), frozenset(table.items()))  # the same weights' splits: the same wants
        hit = self.memo.get(key)
        if hit is not None and hit[0] is jaxpr:
            for x, wanted in hit[1]:
                self.sum_wants.setdefault(x, wanted)
            return
        for _ in range(2):
            _spread(jaxpr, table, None)
            for eqn in jaxpr.eqns:
                body = _subjaxpr(eqn) if eqn.primitive.name in ("jit", "pjit", "closed_call") else None
                if body is None or any(e.primitive.name not in ELEMENTWISE for e in body.eqns):
                    continue
                for x in eqn.invars:
                    shape = tuple(getattr(x.aval, "shape", ()))
                    out = next((table[o] for o in eqn.outvars if o in table and tuple(o.aval.shape) == shape), None)
                    if out is not None and not hasattr(x, "val"):
                        table.setdefault(x, out)
        self.memo[key] = (jaxpr, tuple(table.items()))
        for x, wanted in table.items():
            self.sum_wants.setdefault(x, wanted)

    def _spread(self, jaxpr: Any, table: dict[Any, Dims], constraints: str | None) -> None:
        """:func:`claims._spread` into ``table``, memoised on what ``table`` holds of ``jaxpr``'s
        values before (all the spread reads)."""
        key_vars = self.memo.get(("values", id(jaxpr)))
        if key_vars is None or key_vars[0] is not jaxpr:
            values = tuple(dict.fromkeys([*jaxpr.invars, *jaxpr.constvars, *_made(jaxpr)]))
            key_vars = self.memo[("values", id(jaxpr))] = (jaxpr, values)
        before = frozenset((x, table[x]) for x in key_vars[1] if x in table)
        key = ("spread", id(jaxpr), constraints, before)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            grown = dict(before)
            _spread(jaxpr, grown, constraints)
            hit = self.memo[key] = (jaxpr, tuple((x, d) for x, d in grown.items() if x not in dict(before)))
        for x, dims in hit[1]:
            table.setdefault(x, dims)

    def _structure(self, jaxpr: Any, boundary: _Boundary | None) -> tuple:
        """What a jaxpr's run needs that no plan changes: each value's last reader and reader count,
        its outputs, the values fused into their readers, and its kernels (fresh copies of a memo
        kept per trace: the run updates them)."""
        recomputes, duplicates = self.ctx.book.recomputes, self.ctx.book.duplicates
        outs = None if boundary is None else frozenset(boundary.fusable_outs.items())
        key = ("structure", id(jaxpr), outs, recomputes, duplicates)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            last: dict[Any, int] = {}
            uses: dict[Any, int] = {}
            for k, eqn in enumerate(jaxpr.eqns):
                for x in eqn.invars:
                    if not hasattr(x, "val"):
                        last[x] = k
                        uses[x] = uses.get(x, 0) + 1
            keep = {x for x in jaxpr.outvars if not hasattr(x, "val")}
            kernels = _kernels(jaxpr, {} if boundary is None else boundary.fusable_outs)
            fused = _fused_outputs(jaxpr, uses)
            if recomputes:
                dropped, last = _recomputed(jaxpr, kernels[0], last, fused, duplicates)
                fused = fused | dropped
            hit = (jaxpr, last, uses, keep, fused, kernels)
            self.memo[key] = hit
        _, last, uses, keep, fused, (fused_v, soft, shared) = hit
        return last, uses, keep, fused, (dict(fused_v), dict(soft), set(shared))

    def _steps(self, jaxpr: Any, last: dict[Any, int], keep: set) -> list[tuple]:
        """Per equation of ``jaxpr``, what no plan changes: its literal operands' values (None for a
        variable), its variable operands, and the values whose last reader it is (memoised)."""
        book = self.ctx.book
        key = ("steps", id(jaxpr), book.recomputes, book.duplicates, book.narrows)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            steps = []
            narrows = book.narrows and book.matmul_itemsize
            wide = _last_wide_readers(jaxpr, last, keep) if narrows else {}
            narrowing: dict[int, list] = {}
            for x, k in wide.items():
                narrowing.setdefault(k, []).append(x)
            inputs = {x for x in jaxpr.invars if _is_float(x) and x.aval.dtype == "float32"} if narrows else set()
            ends: dict[int, list] = {}  # a value dies after its last reader (or its last recomputation's)
            for x, k in last.items():
                if x not in keep:
                    ends.setdefault(k, []).append(x)
            for k, eqn in enumerate(jaxpr.eqns):
                literals = tuple(self._read({}, x) if hasattr(x, "val") else None for x in eqn.invars)
                variables = tuple(x for x in eqn.invars if not hasattr(x, "val"))
                dying = tuple(ends.get(k, ()))
                copying = tuple(x for x in variables if x in inputs) if _reads_narrow(eqn) else ()
                simple = eqn.primitive.name in ELEMENTWISE  # (``RuleBook.quick``)
                steps.append((eqn, literals, variables, dying, tuple(narrowing.get(k, ())), copying, simple))
            hit = self.memo[key] = (jaxpr, steps)
        return hit[1]

    def body(self, eqn: Any) -> Any:
        """:func:`_subjaxpr`, once per equation of a trace (asked several times per equation); a
        grouped matmul's dense decomposition (:func:`ragged_dense`, what XLA:CPU runs)."""
        key = ("body", id(eqn), self.ctx.book.dense_ragged)
        hit = self.memo.get(key)
        if hit is None or hit[0] is not eqn:
            if eqn.primitive.name == "ragged_dot_general":
                sub = ragged_dense(eqn) if self.ctx.book.dense_ragged else None
            else:
                sub = _subjaxpr(eqn)
            hit = self.memo[key] = (eqn, sub)
        return hit[1]

    def source_of(self, eqn: Any) -> str:
        """:func:`eqn_source`, once per equation of a trace (``memo`` outlives one plan's costing)."""
        return self._static(eqn)[1]

    def _static(self, eqn: Any) -> tuple[Any, str, bool]:
        """What the walk asks of an equation alone, once per trace: its source line, and whether it
        is in the backward pass (a transpose's, by its name stack)."""
        hit = self.memo.get(id(eqn))
        if hit is None or hit[0] is not eqn:
            stack = str(getattr(eqn.source_info, "name_stack", ""))
            hit = self.memo[id(eqn)] = (eqn, eqn_source(eqn), "transpose(" in stack)
        return hit

    def _sum_origins(self, eqn: Any, outs: list[Val]) -> None:
        """Where each output's pending sum was made: carried through from an input that has one, from
        a call's body, else this equation."""
        if not any(v.partial for v in outs):
            return
        if eqn.primitive.name == "transpose" and not hasattr(eqn.invars[0], "val"):
            # a matmul's batch dims kept in front (a transposed einsum result): still its batch dims
            batch = self.dot_batch.get(self.root(eqn.invars[0]), 0)
            if batch and tuple(eqn.params["permutation"][:batch]) == tuple(range(batch)):
                self.dot_batch[self.root(eqn.outvars[0])] = batch
            if self.root(eqn.invars[0]) in self.rows:  # a matmul's rows follow the permutation
                row = self.rows[self.root(eqn.invars[0])]
                perm = tuple(eqn.params["permutation"])
                self.rows[self.root(eqn.outvars[0])] = None if row is None else perm.index(row)
        carried = next((self.sum_origin[x] for x in eqn.invars if not hasattr(x, "val") and x in self.sum_origin), None)
        sub = self.body(eqn)
        body = getattr(sub, "jaxpr", sub)
        for i, (var, val) in enumerate(zip(eqn.outvars, outs, strict=True)):
            if not val.partial:
                continue
            inner = body.outvars[i] if body is not None and i < len(body.outvars) else None
            self.sum_origin[var] = (
                self.sum_origin.get(inner)
                or carried
                or (eqn.primitive.name, self.ctx.source, _contracted(eqn), self.sum_dims.pop(var, ()))
            )

    def eqn(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        """One equation by the rule book (``rules.RULE_BOOK``); a call of a primitive the catalogue
        does not name is inlined; anything else is a declared fallback (``rules._FALLBACKS``) or not
        catalogued: replicated results, counted in the step's notes as not modelled."""
        name = eqn.primitive.name
        _, source, backward = self._static(eqn)
        self.ctx.source = source or self.call_source
        if self.depth == 1:  # the step's own equations: the backward pass's are a transpose's
            self.ctx.backward = backward
        if name in ELEMENTWISE:  # most equations (no elementwise primitive has a body)
            return [self.rules.elementwise(self, eqn, ins, mult)]
        rule = self.rules.rules.get(name)
        outer = self.backward
        if not outer and self.ctx.book.gather_cse is not None:
            self.backward = backward
        try:
            got = rule(self, eqn, ins, mult) if rule is not None else None
            if got is None and rule is None and name not in ("scan", "while", "cond"):
                got = self.rules.call(self, eqn, ins, mult)
        finally:
            self.backward = outer
        if got is not None:
            return got
        self.ctx.unmodeled[name] = self.ctx.unmodeled.get(name, 0) + 1
        return [_replicated(o.aval) for o in eqn.outvars]

    def laid_first(self, lx: Any, rx: Any) -> str | None:
        """Inside a loop body, the matmul operand (``"lhs"`` or ``"rhs"``) Shardy lays out in its
        first round where the other is a carried value laid out only in a later one
        (``priority``); None elsewhere."""
        if not self.loops:
            return None
        if lx in self.early and rx in self.late:
            return "lhs"
        if rx in self.early and lx in self.late:
            return "rhs"
        return None

    def made_beside(self, frame: _Frame, var: Any) -> Dims | None:
        """The layout of a value already made that an elementwise reader of ``var`` combines it
        with (same shape, split over some axis), or None."""
        key = ("readers", id(frame.jaxpr))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not frame.jaxpr:
            hit = self.memo[key] = (frame.jaxpr, _readers(frame.jaxpr))
        shape = tuple(var.aval.shape)
        for e in hit[1].get(var, ()):
            if e.primitive.name not in ELEMENTWISE:
                continue
            for x in e.invars:
                if x is not var and not hasattr(x, "val") and tuple(x.aval.shape) == shape and x in frame.env:
                    if frame.env[x].axes:
                        return frame.env[x].dims
        return None

    def back_claim(self, var: Any, natural: Dims) -> Dims | None:
        """The layout propagated back to ``var`` from a constraint (``_claims_back``), where it
        splits over at least as many devices as ``natural``, the layout the value would have: the
        more split layout wins where the two meet (measured on XLA:CPU: a dispatch mask is built
        split over data x expert on two dims rather than over both on one, while the tokens
        stay split over both and are gathered at the dispatch)."""
        claim = self.back.get(var)
        if claim is None or self.ctx.split_dims(claim) < self.ctx.split_dims(natural):
            return None
        return claim

    def count_flops(self, n: float, mult: int, name: str) -> None:
        """``n`` flops of ``name`` (times ``mult``). A transcendental function's count apart: XLA's
        cost analysis counts exp, log, power, sqrt, tanh, logistic, ... as no flops."""
        if name in TRANSCENDENTAL:
            self.ctx.transcendentals += n * mult
        else:
            self.ctx.flops += n * mult
            if name in MATMULS:
                where = self.ctx.source or self.call_source
                self.ctx.matmul_flops[where] = self.ctx.matmul_flops.get(where, 0.0) + n * mult

    def _of_frame(self, read: Callable[[Any], _T]) -> _T:
        """``read(jaxpr)`` of the jaxpr being run, once per trace (kept in the memo)."""
        jaxpr = self.frame.jaxpr if self.frame is not None else None
        key = (read.__name__, id(jaxpr))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not jaxpr:
            hit = self.memo[key] = (jaxpr, read(jaxpr))
        return hit[1]

    def transposed_as(self, var: Any) -> tuple[Any, tuple[int, ...]] | None:
        """The transpose that alone reads ``var`` in the jaxpr being run, as (its result, its
        permutation); None where another op reads it, or more than one."""
        return self._of_frame(_sole_transposes).get(var)

    def summed_by_adds(self) -> set[Any]:
        """The values of the jaxpr being run that only additions read (``splitk.summed_by_adds``)."""
        return self._of_frame(splitk.summed_by_adds)

    def kernel_reads(self, var: Any) -> int:
        """How many kernels of the jaxpr being run read ``var`` (``splitk.reads``)."""
        return max(1, self._of_frame(splitk.reads).get(var, 0))

    def dot_merged(self, eqn: Any) -> tuple[int, float]:
        """The side a matmul shares with those XLA:GPU merges it with, and how much wider the merged
        matmul is (``splitk.merged``; 1.0 where it stays alone)."""
        return self._of_frame(splitk.merged).get(id(eqn), (0, 1.0))


def _sole_transposes(jaxpr: Any) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    """Values ``jaxpr``'s transposes read that nothing else reads -> (the transpose's result, its
    permutation)."""
    reads: dict[Any, int] = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):
                reads[x] = reads.get(x, 0) + 1
    for x in jaxpr.outvars:
        if not hasattr(x, "val"):
            reads[x] = reads.get(x, 0) + 1
    return {
        eqn.invars[0]: (eqn.outvars[0], tuple(eqn.params["permutation"]))
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "transpose" and reads.get(eqn.invars[0]) == 1
    }


def _made(jaxpr: Any) -> tuple:
    """The values ``jaxpr`` makes (its equations' results) and its outputs that are variables."""
    made = [o for eqn in jaxpr.eqns for o in eqn.outvars]
    return tuple(dict.fromkeys(made + [o for o in jaxpr.outvars if not hasattr(o, "val")]))


def _closed_constraints(jaxpr: Any) -> dict[Any, Dims]:
    """The values made in ``jaxpr`` that a fully closed sharding constraint reads, each with its
    layout (values two such constraints read with different layouts left out)."""
    made = {o for eqn in jaxpr.eqns for o in eqn.outvars}
    seen: dict[Any, Dims] = {}
    clash: set[Any] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "sharding_constraint":
            continue
        x = eqn.invars[0]
        spec = getattr(eqn.params.get("sharding"), "spec", None)
        unconstrained = getattr(type(spec), "UNCONSTRAINED", object())
        if x not in made or spec is None or any(e is unconstrained for e in spec):
            continue
        target = constraint_target(eqn, ((),) * len(x.aval.shape))
        if target is None:
            continue
        target = _norm(target, len(x.aval.shape))
        if seen.get(x, target) != target:
            clash.add(x)
        seen[x] = target
    return {x: t for x, t in seen.items() if x not in clash}
