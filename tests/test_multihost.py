"""Multi-process: 2 processes x 4 CPU devices under jax.distributed (gloo on 127.0.0.1),
launched by `shardplan launch`, against 1 process x 8 devices. Every run is bounded."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import optax
import pytest

from examples import models
from examples import train as example
import shardplan
from tests.helpers import FAST_COMPILE, PLANS, ROOT
from shardplan import checkpoint

TRAIN = str(ROOT / "examples" / "train.py")
# Reductions cross a process boundary in another order than within one process.
LOSS_RTOL = 1e-5


def launch(*cmd, n=2, grace=10, timeout=300):
    return subprocess.run([sys.executable, "-m", "shardplan", "launch", "-n", str(n), "--devices-per-process",
                           str(8 // n), "--failure-grace", str(grace), "--", *map(str, cmd)],
                          capture_output=True, text=True, timeout=timeout)


def losses(path):
    return json.loads(open(path).read())["losses"]


def test_launch_runs_ranks_with_prefixed_output():
    code = ("from shardplan import distributed; distributed.initialize(); import jax; "
            "print('proc', jax.process_index(), 'of', jax.process_count(), 'devices', jax.device_count()); "
            "import os; print('flags', os.environ['XLA_FLAGS'])")
    r = launch(sys.executable, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] proc 0 of 2 devices 8" in r.stdout and "[rank 1] proc 1 of 2 devices 8" in r.stdout
    assert "all 2 ranks exited 0" in r.stdout
    # the user's XLA flags reach every rank; only the device count is the launcher's
    for rank in (0, 1):
        assert f"[rank {rank}] flags " in r.stdout
    flags = [line.split(" flags ", 1)[1].split() for line in r.stdout.splitlines() if " flags " in line]
    assert all(set(FAST_COMPILE) <= set(f) and "--xla_force_host_platform_device_count=4" in f for f in flags), flags


# examples/train.py's own defaults (--steps aside): its seed, batch size, sequence length and rate.
TRAIN_DEFAULTS = example.parse_args(["--plan", "-"])


def train_py_model():
    """The model examples/train.py trains by default (gpt_tiny with its default --seed)."""
    return models.gpt_tiny(TRAIN_DEFAULTS.seed)


@pytest.fixture(scope="module")
def reference():
    """examples/train.py's first 5 steps with its defaults (gpt_tiny, AdamW, its synthetic batches)
    as plain Flax NNX + optax on one device (tests/reference.py): what every plan, in 1 process or
    2, must train to."""
    from tests import reference as plain

    a = TRAIN_DEFAULTS
    rng = np.random.default_rng(a.seed)
    batches = [example.synthetic_batch(rng, models.TINY.vocab, a.batch_size, a.seq_len) for _ in range(5)]
    losses, _ = plain.train(train_py_model, optax.adamw(a.lr), example.lm_loss, batches, key=f"train.py lr={a.lr}")
    return losses


# Each backend across 2 processes: shard_map here (FSDP), auto in the SLURM case (DP) and in the
# checkpoint case (Megatron TP). Each case is a 2-process launch: the suite's time.
def test_two_processes_match_one(reference, tmp_path):
    m = tmp_path / "m.json"
    r = launch(sys.executable, TRAIN, "--plan", PLANS / "fsdp.splan", "--steps", 5, "--no-show", "--backend",
               "shard_map", "--metrics", m)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(2 process(es))" in r.stdout
    np.testing.assert_allclose(losses(m), reference, rtol=LOSS_RTOL)


def test_checkpoints_cross_process_counts(reference, tmp_path):
    """A checkpoint saved by 1 process resumes in 2 (training on as one device does), and the
    checkpoint those 2 write restores in 1 process with the values 1 process reaches alone."""
    plan = PLANS / "gpt_tp.splan"
    one, two = tmp_path / "one", tmp_path / "two"
    train = ["--plan", str(plan), "--no-show", "--simulate-devices", "0"]
    # Saved by 1 process at step 3 (examples/train.py, run in this one).
    assert example.main([*train, "--steps", "3", "--checkpoint-dir", str(one)]) == 0
    shutil.copytree(one, two)

    # Restored in 2 processes: steps 4 and 5 as one device trains them (the reference's), saved
    # there at step 5.
    r = launch(sys.executable, TRAIN, "--plan", plan, "--steps", 2, "--no-show", "--checkpoint-dir", two, "--resume",
               "--metrics", tmp_path / "m2.json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from step 3" in r.stdout
    np.testing.assert_allclose(losses(tmp_path / "m2.json"), reference[3:5], rtol=LOSS_RTOL)
    assert checkpoint.open_readonly(two).all_steps() == [3, 5]

    # The same 2 steps in this process, then both step-5 checkpoints restored here (1 x 8).
    assert example.main([*train, "--steps", "2", "--checkpoint-dir", str(one), "--resume"]) == 0
    p = shardplan.load(plan)
    restored = []
    for d in (one, two):
        model, optimizer, placement = shardplan.init_sharded(p, train_py_model, optax.adamw(TRAIN_DEFAULTS.lr))
        assert checkpoint.Checkpointer(d, placement).restore(model, optimizer) == 5
        restored.append({leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(model)})
    for path in restored[0]:
        # 1 and 2 processes sum gradients in another order (gloo): float32 rounding, 1.5e-6 measured
        np.testing.assert_allclose(restored[1][path], restored[0][path], rtol=1e-5, atol=1e-5, err_msg=path)


def test_killing_a_rank_mid_training_fails_the_launch_within_the_bound():
    """SIGKILL rank 1 of examples/train.py while it trains: the launcher names it and exits
    non-zero within the bound; rank 0 either fails on its own (its collective sees the dead
    peer) or is stopped by the launcher after the grace period."""
    import signal

    grace = 5
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", "launch", "-n", "2", "--devices-per-process", "4",
                             "--failure-grace", str(grace), "--", sys.executable, TRAIN, "--plan",
                             str(PLANS / "gpt_tp.splan"), "--steps", "100000", "--no-show", "--log-every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids, killed_at = {}, None
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            m = re.match(r"\[rank (\d)\] .*process (\d) pid (\d+)", line)
            if m:
                pids[int(m.group(1))] = int(m.group(3))
            if line.startswith("[rank 0] step 3 ") and 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                killed_at = time.monotonic()
                break
            assert time.monotonic() < deadline, "training did not reach step 3"
        assert killed_at is not None
        proc.stdout.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - killed_at
    err = proc.stderr.read()
    assert code != 0
    assert err.startswith("shardplan launch: rank 1 killed by SIGKILL"), err
    assert elapsed < grace + 30  # bounded: grace + stopping, never a hang
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


DIER = r'''
import os, signal, sys, time
from shardplan import distributed
distributed.initialize()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
print("pid", os.getpid(), flush=True)
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), jnp.ones((4, 8)))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
for step in range(1000):
    if step == 3 and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    float(total(x))
    time.sleep(0.05)
print("finished all steps", flush=True)
'''


def test_a_rank_that_dies_fails_the_launch_within_the_bound():
    t = time.monotonic()
    r = launch(sys.executable, "-c", DIER, grace=5, timeout=120)
    elapsed = time.monotonic() - t
    assert r.returncode != 0
    assert "rank 1 killed by SIGKILL" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "finished all steps" not in r.stdout
    assert elapsed < 60  # 5 s grace + start-up, never a hang
    pids = [int(p) for p in re.findall(r"\] pid (\d+)", r.stdout)]
    assert len(pids) == 2
    for pid in pids:  # no rank is left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_usage_errors():
    r = subprocess.run([sys.executable, "-m", "shardplan", "launch", "-n", "2"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "give the command" in r.stderr


def test_launch_of_a_missing_command_is_a_usage_error():
    r = launch("/nonexistent/program")
    assert r.returncode == 2 and "cannot run '/nonexistent/program'" in r.stderr and "Traceback" not in r.stderr


# -- the same script under cluster managers: their environment, 2 processes x 4 devices ---------
MANAGED = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_", "SHARDPLAN_", "JOB_", "JOBSET_", "TPU_", "XLA_FLAGS",
           "KUBERNETES_")


def manager_env(kind: str, rank: int, n: int, port: int, **extra) -> dict:
    """What SLURM (srun), Open MPI (mpirun) or a Kubernetes indexed Job sets for a rank, on 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MANAGED)}
    env.update(JAX_PLATFORMS="cpu", SHARDPLAN_TIMEOUT="60", PYTHONUNBUFFERED="1", XLA_FLAGS=" ".join(FAST_COMPILE))
    if kind == "slurm":
        env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS=str(n),
                   SLURM_STEP_NUM_TASKS=str(n), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_STEP_NUM_NODES="1", SLURM_NODELIST="127.0.0.1", JAX_COORDINATOR_PORT=str(port))
    elif kind == "ompi":
        env.update(OMPI_MCA_orte_hnp_uri=f"{4096 * 7}.0;tcp://127.0.0.1:{port + 1}", OMPI_COMM_WORLD_SIZE=str(n),
                   OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                   JAX_COORDINATOR_PORT=str(port))
    elif kind == "k8s":
        env.update(KUBERNETES_SERVICE_HOST="10.0.0.1", JOB_COMPLETION_INDEX=str(rank), JAX_NUM_PROCESSES=str(n),
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
    env.update(extra)
    return env


def run_ranks(kind: str, args: list, n: int = 2, timeout: float = 300, ranks=None, **extra) -> list[tuple]:
    """Start the ranks as the manager would (each with its environment), bounded; (rc, out, err) each."""
    from shardplan.tools.launch import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, *map(str, args)], env=manager_env(kind, i, n, port, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (range(n) if ranks is None else ranks)]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def test_train_under_a_cluster_manager_matches_one_process(reference, tmp_path):
    kind = "slurm"
    m = tmp_path / "m.json"
    ranks = run_ranks(kind, [TRAIN, "--plan", PLANS / "dp.splan", "--steps", 5, "--no-show", "--simulate-devices", 4,
                             "--metrics", m])
    for rc, o, e in ranks:
        assert rc == 0, o[-2000:] + e[-3000:]
    np.testing.assert_allclose(losses(m), reference, rtol=LOSS_RTOL)
    manager = {"slurm": "SLURM", "ompi": "Open MPI", "k8s": "Kubernetes"}[kind]
    (_, out0, err0), (_, out1, err1) = ranks
    assert f"shardplan: joined a {manager} job of 2 processes" in err0 and "joined" not in err1
    assert "(2 process(es))" in out0 and "over 5 steps" in out0  # one summary, from process 0
    assert "over 5 steps" not in out1 and "[process 1/2] process 1 pid" in out1


@pytest.mark.parametrize("kind", ["ompi", "k8s"])
def test_ranks_join_under_other_cluster_managers(kind):
    """Open MPI's and a Kubernetes indexed Job's environment: the ranks join one job of 2 processes
    and see all 8 devices (training across processes is the SLURM case above; each manager's
    variables are tests/test_clusters.py's)."""
    code = ("import sys; from shardplan import distributed, simulate_devices; simulate_devices(4); "
            "distributed.initialize(); import jax; "
            "print('proc', jax.process_index(), 'of', jax.process_count(), 'devices', jax.device_count()); "
            "import os; print('flags', os.environ['XLA_FLAGS'])")
    ranks = run_ranks(kind, ["-c", code], timeout=120)
    manager = {"ompi": "Open MPI", "k8s": "Kubernetes"}[kind]
    for i, (rc, o, e) in enumerate(ranks):
        assert rc == 0, o[-2000:] + e[-3000:]
        assert f"proc {i} of 2 devices 8" in o
    assert f"shardplan: joined a {manager} job of 2 processes" in ranks[0][2]


def test_a_job_that_cannot_be_joined_fails_clearly_within_the_timeout():
    t = time.monotonic()
    ranks = run_ranks("slurm", [TRAIN, "--plan", PLANS / "dp.splan", "--steps", 1, "--no-show",
                                "--simulate-devices", 4], timeout=60, SLURM_STEP_NODELIST="no-such-host.invalid",
                       SHARDPLAN_TIMEOUT="3")
    for rc, o, e in ranks:
        assert rc == 1 and "error[cannot-join]" in e and "SLURM job" in e and "does not resolve" in e, e[-2000:]
        assert "Traceback" not in e
    # A peer that never comes: process 0 alone says who is missing, within SHARDPLAN_TIMEOUT.
    (rc, o, e), = run_ranks("slurm", [TRAIN, "--plan", PLANS / "dp.splan", "--steps", 1, "--no-show",
                                      "--simulate-devices", 4], ranks=[0], timeout=60, SHARDPLAN_TIMEOUT="3")
    assert rc == 1 and "only 1 of 2 processes arrived within 3 s (missing: 1)" in e, e[-2000:]
    assert time.monotonic() - t < 60


NOT_JOINED = """
import shardplan
from shardplan.runtime.devices import simulate
simulate(4)
try:
    shardplan.make_mesh(shardplan.load(%r))
except shardplan.ShardPlanError as e:
    print(e.diagnostics[0].code, e.diagnostics[0].message)
else:
    print("made a mesh")
"""


def test_one_of_several_processes_that_did_not_join_is_refused():
    (rc, o, e), = run_ranks("slurm", ["-c", NOT_JOINED % str(PLANS / "dp.splan")], ranks=[1], timeout=120)
    assert rc == 0 and o.startswith("not-joined this is process 1 of a 2-process SLURM job"), o + e[-2000:]


def test_show_on_two_processes_reports_once_with_every_device():
    r = launch(sys.executable, "-m", "shardplan", "show", PLANS / "fsdp.splan", "--model",
               f"{ROOT / 'examples' / 'models.py'}:gpt_tiny", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[Gloo]" not in r.stdout + r.stderr  # the launcher drops Gloo's connection notes
    rank1 = [line for line in r.stdout.splitlines() if line.startswith("[rank 1]")]
    assert rank1 == [], rank1  # one report, from process 0
    assert "[rank 0] fsdp mesh {'data': 8} over 8 cpu devices" in r.stdout
    assert "every array lives where the plan says" in r.stdout
    # Shards are counted over all 8 devices of both processes, not this process's 4.
    assert re.search(r"\[rank 0\] │ embed/embedding .*│ \(8, 32\) x8 ", r.stdout), r.stdout[-4000:]


def test_ranks_output_drops_gloos_notes_and_the_cuda_plugins_notes_on_a_cpu_host():
    """What each rank prints reaches the user prefixed, less Gloo's connection notes and the notes
    importing jax prints where the CUDA plugin is installed and no GPU is (``shardplan[gpu]`` on a
    CPU host, for offline GPU compiles): on such a host every command printed them, rank 1's too."""
    import io
    import threading

    from shardplan.tools import launch as launcher

    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1796614089.929429   20144 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
        "GPU will not be used.\n",
        "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "loss 4.17 [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "WARNING: the user's own warning\n",
    ]
    out = io.StringIO()
    launcher._pump(io.StringIO("".join(lines)), 1, out, threading.Lock())
    assert out.getvalue() == "[rank 1] loss 4.17 \n[rank 1] WARNING: the user's own warning\n"
