"""A stated expert load (a router histogram, or the busiest shard's factor): parsed where it
enters, mapped onto the expert shards as a sharded dim splits them, and the step waiting for the
busiest shard's grouped matmuls where the compiler's grouped kernel follows the routing."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from shardplan.core import chips, routing, timing
from shardplan.errors import ArgumentError
from tests.helpers import HAS_TPU, PLANS, ROOT

MOE = dict(
    model=f"{ROOT / 'examples' / 'models.py'}:moe_tiny_dropless",
    step=f"{ROOT / 'examples' / 'train.py'}:moe_lm_loss",
    batch=["tokens=int32[16,32],labels=int32[16,32]"],
)


def test_a_histogram_a_factor_and_a_file_are_read(tmp_path):
    assert routing.parse("900,100,500,500").counts == (900, 100, 500, 500)
    assert routing.parse(" 1.5 ").factor == 1.5
    listed = tmp_path / "load.json"
    listed.write_text(json.dumps([3, 1, 0, 4]))
    assert routing.parse(str(listed)).counts == (3, 1, 0, 4)
    logged = tmp_path / "router.json"
    logged.write_text(json.dumps({"step": 100, "tokens_per_expert": [1, 2, 3, 4]}))
    assert routing.parse(str(logged)).counts == (1, 2, 3, 4)


@pytest.mark.parametrize("text, words", [
    ("0.8", "at least the mean"),
    ("nan", "at least the mean"),
    ("3,-1,2", "negative"),
    ("0,0,0", "every count is zero"),
    ("3,x,2", "not all numbers"),
    ("no_such_histogram.json", "not a factor, a list of counts or a file"),
])
def test_a_bad_load_is_an_argument_error_at_the_flag(text, words):
    with pytest.raises(ArgumentError) as e:
        routing.parse(text)
    assert words in str(e.value) and "--expert-load" in str(e.value)


@pytest.mark.parametrize("text, words", [
    ('{"a": 1}', "holds no list of counts"),
    ("[1, 2", "not a JSON file"),
    ("[1, true, 3]", "not all numbers"),
    ("[1, NaN, 3]", "not finite"),
])
def test_a_file_without_counts_says_so(tmp_path, text, words):
    bad = tmp_path / "x.json"
    bad.write_text(text)
    with pytest.raises(ArgumentError, match=words):
        routing.parse(str(bad))


def test_a_file_too_large_for_a_histogram_is_refused_unread(tmp_path):
    bad = tmp_path / "x.json"
    with open(bad, "wb") as f:
        f.truncate(routing.MAX_FILE_BYTES + 1)
    with pytest.raises(ArgumentError, match="not a histogram"):
        routing.parse(str(bad))


def test_the_shards_hold_the_experts_in_contiguous_blocks_as_jax_splits_a_dim():
    """The ground truth of which experts a shard holds: jax's own sharding of a stacked experts'
    dim over an 'expert' axis of 4 devices (each device's index into the dim)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    held = NamedSharding(mesh, PartitionSpec("expert")).devices_indices_map((8,))
    blocks = sorted(tuple(range(8))[idx[0]] for idx in held.values())
    assert blocks == [(0, 1), (2, 3), (4, 5), (6, 7)]
    counts = (5, 3, 0, 0, 1, 1, 2, 4)
    load = routing.ExpertLoad(counts=counts)
    want = tuple(sum(counts[i] for i in b) / sum(counts) for b in blocks)
    assert routing.shares(load, 8, 4) == pytest.approx(want)
    assert routing.imbalance(load, 8, 4) == pytest.approx(8 / 16 * 4)  # the first shard: 8 of 16 tokens
    assert routing.imbalance(load, 8, 1) == 1.0  # one shard holds every expert
    assert routing.imbalance(routing.ExpertLoad(counts=(1,) * 8), 8, 8) == 1.0


def test_a_factor_sets_the_busiest_shard_and_cannot_exceed_the_shards():
    load = routing.ExpertLoad(factor=1.6)
    assert routing.imbalance(load, 8, 4) == pytest.approx(1.6)
    assert sum(routing.shares(load, 8, 4)) == pytest.approx(1.0)
    with pytest.raises(ArgumentError, match="at most 2x"):
        routing.shares(routing.ExpertLoad(factor=3.0), 8, 2)
    with pytest.raises(ArgumentError, match="histogram has 4 experts, the step's grouped matmuls 8"):
        routing.shares(routing.ExpertLoad(counts=(1, 2, 3, 4)), 8, 4)


def _shard_map_cost(target: str):
    import shardplan

    return shardplan.api.analyze(PLANS / "moe_ep.splan", mode="fast", backend="shard_map", target=target,
                                 devices=8, **MOE)


def test_the_busiest_expert_shard_sets_the_step_on_xla_tpu():
    """moe_tiny_dropless (2 MoE layers, 4 experts of d_model 32 -> 64, top-2) over `data = 2,
    expert = 4`, 16 x 32 tokens: 1,024 routed rows a grouped matmul, each of the two data replicas
    of an expert shard running half its shard's rows (buffers of 512 rows), a quarter of them each
    device's with every expert alike. By hand, per device: 4 grouped matmuls a layer whose work
    follows the rows (the two forward and their input gradients; XLA:TPU runs the weight gradients
    over every row of its buffer), each 2 x 512 / 4 rows x 32 x 64 FLOPs, 4,194,304 in all (twice
    that before the data replicas split the rows). A histogram that sends 10 of 13 tokens to the
    first expert makes its shard 40/13 of the mean: the step waits for (40/13 - 1) x those FLOPs
    more."""
    cost = _shard_map_cost("tpu-v5e:2x4")
    assert sum(n for *_, n in cost.grouped) == 2 * 4 * 2 * 512 / 4 * 32 * 64
    assert {(g, axes) for _, g, axes, _ in cost.grouped} == {(4, ("expert",))}
    plan = __import__("shardplan").load(PLANS / "moe_ep.splan")
    chip = chips.lookup("tpu-v5e")
    even = timing.step_time(cost, plan, chip)
    # with every expert alike a shard's kernels run a quarter of the rows the program's FLOPs count
    assert even.compute_s == pytest.approx((cost.flops - 3 * 4_194_304) / chip.peak_flops)
    assert any(n.code == "grouped-routed" for n in cost.notes)
    assert timing.step_time(cost, plan, chip, routing.ExpertLoad(counts=(3, 3, 3, 3))) == even
    skewed = timing.step_time(cost, plan, chip, routing.ExpertLoad(counts=(10, 1, 1, 1)))
    extra = (40 / 13 - 1) * 4_194_304 / chip.peak_flops
    assert skewed.imbalance == pytest.approx(40 / 13)
    assert skewed.imbalance_s == pytest.approx(extra)
    assert skewed.compute_s - even.compute_s == pytest.approx(extra)
    assert skewed.serial_s - even.serial_s == pytest.approx(extra)
    assert skewed.mfu_serial < even.mfu_serial <= 1.0 and even.mfu_overlapped <= 1.0
    assert even.mfu_serial == pytest.approx(even.compute_s / even.serial_s)
    # the stated load is the step's: a histogram of another expert count is refused
    with pytest.raises(ArgumentError, match="histogram has 3 experts"):
        timing.step_time(cost, plan, chip, routing.ExpertLoad(counts=(1, 1, 1)))
    assert replace(cost, grouped=()).grouped == ()  # a step without split grouped matmuls:
    assert timing.step_time(replace(cost, grouped=()), plan, chip, routing.ExpertLoad(factor=2.0)).imbalance == 1.0


@pytest.mark.parametrize("target", ["cpu", "h100:8"])
def test_a_compiler_that_runs_grouped_matmuls_densely_is_not_slowed_by_the_routing(target):
    """XLA:CPU (jax's dense decomposition) and XLA:GPU run every row through every local expert:
    the work is fixed, whatever the routing, and a note says so."""
    cost = _shard_map_cost(target)
    assert cost.grouped == ()
    assert any(n.code == "expert-load-static" for n in cost.notes)


def run_check(capsys, *args) -> subprocess.CompletedProcess:
    """`shardplan check ARGS` in this process (the CLI's own main; no interpreter started)."""
    from shardplan.tools import cli as cli_main

    capsys.readouterr()
    rc = cli_main.main(["check", *map(str, args)])
    got = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, got.out, got.err)


def cli(capsys, *args):
    return run_check(capsys, PLANS / "moe_ep.splan", "--model", MOE["model"], "--step", MOE["step"],
                     "--batch", MOE["batch"][0], "--backend", "shard_map", *args)


def test_check_prints_what_the_busiest_expert_shard_costs(capsys):
    r = cli(capsys, "--target", "tpu-v5e:2x4", "--expert-load", "10,1,1,1")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "the step waits for the busiest expert shard, 3.08x the mean tokens" in text
    assert "models.py:620 (4 experts over expert: busiest shard 3.08x)" in text
    r = cli(capsys, "--target", "h100:8", "--expert-load", "10,1,1,1")
    assert r.returncode == 0, r.stderr
    assert "no effect on this step" in " ".join(r.stdout.split())


@pytest.mark.parametrize("args, words", [
    (["--expert-load", "1.5"], "name the step (--step, --batch)"),
    (["--chip", "tpu-v5e", "--expert-load", "0.5"], "--expert-load"),
])
def test_the_load_flag_is_checked_before_any_work(args, words):
    argv = ["check", str(PLANS / "moe_ep.splan"), *args]
    if "--chip" in args:
        argv += ["--model", MOE["model"], "--step", MOE["step"], "--batch", MOE["batch"][0]]
    code = f"import sys; from shardplan.tools import cli; rc = cli.main({argv!r}); print(rc, 'jax' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert words in " ".join(r.stderr.split()) and "Traceback" not in r.stderr


def test_a_routed_layer_of_our_own_counts_its_grouped_work_by_hand():
    """tests/fixtures/engine_models.py's sorted_experts (top-1, SiLU between two grouped matmuls,
    its own names; 4 experts of 64 -> 96) over `data = 2, expert = 4`, 8 x 16 tokens: 128 routed
    rows, each data replica of an expert shard running half its shard's rows; 4 grouped matmuls
    whose work follows the rows (two forward, their input gradients), each 2 x 128 / 2 / 4 rows x
    64 x 96 FLOPs per device."""
    import shardplan
    from tests.helpers import FIXTURES

    cost = shardplan.api.analyze(
        FIXTURES / "experts_ep.splan", mode="fast", backend="shard_map", target="tpu-v5e:2x4", devices=8,
        model=f"{FIXTURES / 'engine_models.py'}:sorted_experts", step=f"{FIXTURES / 'engine_models.py'}:lm_loss",
        batch=["tokens=int32[8,16],labels=int32[8,16]"])
    assert sum(n for *_, n in cost.grouped) == 4 * 2 * 128 / 2 / 4 * 64 * 96
    assert {src.rsplit(":", 1)[1] for src, *_ in cost.grouped} == {"371", "372"}


def test_tokens_over_capacity_are_the_ones_the_models_dispatch_drops(tmp_path):
    """The ground truth: examples/models.py's own capacity dispatch (its one-hot mask) run on one
    device with a routing every group shares, at capacity factor 1: 16 groups of 32 tokens, top-2
    over 4 experts, 16 slots per expert and group. Each group sends all 32 first choices to expert
    0 and its second choices 20 / 8 / 4 to experts 1 / 2 / 3: the mask keeps 16 + 16 + 8 + 4 of 64.
    The capacity read from the step's computation and the histogram of the choices give the same
    fraction dropped."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import shardplan
    from examples import models

    cfg = models.MoEConfig(capacity_factor=1.0)
    factory = tmp_path / "tight.py"
    factory.write_text("from flax import nnx\nfrom examples import models\n\n\ndef tight():\n"
                       "    return models.MoE(models.MoEConfig(capacity_factor=1.0), nnx.Rngs(0))\n")
    (cap,) = shardplan.api.expert_capacity(f"{factory}:tight", MOE["step"], MOE["batch"])
    assert (cap.experts, cap.k, cap.tokens, cap.slots) == (4, 2, 512, 256)
    assert cap.factor == 1.0

    second = np.array([1] * 20 + [2] * 8 + [3] * 4)
    index = np.stack([np.zeros(32, int), second], -1)[None].repeat(16, 0)  # (g, s, k)
    layer = models.MoEFeedForward(cfg, nnx.Rngs(0))
    # experts that return 1 for each token they were dispatched: the combine then sums, per token,
    # the kept choices' weights (1 each)
    e, d, f = layer.w_in[...].shape
    layer.w_in[...] = jnp.full((e, d, f), 1.0 / d)
    layer.w_out[...] = jnp.full((e, f, d), 1.0 / (f * float(jax.nn.gelu(1.0))))
    y = layer._capacity(jnp.ones((16, 32, d)), jnp.ones((16, 32, 2)), jnp.asarray(index))
    kept = round(float(jnp.sum(y[..., 0])))
    assert kept == 16 * (16 + 16 + 8 + 4)
    load = routing.ExpertLoad(counts=tuple(np.bincount(index.reshape(-1), minlength=4).tolist()))
    fraction, busiest = routing.dropped(load, cap)
    assert fraction == pytest.approx(1 - kept / (512 * 2))  # 20 of 64: 31.25%
    assert busiest == pytest.approx(2.0)  # expert 0: 32 choices a group for 16 slots
    assert routing.dropped(None, cap) == (0.0, 1.0)  # every expert alike fills its slots exactly


def test_check_prints_the_tokens_a_capacity_dispatch_drops_and_says_when_it_cannot(capsys):
    model = f"{ROOT / 'examples' / 'models.py'}:moe_tiny"
    r = run_check(capsys, PLANS / "moe_ep.splan", "--model", model, "--step", MOE["step"], "--batch", MOE["batch"][0],
                  "--devices", "8", "--expert-load", "10,1,1,1", "--format", "json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["step_cost"]["expert_capacity"]
    # 512 tokens x top-2 over 4 experts, 512 slots each; 10/13 of 1,024 choices to expert 0
    assert (row["experts"], row["k"], row["tokens"], row["slots"], row["capacity_factor"]) == (4, 2, 512, 512, 2.0)
    assert row["dropped_fraction"] == pytest.approx((10 / 13 * 1024 - 512) / 1024)
    # GShard's router of two argmaxes (tests/fixtures/fast_models.py's routed_moe: the second with
    # the first choice masked out) and its capacity, by hand from its code: 2 * 32 // 4 = 16 slots
    # per expert and group, 16 groups: 256 slots for 512 tokens' top-2 over 4 experts, factor 1
    fixture = ROOT / "tests" / "fixtures" / "fast_models.py"
    r = run_check(capsys, PLANS / "moe_ep.splan", "--model", f"{fixture}:routed_moe", "--step", f"{fixture}:moe_loss",
                  "--batch", MOE["batch"][0], "--devices", "8", "--expert-load", "10,1,1,1", "--format", "json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["step_cost"]["expert_capacity"]
    assert (row["experts"], row["k"], row["tokens"], row["slots"], row["capacity_factor"]) == (4, 2, 512, 256, 1.0)
    assert row["dropped_fraction"] == pytest.approx((10 / 13 * 1024 - 256) / 1024)


def test_a_router_the_step_does_not_show_gets_no_drop_estimate():
    """Expert buffers whose routing the computation does not give (no top-k over the experts, no
    argmaxes that divide over the layers): the slots said, no figure guessed."""
    from rich.console import Console

    from shardplan.tools import report

    cost = _shard_map_cost("cpu")
    out = Console(record=True, width=200)
    report.print_expert_load(out, cost, None, routing.ExpertLoad(factor=1.5), [routing.Capacity(4, 0, 0, 256)])
    assert "(4 experts, 256 slots per expert) routed by no top-k over the experts, nor argmaxes as many per layer: " \
           "the tokens it drops are not estimated" in " ".join(out.export_text().split())
    with pytest.raises(ValueError):
        routing.dropped(None, routing.Capacity(4, 0, 0, 256))


@pytest.mark.skipif(not HAS_TPU, reason="needs XLA:TPU: pip install 'shardplan[tpu]'")
def test_exact_mode_takes_the_busiest_shard_from_the_program_it_compiled(capsys):
    """--compile: XLA:TPU's program of the shard_map backend (compiled offline for a v5e 2x4), the
    rows each device's grouped kernel runs from the partitioner's dry run of that program."""
    r = cli(capsys, "--target", "tpu-v5e:2x4", "--compile", "--expert-load", "10,1,1,1")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "XLA:TPU" in text and "the step waits for the busiest expert shard, 3.08x the mean tokens" in text


def test_a_model_that_sizes_its_buffers_per_token_reads_by_choices():
    """tests/fixtures/engine_models.py's moe (GShard's two argmaxes, its own names; batch rows as
    groups): `cap = int(2.0 * s / 4)`, 16 slots per group of 32 tokens, 8 groups: 128 slots per
    expert for 512 top-2 choices, a capacity factor of 1.00 per choice (its code's 2.0 is per
    token)."""
    import shardplan
    from tests.helpers import FIXTURES

    engine = FIXTURES / "engine_models.py"
    batch = ["tokens=int32[8,32],labels=int32[8,32]"]
    (cap,) = shardplan.api.expert_capacity(f"{engine}:moe", f"{engine}:moe_loss", batch)
    assert (cap.experts, cap.k, cap.tokens, cap.slots, cap.factor) == (4, 2, 256, 128, 1.0)
    assert "capacity factor 1.00: the slots over the 128 choices an expert is routed on average" in cap.describe()
