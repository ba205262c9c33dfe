"""``shardplan launch``: N ranks of a command on this machine, under jax.distributed.

Each rank gets simulated CPU devices and gloo collectives on 127.0.0.1 at a free port.
Output lines are prefixed with the rank. The launch fails (non-zero) if any rank fails;
when one rank dies, the others get ``failure_grace_s`` to finish, then are killed, so a
rank blocked in a collective with a dead peer never hangs the job.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from shardplan.errors import LaunchError, error
from shardplan.runtime import devices, distributed


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None  # None: killed by the launcher
    killed: bool


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# Gloo's own note, printed by its C++ code on stdout (unbuffered apart from Python's, so it can land
# inside another line) once per communicator a rank builds: noise to a user, a dozen lines a run.
GLOO_NOTE = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"
)


# What importing jax prints on a host without a GPU where the CUDA plugin is installed
# (``shardplan[gpu]``, for compiling for GPUs offline): the plugin's note that it found no driver,
# after absl's note that it logs before being set up; once per process, and no rank here uses a GPU.
NATIVE_NOTES = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, "
    r"GPU will not be used\.)\s*$"
)


def _pump(stream, rank: int, out: TextIO, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, ""):
        line = GLOO_NOTE.sub("", raw)
        if (raw != line and not line.strip()) or NATIVE_NOTES.match(raw):
            continue
        with lock:
            out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
            out.flush()
    stream.close()


def launch(
    command: Sequence[str],
    n: int,
    devices_per_process: int,
    *,
    failure_grace_s: float = 10.0,
    timeout_s: float | None = None,
    out: TextIO = sys.stdout,
) -> tuple[int, list[RankResult], str]:
    """Run ``command`` as ``n`` ranks. Returns (exit code, per-rank results, summary line)."""
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    base = dict(os.environ)  # the user's XLA_FLAGS reach every rank; simulate() replaces only the device count
    # Ctrl-C or SIGTERM on the launcher stops every rank (each runs in its own process group,
    # so the terminal's SIGINT does not reach them): none outlives the launcher. Caught from
    # before the first rank starts (a signal while they start is not a launcher killed outright).
    interrupted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: interrupted.append(signum))
    try:
        for rank in range(n):
            env = dict(base)
            env.update(
                {
                    distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                    distributed.ENV_NUM_PROCESSES: str(n),
                    distributed.ENV_PROCESS_ID: str(rank),
                    distributed.ENV_TIMEOUT: str(int(max(failure_grace_s, 5))),
                    "JAX_PLATFORMS": "cpu",
                    "PYTHONUNBUFFERED": "1",
                }
            )
            devices.simulate(devices_per_process, env)
            try:
                p = subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            except OSError as e:
                for q in procs:
                    _kill(q)
                raise LaunchError(
                    [
                        error(
                            "cannot-launch",
                            f"cannot run {command[0]!r}: {e.strerror or e}",
                            "give an executable, e.g. python script.py",
                            path="command",
                        )
                    ]
                ) from None
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, rank, out, lock), daemon=True)
            t.start()
            pumps.append(t)

        start = time.monotonic()
        first_failure: tuple[int, int] | None = None
        failed_at = None
        killed: set[int] = set()
        code, summary = _supervise(
            procs, first_failure, failed_at, killed, interrupted, start, failure_grace_s, timeout_s, n
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=5)
    results = [RankResult(r, None if r in killed else p.returncode, r in killed) for r, p in enumerate(procs)]
    return code, results, summary


def _supervise(
    procs: list[subprocess.Popen],
    first_failure: tuple[int, int] | None,
    failed_at: float | None,
    killed: set[int],
    interrupted: list[int],
    start: float,
    failure_grace_s: float,
    timeout_s: float | None,
    n: int,
) -> tuple[int, str]:
    while True:
        if interrupted:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    killed.add(rank)
                    _kill(p)
            name = signal.Signals(interrupted[0]).name
            stopped = f"; ranks {', '.join(map(str, sorted(killed)))} stopped" if killed else ""
            return 128 + interrupted[0], f"interrupted by {name}{stopped}"
        codes = [p.poll() for p in procs]
        if first_failure is None:
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    first_failure, failed_at = (rank, code), time.monotonic()
                    break
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        over_grace = failed_at is not None and now - failed_at > failure_grace_s
        over_time = timeout_s is not None and now - start > timeout_s
        if over_grace or over_time:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    killed.add(rank)
                    _kill(p)
            for p in procs:
                p.wait()
            break
        time.sleep(0.05)
    if first_failure is not None:
        rank, code = first_failure
        summary = f"rank {rank} {_describe(code)}"
        if killed:
            summary += (
                f"; ranks {', '.join(map(str, sorted(killed)))} stopped by the launcher after {failure_grace_s:g} s"
            )
        return 1, summary
    if killed:
        return 1, f"timed out after {timeout_s:g} s; ranks {', '.join(map(str, sorted(killed)))} killed"
    return 0, f"all {n} ranks exited 0"


def _kill(p: subprocess.Popen) -> None:
    """SIGTERM the rank's whole process group, then SIGKILL what is left."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=3)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
