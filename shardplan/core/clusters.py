"""Which job this process belongs to, read from the environment the cluster manager set.

Pure and jax-free: :func:`detect` maps environment variables to a :class:`Cluster` (the
manager, the coordinator address, the process count and this process's id), or None when
nothing says the process is part of a multi-process job. ``shardplan.distributed.initialize``
joins what it finds. The rules follow what ``jax.distributed.initialize()`` auto-detects
(SLURM, Open MPI, Cloud TPU), and add what it cannot: Open MPI 5 and MPICH (no launcher
address in the environment), Kubernetes indexed Jobs and JobSets (no API access needed), TPU
slices on GKE, and plain ``JAX_*`` variables. An environment that names a job but lacks what
joining needs is an error that names the variable to set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from shardplan.errors import ShardPlanError, as_error, error

# shardplan launch
ENV_COORDINATOR = "SHARDPLAN_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDPLAN_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDPLAN_PROCESS_ID"
ENV_TIMEOUT = "SHARDPLAN_TIMEOUT"
# JAX's own overrides (jax.distributed reads JAX_COORDINATOR_ADDRESS and JAX_COORDINATOR_PORT)
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
JAX_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
JAX_PROCESS_ID = "JAX_PROCESS_ID"
TPU_PORT = 8476  # the coordinator port JAX uses on TPU slices
K8S_PORT = 8476


@dataclass(frozen=True)
class Cluster:
    """A multi-process job as its manager describes it."""

    manager: str  # "SLURM", "Open MPI", ...
    coordinator: str  # host:port of process 0's coordinator service
    num_processes: int
    process_id: int
    local_process_id: int | None = None  # rank on this node, where the manager says
    variables: tuple[str, ...] = ()  # the environment variables it was read from

    @property
    def port(self) -> str:
        return self.coordinator.rpartition(":")[2]

    def describe(self) -> str:
        return (
            f"{self.manager} job of {self.num_processes} processes, coordinator {self.coordinator} "
            f"(read from {', '.join(self.variables)})"
        )


def _bad_env(manager: str, message: str, hint: str, variable: str) -> ShardPlanError:
    return as_error([error("bad-cluster-env", f"{manager}: {message}", hint, path=f"${variable}")])


def _int(env: Mapping[str, str], name: str, manager: str, minimum: int = 0) -> int:
    text = env.get(name, "").strip()
    if not text.isdigit() or int(text) < minimum:
        raise _bad_env(
            manager,
            f"{name}={text!r} is not a whole number of at least {minimum}",
            f"check the job's environment ({name} is set by the cluster manager)",
            name,
        )
    return int(text)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[001-004,7],gpu2`` -> ``node001``."""
    m = re.match(r"([^,\[]*)(?:\[([^\],-]*)[^\]]*\])?", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        return ""
    return m.group(1) + (m.group(2) or "")


def _coordinator(env: Mapping[str, str], host: str, default_port: int) -> str:
    if env.get(JAX_COORDINATOR_ADDRESS):
        return env[JAX_COORDINATOR_ADDRESS]
    return f"{host}:{env.get(JAX_COORDINATOR_PORT) or default_port}"


_ID_VARS = ("PROCID", "RANK", "INDEX", "PROCESS_ID", "WORKER_ID")


def _checked(c: Cluster) -> Cluster:
    if not 0 <= c.process_id < c.num_processes:
        raise _bad_env(
            c.manager,
            f"process id {c.process_id} is not below the process count {c.num_processes}",
            "check the job's environment",
            next((v for v in c.variables if any(t in v for t in _ID_VARS)), "env"),
        )
    host, sep, port = c.coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad_env(
            c.manager,
            f"the coordinator address '{c.coordinator}' is not host:port",
            f"set {JAX_COORDINATOR_ADDRESS}=<host of process 0>:<free port>",
            JAX_COORDINATOR_ADDRESS,
        )
    return c


def _slurm(env: Mapping[str, str]) -> Cluster | None:
    # A job step (srun) has a step node list; a batch script alone is one process.
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_NODELIST" not in env or "SLURM_PROCID" not in env:
        return None
    m = "SLURM"
    count_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    host = first_host(env["SLURM_STEP_NODELIST"])
    if not host:
        raise _bad_env(
            m, f"cannot read a host from SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']!r}", "", "SLURM_STEP_NODELIST"
        )
    job = _int(env, "SLURM_JOB_ID", m)
    return Cluster(
        m,
        _coordinator(env, host, job % 2**12 + (65535 - 2**12 + 1)),  # JAX's port rule
        _int(env, count_var, m, 1),
        _int(env, "SLURM_PROCID", m),
        _int(env, "SLURM_LOCALID", m) if "SLURM_LOCALID" in env else None,
        ("SLURM_STEP_NODELIST", count_var, "SLURM_PROCID", "SLURM_JOB_ID"),
    )


def _open_mpi(env: Mapping[str, str]) -> Cluster | None:
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
        return None
    m = "Open MPI"
    if env.get("OMPI_COMM_WORLD_SIZE", "").strip() == "1":
        return None  # mpirun -n 1: one process, nothing to join
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    if env.get(JAX_COORDINATOR_ADDRESS):
        coordinator = env[JAX_COORDINATOR_ADDRESS]
    elif uri:  # Open MPI 4: "<jobid>.0;tcp://<launcher ip>,...:<port>"
        ip = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        job = uri.split(".", 1)[0]
        if ip is None or not job.isdigit():
            raise _bad_env(
                m, f"cannot read the launcher's address from OMPI_MCA_orte_hnp_uri={uri!r}", "", "OMPI_MCA_orte_hnp_uri"
            )
        host = next(g for g in ip.groups() if g is not None)
        coordinator = _coordinator(env, host, int(job) // 2**12 % 2**12 + (65535 - 2**12 + 1))
    else:
        raise _bad_env(
            m,
            "Open MPI 5 does not put the launcher's address in the environment",
            f"export {JAX_COORDINATOR_ADDRESS}=<first host>:<free port> and pass it to every rank "
            f"(mpirun -x {JAX_COORDINATOR_ADDRESS} ...)",
            JAX_COORDINATOR_ADDRESS,
        )
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", m) if "OMPI_COMM_WORLD_LOCAL_RANK" in env else None
    return Cluster(
        m,
        coordinator,
        _int(env, "OMPI_COMM_WORLD_SIZE", m, 1),
        _int(env, "OMPI_COMM_WORLD_RANK", m),
        local,
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_MCA_orte_hnp_uri" if uri else JAX_COORDINATOR_ADDRESS),
    )


def _pmi(env: Mapping[str, str]) -> Cluster | None:
    """MPICH, Intel MPI and other Hydra/PMI launchers: rank and size, no coordinator."""
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    m = "MPI (PMI)"
    if env.get("PMI_SIZE", "").strip() == "1":
        return None
    if not env.get(JAX_COORDINATOR_ADDRESS):
        raise _bad_env(
            m,
            "the MPI launcher does not put a coordinator address in the environment",
            f"export {JAX_COORDINATOR_ADDRESS}=<first host>:<free port> for every rank (mpiexec -genv ...)",
            JAX_COORDINATOR_ADDRESS,
        )
    return Cluster(
        m,
        env[JAX_COORDINATOR_ADDRESS],
        _int(env, "PMI_SIZE", m, 1),
        _int(env, "PMI_RANK", m),
        None,
        ("PMI_SIZE", "PMI_RANK", JAX_COORDINATOR_ADDRESS),
    )


def _kubernetes(env: Mapping[str, str]) -> Cluster | None:
    """An indexed Job or a JobSet: the pod's index is its process id."""
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    m = "Kubernetes"
    if JAX_NUM_PROCESSES not in env:
        if not env.get("JOBSET_NAME"):
            return None  # a plain indexed Job without a process count: independent pods (a sweep)
        raise _bad_env(
            m,
            "a JobSet says this pod's index but not how many pods take part",
            f"set {JAX_NUM_PROCESSES} in the pod template to the number of pods in the job",
            JAX_NUM_PROCESSES,
        )
    if env.get("JOB_INDEX", "0").strip() not in ("", "0") and not env.get(JAX_PROCESS_ID):
        raise _bad_env(
            m,
            f"a JobSet with several jobs (JOB_INDEX={env['JOB_INDEX']}): pod indices repeat in every job",
            f"set {JAX_PROCESS_ID} per pod (JOB_INDEX x pods per job + JOB_COMPLETION_INDEX)",
            JAX_PROCESS_ID,
        )
    if env.get(JAX_COORDINATOR_ADDRESS):
        coordinator = env[JAX_COORDINATOR_ADDRESS]
    elif env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME"):
        # JobSet pods are <jobset>-<replicated job>-<job index>-<pod index>.<jobset> (its headless service).
        js = env["JOBSET_NAME"]
        coordinator = _coordinator(env, f"{js}-{env['REPLICATED_JOB_NAME']}-0-0.{js}", K8S_PORT)
    else:
        raise _bad_env(
            m,
            "an indexed Job does not say where process 0 is",
            f"set {JAX_COORDINATOR_ADDRESS} to pod 0's DNS name and a port (<job>-0.<headless service>:{K8S_PORT})",
            JAX_COORDINATOR_ADDRESS,
        )
    return Cluster(
        m,
        coordinator,
        _int(env, JAX_NUM_PROCESSES, m, 1),
        _int(env, JAX_PROCESS_ID if env.get(JAX_PROCESS_ID) else "JOB_COMPLETION_INDEX", m),
        None,
        (
            "JOB_COMPLETION_INDEX",
            JAX_NUM_PROCESSES,
            JAX_COORDINATOR_ADDRESS if env.get(JAX_COORDINATOR_ADDRESS) else "JOBSET_NAME",
        ),
    )


def _tpu_gke(env: Mapping[str, str]) -> Cluster | None:
    if "TPU_WORKER_HOSTNAMES" not in env or "TPU_WORKER_ID" not in env:
        return None
    hosts = [h.strip() for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h.strip()]
    m = "TPU slice (GKE)"
    if not hosts:
        raise _bad_env(m, "TPU_WORKER_HOSTNAMES is empty", "", "TPU_WORKER_HOSTNAMES")
    return Cluster(
        m,
        _coordinator(env, hosts[0], TPU_PORT),
        len(hosts),
        _int(env, "TPU_WORKER_ID", m),
        None,
        ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"),
    )


def _launch(env: Mapping[str, str]) -> Cluster | None:
    if ENV_COORDINATOR not in env:
        return None
    m = "shardplan launch"
    return Cluster(
        m,
        env[ENV_COORDINATOR],
        _int(env, ENV_NUM_PROCESSES, m, 1),
        _int(env, ENV_PROCESS_ID, m),
        None,
        (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
    )


def _explicit(env: Mapping[str, str]) -> Cluster | None:
    if not all(env.get(k) for k in (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)):
        return None
    m = "environment"
    return Cluster(
        m,
        env[JAX_COORDINATOR_ADDRESS],
        _int(env, JAX_NUM_PROCESSES, m, 1),
        _int(env, JAX_PROCESS_ID, m),
        None,
        (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
    )


# In order: shardplan's own launcher, then the managers (a SLURM step that runs mpirun-style
# ranks sets both SLURM and MPI variables; SLURM's describe the step; a GKE TPU Job is also an
# indexed Job, and its TPU variables describe it), then plain JAX_* variables.
DETECTORS = (_launch, _slurm, _open_mpi, _pmi, _tpu_gke, _kubernetes, _explicit)
MANAGERS = ("shardplan launch", "SLURM", "Open MPI", "MPI (PMI)", "TPU slice (GKE)", "Kubernetes", "environment")


def detect(env: Mapping[str, str]) -> Cluster | None:
    """The job this environment describes, or None (a single process, as far as it says).

    Raises:
        ShardPlanError: ``bad-cluster-env``: the environment names a job but cannot be joined
            as it is (a variable missing or malformed); the message names the variable.
    """
    for find in DETECTORS:
        found = find(env)
        if found is not None:
            return _checked(found)
    return None
