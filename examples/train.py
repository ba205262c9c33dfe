"""Train an example model under a plan, on simulated CPU devices or real ones.

    python examples/train.py --plan plans/gpt_tp.splan            # 8 simulated CPU devices
    python examples/train.py --plan plans/fsdp.splan --model mlp_small --steps 50
    python examples/train.py --plan plans/dp.splan --simulate-devices 0   # the real devices
    python examples/train.py --plan plans/fsdp.splan --model my_model.py:make --data examples/data/corpus.txt

The step is the single-device step (loss_fn below); only the plan decides placement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from shardplan.core.backends import NAMES as BACKENDS  # jax-free: devices are set up later


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="the .splan file")
    p.add_argument("--model", default="gpt_tiny", help="a factory in examples/models.py (gpt_tiny, gpt_small, "
                   "llama_tiny, mlp_small, ...), or your own: FILE.py:FACTORY or package.module:FACTORY")
    p.add_argument("--loss", metavar="FILE:FN", help="loss_fn(model, batch) -> scalar (default: LM cross-entropy; "
                   "MSE for the MLP); it may call a model that takes more than tokens (tokens then < its tables' rows)")
    p.add_argument("--data", metavar="FILE", help="train on this text file (e.g. examples/data/corpus.txt) "
                   "instead of synthetic sequences; 10%% held out for eval loss")
    p.add_argument("--eval-every", type=int, default=0, help="with --data: eval loss every N steps (default: "
                   "at the start and the end)")
    p.add_argument("--mesh", help="axis sizes replacing the plan's mesh, e.g. data=4,model=2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=BACKENDS, help="default: the plan's backend")
    p.add_argument("--axis-types", choices=("auto", "explicit"),
                   help="every mesh axis of this type (default: the plan's mesh statement's types)")
    p.add_argument("--simulate-devices", type=int, default=8,
                   help="simulated CPU devices (set before jax loads); 0 uses the real devices")
    p.add_argument("--no-show", action="store_true", help="skip the sharding view")
    p.add_argument("--checkpoint-dir", help="save Orbax checkpoints here")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (default: at the end)")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint first")
    p.add_argument("--metrics", help="write the losses (JSON) here")
    p.add_argument("--log-every", type=int, default=0, help="also print 'step N loss X' every N steps (plain "
                   "lines, for logs and multi-process runs)")
    return p.parse_args(argv)


def setup_devices(n: int) -> None:
    if n and "SHARDPLAN_COORDINATOR" not in os.environ:  # under `shardplan launch`, the launcher sets them
        from shardplan.runtime.devices import simulate

        simulate(n)


def synthetic_batch(rng, vocab: int, batch: int, seq: int, rows: slice | None = None):
    """Sequences that follow x[t+1] = (3 x[t] + 1) mod vocab from a random start: learnable.

    ``rows``: this process's part of the global batch (every process draws the same global
    batch, so 2 processes x 4 devices see exactly what 1 process x 8 devices sees).
    """
    import numpy as np

    start = rng.integers(0, vocab, size=(batch, 1))
    seqs = start.copy()
    for _ in range(seq):
        seqs = np.concatenate([seqs, (3 * seqs[:, -1:] + 1) % vocab], axis=1)
    seqs = seqs[rows] if rows is not None else seqs
    return {"tokens": seqs[:, :-1].astype(np.int32), "labels": seqs[:, 1:].astype(np.int32)}


def synthetic_regression(rng, batch: int, din: int, dout: int, rows: slice | None = None):
    import numpy as np

    x = rng.standard_normal((batch, din)).astype(np.float32)
    w = np.linspace(-1, 1, din * dout, dtype=np.float32).reshape(din, dout)
    x = x[rows] if rows is not None else x
    return {"x": x, "y": np.tanh(x @ w)}


def lm_loss(model, batch):
    import optax

    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def moe_lm_loss(model, batch):
    """The LM loss of a model returning (logits, load-balancing loss): cross-entropy plus the
    balancing term at the model's weight (examples/models.py's MoE)."""
    import optax

    logits, aux = model(batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    weight = getattr(getattr(model, "cfg", None), "aux_weight", 0.01)  # examples/models.py's MoEConfig
    return ce + weight * aux


def mse_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def logits_of(out):
    """The logits of a causal LM's output: the output itself, or the first item of a tuple
    (``(logits, aux)`` from a mixture of experts, ``(logits, cache)``)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def output_of(model, placement, batch: int, seq: int):
    """The abstract output of a causal LM on a (batch, seq) token batch laid out as the plan lays
    it out, traced under the plan's mesh (a model typed by explicit mesh axes reads it from the
    context): any model, no config read."""
    import jax
    import numpy as np
    from flax import nnx

    from shardplan.runtime.placement import mesh_context

    gd, state = nnx.split(model)
    spec = {"tokens": jax.ShapeDtypeStruct((batch, seq), np.int32)}
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=placement.batch_shardings(spec)["tokens"])
    with mesh_context(placement.mesh):
        return jax.eval_shape(lambda s, t: nnx.merge(gd, s)(t), state, tokens)


def vocab_of(model, placement, batch: int, seq: int) -> int:
    """The vocabulary of a causal LM, from the logits it returns."""
    return logits_of(output_of(model, placement, batch, seq)).shape[-1]


def embedding_rows(model) -> int | None:
    """The fewest rows of the model's embedding tables (its ``nnx.Embed`` modules, by type): token
    ids below it index every table. None: it has none."""
    from flax import nnx

    rows = [m.num_embeddings for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Embed)]
    return min(rows) if rows else None


def make_data(model_name: str, model, placement, seed: int, batch: int, seq: int, data: str | None = None,
              own_loss: bool = False):
    """A batch generator (this process's rows of each global batch), the default loss (the LM
    loss, with the balancing term for a model returning ``(logits, aux)``), and the held-out
    text data (with --data). ``own_loss``: the user's loss calls the model (--loss), which need
    not take a token batch alone: then the tokens are drawn below its embedding tables' rows."""
    import numpy as np

    from shardplan import distributed

    rng = np.random.default_rng(seed)
    rows = distributed.process_slice(batch)
    if model_name.startswith("mlp"):
        din = model.layers[0].in_features
        dout = model.layers[-1].out_features
        return (lambda: synthetic_regression(rng, batch, din, dout, rows)), mse_loss, None
    try:
        out = output_of(model, placement, batch, seq)
    except Exception as err:  # the user's model, called as a causal LM on tokens alone
        table = embedding_rows(model) if own_loss else None
        if table is None:
            how = "" if own_loss else "; give --loss FILE:FN, a loss that calls it as it is called"
            raise ValueError(f"the model does not run on a ({batch}, {seq}) token batch alone "
                             f"({type(err).__name__}: {err}){how}") from None
        vocab, loss = table, lm_loss  # (the --loss replaces the loss)
    else:
        vocab = logits_of(out).shape[-1]
        # (logits, aux) with a scalar aux: a mixture of experts' balancing loss, added to the LM loss.
        with_aux = isinstance(out, (tuple, list)) and len(out) == 2 and getattr(out[1], "shape", None) == ()
        loss = moe_lm_loss if with_aux else lm_loss
    if data:
        import data as text

        source = text.TextData(data, seq, batch, seed, rows)
        if vocab < len(text.ALPHABET):
            raise ValueError(f"the model's vocabulary ({vocab}) is smaller than the text's "
                             f"alphabet ({len(text.ALPHABET)})")
        return source.next_batch, loss, source
    return (lambda: synthetic_batch(rng, vocab, batch, seq, rows)), loss, None


def load_factory(spec: str, seed: int):
    """A factory in examples/models.py by name (called with the seed), or FILE:FACTORY /
    module:FACTORY (called with no arguments, as the CLI does)."""
    import inspect

    if ":" not in spec:
        import models

        factory = getattr(models, spec, None)
        if factory is None:
            raise ValueError(f"no model factory '{spec}' in examples/models.py; or write FILE.py:FACTORY")
        return lambda: factory(seed)
    from shardplan.runtime.model import load_factory as load

    factory = load(spec, "--model")
    takes_seed = any(p.default is inspect.Parameter.empty for p in inspect.signature(factory).parameters.values())
    return (lambda: factory(seed)) if takes_seed else factory


def make_eval(placement, loss_fn, text, batches: int = 4):
    """Mean loss over fixed held-out batches, each placed per the plan's batch spec."""
    import jax
    import numpy as np
    from flax import nnx

    held_out = [placement.shard_batch(b) for b in text.eval_batches(batches)]
    compiled = {}

    def evaluate(model) -> float:
        gd, state = nnx.split(model)
        if "fn" not in compiled:
            compiled["fn"] = jax.jit(lambda s, b: loss_fn(nnx.merge(gd, s), b))
        return float(np.mean([float(compiled["fn"](state, b)) for b in held_out]))

    return evaluate


def precheck(args) -> int:
    """The flags checked before jax loads (a mistake reported in about a second): the plan, the
    mesh, the model and loss references (with a did-you-mean). Returns an exit code (0: go on)."""
    from rich.console import Console

    import shardplan
    from shardplan.core.callables import check_ref

    model = args.model if ":" in args.model else f"{Path(__file__).resolve().parent / 'models.py'}:{args.model}"
    try:
        mesh_arg = shardplan.parse_mesh_arg(args.mesh) if args.mesh else None
        shardplan.load(args.plan, mesh=mesh_arg)
        check_ref(model, "--model")
        if args.loss:
            check_ref(args.loss, "--loss")
    except shardplan.ShardPlanError as e:
        shardplan.print_diagnostics(Console(stderr=True), e.diagnostics)
        return 2
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if rc := precheck(args):
        return rc
    setup_devices(args.simulate_devices)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    import jax

    from shardplan import distributed

    import optax
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import shardplan
    from shardplan import print_diagnostics

    try:
        distributed.initialize()  # joins the job SLURM, MPI, Kubernetes or `shardplan launch` started; else a no-op
    except shardplan.ShardPlanError as e:
        print_diagnostics(Console(stderr=True), e.diagnostics)
        return 1
    # One progress bar and one summary, from process 0; other processes print prefixed lines.
    # Wide tables when piped or logged, as the shardplan command prints them (rich assumes 80 columns).
    console = Console(quiet=jax.process_index() != 0, width=None if sys.stdout.isatty() else 160)
    tag = f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""
    try:
        mesh_arg = shardplan.parse_mesh_arg(args.mesh) if args.mesh else None
        plan = shardplan.load(args.plan, mesh=mesh_arg)
        try:
            factory = load_factory(args.model, args.seed)
        except ValueError as e:
            console.print(f"[red]{e}[/]")
            return 2
        mesh = shardplan.make_mesh(plan, axis_types=args.axis_types)
        tx = optax.adamw(args.lr)
        model, optimizer, placement = shardplan.init_sharded(plan, factory, tx, mesh=mesh)
        ckpt = None
        if args.checkpoint_dir:
            from shardplan import checkpoint

            ckpt = checkpoint.Checkpointer(args.checkpoint_dir, placement)
            if args.resume and ckpt.latest_step() is not None:
                step0 = ckpt.restore(model, optimizer)
                console.print(f"resumed from step {step0} in {args.checkpoint_dir}")
        try:
            next_batch, loss_fn, text = make_data(args.model, model, placement, args.seed, args.batch_size,
                                                   args.seq_len, args.data, own_loss=bool(args.loss))
        except ValueError as e:
            console.print(f"[red]{e}[/]")
            return 2
        if args.loss:
            from shardplan.runtime.model import load_factory as load

            loss_fn = load(args.loss, "--loss")
        step = shardplan.train_step(placement, loss_fn, model, optimizer, backend=args.backend)
        evaluate = make_eval(placement, loss_fn, text) if text is not None else None
        evals = []
        start = int(optimizer.step[...])
        for _ in range(start):  # resumed: continue the data stream where the checkpoint left it
            next_batch()
        batch = next_batch()
        console.print(f"[bold]{plan.name or args.plan}[/] on {len(jax.devices())} {jax.devices()[0].platform} "
                      f"devices ({jax.process_count()} process(es)), mesh {placement.mesh_shape}, "
                      f"backend {step.backend}")
        print(f"{tag}process {jax.process_index()} pid {os.getpid()}: {jax.local_device_count()} local devices, "
              f"feeds batch rows {distributed.process_slice(args.batch_size)}", flush=True)
        print_diagnostics(console, placement.params.warnings)
        if not args.no_show and jax.process_count() == 1:
            shardplan.show(model, console=console, title="params", max_visualize=2)
            shardplan.show(placement.shard_batch(batch), console=console, title="batch", max_visualize=1)
        shardplan.verify(placement, model, optimizer, placement.shard_batch(batch))

        losses = []
        if evaluate is not None:
            evals.append((start, evaluate(model)))
            console.print(f"eval loss {evals[-1][1]:.4f} at step {start} (held-out text)")
        with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[ms]} ms/step"),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("train", total=args.steps, loss="-", ms="-")
            for i in range(args.steps):
                t0 = time.perf_counter()
                loss = float(step(model, optimizer, batch))
                dt = time.perf_counter() - t0
                losses.append(loss)
                progress.update(task, advance=1, loss=f"{loss:.4f}", ms=f"{1000 * dt:.1f}")
                if args.log_every and (start + i + 1) % args.log_every == 0 and jax.process_index() == 0:
                    print(f"step {start + i + 1} loss {loss:.6f} ({1000 * dt:.1f} ms)", flush=True)
                batch = next_batch()
                at = start + i + 1
                if evaluate is not None and (i == args.steps - 1 or (args.eval_every and at % args.eval_every == 0)):
                    evals.append((at, evaluate(model)))
                    progress.console.print(f"eval loss {evals[-1][1]:.4f} at step {at} (held-out text)")
                if ckpt and args.save_every and (start + i + 1) % args.save_every == 0:
                    ckpt.save(start + i + 1, model, optimizer)
        if ckpt:
            if not (args.save_every and args.steps and (start + args.steps) % args.save_every == 0):
                ckpt.save(start + args.steps, model, optimizer)  # not saved by --save-every already
            ckpt.wait()
        shardplan.verify(placement, model, optimizer)
        if args.metrics and jax.process_index() == 0:
            import json

            Path(args.metrics).write_text(json.dumps({"start": start, "losses": losses, "eval": evals}))
        console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps "
                      f"(step {start} -> {start + args.steps})")
        return 0
    except shardplan.ShardPlanError as e:
        print_diagnostics(Console(stderr=True), e.diagnostics)
        return 1
    except (ValueError, OSError) as e:  # --data: a file that cannot be read or is too short
        Console(stderr=True).print(f"error: {e}", markup=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
