"""Property fuzzers for the inputs beside the plan text: shapes files and command-line flags.

Whatever is drawn, the only exception that may escape is ShardPlanError (argparse's usage
exit aside), the CLI exits 0, 1 or 2, and a shapes file that loads holds exactly the values
written (nothing coerced)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.core.optimizers import optimizer_leaves
from shardplan.core.shapes import ITEMSIZE, load_shapes
from shardplan.tools import cli
from tests.helpers import PLANS

MANY = settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
TMP = Path(tempfile.mkdtemp(prefix="fuzz-", dir=os.environ.get("SHARDPLAN_TEST_RUN")))  # removed with the run
PLAN = shardplan.loads('mesh data = *, model = 2\nparam ".*/w" (data, model)\naxis embed -> model\n'
                       'default replicated\n', "fuzz.splan")

scalars = st.one_of(
    st.integers(-3, 4096), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["float32", "bfloat16", "int8", "8", "", "embed"]),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)


@st.composite
def leaf_records(draw):
    """Mostly well-formed leaf records, each field replaced by anything now and then."""
    good_shape = draw(st.lists(st.sampled_from([1, 2, 4, 8, 16, 0, 6]), max_size=4))
    rec = {
        "path": draw(st.sampled_from(["blocks/0/w", "embed/w", "ln/scale", "a", "blocks/1/w"])),
        "shape": good_shape,
        "dtype": draw(st.sampled_from(sorted(ITEMSIZE))),
    }
    if draw(st.booleans()):
        rec["names"] = draw(st.lists(st.sampled_from(["embed", "mlp", None]), max_size=len(good_shape)))
    if draw(st.booleans()):
        rec["kind"] = draw(st.sampled_from(["batch_stat", "rng_key", "param"]))
    for key in ("path", "shape", "dtype", "names", "kind"):
        if draw(st.integers(0, 9)) == 0:
            rec[key] = draw(json_values)
    if draw(st.integers(0, 19)) == 0:
        rec.pop(draw(st.sampled_from(sorted(rec))))
    return rec


@st.composite
def shapes_docs(draw):
    doc = {"format": "shardplan-shapes/1", "params": draw(st.lists(leaf_records(), max_size=6))}
    if draw(st.booleans()):
        doc["opt_state"] = draw(st.lists(leaf_records(), max_size=4))
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.sampled_from(["format", "params", "opt_state"]))] = draw(json_values)
    return doc


def _write(data: bytes) -> Path:
    f = TMP / "shapes.json"
    f.write_bytes(data)
    return f


def _loaded_as_written(leaves, records):
    for lf, rec in zip(leaves, records, strict=True):
        assert lf.path == rec["path"] and isinstance(lf.path, str)
        assert list(lf.shape) == rec["shape"] and all(type(d) is int and d >= 0 for d in lf.shape)
        assert lf.dtype == rec["dtype"] and lf.itemsize == ITEMSIZE[lf.dtype]


@MANY
@given(shapes_docs())
def test_shapes_files_load_as_written_or_fail_located(doc):
    path = _write(json.dumps(doc).encode())  # NaN and Infinity written as JSON's extensions
    try:
        params, opt = load_shapes(path)
    except shardplan.ShardPlanError as e:
        assert all(d.path and d.path.startswith(str(path)) for d in e.diagnostics), e
        return
    _loaded_as_written(params, doc["params"])
    if opt is not None:
        _loaded_as_written(opt, doc["opt_state"])
    opt_leaves = optimizer_leaves(params, "adam")
    assert len(opt_leaves) == 2 * sum(p.is_param for p in params) + 2, "only params get Adam moments"
    try:
        shardplan.resolve_leaves(PLAN, {"data": 4, "model": 2}, params, opt_leaves)
    except shardplan.ShardPlanError:
        pass


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=300))
def test_shapes_files_of_arbitrary_bytes(data):
    try:
        load_shapes(_write(data))
    except shardplan.ShardPlanError:
        pass


# -- command-line flags ------------------------------------------------------------------------
NASTY_NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "1e999", "0", "-0", "-0.0", "1e3", "0x10", " 8",
                 "8 ", "", "٨", "²", "８", "٣٢", "8_0", "ⅷ", "1" * 40]
numbers = st.one_of(st.integers(-10, 10**6).map(str), st.integers().map(str), st.sampled_from(NASTY_NUMBERS),
                    st.floats(allow_nan=True, allow_infinity=True).map(str),
                    st.text(st.characters(categories=["Nd", "No", "Nl"]), min_size=1, max_size=3))
sizes = st.one_of(numbers, st.builds(lambda n, u: f"{n}{u}", numbers, st.sampled_from(["", "B", "KB", "GiB", "TB",
                                                                                          "XB", "gib"])))
meshes = st.one_of(
    st.lists(st.tuples(st.sampled_from(["data", "model", "fsdp", "x", "1a", ""]),
                       st.one_of(numbers, st.just("*"))), max_size=3)
    .map(lambda xs: ",".join(f"{n}={s}" for n, s in xs)),
    st.text(max_size=20),
)
SHAPES_OK = TMP / "ok.json"
SHAPES_OK.write_text(json.dumps({"format": "shardplan-shapes/1", "params": [
    {"path": "blocks/0/mlp/up/kernel", "shape": [64, 256], "dtype": "float32"},
    {"path": "embed/embedding", "shape": [512, 64], "dtype": "bfloat16"},
]}))
FLAGS = st.one_of(
    st.tuples(st.just("--mesh"), meshes),
    st.tuples(st.just("--devices"), numbers),
    st.tuples(st.just("--device-memory"), sizes),
    st.tuples(st.just("--replicated-threshold"), sizes),
    st.tuples(st.just("--optimizer"), st.sampled_from(["adam", "adamw", "sgd", "none", "recorded", "lion", ""])),
    st.tuples(st.just("--format"), st.sampled_from(["text", "json", "yaml"])),
    st.tuples(st.sampled_from(["--strict", "--expand", "--show-opt"])),
    st.tuples(st.just("--shapes"), st.sampled_from([str(SHAPES_OK), str(TMP / "missing.json"), "/dev/null",
                                                     str(TMP)])),
    st.tuples(st.just("--backend"), st.sampled_from(["auto", "shard_map", "pmap"])),
    st.tuples(st.just("--chip"), st.sampled_from(["h100", "tpu-v5p", "h1000"])),
    st.tuples(st.just("--link"), st.sampled_from(["data=dcn", "model=ici", "data=slow", "nope=dcn", "="])),
    st.tuples(st.just("--batch"), st.sampled_from(["tokens=int32[8,16]", "tokens=int32[0]", "x", "t=8x8:f99"])),
    st.tuples(st.just("--step"), st.sampled_from(["loss.py:f", "nofn", ""])),
    st.tuples(st.just("--vs"), st.sampled_from([str(PLANS / "fsdp.splan"), str(TMP / "nope.splan")])),
)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: a usage error
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@MANY
@given(st.sampled_from(["dp.splan", "fsdp.splan", "gpt_tp.splan", "gpt_2d.splan"]), st.lists(FLAGS, max_size=5))
def test_check_flags_never_escape(plan_name, flags):
    argv = ["check", str(PLANS / plan_name)] + [x for flag in flags for x in flag]
    code, out, err = run_main(argv)
    assert code in (0, 1, 2), (argv, code)
    assert "Traceback" not in out + err
    last = {flag[0]: flag[-1] for flag in flags}  # argparse: the last of a repeated flag wins
    if code in (0, 1) and last.get("--format") == "json":
        json.loads(out)  # machine-readable, errors included
    if code == 0:
        # A size that is not a finite number never passes silently.
        for name in ("--device-memory", "--replicated-threshold"):
            if name in last:
                with contextlib.suppress(ValueError):
                    assert math.isfinite(float(last[name].rstrip("BKMGTiIbkmgt"))), (name, last[name])


def _typed_flags():
    """(subcommand path, flag, type) for every flag of every subcommand that converts its text."""
    out = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, prefix + [name])
            elif action.type is not None and action.option_strings:
                out.append((tuple(prefix), action.option_strings[-1], action.type))

    walk(cli.build_parser(), [])
    return out


TYPED = _typed_flags()


def test_every_numeric_flag_is_fuzzed():
    """The flags converted by a type (the `int(`/`float(` of user input): at least launch's and check's."""
    names = {flag for _, flag, _ in TYPED}
    assert {"--devices", "--failure-grace", "--timeout", "-n", "--max-replicated-fraction", "--step"} <= names
    assert all(t not in (int, float) for _, _, t in TYPED), "int/float accept nan, inf, '٣' and '1_0'"


@MANY
@given(st.sampled_from(TYPED), numbers)
def test_numeric_flags_take_finite_ascii_numbers_or_exit_2(typed, text):
    _, flag, convert = typed
    try:
        value = convert(text)
    except argparse.ArgumentTypeError:  # argparse prints it at the flag and exits 2
        return
    assert text.isascii() and math.isfinite(value) and value >= 0, (flag, text, value)
    if isinstance(value, int):
        assert text.strip().isdigit(), (flag, text)


def test_run_main_reports_what_escapes(monkeypatch):
    """The fuzz can fail: a crash inside a command escapes run_main."""
    def crash(args, out, err):
        raise ValueError("boom")

    monkeypatch.setattr(cli, "cmd_check", crash)
    with pytest.raises(ValueError):
        run_main(["check", str(PLANS / "dp.splan")])
