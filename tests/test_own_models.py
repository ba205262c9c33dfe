"""Users' own models: examples/train.py and examples/generate.py take FILE:FACTORY (and a loss
FILE:FN, and a text file), for a causal LM written outside this repository."""

import json
import subprocess
import sys

from tests.helpers import PLANS, ROOT

OWN_MODEL = '''
"""A causal LM written outside shardplan: tokens -> logits, nothing else."""
import jax.numpy as jnp
from flax import nnx


class TinyLM(nnx.Module):
    def __init__(self, rngs, vocab=64, d=64, t=64):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(t, d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
        self.ff = nnx.Linear(d, 4 * d, rngs=rngs)
        self.back = nnx.Linear(4 * d, d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
        return self.head(x + self.back(nnx.gelu(self.ff(x))))


def make():
    return TinyLM(nnx.Rngs(0))
'''
OWN_LOSS = '''
import optax


def loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
'''
OWN_PLAN = '''plan "own"
mesh data = *, model = 2
batch (data, _)
param "(ff|head)/kernel"  (_, model)
param "back/kernel"       (model, _)
default replicated
'''


def run(*args, timeout=300):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_train_a_model_defined_elsewhere_on_the_bundled_text(tmp_path):
    (tmp_path / "mymodel.py").write_text(OWN_MODEL)
    (tmp_path / "myloss.py").write_text(OWN_LOSS)
    (tmp_path / "own.splan").write_text(OWN_PLAN)
    m = tmp_path / "m.json"
    r = run(ROOT / "examples" / "train.py", "--plan", tmp_path / "own.splan", "--model",
            f"{tmp_path / 'mymodel.py'}:make", "--loss", f"{tmp_path / 'myloss.py'}:loss", "--data",
            ROOT / "examples" / "data" / "corpus.txt", "--steps", 40, "--seq-len", 32, "--no-show", "--metrics", m)
    evals = json.loads(m.read_text())["eval"]
    assert [s for s, _ in evals] == [0, 40]
    assert evals[1][1] < evals[0][1] - 0.5, evals  # the held-out loss falls
    assert "eval loss" in r.stdout


POSITIONS_MODEL = OWN_MODEL.replace(
    "def __call__(self, tokens):\n        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]",
    "def __call__(self, tokens, positions):\n        x = self.tok(tokens) + self.pos(positions)",
)
POSITIONS_LOSS = OWN_LOSS.replace(
    'logits = model(batch["tokens"])',
    'tokens = batch["tokens"]\n    logits = model(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))',
).replace("import optax", "import jax.numpy as jnp\nimport optax")


def test_a_model_that_takes_more_than_tokens_trains_with_its_own_loss(tmp_path):
    """A model called as ``model(tokens, positions)`` (Flax's Gemma takes positions, a cache and a
    mask): with its own --loss it trains, the synthetic tokens drawn below its embedding tables'
    rows (train.py had called it on tokens alone to size them: a TypeError traceback); without a
    loss the script says what to give and exits 2."""
    assert "def __call__(self, tokens, positions)" in POSITIONS_MODEL and "arange" in POSITIONS_LOSS
    (tmp_path / "mymodel.py").write_text(POSITIONS_MODEL)
    (tmp_path / "myloss.py").write_text(POSITIONS_LOSS)
    (tmp_path / "own.splan").write_text(OWN_PLAN)
    args = [ROOT / "examples" / "train.py", "--plan", tmp_path / "own.splan", "--model",
            f"{tmp_path / 'mymodel.py'}:make", "--steps", 3, "--seq-len", 16, "--batch-size", 8, "--no-show"]
    r = run(*args, "--loss", f"{tmp_path / 'myloss.py'}:loss")
    assert "over 3 steps" in r.stdout
    bare = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert bare.returncode == 2 and "Traceback" not in bare.stdout + bare.stderr
    assert "does not run on a (8, 16) token batch alone" in bare.stdout and "--loss" in bare.stdout


def test_generate_with_a_model_defined_elsewhere_takes_the_plain_path(tmp_path):
    (tmp_path / "mymodel.py").write_text(OWN_MODEL)
    r = run(ROOT / "examples" / "generate.py", "--plan", PLANS / "dp.splan", "--model",
            f"{tmp_path / 'mymodel.py'}:make", "--max-new-tokens", 4)
    assert "generation path: plain" in r.stdout and "shardplan_forward" in r.stdout


OWN_STEP = """
import sys
from shardplan.runtime.devices import simulate
simulate(8)
import numpy as np
import optax
from flax import nnx
import shardplan
sys.path.insert(0, %(root)r)
from examples import models, train as ex

plan = shardplan.load(%(plan)r)
model, optimizer, placement = shardplan.init_sharded(plan, models.gpt_tiny, optax.adamw(1e-3))
PIN = %(pin)s


@nnx.jit
def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(ex.lm_loss)(model, batch)
    optimizer.update(model, grads)
    if PIN:
        placement.constrain(model, optimizer)  # the README's one line
    return loss


rng = np.random.default_rng(0)
host = ex.synthetic_batch(rng, 64, 16, 16)
try:
    shardplan.verify(placement, model, optimizer, host)
except shardplan.ShardPlanError as e:
    print("host batch:", e.diagnostics[0].message)
for i in range(5):
    step(model, optimizer, placement.shard_batch(ex.synthetic_batch(rng, 64, 16, 16)))
    try:
        shardplan.verify(placement, model, optimizer)
    except shardplan.ShardPlanError as e:
        print(f"step {i}: {len(e.diagnostics)} leaves off plan, e.g. {e.diagnostics[0].message}")
        break
else:
    print("5 steps on plan")
"""


def test_a_plain_nnx_jit_step_keeps_the_plan_with_the_readme_line(tmp_path):
    """Under gpt_2d, a plain nnx.jit step lets XLA move the replicated norm scales after one
    step; `placement.constrain(model, optimizer)` at the end of the step keeps every leaf on plan."""
    script = tmp_path / "own_step.py"
    for pin, want in ((False, "step 0:"), (True, "5 steps on plan")):
        script.write_text(OWN_STEP % {"root": str(ROOT), "plan": str(PLANS / "gpt_2d.splan"), "pin": pin})
        r = run(script)
        assert want in r.stdout, r.stdout
        assert "host batch: batch leaf labels is a host ndarray, not placed on the mesh" in r.stdout
