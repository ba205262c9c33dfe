"""Source emission: a plan lowered to a standalone, readable Python module.

The module imports only jax, flax, optax, numpy and the standard library, and spells every
spec out. It exposes ``make_mesh()``, ``place(model, optimizer, mesh)``,
``shard_batch(batch, mesh)`` and ``make_train_step(model, optimizer, loss_fn, mesh)`` ->
``step(model, optimizer, batch)``. For the shard_map backend that step is the runtime's
partitioned one (a copy of ``shardplan/runtime/partition/`` is appended), and
``make_gather_whole_step`` spells the plan's param collectives out, one per line with why.
"""

from __future__ import annotations

import re
from importlib import resources

from shardplan.core import backends
from shardplan.core.leaves import Resolution
from shardplan.core.lowering import Collective, Lowering
from shardplan.core.plan import Plan
from shardplan.core.spec import Spec


def _template(name: str) -> str:
    return resources.files("shardplan.tools").joinpath("templates", name).read_text()


def _p(spec: Spec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec.entries) + ")"


def _table(name: str, res: Resolution, comment: str) -> list[str]:
    out = [f"# {comment}", f"{name} = {{"]
    for d in res.decisions:
        out.append(f"    {d.path!r}: {_p(d.spec)},  # {d.shape} -> {d.shard_shape} ({d.how}: {d.origin})")
    out.append("}")
    return out


def _axes(c: Collective) -> str:
    return repr(c.axes[0]) if len(c.axes) == 1 else repr(tuple(c.axes))


def _gather_lines(lowering: Lowering) -> list[str]:
    lines = []
    for p in lowering.params:
        shape = list(p.shard_shape)
        for c in p.gather:
            before = tuple(shape)
            shape[c.dim] = p.shape[c.dim]
            lines.append(
                f"    p[{p.path!r}] = jax.lax.all_gather(p[{p.path!r}], {_axes(c)}, axis={c.dim}, "
                f"tiled=True, to='invarying')  # {before} -> {tuple(shape)}: {c.why}"
            )
    return lines or ["    pass  # every param is replicated: nothing to gather"]


def _reduce_lines(lowering: Lowering) -> list[str]:
    lines = []
    for p in lowering.params:
        shape = list(p.shape)
        k = repr(p.path)
        for c in p.reduce:
            if c.kind == "psum_scatter":
                shape[c.dim] //= lowering.mesh[c.axes[0]]
                lines.append(
                    f"    g[{k}] = jax.lax.psum_scatter(g[{k}], {c.axes[0]!r}, scatter_dimension={c.dim}, "
                    f"tiled=True)  # -> {tuple(shape)}: {c.why}"
                )
            elif c.kind == "slice":
                size = shape[c.dim] // lowering.mesh[c.axes[0]]
                shape[c.dim] = size
                lines.append(
                    f"    g[{k}] = jax.lax.dynamic_slice_in_dim(g[{k}], jax.lax.axis_index({c.axes[0]!r}) "
                    f"* {size}, {size}, axis={c.dim})  # -> {tuple(shape)}: {c.why}"
                )
            else:
                lines.append(f"    g[{k}] = jax.lax.psum(g[{k}], {tuple(c.axes)!r})  # {c.why}")
    return lines or ["    pass  # no batch axes: nothing to reduce"]


def emit(plan: Plan, params: Resolution, opt: Resolution, lowering: Lowering, backend: str) -> str:
    """The standalone module's source text for a backend registered in ``shardplan.core.backends``."""
    info = backends.lookup(backend)
    mesh = params.mesh
    batch_spec = _p(plan.batch) if plan.batch is not None else "P()"
    rules = "[" + ", ".join(f"({r.pattern!r}, {_p(r.spec)})" for r in plan.inputs) + "]"
    parts = [
        _template("header.py.tmpl").format(
            title=f"Plan {plan.name or plan.files[0]!r} lowered to the {backend} backend.",
            files=", ".join(plan.files),
            name=plan.name,
            backend=backend,
            mesh=", ".join(f"{k}={v}" for k, v in mesh.items()),
            axes=tuple(mesh),
            shape=tuple(mesh.values()),
            batch_axes=lowering.batch_axes,
            batch_spec=batch_spec,
            input_rules=rules,
        )
    ]
    parts.append(
        "\n".join(
            _table("PARAM_SPECS", params, "Param path -> spec: global shape -> per-device shard (what decided it)")
        )
    )
    parts.append(
        "\n" + "\n".join(_table("OPT_SPECS", opt, "Optimizer-state path -> spec (Adam's mu/nu mirror their param)"))
    )
    parts.append("\n\n" + _template("common.py.tmpl"))
    parts.append(
        "\n\n"
        + _template(info.template).format(
            gathers="\n".join(_gather_lines(lowering)),
            reduces="\n".join(_reduce_lines(lowering)),
            n_batch=lowering.batch_axis_size,
        )
    )
    if backend == "shard_map":
        parts.append("\n\n" + _partitioner_source())
    return "\n".join(parts).rstrip() + "\n"


# The partitioner's files, in the order its module's names are defined (``runtime/partition/``).
PARTITIONER_FILES = (
    "values.py",
    "partitioner.py",
    "ops_layout.py",
    "ops_contract.py",
    "ops_lookup.py",
    "ops_control.py",
    "program.py",
)


def _partitioner_source() -> str:
    """shardplan's partitioner (``shardplan/runtime/partition/``: its files in order, after the
    ledger, the primitive catalogue and the sharding floor it imports), copied in so the module
    stays standalone; source lines of ops are not looked up there (reports only)."""
    carried = re.compile(
        r"^from shardplan\.(ledger|runtime\.sharding|runtime\.primitives|runtime\.partition\.\w+) import "
        r"(\([^)]*\)|[^\n]+)\n",
        re.M,
    )

    def copied(path: str, where: str = "shardplan.runtime") -> str:  # less what is copied above it
        text = resources.files(where).joinpath(*path.split("/")).read_text()
        return carried.sub("", text.replace("from __future__ import annotations\n", ""))

    def part(name: str) -> str:
        text = copied("partition/" + name)  # read as a file: the package is not imported
        if "def _source(" in text:  # no source lines in the emitted module
            start = text.index("def _source(")
            end = text.index("\n\n\n", start)
            text = text[:start] + 'def _source(eqn: Any) -> str:\n    return ""' + text[end:]
        return f"\n\n# -- shardplan/runtime/partition/{name} " + "-" * (60 - len(name)) + "\n" + text

    ledger = copied("ledger.py", "shardplan")
    catalogue, floor = copied("primitives.py"), copied("sharding.py")
    return (
        "# -- the collective ledger: a copy of shardplan/ledger.py "
        + "-" * 36
        + "\n"
        + ledger
        + "\n\n# -- the primitive catalogue: a copy of shardplan/runtime/primitives.py "
        + "-" * 21
        + "\n"
        + catalogue
        + "\n\n# -- the sharding floor: a copy of shardplan/runtime/sharding.py "
        + "-" * 28
        + "\n"
        + floor
        + "\n\n# -- the partitioner: a copy of shardplan/runtime/partition/ "
        + "-" * 32
        + "".join(part(name) for name in PARTITIONER_FILES)
    )
