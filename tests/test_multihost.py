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
import shardplan
from tests.helpers import PLANS, ROOT
from shardplan import checkpoint

TRAIN = str(ROOT / "examples" / "train.py")
# Reductions cross a process boundary in another order than within one process.
LOSS_RTOL = 1e-5


def launch(*cmd, n=2, grace=10, timeout=300):
    return subprocess.run([sys.executable, "-m", "shardplan", "launch", "-n", str(n), "--devices-per-process",
                           str(8 // n), "--failure-grace", str(grace), "--", *map(str, cmd)],
                          capture_output=True, text=True, timeout=timeout)


def single(*cmd, timeout=300):
    return subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, timeout=timeout)


def losses(path):
    return json.loads(open(path).read())["losses"]


def test_launch_runs_ranks_with_prefixed_output():
    code = ("from shardplan import distributed; distributed.initialize(); import jax; "
            "print('proc', jax.process_index(), 'of', jax.process_count(), 'devices', jax.device_count())")
    r = launch(sys.executable, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] proc 0 of 2 devices 8" in r.stdout and "[rank 1] proc 1 of 2 devices 8" in r.stdout
    assert "all 2 ranks exited 0" in r.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process x 8 devices, 5 steps, per plan (the auto backend; shard_map matches it, see
    test_shard_map)."""
    d = tmp_path_factory.mktemp("single")
    out = {}
    for plan in ("dp.splan", "fsdp.splan", "gpt_tp.splan"):
        r = single(TRAIN, "--plan", PLANS / plan, "--steps", 5, "--no-show", "--metrics", d / f"{plan}.json")
        assert r.returncode == 0, r.stderr[-3000:]
        out[plan] = losses(d / f"{plan}.json")
    return out


@pytest.mark.parametrize("backend", ["auto", "shard_map"])
@pytest.mark.parametrize("plan", ["dp.splan", "fsdp.splan", "gpt_tp.splan"])
def test_two_processes_match_one(plan, backend, reference, tmp_path):
    m = tmp_path / "m.json"
    r = launch(sys.executable, TRAIN, "--plan", PLANS / plan, "--steps", 5, "--no-show", "--backend", backend, "--metrics", m)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(2 process(es))" in r.stdout
    np.testing.assert_allclose(losses(m), reference[plan], rtol=LOSS_RTOL)


def test_checkpoints_cross_process_counts(tmp_path):
    plan = PLANS / "gpt_tp.splan"
    one, two = tmp_path / "one", tmp_path / "two"
    # Saved by 1 process (3 steps), and by 2 processes (the same 3 steps).
    r = single(TRAIN, "--plan", plan, "--steps", 3, "--no-show", "--checkpoint-dir", one)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(sys.executable, TRAIN, "--plan", plan, "--steps", 3, "--no-show", "--checkpoint-dir", two)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert checkpoint.open_readonly(two).all_steps() == [3]

    # The 2-process checkpoint restores in this process (1 x 8) with the same values.
    p = shardplan.load(plan)
    restored = []
    for d in (one, two):
        model, optimizer, placement = shardplan.init_sharded(p, lambda: models.gpt_tiny(5), optax.adamw(3e-3))
        assert checkpoint.Checkpointer(d, placement).restore(model, optimizer) == 3
        restored.append({leaf.path: np.asarray(leaf.array) for leaf in shardplan.live_leaves(model)})
    for path in restored[0]:
        np.testing.assert_allclose(restored[1][path], restored[0][path], rtol=1e-5, atol=1e-6, err_msg=path)

    # The 1-process checkpoint restores in 2 processes: resuming there continues as in 1.
    shutil.copytree(one, tmp_path / "one_copy")
    r = launch(sys.executable, TRAIN, "--plan", plan, "--steps", 2, "--no-show", "--checkpoint-dir", one, "--resume",
               "--metrics", tmp_path / "m2.json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from step 3" in r.stdout
    r = single(TRAIN, "--plan", plan, "--steps", 2, "--no-show", "--checkpoint-dir", tmp_path / "one_copy",
               "--resume", "--metrics", tmp_path / "m1.json")
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "m2.json"), losses(tmp_path / "m1.json"), rtol=LOSS_RTOL)


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
            if line.startswith("[rank 1] step 3 ") and 1 in pids:
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
