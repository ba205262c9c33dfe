"""Models from outside: import a factory, build it abstractly, write its shapes, make its optimizer.

Everything the command line and the API need to turn ``FILE.py:FACTORY`` and an optimizer
name into abstract state, with errors that say which argument is wrong.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optax
from flax import nnx

from shardplan.core import optimizers
from shardplan.core.frames import user_frame
from shardplan.core.shapes import shapes_json
from shardplan.errors import ShardPlanError, as_error, error
from shardplan.runtime.tree import flatten

_TXS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adam": optax.adam,
    "adamw": optax.adamw,
    "sgd": optax.sgd,
}


def make_tx(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation | None:
    """The optax transformation registered as ``name`` in ``shardplan.core.optimizers``
    (``none``: no optimizer)."""
    optimizers.lookup(name)
    return _TXS[name](learning_rate) if name in _TXS else None


def dump_shapes(model: Any, path: str | os.PathLike, optimizer: Any = None) -> None:
    """Write the shapes JSON of a model (an NNX Module or State), and of its optimizer.

    Args:
        model: an ``nnx.Module`` (live or from ``nnx.eval_shape``) or its state.
        path: the JSON file to write.
        optimizer: an ``nnx.Optimizer`` (or its state), to record the real optimizer state.
    """
    params, _ = flatten(model)
    opt = flatten(optimizer)[0] if optimizer is not None else None
    Path(path).write_text(shapes_json(params, opt))


def load_factory(spec: str, what: str = "--model") -> Callable[..., Any]:
    """``path/to/file.py:factory`` or ``package.module:factory`` -> the callable.

    Raises:
        ShardPlanError: the file, module or attribute cannot be found or imported.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise as_error(
            [
                error(
                    "bad-model-arg",
                    f"cannot read {what} '{spec}'",
                    "write FILE.py:FACTORY or package.module:FACTORY",
                    path=what,
                )
            ]
        )
    try:
        if target.endswith(".py") or os.sep in target:
            file = Path(target).resolve()
            if not file.exists():
                raise as_error(
                    [
                        error(
                            "bad-model-arg",
                            f"no such file: {target}",
                            "check the path to the model file",
                            path=what,
                        )
                    ]
                )
            if str(file.parent) not in sys.path:
                sys.path.insert(0, str(file.parent))
            mod_name = f"_shardplan_model_{abs(hash(str(file)))}"
            loaded = sys.modules.get(mod_name)
            stamp = file.stat().st_mtime_ns
            if loaded is not None and getattr(loaded, "__shardplan_mtime__", None) == stamp:
                # the model and the step from one file: one module (loaded again once edited: a
                # long-lived process, the language server's, reads the file as it is now)
                return _attribute(loaded, target, name, what)
            loader_spec = importlib.util.spec_from_file_location(mod_name, file)
            assert loader_spec is not None and loader_spec.loader is not None  # a .py file always has one
            module = importlib.util.module_from_spec(loader_spec)
            module.__shardplan_mtime__ = stamp  # type: ignore[attr-defined]
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
        else:
            # As `python -m` does: a package in the working directory imports (examples.models:gpt_tiny
            # from a repository's root), where a console script's sys.path starts at its bin folder.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except ShardPlanError:
        raise
    except Exception as e:
        frame = user_frame(e.__traceback__)
        raise as_error(
            [
                error(
                    "model-import",
                    f"importing '{target}' failed{' at ' + frame if frame else ''}: {type(e).__name__}: {e}",
                    f"fix the model module{' at ' + frame if frame else ''}, or check with --shapes from dump_shapes",
                    path=what,
                )
            ]
        ) from None
    return _attribute(module, target, name, what)


def _attribute(module: Any, target: str, name: str, what: str) -> Callable[..., Any]:
    fn = getattr(module, name, None)
    if not callable(fn):
        raise as_error(
            [
                error(
                    "bad-model-arg",
                    f"'{target}' has no callable '{name}'",
                    "name a function (or class) defined in that module",
                    path=what,
                )
            ]
        )
    return fn


def _callable_without_arguments(factory: Any, path: str) -> None:
    """A factory is called with no arguments: one that needs some is named before it is called."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a signature Python cannot read: let the call say
        return
    needs = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if needs:
        raise as_error(
            [
                error(
                    "model-build",
                    f"the factory takes arguments ({', '.join(needs)}); shardplan calls it with none",
                    "name a function that builds the model with no arguments, e.g. "
                    "def make(): return MyModel(Config(), nnx.Rngs(0))",
                    path=path,
                )
            ]
        )


@contextlib.contextmanager
def quiet_tracer_origins() -> Iterator[None]:
    """While shardplan traces a model or a step abstractly, JAX's tracer error text skips its
    search for where a value came from.

    Flax reads ``getattr(value, "sharding", None)`` on every Variable write (each RNG draw and
    optimizer update); on a tracer that raises an AttributeError whose message JAX builds by
    walking the whole trace so far (``find_progenitors``), so an abstract init is quadratic in
    the model's size: 3.2 of the 3.8 s ``nnx.eval_shape`` spends on Llama-2-70B here. The text is
    only read when such an error reaches a user; it loses its "the error occurred while tracing
    ..." sentence while shardplan traces, and is restored after.
    """
    from jax._src.interpreters import partial_eval

    tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
    original = getattr(tracer, "_origin_msg", None)
    if tracer is None or original is None:  # another JAX: nothing to skip
        yield
        return
    tracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        tracer._origin_msg = original


def abstract_model(factory, *, path: str = "--model") -> Any:
    """Build a model abstractly (``nnx.eval_shape``): shapes only, nothing allocated.

    Eager sharding is off while building, so models annotated with
    ``nnx.with_partitioning`` build without a mesh; the annotations stay in metadata.
    ``path`` names the factory in the error when building fails.
    """
    _callable_without_arguments(factory, path)
    try:
        with nnx.use_eager_sharding(False), quiet_tracer_origins():
            built = nnx.eval_shape(factory)
    except ShardPlanError:
        raise
    except Exception as e:  # the user's code: their error at their line
        frame = user_frame(e.__traceback__)
        raise as_error(
            [
                error(
                    "model-build",
                    f"building the model failed{' at ' + frame if frame else ''}: {type(e).__name__}: {e}",
                    f"fix the model code{' at ' + frame if frame else ''}; the factory is called with no "
                    "arguments under nnx.eval_shape (shapes only: no array is allocated)",
                    path=path,
                )
            ]
        ) from None
    parts = built if isinstance(built, tuple) else (built,)
    pytree = getattr(nnx, "Pytree", nnx.Module)
    if not parts or not isinstance(parts[0], (nnx.Module, pytree)):
        got = type(parts[0]).__name__ if parts else "an empty tuple"
        raise as_error(
            [
                error(
                    "model-build",
                    f"the factory returned {got}, not an nnx.Module",
                    "return the model from the factory (a missing `return`?)",
                    path=path,
                )
            ]
        )
    if not nnx.state(parts[0]):
        raise as_error(
            [
                error(
                    "model-build",
                    f"the factory's {type(parts[0]).__name__} has no arrays: nothing to place",
                    "build the model's layers in its __init__ (nnx.Linear, nnx.Param, ...)",
                    path=path,
                )
            ]
        )
    return built


def abstract_model_and_optimizer(
    factory: Callable[[], Any], tx: optax.GradientTransformation | None, *, wrt: Any = nnx.Param, path: str = "--model"
) -> tuple[Any, Any]:
    """(model, ``nnx.Optimizer`` or None) built abstractly: shapes only."""
    _callable_without_arguments(factory, path)

    def build():
        model = factory()
        return model, (nnx.Optimizer(model, tx, wrt=wrt) if tx is not None else None)

    return abstract_model(build, path=path)
