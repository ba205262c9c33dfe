"""Reading plan files: text -> parse -> follow ``extends`` -> check. The public entry points."""

from __future__ import annotations

import os
from pathlib import Path

from shardplan import ast
from shardplan.checker import check
from shardplan.errors import PlanCheckError, Span, error
from shardplan.parser import parse
from shardplan.plan import Plan

MAX_EXTENDS_DEPTH = 32


def _read(path: Path, span: Span | None, line: str | None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise PlanCheckError([error("cannot-read", f"cannot read plan file '{path}': {reason}",
                                    "check the path (a base in 'extends' is relative to the file "
                                    "that names it)", span=span, path=None if span else str(path),
                                    source_line=line)]) from None


def _chain(module: ast.Module, base_dir: Path) -> tuple[ast.Module, ...]:
    """The module and every base it extends, nearest first."""
    chain = [module]
    seen = {os.path.abspath(module.file)}
    while True:
        m, where = chain[-1], base_dir if len(chain) == 1 else Path(chain[-1].file).parent
        ext = [s for s in m.statements if isinstance(s, ast.Extends)]
        if not ext:
            return tuple(chain)
        if len(ext) > 1:
            raise PlanCheckError([error("duplicate-statement", "'extends' given twice in one file",
                                        "a plan extends one base; let the base extend another",
                                        span=ext[1].span, source_line=m.line(ext[1].span.line))])
        target = (where / ext[0].path)
        key = os.path.abspath(target)
        if key in seen or len(chain) > MAX_EXTENDS_DEPTH:
            raise PlanCheckError([error("extends-cycle", f"'{ext[0].path}' is already part of this "
                                        "chain of extends", "remove the cycle: a plan cannot extend "
                                        "itself, directly or through its bases",
                                        span=ext[0].span, source_line=m.line(ext[0].span.line))])
        seen.add(key)
        text = _read(target, ext[0].span, m.line(ext[0].span.line))
        chain.append(parse(text, str(target)))


def loads(text: str, file: str = "<string>", *, base_dir: str | os.PathLike | None = None,
          mesh: dict[str, int | None] | None = None) -> Plan:
    """Parse and check plan text.

    Args:
        text: the plan source.
        file: the name diagnostics use for it.
        base_dir: where ``extends`` paths are looked up (default: the current directory).
        mesh: axis sizes that replace the plan's mesh (``None`` for a ``*`` axis).

    Raises:
        ShardPlanError: every problem found, each located.
    """
    module = parse(text, file)
    return check(_chain(module, Path(base_dir) if base_dir else Path.cwd()), mesh_override=mesh)


def load(path: str | os.PathLike, *, mesh: dict[str, int | None] | None = None) -> Plan:
    """Read, parse and check a ``.splan`` file (and the bases it ``extends``)."""
    p = Path(path)
    text = _read(p, None, None)
    return loads(text, str(path), base_dir=p.parent, mesh=mesh)


def parse_mesh_arg(text: str) -> dict[str, int | None]:
    """``data=8,model=4`` (or ``data=*,model=2``) -> ordered axis sizes.

    Raises:
        ShardPlanError: the text is not a comma-separated list of name=size.
    """
    out: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name.isidentifier() or not (size == "*" or size.isdigit()):
            raise PlanCheckError([error("bad-mesh-arg", f"cannot read mesh axis '{part}' in '{text}'",
                                        "write the mesh as name=size pairs: data=8,model=4 "
                                        "(one size may be *)", path="--mesh")])
        if name in out:
            raise PlanCheckError([error("duplicate-axis", f"mesh axis '{name}' given twice in '{text}'",
                                        "give each axis once", path="--mesh")])
        out[name] = None if size == "*" else int(size)
    if not out:
        raise PlanCheckError([error("bad-mesh-arg", "empty mesh", "write e.g. --mesh data=8,model=4",
                                    path="--mesh")])
    return out
