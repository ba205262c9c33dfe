"""Lock files: the layout a plan decides for a model, written down to be reviewed and pinned.

A lock is text, one line per group of leaves (layers with equal shape and spec grouped as
``blocks/*/...  x12``), sorted, so a change reads as a diff in code review. ``check --locked``
resolves again and compares: any line that differs (a new rule, a renamed param, a library
that changed a shape or a regex engine that matches differently) is a ``lock-drift`` error at
the lock file's line. Rule locations are not part of the lock (moving a rule is not a change).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from shardplan.core.format import fmt_shape, layer_group
from shardplan.core.leaves import Decision, Resolution
from shardplan.errors import Diagnostic, Span, error

HEADER = "# shardplan lock"


def lines(res: Resolution) -> list[str]:
    """The lock's body: ``role path [xN] shape dtype spec`` per group, sorted."""
    groups: dict[tuple, list] = {}
    for d in res.decisions:
        key = (d.role, layer_group(d.path), fmt_shape(d.shape), d.dtype, str(d.spec))
        groups.setdefault(key, [d.path, 0])[1] += 1
    out = []
    for (role, path, shape, dtype, spec), (first, n) in groups.items():
        out.append(f"{role:<5} {path + f'  x{n}' if n > 1 else first}  {shape} {dtype}  {spec}")
    return sorted(out)


def text(plan_name: str, mesh: dict[str, int], res: Resolution, command: str) -> str:
    mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
    head = [
        f"{HEADER} of plan {plan_name!r}: the layout it decides, reviewed. Regenerate: {command}",
        f"mesh {mesh_text}",
    ]
    return "\n".join(head + lines(res)) + "\n"


def _body(lock_text: str) -> list[tuple[int, str]]:
    return [(i, ln.rstrip()) for i, ln in enumerate(lock_text.splitlines(), 1) if ln.strip() and not ln.startswith("#")]


def drift(lock_file: str, lock_text: str, mesh: dict[str, int], res: Resolution) -> list[Diagnostic]:
    """Every difference between a lock and the layout resolved now, each at its lock line."""
    want = _body(lock_text)
    mesh_text = "mesh " + ",".join(f"{k}={v}" for k, v in mesh.items())
    have = [mesh_text] + lines(res)
    old = [ln for _, ln in want]
    diags: list[Diagnostic] = []
    matcher = difflib.SequenceMatcher(a=old, b=have, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        line_no = want[i1][0] if i1 < len(want) else (want[-1][0] + 1 if want else 1)
        removed, added = old[i1:i2], have[j1:j2]
        shown = "\n".join([f"- {x}" for x in removed[:6]] + [f"+ {x}" for x in added[:6]])
        more = len(removed) + len(added) - min(len(removed), 6) - min(len(added), 6)
        diags.append(
            error(
                "lock-drift",
                f"the layout drifted from the lock ({len(removed)} line(s) locked, {len(added)} now):\n{shown}"
                + (f"\n  ... and {more} more" if more > 0 else ""),
                "review the change; if it is intended, regenerate the lock (shardplan lock ... -o FILE)",
                span=Span(lock_file, line_no, 1, line_no, 2),
                source_line=lock_text.splitlines()[line_no - 1] if line_no - 1 < len(lock_text.splitlines()) else "",
            )
        )
    return diags


def replicated_fraction(decisions: Iterable[Decision]) -> tuple[float, list[Decision]]:
    """The fraction of param bytes left whole on every device, and those params (largest first)."""
    params = [d for d in decisions if d.role == "param"]
    total = sum(d.nbytes for d in params)
    whole = sorted((d for d in params if d.shard_shape == d.shape), key=lambda d: -d.nbytes)
    return (sum(d.nbytes for d in whole) / total if total else 0.0), whole
