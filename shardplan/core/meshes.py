"""Mesh sizes given from outside the plan file: ``--mesh data=8,model=4`` or ``mesh=``.

Both the command line and the API validate them here: positive sizes, at most one ``*``,
and every axis the plan's specs name present.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

from shardplan.core.plan import LINKS, MAX_DEVICES, MeshAxis, Plan
from shardplan.errors import Diagnostic, Span, as_error, error

MeshSizes = Mapping[str, "int | None"]  # None: a '*' axis, inferred from the device count


def closest(name: str, choices: Iterable[str]) -> str:
    """'did you mean ...?' for the choice nearest ``name``, or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"did you mean '{match[0]}'?" if match else ""


def parse_mesh_arg(text: str) -> dict[str, int | None]:
    """``data=8,model=4`` (or ``data=*,model=2``) -> ordered axis sizes.

    Raises:
        UsageError: the text is not a comma-separated list of name=size with positive
            sizes and at most one ``*``.
    """
    out: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name.isidentifier() or not (size == "*" or (size.isascii() and size.isdigit())):
            raise as_error(
                [
                    error(
                        "bad-mesh-arg",
                        f"cannot read mesh axis '{part}' in '{text}'",
                        "write the mesh as name=size pairs: data=8,model=4 (one size may be *)",
                        path="--mesh",
                    )
                ]
            )
        if name in out:
            raise as_error(
                [
                    error(
                        "bad-mesh-arg",
                        f"mesh axis '{name}' given twice in '{text}'",
                        "give each axis once",
                        path="--mesh",
                    )
                ]
            )
        out[name] = None if size == "*" else int(size)
    if not out:
        raise as_error([error("bad-mesh-arg", "empty mesh", "write e.g. --mesh data=8,model=4", path="--mesh")])
    diags = size_problems(out, "--mesh")
    if diags:
        raise as_error(diags)
    return out


def size_problems(sizes: MeshSizes, where: str) -> list[Diagnostic]:
    diags = []
    for name, size in sizes.items():
        if size is not None and size <= 0:
            diags.append(
                error(
                    "axis-size",
                    f"mesh axis '{name}' has size {size}; sizes must be positive",
                    "use a positive size, or * for the remaining devices",
                    path=f"{where} {name}",
                )
            )
    known = [s for s in sizes.values() if s is not None and s > 0]
    if math.prod(known) > MAX_DEVICES:
        diags.append(
            error(
                "axis-size",
                f"a mesh of {math.prod(known):,} devices; shardplan plans meshes of at most {MAX_DEVICES:,}",
                "check the sizes (a typo with extra digits?)",
                path=where,
            )
        )
    if sum(1 for s in sizes.values() if s is None) > 1:
        diags.append(
            error("two-inferred-sizes", "more than one mesh axis is '*'", "give every axis but one a size", path=where)
        )
    return diags


def mesh_override_problems(plan: Plan, sizes: MeshSizes, where: str = "--mesh") -> list[Diagnostic]:
    """Why ``sizes`` cannot replace the plan's mesh: bad sizes, or axes its specs name missing."""
    diags = size_problems(sizes, where)
    names = tuple(sizes)
    written = ",".join(f"{n}={'*' if s is None else s}" for n, s in sizes.items())
    items: list[tuple[tuple[str, ...], Span | None, str]] = [
        (r.spec.axes, r.spec_span, r.source_line) for r in plan.params + plan.opts + plan.inputs
    ]
    items += [(a.axes, a.span, a.source_line) for a in plan.axes]
    if plan.batch is not None:
        items.append((plan.batch.axes, plan.batch_span, ""))
    if plan.default is not None:
        items.append((plan.default.axes, plan.default_span, ""))
    if plan.cache is not None:
        items.append((plan.cache.axes, plan.cache_span, ""))
    if plan.pipeline is not None:
        items.append(((plan.pipeline.axis,), plan.pipeline.span, plan.pipeline.source_line))
    for axes, span, line in items:
        for a in axes:
            if a not in names:
                near = closest(a, names)
                diags.append(
                    error(
                        "unknown-axis",
                        f"the plan uses mesh axis '{a}', which the mesh {written} lacks",
                        (near + " " if near else "") + "add the axis to the mesh (size 1 keeps it unsplit)",
                        span=span,
                        source_line=line or None,
                    )
                )
    return diags


def with_mesh(plan: Plan, sizes: MeshSizes) -> Plan:
    """The plan on another mesh (e.g. from ``--mesh data=8,model=4``).

    The new mesh replaces the file's; every axis a rule names must still exist in it.

    Raises:
        PlanCheckError: a size is not positive, two sizes are '*', or an axis is missing.
    """
    diags = mesh_override_problems(plan, sizes)
    if diags:
        raise as_error(diags)
    return replace(
        plan,
        mesh=tuple(MeshAxis(n, s, None, {a.name: a.link for a in plan.mesh}.get(n, "ici")) for n, s in sizes.items()),
        mesh_span=None,
        mesh_source_line="",
    )


def parse_links_arg(items: list[str]) -> dict[str, str]:
    """``["data=dcn"]`` (or ``data=dcn,model=ici``) -> {"data": "dcn"}.

    Raises:
        ArgumentError: not name=link with a link in LINKS.
    """
    out: dict[str, str] = {}
    for part in (p.strip() for item in items for p in item.split(",")):
        name, eq, link = part.partition("=")
        if not eq or not name.strip().isidentifier() or link.strip() not in LINKS:
            raise as_error(
                [
                    error(
                        "bad-argument",
                        f"cannot read the link '{part}'",
                        f"write AXIS=LINK with LINK one of {', '.join(LINKS)}: --link data=dcn",
                        path="--link",
                    )
                ]
            )
        out[name.strip()] = link.strip()
    return out


def with_links(plan: Plan, links: dict[str, str]) -> Plan:
    """The plan with some mesh axes' links replaced (``--link data=dcn``).

    Raises:
        ArgumentError: an axis the mesh lacks.
    """
    names = [a.name for a in plan.mesh]
    missing = [n for n in links if n not in names]
    if missing:
        raise as_error(
            [
                error(
                    "bad-argument",
                    f"--link names axis '{missing[0]}', which the mesh lacks",
                    f"the mesh axes are: {', '.join(names)}",
                    path="--link",
                )
            ]
        )
    return replace(plan, mesh=tuple(replace(a, link=links.get(a.name, a.link)) for a in plan.mesh))
