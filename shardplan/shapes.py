"""Shapes without models: the shapes JSON format, abstract model builds, optimizer state.

``dump_shapes`` writes a model's param (and optionally optimizer-state) shapes from a
training script, so a plan can be checked where the model code cannot be imported.
Reading a shapes file needs no jax.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from shardplan.errors import PlanCheckError, ShardPlanError, error
from shardplan.resolve import Leaf

FORMAT = "shardplan-shapes/1"
Optimizer = Literal["adam", "adamw", "sgd", "none"]
_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8, "complex128": 16}


def _leaf_json(leaf: Leaf) -> dict:
    d: dict = {"path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype}
    if leaf.names:
        d["names"] = list(leaf.names)
    return d


def dump_shapes(model: Any, path: str | os.PathLike, optimizer: Any = None) -> None:
    """Write the shapes JSON of a model (an NNX Module or State), and of its optimizer.

    Args:
        model: an ``nnx.Module`` (live or from ``nnx.eval_shape``) or its state.
        path: the JSON file to write.
        optimizer: an ``nnx.Optimizer`` (or its state), to record the real optimizer state.
    """
    from shardplan import tree

    params, _ = tree.flatten(model)
    doc: dict = {"format": FORMAT, "params": [_leaf_json(leaf) for leaf in params]}
    if optimizer is not None:
        opt, _ = tree.flatten(optimizer)
        doc["opt_state"] = [_leaf_json(leaf) for leaf in opt]
    Path(path).write_text(json.dumps(doc, indent=1))


def load_shapes(path: str | os.PathLike) -> tuple[list[Leaf], list[Leaf] | None]:
    """Read a shapes JSON: (param leaves, optimizer-state leaves or None if not recorded).

    Raises:
        PlanCheckError: the file is unreadable or not in the shapes format.
    """
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanCheckError([error("cannot-read", f"cannot read shapes file: {e.strerror}",
                                    "write one with shardplan.dump_shapes(model, path)", path=where)]) from None
    except json.JSONDecodeError as e:
        raise PlanCheckError([error("bad-shapes", f"not JSON (line {e.lineno}, column {e.colno}): {e.msg}",
                                    "write the file with shardplan.dump_shapes(model, path)",
                                    path=where)]) from None

    def leaves(items, key) -> list[Leaf]:
        out = []
        if not isinstance(items, list):
            raise PlanCheckError([error("bad-shapes", f"'{key}' must be a list of leaves",
                                        "write the file with shardplan.dump_shapes", path=where)])
        for i, it in enumerate(items):
            try:
                shape = tuple(int(s) for s in it["shape"])
                dtype = str(it["dtype"])
                names = it.get("names")
                if any(s < 0 for s in shape) or dtype not in _ITEMSIZE or not isinstance(it["path"], str):
                    raise ValueError
                out.append(Leaf(it["path"], shape, dtype, _ITEMSIZE[dtype],
                                tuple(names) if names else None))
            except (KeyError, TypeError, ValueError):
                raise PlanCheckError([error(
                    "bad-shapes", f"{key}[{i}] is not a leaf record {{path, shape, dtype}} with a known dtype",
                    f"fix entry {i}; dtypes: {', '.join(sorted(_ITEMSIZE))}", path=where)]) from None
        return out

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanCheckError([error("bad-shapes", f"not a shapes file (expected \"format\": \"{FORMAT}\")",
                                    "write the file with shardplan.dump_shapes(model, path)", path=where)])
    params = leaves(doc.get("params"), "params")
    opt = leaves(doc["opt_state"], "opt_state") if "opt_state" in doc else None
    return params, opt


def optimizer_leaves(params: list[Leaf], kind: Optimizer) -> list[Leaf]:
    """The state leaves ``nnx.Optimizer(model, optax.<kind>(...), wrt=nnx.Param)`` holds,
    derived from param shapes alone (no jax), with nnx.Optimizer's paths."""
    step = Leaf("step", (), "uint32", 4)
    if kind in ("sgd", "none"):
        return [step]
    if kind not in ("adam", "adamw"):
        raise PlanCheckError([error("unknown-optimizer", f"unknown optimizer '{kind}'",
                                    "use one of: adam, adamw, sgd, none", path="--optimizer")])
    out = [Leaf("opt_state/0/count", (), "int32", 4)]
    for field in ("mu", "nu"):
        out += [Leaf(f"opt_state/0/{field}/{p.path}", p.shape, p.dtype, p.itemsize) for p in params]
    return out + [step]


def load_factory(spec: str):
    """``path/to/file.py:factory`` or ``package.module:factory`` -> the callable.

    Raises:
        ShardPlanError: the file, module or attribute cannot be found or imported.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ShardPlanError([error("bad-model-arg", f"cannot read model '{spec}'",
                                    "write FILE.py:FACTORY or package.module:FACTORY", path="--model")])
    try:
        if target.endswith(".py") or os.sep in target:
            file = Path(target).resolve()
            if not file.exists():
                raise ShardPlanError([error("bad-model-arg", f"no such file: {target}",
                                            "check the path to the model file", path="--model")])
            sys.path.insert(0, str(file.parent))
            mod_name = f"_shardplan_model_{abs(hash(str(file)))}"
            loader_spec = importlib.util.spec_from_file_location(mod_name, file)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ShardPlanError:
        raise
    except Exception as e:
        raise ShardPlanError([error("model-import", f"importing '{target}' failed: {type(e).__name__}: {e}",
                                    "fix the model module, or check with --shapes from dump_shapes",
                                    path="--model")]) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ShardPlanError([error("bad-model-arg", f"'{target}' has no callable '{name}'",
                                    "name a function (or class) that builds the model with no arguments",
                                    path="--model")])
    return fn


def abstract_model(factory, *, path: str = "--model") -> Any:
    """Build a model abstractly (``nnx.eval_shape``): shapes only, nothing allocated.

    Eager sharding is off while building, so models annotated with
    ``nnx.with_partitioning`` build without a mesh; the annotations stay in metadata.
    ``path`` names the factory in the error when building fails.
    """
    from flax import nnx

    try:
        with nnx.use_eager_sharding(False):
            return nnx.eval_shape(factory)
    except ShardPlanError:
        raise
    except Exception as e:
        raise ShardPlanError([error("model-build", f"building the model abstractly failed: "
                                    f"{type(e).__name__}: {e}",
                                    "the factory must build an nnx.Module with no arguments",
                                    path=path)]) from None
