"""XLA's layouts offline (``shardplan.runtime.shardy``): Shardy's propagation run from jaxlib over a
traced step, checked against the program XLA:CPU compiles for the same step (its post-Shardy HLO,
read by ``core.hlo.shardings``), equation by equation, on random plans over models of the pool."""

from __future__ import annotations

import glob
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import shardplan
from benchmarks import random_plans as rp
from shardplan.core.hlo.shardings import layouts as xla_layouts
from shardplan.runtime import shardy, tracing


def _spec(mesh: Mesh, dims) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*[(d if len(d) != 1 else d[0]) if d else None for d in dims]))


def _xla(closed, sizes: dict[str, int], args, results):
    """XLA:CPU's own layouts for ``closed`` (named as ``shardy.lowered`` names it) under the given
    layouts: the module after its Shardy pass, from a dump of one compile."""
    from jax._src import core

    shape = tuple(sizes.values())
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), tuple(sizes))
    renamed = closed.replace(jaxpr=shardy._renamed(closed.jaxpr))
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    fn = jax.jit(
        core.jaxpr_as_fun(renamed),
        in_shardings=[_spec(mesh, a) for a in args],
        out_shardings=[_spec(mesh, r) for r in results],
        keep_unused=True,
    )
    dump = tempfile.mkdtemp()
    with jax.set_mesh(mesh):
        lowered = fn.trace(*avals).lower()
    lowered.compile(
        compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "shardy-xla", "xla_dump_hlo_as_text": True}
    )
    (text,) = [open(f).read() for f in glob.glob(dump + "/*after_shardy-xla.before_spmd-partitioning.txt")]
    return xla_layouts(text, list(sizes.items()))


def _step(model: str, text: str):
    plan = shardplan.loads(text, "random.splan")
    ref, step = rp.POOL[model]
    sizes = dict(plan.mesh_shape(rp.DEVICES))
    coster = shardplan.api.step_coster(model=ref, step=step, batch=rp.BATCH_ARG)
    res = coster.tracer.resolve(plan, sizes)
    traced = coster.tracer.step(plan, sizes, res)
    kept = [*res.params.decisions, *res.opt.decisions]
    args, results = shardy.given(traced.closed.jaxpr, [*kept, *res.inputs.decisions], kept)
    return traced.closed, sizes, tracing.abstract_mesh(sizes, plan), args, results


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_layouts_are_the_ones_xla_propagates_on_random_plans(index):
    model, text = rp.draw_pair(11, index, rp.leaves_of)
    closed, sizes, abstract, args, results = _step(model, text)
    got = shardy.Propagator(closed, abstract).layouts(args, results)
    agree, differ, compared = 0, [], 0
    for ch in _xla(closed, sizes, args, results):
        path = shardy.path_of(ch.name)
        if not path or not ch.shape or ch.dims is None:
            continue
        compared += 1
        mine = {d for op in got.get(path, ()) for s, d in zip(op.shapes, op.dims, strict=True) if s == ch.shape}
        if ch.dims in mine:
            agree += 1
        elif mine:
            differ.append((path, ch.op, ch.shape, ch.dims, mine))
    assert compared > 300, (model, compared)
    # every value XLA lays out that the propagation names the same way: the same layout (measured:
    # 1 of about 7,000 differs over six pairs, a call's result); the rest are ops XLA makes itself
    assert len(differ) <= compared // 200, differ[:5]
    assert agree >= 0.9 * compared, (agree, compared, model, text)


def _traced(fn, *avals):
    return jax.make_jaxpr(fn)(*avals)


def test_a_function_called_twice_gets_a_path_per_call_and_a_layout_each():
    """One jitted function, two callers with differently split operands: one jaxpr, two paths."""
    sizes = {"data": 2, "model": 4}
    abstract = tracing.abstract_mesh(sizes)

    @jax.jit
    def scale(x):
        return x * 2.0

    def step(a, b):
        return scale(a), scale(b)

    closed = _traced(step, jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    split = [(("data",), ()), ((), ("model",))]
    got = shardy.Propagator(closed, abstract).layouts(split, split)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["jit", "jit"]
    assert shardy.result_layout(got[(0, 0)], (8, 16)) == (("data",), ())
    assert shardy.result_layout(got[(1, 0)], (8, 16)) == ((), ("model",))


def test_a_loop_reads_what_its_body_never_changes_from_outside_through_an_open_constraint():
    """XLA's import: a while loop's pass-through operands become free variables of its body,
    each read through a constraint open on every dim (the body may lay it out otherwise)."""
    sizes = {"data": 2, "model": 4}

    def step(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)

    closed = _traced(step, jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
    text = shardy.imported(shardy.lowered(closed, tracing.abstract_mesh(sizes)))
    opened = re.search(r"(%\d+) = sdy\.sharding_constraint %arg1 <@mesh, \[\{\?\}, \{\?\}\]>", text)
    assert opened, text
    (dot,) = [line for line in text.splitlines() if "stablehlo.dot" in line]
    assert dot.split("(")[0].split(",")[-1].strip() == opened.group(1) or f", {opened.group(1)}," in dot, dot


def test_a_constraint_in_the_step_reaches_the_propagation():
    sizes = {"data": 2, "model": 4}
    abstract = tracing.abstract_mesh(sizes)

    def step(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(abstract, PartitionSpec(None, "model")))
        return jnp.tanh(h)

    closed = _traced(step, jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 32), jnp.float32))
    got = shardy.Propagator(closed, abstract).layouts([((), ()), ((), ())], [((), ())])
    tanh = next(k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "tanh")
    assert shardy.result_layout(got[(tanh,)], (8, 32)) == ((), ("model",))


_ENGINE = "tests/fixtures/engine_models.py"
_BATCH = "tokens=int32[32,64],labels=int32[32,64]"


def _check(*args):
    import subprocess
    import sys

    from tests.helpers import ROOT

    cmd = [sys.executable, "-m", "shardplan", "check", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_check_layouts_lists_the_largest_values_and_says_which_every_device_holds_whole(tmp_path, capsys):
    """A model of our own: under data parallelism its largest values are split over the batch's
    axis; with the batch left whole, every device holds them whole and ``check`` says so."""
    from shardplan.tools import cli

    step = ["--model", f"{_ENGINE}:decoder", "--devices", "8", "--step", f"{_ENGINE}:decoder_loss", "--batch", _BATCH]
    assert cli.main(["check", "plans/dp.splan", *step, "--layouts", "4"]) == 0
    table = capsys.readouterr().out.split("as XLA lays them out")[1]
    assert table.count("1/8") == 4 and "(data, " in table and "whole on every device" not in table
    whole = tmp_path / "whole.splan"
    whole.write_text('plan "whole"\nmesh data = *\nbatch (_, _)\ndefault replicated\n')
    assert cli.main(["check", str(whole), *step, "--layouts", "4", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all(not any(r["layout"]) for r in rows)  # nothing splits anything
    assert [r["bytes_per_device"] for r in rows] == sorted((r["bytes_per_device"] for r in rows), reverse=True)
    assert cli.main(["check", str(whole), *step, "--layouts", "4"]) == 0
    text = capsys.readouterr().out
    assert "whole on every device" in text and "act rule" in text


def test_check_propagation_xla_costs_the_step_on_xlas_layouts(capsys):
    """``check --step --propagation xla``: fast mode partitions Shardy's layouts and says so; the
    API gives the same figures; it refuses what it cannot cost (a compile, the shard_map backend)."""
    from shardplan.tools import cli

    step = ["--model", f"{_ENGINE}:decoder", "--devices", "8", "--step", f"{_ENGINE}:decoder_loss", "--batch", _BATCH]
    args = ["check", "plans/fsdp.splan", *step, "--propagation", "xla"]
    assert cli.main([*args, "--format", "json"]) == 0
    cost = json.loads(capsys.readouterr().out)["step_cost"]
    assert cost["mode"] == "fast" and cost["propagation"] == "xla"
    same = shardplan.api.analyze(
        "plans/fsdp.splan",
        model=f"{_ENGINE}:decoder",
        step=f"{_ENGINE}:decoder_loss",
        batch=[_BATCH],
        optimizer="adam",  # (check's default)
        devices=8,
        mode="fast",
        propagation="xla",
    )
    assert cost["flops_per_device"] == same.flops and same.propagation == "xla"
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "laid out by XLA's propagation" in text and "Shardy's propagation" in text
    assert cli.main([*args, "--compile"]) == 2
    assert "--propagation says how fast mode lays a step out" in capsys.readouterr().err
    assert cli.main([*args, "--backend", "shard_map"]) == 2
    assert "costs the auto backend's step" in capsys.readouterr().err


def test_check_layouts_needs_a_step():
    got = _check("plans/dp.splan", "--model", f"{_ENGINE}:decoder", "--devices", 8, "--layouts")
    assert got.returncode == 2 and "--layouts lists a step's values" in got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
def test_a_shard_map_region_is_imported_as_xla_imports_it():
    """A step with a hand-placed region: its body runs per device (XLA imports it as a manual
    computation), and the values around it are laid out as XLA lays them out."""
    sizes = {"data": 2, "model": 4}
    abstract = tracing.abstract_mesh(sizes)

    def step(x, w, v):
        def local(a, b):
            return jax.lax.psum(a @ b, "model")

        y = jax.shard_map(
            local,
            mesh=abstract,
            in_specs=(PartitionSpec("data", "model"), PartitionSpec("model")),
            out_specs=PartitionSpec("data"),
        )(x, w)
        return jnp.tanh(y) @ v, jnp.sum(y * 2.0)

    avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 16), (16, 32), (32, 24))]
    with jax.sharding.use_abstract_mesh(abstract):
        closed = _traced(step, *avals)
    args = [((), ()), ((), ()), ((), ("model",))]
    results = [((), ()), ()]
    got = shardy.Propagator(closed, abstract).layouts(args, results)
    compared = 0
    for ch in _xla(closed, sizes, args, results):
        path = shardy.path_of(ch.name)
        mine = {d for op in got.get(path, ()) for s, d in zip(op.shapes, op.dims, strict=True) if s == ch.shape}
        if path and ch.shape and ch.dims is not None and mine and path[0] != 0:  # (outside the region)
            compared += 1
            assert ch.dims in mine, (path, ch.op, ch.shape, ch.dims, mine)
    assert compared >= 3
    tanh = next(k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "tanh")
    assert shardy.result_layout(got[(tanh,)], (8, 32)) == (("data",), ())


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
def test_a_while_loops_condition_and_body_get_paths_of_their_own_and_xlas_layouts():
    """A while loop runs two jaxprs whose equations share indices: each gets its own path, and
    the values the body makes are listed in the layouts XLA gives them."""
    sizes = {"data": 2, "model": 4}
    abstract = tracing.abstract_mesh(sizes)

    def step(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]

    closed = _traced(step, jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
    args, results = [(("data",), ()), ((), ())], [(("data",), ())]
    got = shardy.Propagator(closed, abstract).layouts(args, results)
    (loop,) = [k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "while"]
    assert any(p[:2] == (loop, 0) for p in got) and any(p[:2] == (loop, 1) for p in got)  # condition, body
    listed = {(v.op, v.shape): v.dims for v in shardy.values(closed.jaxpr, got)}
    assert listed[("tanh", (8, 16))] == (("data",), ())
    xla = {(ch.op, ch.shape): ch.dims for ch in _xla(closed, sizes, args, results) if shardy.path_of(ch.name)}
    assert xla[("tanh", (8, 16))] == listed[("tanh", (8, 16))]


def test_a_propagation_failure_is_said_without_the_call_stack_of_its_location():
    err = RuntimeError(
        'Failure while executing pass pipeline:\nerror: "p3/shard_map"(callsite("f"("/x/m.py":2:1) at '
        'callsite("g"("/x/m.py":9:4) at "h"("/x/m.py":12:0)))): Shardy propagation doesn\'t support tuples: '
        "'tuple<tensor<2xf32>>'\n note: see current operation"
    )
    assert shardy.reason(err) == "RuntimeError: Shardy propagation doesn't support tuples: 'tuple<tensor<2xf32>>'"
