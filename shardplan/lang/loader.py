"""Reading plans: text -> parse -> follow ``extends`` -> check. The public entry points."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from shardplan.core.meshes import MeshSizes
from shardplan.core.plan import Plan
from shardplan.errors import PlanCheckError, Span, error
from shardplan.lang import syntax
from shardplan.lang.checker import check
from shardplan.lang.parser import parse

MAX_EXTENDS_DEPTH = 32
MAX_PLAN_BYTES = 16 * 2**20  # a plan file is text a person wrote; refuse devices and huge files

# Reads one plan file: (path, the extends span naming it, that span's line) -> text.
Reader = Callable[[Path, "Span | None", "str | None"], str]


def _cannot_read(path: Path, reason: str, span: Span | None, line: str | None) -> PlanCheckError:
    return PlanCheckError(
        [
            error(
                "cannot-read",
                f"cannot read plan file '{path}': {reason}",
                "check the path (a base in 'extends' is relative to the file that names it)",
                span=span,
                path=None if span else str(path),
                source_line=line,
            )
        ]
    )


def _not_utf8(path: Path, data: bytes, e: UnicodeDecodeError) -> PlanCheckError:
    """The first byte that is not UTF-8, located at its line and column in the file."""
    start = data.rfind(b"\n", 0, e.start) + 1
    end = data.find(b"\n", e.start)
    line_no = data.count(b"\n", 0, e.start) + 1
    line = data[start : end if end >= 0 else len(data)][:4096].decode("utf-8", "replace")
    col = len(data[start : e.start].decode("utf-8", "replace")) + 1
    return PlanCheckError(
        [
            error(
                "cannot-read",
                f"'{path}' is not UTF-8 text (byte 0x{data[e.start]:02x})",
                "save the plan as UTF-8",
                span=Span(str(path), line_no, col, line_no, col + 1),
                source_line=line,
            )
        ]
    )


def read_file(path: Path, span: Span | None = None, line: str | None = None) -> str:
    """A plan file's text: a regular file of at most MAX_PLAN_BYTES, UTF-8."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _cannot_read(path, "not a regular file", span, line)
        if st.st_size > MAX_PLAN_BYTES:
            raise _cannot_read(path, f"{st.st_size:,} bytes; a plan is at most {MAX_PLAN_BYTES:,}", span, line)
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
        try:
            return data.decode("utf-8").removeprefix("\ufeff")  # a BOM is not part of the plan
        except UnicodeDecodeError as e:
            raise _not_utf8(path, data, e) from None
    except OSError as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise _cannot_read(path, reason, span, line) from None


def _chain(module: syntax.Module, base_dir: Path, read: Reader) -> tuple[syntax.Module, ...]:
    """The module and every base it extends, nearest first."""
    chain = [module]
    seen = {os.path.abspath(module.file)}
    while True:
        m, where = chain[-1], base_dir if len(chain) == 1 else Path(chain[-1].file).parent
        ext = [s for s in m.statements if isinstance(s, syntax.Extends)]
        if not ext:
            return tuple(chain)
        if len(ext) > 1:
            raise PlanCheckError(
                [
                    error(
                        "duplicate-statement",
                        "'extends' given twice in one file",
                        "a plan extends one base; let the base extend another",
                        span=ext[1].span,
                        source_line=m.line(ext[1].span.line),
                    )
                ]
            )
        target = where / ext[0].path
        key = os.path.abspath(target)
        if len(chain) > MAX_EXTENDS_DEPTH:
            raise PlanCheckError(
                [
                    error(
                        "extends-too-deep",
                        f"the chain of extends is deeper than {MAX_EXTENDS_DEPTH} files",
                        "flatten the chain: let a plan extend a base that holds the shared rules",
                        span=ext[0].span,
                        source_line=m.line(ext[0].span.line),
                    )
                ]
            )
        if key in seen:
            raise PlanCheckError(
                [
                    error(
                        "extends-cycle",
                        f"'{ext[0].path}' is already part of this chain of extends",
                        "remove the cycle: a plan cannot extend itself, directly or through its bases",
                        span=ext[0].span,
                        source_line=m.line(ext[0].span.line),
                    )
                ]
            )
        seen.add(key)
        if target.suffix != ".splan" and read is read_file:
            # The policy: a base is a plan file. Never open a .env, a key or /etc/passwd because
            # a plan names it, and so never echo a line of one in a diagnostic.
            raise PlanCheckError(
                [
                    error(
                        "bad-extends",
                        f"'{ext[0].path}' is not a .splan file; a plan extends only plan files",
                        "name a .splan file (bases may live anywhere, e.g. a shared ../common/base.splan)",
                        span=ext[0].span,
                        source_line=m.line(ext[0].span.line),
                    )
                ]
            )
        text = read(target, ext[0].span, m.line(ext[0].span.line))
        chain.append(parse(text, str(target)))


def loads(
    text: str,
    file: str = "<string>",
    *,
    base_dir: str | os.PathLike | None = None,
    mesh: MeshSizes | None = None,
    read: Reader = read_file,
) -> Plan:
    """Parse and check plan text.

    Args:
        text: the plan source.
        file: the name diagnostics use for it.
        base_dir: where ``extends`` paths are looked up (default: the current directory).
        mesh: axis sizes that replace the plan's mesh (``None`` for a ``*`` axis).
        read: how a base named by ``extends`` is read (default: from the file system).

    Raises:
        ShardPlanError: every problem found, each located.
    """
    module = parse(text.removeprefix("\ufeff"), file)
    return check(_chain(module, Path(base_dir) if base_dir else Path.cwd(), read), mesh_override=mesh)


def load(path: str | os.PathLike, *, mesh: MeshSizes | None = None) -> Plan:
    """Read, parse and check a ``.splan`` file (and the bases it ``extends``)."""
    p = Path(path)
    return loads(read_file(p), str(path), base_dir=p.parent, mesh=mesh)


def load_sources(sources: Mapping[str, str] | tuple[tuple[str, str], ...], *, mesh: MeshSizes | None = None) -> Plan:
    """Rebuild a plan from stored texts (``Plan.sources``: the plan's file first, then each
    base), e.g. from a checkpoint; nothing is read from disk."""
    items = tuple(sources.items()) if isinstance(sources, Mapping) else tuple(sources)
    if not items:
        raise PlanCheckError([error("cannot-read", "no plan text stored", "store Plan.sources", path="<plan>")])
    texts = {os.path.normpath(f): t for f, t in items}

    def read(path: Path, span: Span | None, line: str | None) -> str:
        text = texts.get(os.path.normpath(path))
        if text is None:
            raise _cannot_read(path, "not among the stored plan files", span, line)
        return text

    file, text = items[0]
    return loads(text, file, base_dir=Path(file).parent, mesh=mesh, read=read)
