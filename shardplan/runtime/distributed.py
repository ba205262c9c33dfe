"""Multi-process runs: join the job the cluster manager (or ``shardplan launch``) started.

A training script calls :func:`initialize` first thing, before any JAX computation. It reads
the job from the environment (``shardplan.core.clusters.detect``: SLURM steps, Open MPI and
other MPI launchers, Kubernetes indexed Jobs and JobSets, TPU slices, ``shardplan launch``,
plain ``JAX_*`` variables), joins it through ``jax.distributed.initialize`` and says what it
joined, once, from process 0. A process that is one of several but did not join is refused by
:func:`require_joined` (``make_mesh`` calls it), so a job never silently trains as N
independent single-process runs. On CPU the collectives go through gloo.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping

from shardplan.core import clusters
from shardplan.core.clusters import (  # re-exported: the launcher sets these
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TIMEOUT,
    Cluster,
)
from shardplan.errors import ShardPlanError, as_error, error

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_TIMEOUT",
    "Cluster",
    "detect",
    "initialize",
    "launched",
    "process_slice",
    "require_joined",
]

DEFAULT_TIMEOUT_S = 300
HELLO_TIMEOUT_S = 5.0
_joined: list[Cluster] = []


def launched() -> bool:
    """True inside a rank started by ``shardplan launch``."""
    return ENV_COORDINATOR in os.environ


def detect(env: Mapping[str, str] | None = None) -> Cluster | None:
    """The multi-process job this process's environment describes (None: a single process)."""
    return clusters.detect(os.environ if env is None else env)


def _timeout(timeout_s: int | None) -> int:
    text = os.environ.get(ENV_TIMEOUT, "")
    if timeout_s is None and text:
        if not text.isdigit() or int(text) < 1:
            raise as_error(
                [
                    error(
                        "bad-cluster-env",
                        f"{ENV_TIMEOUT}={text!r} is not a positive number of seconds",
                        "",
                        path=f"${ENV_TIMEOUT}",
                    )
                ]
            )
        return int(text)
    return int(timeout_s or DEFAULT_TIMEOUT_S)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int | None = None,
    quiet: bool = False,
) -> Cluster | None:
    """Join the multi-process job this process belongs to; a no-op for a single process.

    Args:
        coordinator, num_processes, process_id: explicit values; each overrides what the
            environment says (all three make a job without any manager).
        timeout_s: how long to wait for every process to join, and the heartbeat timeout
            after which a silent process counts as dead (default: $SHARDPLAN_TIMEOUT, else 300).
        quiet: do not print the one line (process 0) that says what was joined.

    Returns:
        The job joined, or None when this is a single process.

    Raises:
        ShardPlanError: ``bad-cluster-env`` when the environment names a job that cannot be
            joined as it is; ``cannot-join`` when joining fails or times out (the manager, the
            coordinator and the process are named).
    """
    if _joined:
        return _joined[0]
    given = (coordinator, num_processes, process_id)
    # Complete explicit arguments need nothing from the environment (which may be garbled).
    found = None if None not in given else detect()
    if any(v is not None for v in given):
        if found is None and None in given:
            raise as_error(
                [
                    error(
                        "bad-cluster-env",
                        "explicit arguments name part of a job and the environment names none",
                        "pass coordinator, num_processes and process_id together",
                        path="initialize()",
                    )
                ]
            )
        base = found or Cluster("explicit arguments", "", 0, 0)
        found = clusters._checked(
            Cluster(
                base.manager if found else "explicit arguments",
                coordinator or base.coordinator,
                num_processes if num_processes is not None else base.num_processes,
                process_id if process_id is not None else base.process_id,
                base.local_process_id,
                base.variables,
            )
        )
    if found is None or found.num_processes == 1:
        return None
    import jax

    if jax.distributed.is_initialized():
        _joined.append(found)
        return found
    timeout = _timeout(timeout_s)
    _rendezvous(found, timeout)  # clean errors for what would abort inside the runtime
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            found.coordinator,
            found.num_processes,
            found.process_id,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=timeout,
        )
        jax.devices()  # the first call waits for every process's devices: a failure shows here
    except Exception as e:  # XlaRuntimeError, RuntimeError, ValueError from the runtime
        host = found.coordinator.rpartition(":")[0]
        raise as_error(
            [
                error(
                    "cannot-join",
                    f"joining the {found.manager} job as process {found.process_id} of {found.num_processes} "
                    f"(coordinator {found.coordinator}) failed within {timeout} s: "
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                    f"check that all {found.num_processes} processes started, that '{host}' resolves and port "
                    f"{found.port} is free on it and reachable from every node (set JAX_COORDINATOR_PORT to "
                    f"move it); {ENV_TIMEOUT} sets the wait",
                    path=f"process {found.process_id}",
                )
            ]
        ) from None
    _joined.append(found)
    if jax.process_index() == 0 and not quiet:
        print(
            f"shardplan: joined a {found.describe()}: {jax.process_count()} processes, "
            f"{jax.device_count()} {jax.devices()[0].platform} devices",
            file=sys.stderr,
            flush=True,
        )
    return found


def _cannot_join(found: Cluster, what: str, hint: str) -> ShardPlanError:
    return as_error(
        [
            error(
                "cannot-join",
                f"joining the {found.manager} job as process {found.process_id} of {found.num_processes} "
                f"(coordinator {found.coordinator}): {what}",
                hint,
                path=f"process {found.process_id}",
            )
        ]
    )


def _rendezvous(found: Cluster, timeout: int) -> None:
    """Meet every process on the coordinator's port before JAX does.

    The JAX runtime aborts the process (no Python exception) when it cannot reach the
    coordinator or a peer never comes, so the failures users hit most are checked first, each a
    ``cannot-join`` error within ``timeout``: a host that does not resolve, a coordinator that is
    not this machine for process 0, a port taken, processes missing or disagreeing on the job.
    Process 0 listens on the port, the others connect and say who they are; once all are there,
    process 0 says go, the others close first (so the port is free again) and JAX starts its
    coordinator on it.
    """
    host, _, port_text = found.coordinator.rpartition(":")
    host = host.strip("[]")
    port = int(port_text)
    deadline = time.monotonic() + timeout
    while True:  # a pod's DNS name appears only once the pod exists: peers retry until the deadline
        try:
            addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise _cannot_join(
                    found,
                    f"the coordinator host '{host}' does not resolve ({e.strerror or e}) within {timeout} s",
                    "check the host of process 0 in the job's environment (e.g. SLURM_STEP_NODELIST, "
                    f"JAX_COORDINATOR_ADDRESS); {ENV_TIMEOUT} sets how long the processes wait for it",
                ) from None
            time.sleep(0.5)
    if found.process_id == 0:
        _serve(found, port, addrs, deadline, timeout)
    else:
        _join(found, host, port, deadline, timeout)


def _serve(found: Cluster, port: int, addrs: set[str], deadline: float, timeout: int) -> None:
    if not any(_is_local(a) for a in addrs):
        raise _cannot_join(
            found,
            f"this is process 0, which runs the coordinator, but '{found.coordinator}' is not this machine "
            f"({socket.gethostname()})",
            "point the coordinator address at the host of process 0",
        )
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port), family=socket.AF_INET)
    except OSError as e:
        raise _cannot_join(
            found,
            f"port {port} cannot be opened on process 0's host ({e.strerror or e})",
            "set JAX_COORDINATOR_PORT to a free port for every process",
        ) from None
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < found.num_processes - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, found.num_processes)) - set(peers))
                raise _cannot_join(
                    found,
                    f"only {len(peers) + 1} of {found.num_processes} processes arrived within {timeout} s "
                    f"(missing: {', '.join(map(str, missing[:16]))})",
                    "check that the job started every process and that they can reach this host's port "
                    f"{port}; {ENV_TIMEOUT} sets the wait",
                ) from None
            # A peer says hello at once; a silent connection (a port scan, a health probe) is
            # dropped after a few seconds instead of holding the rendezvous.
            conn.settimeout(min(HELLO_TIMEOUT_S, max(deadline - time.monotonic(), 0.01)))
            try:
                hello = conn.makefile().readline(200).split()
            except (OSError, UnicodeDecodeError):
                conn.close()
                continue
            if len(hello) != 3 or hello[0] != "shardplan-join" or not (hello[1].isdigit() and hello[2].isdigit()):
                conn.close()  # something else knocked on the port: not one of ours
                continue
            n, pid = int(hello[1]), int(hello[2])
            if pid in peers and n == found.num_processes:  # a restarted peer: the new connection wins
                peers.pop(pid).close()
            if n != found.num_processes or not 0 < pid < n:
                conn.sendall(b"refused\n")
                conn.close()
                raise _cannot_join(
                    found,
                    f"a process says it is {pid} of {n}, which does not fit this job of {found.num_processes}",
                    "every process of the job must see the same process count and distinct process ids",
                )
            peers[pid] = conn
        for conn in peers.values():
            conn.sendall(b"go\n")
        for conn in peers.values():  # wait for each peer to close first: the port stays reusable
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            try:
                conn.recv(1)
            except OSError:
                pass
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def _join(found: Cluster, host: str, port: int, deadline: float, timeout: int) -> None:
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise _cannot_join(
                    found,
                    f"nothing answered on {host}:{port} within {timeout} s",
                    "check that process 0 started and runs on that host, and that the port is reachable "
                    f"from here (firewalls); {ENV_TIMEOUT} sets the wait",
                ) from None
            time.sleep(0.2)
    with conn:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            conn.sendall(f"shardplan-join {found.num_processes} {found.process_id}\n".encode())
            reply = conn.makefile().readline().strip()
        except OSError:
            reply = ""
        if reply != "go":
            raise _cannot_join(
                found,
                "process 0 refused this process"
                if reply == "refused"
                else f"process 0 did not say go within {timeout} s",
                "see process 0's error: every process must agree on the job",
            )


def _is_local(addr: str) -> bool:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def require_joined() -> None:
    """Refuse to go on as one process of several that did not join their job.

    Raises:
        ShardPlanError: ``not-joined``, naming the manager, the process and what to call.
    """
    found = detect()
    if found is None or found.num_processes == 1:
        return
    import jax

    if jax.distributed.is_initialized() and jax.process_count() == found.num_processes:
        return
    raise as_error(
        [
            error(
                "not-joined",
                f"this is process {found.process_id} of a {found.num_processes}-process {found.manager} job, "
                f"but JAX runs it as {jax.process_count()} of {jax.process_count()}: every process would train "
                "its own copy of the model",
                "call shardplan.distributed.initialize() first thing in the script, before any JAX computation",
                path=f"process {found.process_id}",
            )
        ]
    )


def process_slice(global_batch: int) -> slice:
    """The rows of a global batch that this process feeds (contiguous, by process index)."""
    import jax

    n, i = jax.process_count(), jax.process_index()
    if global_batch % n:
        raise as_error(
            [
                error(
                    "indivisible",
                    f"a global batch of {global_batch} does not divide over {n} processes",
                    f"use a batch size that is a multiple of {n}",
                    path="batch",
                )
            ]
        )
    per = global_batch // n
    return slice(i * per, (i + 1) * per)
