"""The README's commands, run as written: the Quick start's (less the install, which CI runs) and
every command block after it, each block in order in one folder, with the package's environment
active as the Quick start leaves it. A command that fails, or that the README shows but this file
does not find, fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST_COMPILE, ROOT

README = (ROOT / "README.md").read_text()
STARTS = ("shardplan ", "python ", "python3 ")


def _joined(lines: list[str]) -> list[str]:
    """Lines with trailing-backslash continuations joined."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith("\\"):
            out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
        else:
            out.append(line.strip())
    return out


def blocks(text: str) -> list[list[str]]:
    """The shell commands of each block: fenced blocks with no language (or bash/sh), and runs of
    4-space indented lines outside fences; only lines that start a command."""
    found: list[list[str]] = []
    fence: str | None = None
    body: list[str] = []
    indented: list[str] = []
    for line in text.splitlines() + [""]:
        if fence is not None:
            if line.startswith("```"):
                if fence in ("", "bash", "sh", "console"):
                    found.append([c for c in _joined(body) if c.startswith(STARTS)])
                fence, body = None, []
            else:
                body.append(line)
            continue
        if line.startswith("```"):
            fence = line[3:].strip()
            continue
        if line.startswith("    ") and line.strip():
            indented.append(line)
            continue
        if indented:
            found.append([c for c in _joined(indented) if c.startswith(STARTS)])
            indented = []
    return [b for b in found if b]


BLOCKS = blocks(README)
CI_TEST_COMMAND = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install -q '\.\[test\]'")


def _without_install(command: str) -> str:
    """The Quick start's command less making the venv and installing into it (this test runs inside
    the installed package): what remains runs as written."""
    parts = command.split(" && ")
    return " && ".join(p for p in parts if not p.startswith("python3 -m venv") and "pip install" not in p)


def test_the_readme_has_the_quick_start_and_the_command_blocks():
    first, second = BLOCKS[0], BLOCKS[1]
    assert len(first) == 1 and "examples/train.py --plan plans/gpt_tp.splan --simulate-devices 8" in first[0]
    assert len(second) == 1 and CI_TEST_COMMAND.match(second[0]), second
    assert all(". .venv/bin/activate" in b[0] for b in (first, second)), "later commands need the venv active"
    assert len(BLOCKS) >= 6 and sum(map(len, BLOCKS)) >= 13


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A working folder like the clone's root: its plans and examples, and the venv the Quick start
    made (the one running these tests)."""
    for name in ("plans", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


def run_block(commands: list[str], cwd: Path, timeout: float = 55) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # The commands set their own devices (--simulate-devices, --devices): no device count here, only
    # the suite's compile flags (tests/conftest.py).
    env["XLA_FLAGS"] = " ".join(FAST_COMPILE)
    for command in commands:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-3000:])
        assert "Traceback" not in r.stdout + r.stderr, (command, r.stderr[-3000:])


def test_quick_start_main_job_runs_as_written(folder):
    command = _without_install(BLOCKS[0][0])
    assert command.startswith(". .venv/bin/activate && python examples/train.py"), command
    run_block([command], folder)


@pytest.mark.parametrize("index", range(2, len(BLOCKS)), ids=[b[0][:60] for b in BLOCKS[2:]])
def test_readme_block_runs_as_written(index, folder):
    run_block(BLOCKS[index], folder)
    if BLOCKS[index][0].startswith("shardplan suggest") and "-o my.splan" in BLOCKS[index][0]:
        # What the README says of it: a plan a compiler confirmed within the budget, its header saying
        # so: data parallel, ranked first by fast mode.
        header = " ".join(line.lstrip("# ") for line in (folder / "my.splan").read_text().splitlines()
                          if line.startswith("#"))
        assert "Compiled by XLA:CPU (exact mode)" in header and "Not confirmed" not in header, header
        assert "This plan: data=8; data parallel" in header, header
