"""``shardplan suggest``: search the plans for a model, step, device count and memory budget and
write the best as a readable .splan (docs/suggest.md).

The stages: read what each param dim is from the step's computation (``runtime.roles``), group
params into families (a path template and a shape), search the space ``core.search`` spans with
fast mode re-costing every candidate on one trace per mesh, time each on the chip
(``core.timing``), confirm the best few in exact mode where the mesh compiles here, and write the
winner in the house style with its runners-up as comments.
"""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shardplan import api
from shardplan.core import backends, chips, optimizers, search, targets, timing
from shardplan.core.format import fmt_bytes, fmt_count
from shardplan.core.notes import Note
from shardplan.core.stepcost import StepCost
from shardplan.errors import ShardPlanError, as_error, error
from shardplan.lang.fmt import format_text
from shardplan.lang.loader import loads

DEFAULT_CHIP = "h100"
CONFIRM = 3  # candidates confirmed in exact mode
MORE_CONFIRMS = 3  # more tried while none of the confirmed ones compiles within the budget
# Step times within this share of the fastest are a tie: the time model does not resolve them (on
# a toy model every plan is bound by its kernels' launches), so the plan whose devices do the least
# of the same work (FLOPs per device), then the lowest peak, is taken among them.
TIE = 0.02


@dataclass(frozen=True)
class Candidate:
    """One plan the search costed: its text, what it is, its predicted step and peak."""

    text: str
    description: str
    step_s: float  # serial step time on the chip (fast mode)
    overlapped_s: float
    peak: int  # bytes per device
    fits: bool
    exact_step_s: float | None = None  # the same, from the compiled program (exact mode)
    exact_peak: int | None = None
    flops: float = 0.0  # per device per step (the compiled program's where confirmed)
    kind: str = ""  # shown as the best plan of this kind of parallelism (search.KINDS) the search costed
    kinds: tuple[str, ...] = ()  # the kinds of parallelism it uses (search.Choice.kinds)


@dataclass(frozen=True)
class Suggestion:
    """What ``suggest`` found: the plan's text (formatted, with comments), the winner and the
    runners-up, and how the search went."""

    text: str
    best: Candidate
    alternatives: tuple[Candidate, ...]
    chip: str
    devices: int
    budget: int | None
    searched: int  # plans costed
    traces: int
    search_s: float  # fast-mode search
    confirm_s: float  # exact-mode confirmation
    notes: tuple[Note, ...]
    cost: StepCost  # the winner's (exact mode when confirmed)

    def to_json(self) -> dict:
        def cand(c: Candidate) -> dict:
            return dict(c.__dict__)

        return {
            "plan": self.text,
            "best": cand(self.best),
            "alternatives": [cand(c) for c in self.alternatives],
            "chip": self.chip,
            "devices": self.devices,
            "device_memory": self.budget,
            "searched": self.searched,
            "traces": self.traces,
            "search_seconds": self.search_s,
            "confirm_seconds": self.confirm_s,
            "notes": [n.to_json() for n in self.notes],
            "cost": self.cost.to_json(),
        }


def families(roles: Any) -> tuple[search.Family, ...]:
    """Params grouped by path template and shape, in the model's order. Where arrays of several
    shapes share a template (a list of layers of two kinds), each family's regex names its own
    list indices, so one rule never decides arrays of two shapes."""
    from shardplan.runtime.roles import template  # jax-free module; imported late like the rest of runtime

    out: dict[tuple[str, tuple[int, ...]], list] = {}
    for p in roles.params:
        out.setdefault((template(p.path), p.shape), []).append(p)
    shapes_of: dict[str, int] = {}
    for tpl, _ in out:
        shapes_of[tpl] = shapes_of.get(tpl, 0) + 1
    fams = []
    for (tpl, shape), ps in out.items():
        tags = tuple(frozenset().union(*(p.tags[d] for p in ps)) for d in range(len(shape)))
        regex = tpl if shapes_of[tpl] == 1 else _indices(tpl, [p.path for p in ps])
        fams.append(search.Family(regex, shape, ps[0].units, tags, len(ps)))
    return tuple(fams)


def _indices(tpl: str, paths: list[str]) -> str:
    """``tpl`` with each ``\\d+`` narrowed to the indices ``paths`` have there."""
    parts = tpl.split("/")
    for k, part in enumerate(parts):
        if part == r"\d+":
            seen = sorted({p.split("/")[k] for p in paths}, key=int)
            parts[k] = seen[0] if len(seen) == 1 else "(?:" + "|".join(seen) + ")"
    return "/".join(parts)


def _names(space: search.Space) -> dict[int, str]:
    """Readable names for the logical dims, from what the step does with them and where they
    occur (never from the params' names)."""
    names: dict[int, str] = {}
    width = space.width
    for u in space.sizes:
        where = [(f, i) for f in space.families for i, x in enumerate(f.units) if x == u]
        if not where:
            continue
        tags = frozenset().union(*(f.tags[i] for f, i in where))
        size = space.sizes[u]
        wholes = sorted({f.shape[i] for f, i in where})
        of = f"the {'/'.join(map(str, wholes))}-wide dims"
        writes = sum(f.count for f, i in where if len(f.shape) >= 2 and "free" in f.tags[i])
        reads = sum(f.count for f, i in where if len(f.shape) >= 2 and "contract" in f.tags[i])
        if u == width:
            names[u] = f"the residual width ({size})"
        elif "rows" in tags:
            names[u] = f"the table rows ({size})"
        elif "batch" in tags:
            names[u] = f"the experts ({size})"
        elif "stack" in tags:
            names[u] = f"the stacked layers ({size})"
        else:
            what = f"the {size}-wide dim" if wholes == [size] else f"the {size} groups of {of}"
            uses = [f"output of {_n(writes, 'matrix', 'matrices')}"] if writes else []
            if reads:
                uses.append(f"input of {reads}" if writes else f"input of {_n(reads, 'matrix', 'matrices')}")
            names[u] = f"{what} ({', '.join(uses) or 'vectors alone'})"
    return names


def _n(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _fits_nowhere(best: search.Scored, budget: int) -> ShardPlanError:
    m = best.cost.memory
    parts = {
        "params": m.params,
        "optimizer state": m.opt_state,
        "activations and temporaries": m.temporaries,
        "the batch": m.batch,
    }
    top = max(parts, key=parts.__getitem__)
    return as_error(
        [
            error(
                "no-plan-fits",
                f"no plan searched fits {fmt_bytes(budget)} per device: the smallest peak is {fmt_bytes(best.peak)} "
                f"({'; '.join(f'{k} {fmt_bytes(v)}' for k, v in parts.items())}; most is {top})",
                "use more devices, remat in the model (nnx.remat) to drop saved activations, a smaller batch, "
                "or a device with more memory",
                path="--device-memory",
            )
        ]
    )


def search_space(coster: Any, devices: int) -> search.Space:
    """The space ``suggest`` searches for the step ``coster`` traced (``api.step_coster``) on
    ``devices`` devices: the param families and what each dim is, read from the computation."""
    roles = coster.roles(devices)
    shapes = coster.shapes
    space = search.Space(families(roles), dict(roles.sizes), tuple(int(s[0][0]) for s in shapes.values() if s[0]))
    seq = tuple(int(s[0][1]) for s in shapes.values() if len(s[0]) > 1)
    return search.Space(space.families, space.sizes, space.batch, _names(space), seq, roles.opt_prefixes)


def suggest(
    *,
    model: str,
    step: str,
    batch: dict | list[str],
    devices: int,
    chip: str | None = None,
    devices_per_host: int | None = None,
    device_memory: int | None = None,
    optimizer: str = "adamw",
    top: int = 5,
    confirm: int = CONFIRM,
    progress: Any = None,
    target: str | None = None,
    backend: str = "auto",
) -> Suggestion:
    """Search plans for ``model`` on ``devices`` devices and return the best as .splan text.

    Args:
        model, step, batch, optimizer: as for :func:`shardplan.api.analyze`.
        devices: the device count the mesh factors.
        chip: the accelerator whose step time ranks plans (``shardplan.core.chips``; default: the
            target's chip, else h100).
        devices_per_host: devices a host holds: the model axis stays inside one, and axes that
            cross hosts are tagged ``@dcn`` (network rates).
        device_memory: bytes per device a plan must fit (default: the chip's memory).
        top: runners-up to keep.
        confirm: the best this many are compiled (exact mode) and re-ranked, where the mesh
            compiles here (at most ``api.MAX_SIMULATED_DEVICES`` devices for XLA:CPU, any size
            for a target's compiler); 0 to skip.
        progress: called with a line per plan costed.
        target: the compiler the plan is for (``shardplan.core.targets``): ``cpu`` (XLA:CPU on
            simulated devices) or the TPU slice or GPUs the plan is for (``tpu-v5p:2x2x2``,
            ``h100:8``): candidates are ranked by fast mode's rules for its program and the best
            compiled by it offline at the full mesh; it must have ``devices`` devices. Default:
            a GPU ``chip``'s own compiler for ``devices`` of it (``targets.for_chip``) where
            ``chip`` is named and that compiler is installed, else ``cpu`` (a note says why; a
            TPU's program is confirmed only when named: shardplan's time model runs XLA:TPU's
            windowed einsums' rings one collective after another, 3.1x fast mode's step on an
            FSDP step of gpt_small, 16,384 tokens on 8 v5p chips).
        backend: the backend the plan is for (``auto`` or ``shard_map``): candidates are ranked by
            that backend's step (fast mode costs the shard_map backend from its partitioner's
            record), the best confirmed by compiling that backend's step, and the plan names it.

    Raises:
        ShardPlanError: bad arguments, a model or step that fails, or no plan that fits.
    """
    for name, value in (("devices", devices), ("devices_per_host", devices_per_host), ("top", top)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise as_error(
                [
                    error(
                        "bad-argument",
                        f"{name} must be a positive whole number, not {value!r}",
                        f"pass {name}=8",
                        path=f"--{name.replace('_', '-')}",
                    )
                ]
            )
    if devices_per_host is not None and devices > devices_per_host and devices % devices_per_host:
        fits = devices - devices % devices_per_host
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"{devices} devices do not fill hosts of {devices_per_host}: {devices} is not a multiple of "
                    f"{devices_per_host}",
                    f"give whole hosts (--devices {fits} or {fits + devices_per_host}), or the hosts' real size",
                    path="--devices-per-host",
                )
            ]
        )
    if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 0:
        raise as_error(
            [error("bad-argument", f"confirm must be 0 or more, not {confirm!r}", "pass confirm=3", path="confirm")]
        )
    if device_memory is not None and (not isinstance(device_memory, int) or device_memory <= 0):
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"device_memory must be a positive number of bytes, not {device_memory!r}",
                    "pass device_memory=80 * 10**9",
                    path="--device-memory",
                )
            ]
        )
    notes: list[Note] = []
    if chip is not None:
        chips.lookup(chip)
    if target is None:
        chosen, why = targets.for_chip(chip, devices, devices_per_host, tpus=False) if chip is not None else (None, "")
        aim = chosen or targets.CPU
        if chosen is None and chip is not None and confirm:
            by = "XLA:CPU confirms" if devices <= api.MAX_SIMULATED_DEVICES else "nothing here confirms"
            by += " the plans"
            notes.append(Note("suggest-confirmed-on-cpu", f"{by}, not {chip}'s compiler: {why}"))
    else:
        aim = targets.parse(target, "--target")
    targets.agree(aim, chip)
    if aim.devices is not None and aim.devices != devices:
        raise as_error(
            [
                error(
                    "bad-target",
                    f"--target {aim.name} has {aim.devices} devices; the plans are searched for {devices}",
                    f"search for --devices {aim.devices}, or name a target of {devices} devices",
                    path="--target",
                )
            ]
        )
    hw = chips.lookup(chip or aim.chip or DEFAULT_CHIP)
    optimizers.lookup(optimizer)
    backends.lookup(backend, "--backend")
    budget = device_memory if device_memory is not None else int(hw.hbm_bytes)
    t0 = time.perf_counter()
    # the last model's coster again where model, step, batch and optimizer are the same and their
    # files unchanged (a second search, under another budget or device count, re-costs nothing it costed)
    coster = api._coster(model, step, api._batch_shapes(batch, "batch"), optimizer)
    traces0 = coster.traces
    space = replace(search_space(coster, devices), backend=backend)

    def score(text: str) -> tuple | None:
        try:  # a candidate the plan checker or the model refuses is dropped, not the search
            plan = loads(text, "<suggest>")
            cost = coster.cost(plan, delta=False, compiler=aim.book)
        except ShardPlanError:
            return None
        t = timing.step_time(cost, plan, hw)
        return cost, t, t.serial_s, cost.memory.peak

    s = search.Search(space, score, budget, progress)
    ranked = s.run(search.meshes(space, devices, devices_per_host))
    search_s = time.perf_counter() - t0
    if not ranked:
        raise as_error(
            [
                error(
                    "no-plan-fits",
                    "no plan searched applies to this model and device count",
                    "try another device count",
                    path="--devices",
                )
            ]
        )
    if not ranked[0].fits:
        raise _fits_nowhere(min(ranked, key=lambda r: r.peak), budget)
    fitting = _ties_broken([r for r in ranked if r.fits], lambda r: (r.seconds, r.cost.flops, r.peak, r.text))
    t1 = time.perf_counter()
    confirmed: dict[str, tuple[float, int, StepCost]] = {}
    failed: list[str] = []
    over: list[search.Scored] = []  # confirmed, over the budget: left out
    if confirm and (devices <= api.MAX_SIMULATED_DEVICES or aim.platform != "cpu"):
        # Confirm the best ``confirm``; while none of them compiles within the budget, go on down
        # the ranking (at most MORE_CONFIRMS more): a plan whose own confirmation rejected it is
        # never returned while a fitting one is found.
        tried: list[search.Scored] = []
        for r in fitting:
            good = sum(1 for t in tried if t.text in confirmed and confirmed[t.text][1] <= budget)
            if len(tried) >= confirm and (good or len(tried) >= confirm + MORE_CONFIRMS):
                break
            tried.append(r)
            plan = loads(r.text, "<suggest>")
            try:
                exact = api.analyze(
                    plan, model=model, step=step, batch=batch, optimizer=optimizer, mode="exact", target=aim.name
                )
            except ShardPlanError as e:
                failed.append(r.text)
                notes.append(
                    Note(
                        "suggest-exact-failed",
                        f"exact mode failed for {r.choice.describe(space)}: {str(e).splitlines()[0]}",
                    )
                )
                continue
            confirmed[r.text] = (timing.step_time(exact, plan, hw).serial_s, exact.memory.peak, exact)
        over = [r for r in tried if r.text in confirmed and confirmed[r.text][1] > budget]
        for r in over:
            notes.append(
                Note(
                    "suggest-over-budget",
                    f"{r.choice.describe(space)}: fast mode's peak {fmt_bytes(r.peak)} fits, the compiled "
                    f"program's {fmt_bytes(confirmed[r.text][1])} does not: left out",
                )
            )
        if over:
            fitting = [r for r in fitting if r not in over]
            tried = [r for r in tried if r not in over]
            if not fitting:
                raise _fits_nowhere(min(over, key=lambda r: confirmed[r.text][1]), budget)
        if confirmed and fitting and tried:
            done = _ties_broken(
                [r for r in tried if r.text in confirmed],
                lambda r: (confirmed[r.text][0], confirmed[r.text][2].flops, confirmed[r.text][1], r.text),
            )
            order = done + [r for r in tried if r.text not in confirmed]
            if order[0] is not fitting[0]:
                notes.append(
                    Note(
                        "suggest-reranked",
                        f"exact mode re-ranked the best {len(order)}: fast mode's first "
                        f"({fitting[0].choice.describe(space)}) "
                        f"compiles to {_ms(confirmed.get(fitting[0].text, (math.inf,))[0])}, "
                        f"{order[0].choice.describe(space)} to {_ms(confirmed[order[0].text][0])}",
                    )
                )
            fitting = order + [r for r in fitting if r not in tried]
    elif confirm:
        notes.append(
            Note(
                "suggest-unconfirmed",
                f"not confirmed in exact mode: {devices} devices are more than this machine simulates",
            )
        )
    confirm_s = time.perf_counter() - t1

    winner = fitting[0]

    def candidate(r: search.Scored) -> Candidate:
        ex = confirmed.get(r.text)
        return Candidate(
            r.text,
            r.choice.describe(space) if r is winner else r.choice.versus(winner.choice, space),
            r.seconds,
            r.time.overlapped_s,
            r.peak,
            r.fits,
            ex[0] if ex else None,
            ex[1] if ex else None,
            ex[2].flops if ex else r.cost.flops,
            kinds=r.choice.kinds(),
        )

    best = candidate(fitting[0])
    others = [candidate(r) for r in fitting[1:]][: max(top - 1, 0)]
    ruled_out = [candidate(r) for r in ranked if not r.fits][:2]
    # The best plan of each kind of parallelism the winner does not use, whether or not it ranked
    # near the top: what each costs and why it lost, said (a fitting one before one over the budget).
    shown = {c.text for c in [best, *others, *ruled_out]}
    left_out = {r.text for r in over}
    pool = [r for r in fitting[1:] if r.text not in left_out] + [r for r in ranked if not r.fits]
    kinds = []
    for kind in search.KINDS:
        if kind in winner.choice.kinds():
            continue
        r = next((r for r in pool if kind in r.choice.kinds()), None)
        if r is not None and r.text not in shown:
            shown.add(r.text)
            kinds.append(replace(candidate(r), kind=kind))
    others += kinds
    cost = confirmed[winner.text][2] if winner.text in confirmed else winner.cost
    if winner.text in confirmed:
        status = ""
    elif not confirm:
        status = "Not confirmed by a compiler (--confirm 0 / --no-compile): every figure here is fast mode's."
    elif devices > api.MAX_SIMULATED_DEVICES and aim.platform == "cpu":
        status = (
            f"Not confirmed by a compiler: {devices} devices are more than this machine simulates (--target "
            "names an offline TPU or GPU compiler that can); every figure here is fast mode's."
        )
    elif winner.text in failed:
        status = "Not confirmed: exact mode failed to compile it (see the notes); every figure here is fast mode's."
    else:
        status = (
            f"Not confirmed by a compiler: {len(over)} better-ranked plan(s) compiled over the budget and were left "
            f"out, and the confirmations ran out ({confirm} + {MORE_CONFIRMS} tried); every figure here is fast "
            "mode's: check it with `shardplan check --compile`."
        )
    text = render(
        best, others + ruled_out, winner, space, hw, devices, budget, s.costed, search_s, aim.compiler, status
    )
    return Suggestion(
        text,
        best,
        tuple(others + ruled_out),
        hw.name,
        devices,
        budget,
        s.costed,
        coster.traces - traces0,
        search_s,
        confirm_s,
        tuple(notes),
        cost,
    )


def _ms(s: float) -> str:
    return "-" if s == math.inf else f"{s * 1e3:,.3f} ms" if s < 1 else f"{s:,.2f} s"


def render(
    best: Candidate,
    others: list[Candidate],
    winner: search.Scored,
    space: search.Space,
    hw: chips.Chip,
    devices: int,
    budget: int,
    searched: int,
    seconds: float,
    compiler: str = "XLA:CPU",
    status: str = "",
) -> str:
    """The winner's plan in the house style, its prediction and the runners-up as comments;
    ``status``: why the winner was not confirmed by a compiler ('' when it was)."""
    t = winner.time
    head = [
        f"Written by shardplan suggest: {fmt_count(searched, 'plan')} costed in {seconds:.1f} s for "
        f"{fmt_count(devices, 'device')} on {hw.name}, at most {fmt_bytes(budget)} per device"
        + (f", ranked by the {space.backend} backend's step." if space.backend != "auto" else "."),
        f"This plan: {best.description}.",
        f"Fast mode{'' if compiler == 'XLA:CPU' else f' ({compiler} rules)'} predicts a step of "
        f"{_ms(best.step_s)} with no overlap, {_ms(best.overlapped_s)} with communication "
        f"hidden (MFU {t.mfu_serial:.0%}..{t.mfu_overlapped:.0%}); peak {fmt_bytes(best.peak)} per device."
        + (
            f" Compiled by {compiler} (exact mode): step {_ms(best.exact_step_s)}, peak "
            f"{fmt_bytes(best.exact_peak or 0)}."
            if best.exact_step_s is not None
            else ""
        ),
    ]
    if status:
        head.append(status)
    if others:
        head.append("Runners-up:")
    for c in others:
        both = c.exact_step_s is not None and best.exact_step_s is not None and best.exact_step_s > 0
        if c.exact_step_s is not None and best.exact_step_s:
            ratio = c.exact_step_s / best.exact_step_s
        else:
            ratio = c.step_s / best.step_s if best.step_s else 1.0
        why = (
            f"peak {fmt_bytes(c.peak)} does not fit"
            if not c.fits
            else f"{ratio - 1:+.0%} step time" + (" compiled" if both else "")
        )
        if c.fits and ratio < 1:  # faster by less than the time model resolves (TIE)
            more = (
                f"{c.flops / best.flops:.1f}x the FLOPs per device"
                if best.flops and c.flops > best.flops * 1.001
                else f"a higher peak than {fmt_bytes(best.exact_peak or best.peak)}"
            )
            why = (
                f"{(ratio - 1) * 100:+.1f}% step time"
                + (" compiled" if both else "")
                + (f": a tie within {TIE:.0%}, and {more}")
            )
        label = f"best {c.kind} plan costed: " if c.kind else ""
        head.append(f"- {label}{c.description}: step {_ms(c.step_s)}, peak {fmt_bytes(c.peak)} ({why})")
    wrapped = [
        line
        for h in head
        for line in textwrap.wrap(h, 96, subsequent_indent="    " if h.startswith("- ") else "  ") or [""]
    ]
    raw = search.plan_text(space, winner.choice, header=wrapped)
    return format_text(raw, "<suggest>")


@dataclass(frozen=True)
class Change:
    """One rule an improvement adds (before the plan's own rules: the first match wins)."""

    rule: str  # 'param "REGEX" SPEC'
    before: str  # the spec the family had
    step_s: float  # the plan's predicted step with this and every earlier change
    peak: int


@dataclass(frozen=True)
class Improvement:
    """What ``improve`` found: the fewest rule changes that gain the most, in the order they pay."""

    text: str  # the plan with the changes
    diff: str  # unified diff against the plan as given
    changes: tuple[Change, ...]
    step_s: float  # the plan as given
    peak: int
    searched: int
    search_s: float
    chip: str

    @property
    def gain(self) -> float:
        """The predicted step time saved, as a share of the plan's."""
        end = self.changes[-1].step_s if self.changes else self.step_s
        return 1 - end / self.step_s if self.step_s else 0.0

    def to_json(self) -> dict:
        return {
            "plan": self.text,
            "diff": self.diff,
            "changes": [dict(c.__dict__) for c in self.changes],
            "step_s": self.step_s,
            "peak": self.peak,
            "gain": self.gain,
            "searched": self.searched,
            "search_seconds": self.search_s,
            "chip": self.chip,
        }


def _ties_broken(results: list, figures: Callable[[Any], tuple]) -> list:
    """``results`` ordered by their step time, where those within :data:`TIE` of the fastest come
    first by FLOPs per device, then peak (``figures(r) -> (seconds, flops, peak, text)``)."""
    if not results:
        return results
    ordered = sorted(results, key=figures)
    fastest = figures(ordered[0])[0]
    cut = next((i for i, r in enumerate(ordered) if figures(r)[0] > fastest * (1 + TIE)), len(ordered))
    return sorted(ordered[:cut], key=lambda r: figures(r)[1:]) + ordered[cut:]


MIN_GAIN = 0.002  # a change must save at least this share of the step to be proposed


def _spec_text(dims: list[tuple[str, ...]]) -> str:
    if not any(dims):
        return "replicated"
    return "(" + ", ".join("_" if not d else d[0] if len(d) == 1 else "(" + ", ".join(d) + ")" for d in dims) + ")"


def _options(f: search.Family, axes: dict[str, int], stacked: set[int]) -> list[str]:
    """Every spec of a family's arrays over the plan's axes: each axis on one dim or none (stacked
    dims whole), where the sizes divide."""
    import itertools

    dims = [i for i, u in enumerate(f.units) if u not in stacked]
    out = []
    names = list(axes)
    for placed in itertools.product([None, *dims], repeat=len(names)):
        spec: list[tuple[str, ...]] = [() for _ in f.shape]
        for a, d in zip(names, placed, strict=True):
            if d is not None:
                spec[d] += (a,)
        if all(f.shape[i] % math.prod(axes[a] for a in spec[i]) == 0 for i in range(len(f.shape))):
            out.append(_spec_text(spec))
    return out


def _with_rules(text: str, rules: list[str]) -> str:
    """``text`` with ``rules`` before its first param or default statement (they win: first match);
    a rule of the plan with the same regex is replaced where it stands."""
    lines = text.splitlines()
    rest = []
    for rule in rules:
        head = rule[: rule.index('" ') + 1]  # 'param "REGEX"'
        at = next((i for i, line in enumerate(lines) if line.strip().startswith(head + " ")), None)
        if at is None:
            rest.append(rule)
        else:
            lines[at] = rule
    rules = rest
    at = next(
        (i for i, line in enumerate(lines) if line.lstrip().startswith(("param ", "default ", "opt "))), len(lines)
    )
    return "\n".join(lines[:at] + rules + lines[at:]) + "\n"


def _decided(plan: Any, path: str) -> str:
    """The spec the plan's own rules give ``path`` (first full match), or its default."""
    import re

    for r in plan.params:
        try:
            if re.fullmatch(r.pattern, path):
                return str(r.spec)
        except re.error:  # RE2 syntax Python lacks: say so rather than guess
            return "(decided by the plan)"
    return str(plan.default) if plan.default is not None else "(decided by the plan)"


def improve(
    plan_path: str,
    *,
    model: str,
    step: str,
    batch: dict | list[str],
    devices: int | None = None,
    chip: str = DEFAULT_CHIP,
    device_memory: int | None = None,
    optimizer: str = "adamw",
    rounds: int = 4,
    progress: Any = None,
) -> Improvement:
    """The fewest rule changes to an existing plan that gain the most (``suggest --from``): a
    greedy search over one family's spec at a time (every placement of the plan's own mesh axes on
    its dims), each round keeping the change that saves the most, while it saves at least
    ``MIN_GAIN`` and
    the plan fits ``device_memory``.

    Raises:
        ShardPlanError: an unreadable plan, a model or step that fails, bad arguments.
    """
    import difflib
    from pathlib import Path

    from shardplan.lang.loader import load, read_file

    hw = chips.lookup(chip)
    optimizers.lookup(optimizer)
    budget = device_memory if device_memory is not None else int(hw.hbm_bytes)
    t0 = time.perf_counter()
    base = load(plan_path)
    sizes = base.mesh_shape(devices)
    n = math.prod(sizes.values())
    original = read_file(Path(plan_path))
    base_dir = str(Path(plan_path).resolve().parent)
    coster = api._coster(model, step, api._batch_shapes(batch, "batch"), optimizer)
    roles = coster.roles(n)
    fams = families(roles)
    space = search.Space(fams, dict(roles.sizes), ())
    stacked = set(space.stacked)
    seen: dict[str, tuple[float, int] | None] = {}

    def score(text: str) -> tuple[float, int] | None:
        if text not in seen:
            try:
                plan = loads(text, str(plan_path), base_dir=base_dir, mesh=dict(sizes))
                cost = coster.cost(plan, delta=False)
                seen[text] = (timing.step_time(cost, plan, hw).serial_s, cost.memory.peak)
            except ShardPlanError:
                seen[text] = None
            if progress:
                progress(f"{fmt_count(len(seen), 'plan')} costed")
        return seen[text]

    start = score(original)
    if start is None:
        coster.cost(loads(original, str(plan_path), base_dir=base_dir, mesh=dict(sizes)), delta=False)  # raises
        raise AssertionError("unreachable")
    current_s, current_peak = start
    rules: list[str] = []
    changes: list[Change] = []
    decided: dict[str, str] = {}  # family template -> spec chosen
    import re

    first_path = {
        f.template: next(p.path for p in roles.params if p.shape == f.shape and re.fullmatch(f.template, p.path))
        for f in fams
    }
    axes = {a: s for a, s in sizes.items() if s > 1}
    for _ in range(rounds):
        best: tuple[float, int, str, str, str] | None = None
        for f in fams:
            if sum(u not in stacked for u in f.units) < 2 or f.template in decided:
                continue
            for spec in _options(f, axes, stacked):
                rule = f'param "{f.template}" {spec}'
                got = score(_with_rules(original, rules + [rule]))
                if got is None or got[1] > budget:
                    continue
                if best is None or got[0] < best[0]:
                    best = (got[0], got[1], rule, f.template, spec)
        if best is None or best[0] > (changes[-1].step_s if changes else current_s) * (1 - MIN_GAIN):
            break
        rules.append(best[2])
        decided[best[3]] = best[4]
        changes.append(Change(best[2], _decided(base, first_path[best[3]]), best[0], best[1]))
    text = format_text(_with_rules(original, rules), str(plan_path)) if rules else original
    ends = (original if original.endswith("\n") else original + "\n").splitlines(True)
    diff = "".join(difflib.unified_diff(ends, text.splitlines(True), str(plan_path), "suggested"))
    return Improvement(
        text, diff, tuple(changes), current_s, current_peak, len(seen), time.perf_counter() - t0, hw.name
    )
