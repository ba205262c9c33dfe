"""Layouts as XLA chose them (``shardplan.core.hlo.shardings``): an instruction's sharding text read
back into the mesh axes of each dim, and a propagated module read whole, checked against XLA's
own dump of a program whose layouts are known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import random_plans as rp
from shardplan.core.hlo.shardings import Chosen, dims

ROOT = Path(__file__).resolve().parent.parent
MESH = [("data", 4), ("seq", 2)]


@pytest.mark.parametrize(
    "text, rank, want",
    [
        ("replicated", 2, ((), ())),
        ("devices=[4,1,1,2]<=[8] last_tile_dim_replicate", 3, (("data",), (), ())),
        ("devices=[1,1,8]<=[8]", 3, ((), (), ("data", "seq"))),
        ("devices=[2,4]<=[4,2]T(1,0)", 2, (("seq",), ("data",))),
        ("devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate", 2, ((), ("seq",))),
        ("devices=[4,2]0,1,2,3,4,5,6,7", 2, (("data",), ("seq",))),
        # split over part of an axis, or over both axes out of order: not whole mesh axes
        ("devices=[2,1,4]<=[8] last_tile_dim_replicate", 2, None),
        ("devices=[1,1,8]<=[2,4]T(1,0)", 3, None),
        ("devices=[4,2]0,2,4,6,1,3,5,7", 2, None),
        ("maximal device=0", 2, None),
    ],
)
def test_a_sharding_reads_back_as_the_mesh_axes_of_each_dim(text, rank, want):
    assert dims(text, rank, MESH) == want


_PROGRAM = textwrap.dedent(
    """
    import glob, json, os, sys, tempfile
    dump = tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=shardy-xla")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from shardplan.core.hlo.shardings import layouts
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "seq"))
    def f(x, w, v):
        h = jnp.tanh(x @ w)          # x over data on the batch, w over seq on its columns
        return jnp.sum(h * 2.0) + jnp.sum(v.T * 3.0)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in
            [((16, 32), P("data")), ((32, 24), P(None, "seq")), ((8, 64), P(None, ("data", "seq")))]]
    jax.jit(f).lower(*args).compile()
    text = open(glob.glob(dump + "/*after_shardy-xla.before_spmd-partitioning.txt")[0]).read()
    print(json.dumps([[c.op, c.shape, c.dims] for c in layouts(text, [("data", 4), ("seq", 2)])]))
    """
)


def test_the_layouts_xla_propagated_are_read_from_its_dump():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    got = {(op, tuple(shape)): tuple(tuple(d) for d in ds) for op, shape, ds in read}
    # XLA's propagation (the dot's result takes the batch split of x and the column split of w; the
    # transpose carries v's column split to its rows); the parameters keep what they were given
    assert got[("dot_general", (16, 24))] == (("data",), ("seq",))
    assert got[("tanh", (16, 24))] == (("data",), ("seq",))
    assert got[("transpose", (64, 8))] == (("data", "seq"), ())
    assert got[("w", (32, 24))] == ((), ("seq",))


def test_divergences_name_the_largest_values_xla_lays_out_otherwise():
    fast = [
        ("/m/models.py:10", "mul", (8, 32), (("data",), ())),
        ("/m/models.py:11", "add", (8, 16), (("data",), ())),
        ("/m/models.py:12", "tanh", (8, 64), ((), ())),
        ("/m/models.py:13", "mul", (4,), ((),)),
    ]
    xla = [
        Chosen("/x/models.py:13", "mul", (4,), ((),)),
        Chosen("/x/models.py:11", "add", (8, 16), (("data",), ("seq",))),
        Chosen("/x/models.py:10", "mul", (8, 32), (("data",), ())),
        Chosen("/x/models.py:12", "tanh", (8, 64), (("data",), ("seq",))),
        Chosen("/x/models.py:12", "broadcast_in_dim", (8, 64, 4), (("data",), (), ())),  # read where used
        Chosen("/x/models.py:14", "exp", (8, 64), (("data",), ())),  # fast mode made none there
    ]
    got = rp.divergences(fast, xla)
    assert [(d["source"], d["op"]) for d in got] == [("models.py:12", "tanh"), ("models.py:11", "add")]
    assert got[0]["xla"] == ["(data, seq)"] and got[0]["fast"] == ["(_, _)"]
