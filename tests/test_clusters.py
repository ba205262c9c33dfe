"""Reading the job from a cluster manager's environment (pure: environment dicts in, Cluster out)."""

import pytest

import shardplan
from shardplan.core.clusters import Cluster, detect, first_host


def test_nothing_in_the_environment_is_a_single_process():
    assert detect({"HOME": "/root", "PATH": "/bin"}) is None
    # An sbatch script itself (no srun step) is one process, whatever SLURM_NTASKS says.
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize("nodelist, host", [("node001", "node001"), ("node001,gpu2", "node001"),
                                            ("node[001-004],gpu2", "node001"), ("node[007,009-012]", "node007"),
                                            ("10.0.0.5", "10.0.0.5"), ("gpu-a100-[3-5]", "gpu-a100-3")])
def test_slurm_node_lists(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_step():
    env = {"SLURM_JOB_ID": "123457", "SLURM_STEP_NODELIST": "gpu[017-020]", "SLURM_NTASKS": "32",
           "SLURM_STEP_NUM_TASKS": "32", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    c = detect(env)
    # JAX's port rule: job id mod 4096 in the top 4096 ports.
    assert c == Cluster("SLURM", f"gpu017:{123457 % 4096 + 61440}", 32, 9, 1, c.variables)
    assert detect({**env, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu017:1234"
    assert detect({**env, "JAX_COORDINATOR_ADDRESS": "login:99"}).coordinator == "login:99"


def test_open_mpi_4_and_5():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    c = detect(env)
    assert (c.manager, c.coordinator, c.num_processes, c.process_id) == (
        "Open MPI", f"10.96.0.1:{1531576320 // 4096 % 4096 + 61440}", 4, 2)
    five = {k: v for k, v in env.items() if k != "OMPI_MCA_orte_hnp_uri"}
    with pytest.raises(shardplan.ShardPlanError) as info:
        detect(five)
    d = info.value.diagnostics[0]
    assert d.code == "bad-cluster-env" and d.path == "$JAX_COORDINATOR_ADDRESS" and "mpirun -x" in d.hint
    assert detect({**five, "JAX_COORDINATOR_ADDRESS": "h0:5000"}).coordinator == "h0:5000"


def test_mpich_needs_a_coordinator():
    with pytest.raises(shardplan.ShardPlanError, match="JAX_COORDINATOR_ADDRESS"):
        detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert detect({"PMI_RANK": "1", "PMI_SIZE": "2", "JAX_COORDINATOR_ADDRESS": "n0:7000"}).process_id == 1


def test_kubernetes_indexed_job_and_jobset():
    with pytest.raises(shardplan.ShardPlanError, match="JAX_NUM_PROCESSES"):
        detect({"JOB_COMPLETION_INDEX": "3", "JOBSET_NAME": "llama"})
    js = detect({"JOB_COMPLETION_INDEX": "3", "JAX_NUM_PROCESSES": "4", "JOBSET_NAME": "llama",
                 "REPLICATED_JOB_NAME": "workers"})
    assert (js.manager, js.coordinator, js.num_processes, js.process_id) == (
        "Kubernetes", "llama-workers-0-0.llama:8476", 4, 3)
    with pytest.raises(shardplan.ShardPlanError, match="pod 0"):
        detect({"JOB_COMPLETION_INDEX": "3", "JAX_NUM_PROCESSES": "4"})


def test_tpu_slice_on_gke_and_explicit_variables():
    c = detect({"TPU_WORKER_HOSTNAMES": "t-0.svc,t-1.svc,t-2.svc,t-3.svc", "TPU_WORKER_ID": "2"})
    assert (c.coordinator, c.num_processes, c.process_id) == ("t-0.svc:8476", 4, 2)
    e = detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert (e.manager, e.num_processes, e.process_id) == ("environment", 2, 1)


@pytest.mark.parametrize("env, variable", [
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "two", "SLURM_PROCID": "0"}, "$SLURM_NTASKS"),
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "5"}, "$SLURM_PROCID"),
    ({"OMPI_COMM_WORLD_SIZE": "0", "OMPI_COMM_WORLD_RANK": "0", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "$OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "JAX_COORDINATOR_ADDRESS": "nohostport"}, "$JAX_COORDINATOR_ADDRESS"),
    ({"SHARDPLAN_COORDINATOR": "127.0.0.1:5", "SHARDPLAN_NUM_PROCESSES": "2", "SHARDPLAN_PROCESS_ID": "-1"},
     "$SHARDPLAN_PROCESS_ID"),
])
def test_a_garbled_environment_names_the_variable(env, variable):
    with pytest.raises(shardplan.ShardPlanError) as info:
        detect(env)
    assert info.value.diagnostics[0].code == "bad-cluster-env" and info.value.diagnostics[0].path == variable


def test_the_launcher_comes_first():
    env = {"SHARDPLAN_COORDINATOR": "127.0.0.1:5000", "SHARDPLAN_NUM_PROCESSES": "2", "SHARDPLAN_PROCESS_ID": "1",
           "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert detect(env).manager == "shardplan launch"


def test_single_process_launches_and_sweeps_are_not_jobs():
    assert detect({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None  # mpirun -n 1, Open MPI 5
    assert detect({"PMI_SIZE": "1", "PMI_RANK": "0"}) is None
    assert detect({"JOB_COMPLETION_INDEX": "7"}) is None  # an indexed Job as a sweep: independent pods
    # A GKE TPU Job is an indexed Job too: its TPU variables describe it.
    c = detect({"JOB_COMPLETION_INDEX": "1", "TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1"})
    assert (c.manager, c.num_processes, c.process_id) == ("TPU slice (GKE)", 2, 1)


def test_a_jobset_of_several_jobs_needs_process_ids():
    env = {"JOB_COMPLETION_INDEX": "0", "JOB_INDEX": "1", "JAX_NUM_PROCESSES": "8", "JOBSET_NAME": "js",
           "REPLICATED_JOB_NAME": "slice"}
    with pytest.raises(shardplan.ShardPlanError, match="JAX_PROCESS_ID"):
        detect(env)
    assert detect({**env, "JAX_PROCESS_ID": "4"}).process_id == 4
