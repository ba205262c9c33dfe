"""The registry of diagnostic codes: every code shardplan reports, its kind, stage and meaning.

A diagnostic can only be made with a code listed here (``shardplan.errors.error`` checks),
and docs/language.md's table of diagnostics is checked against this registry by the tests,
so adding a code touches this file and the docs, nothing else.

The stage decides the exception class: ``syntax`` -> PlanSyntaxError, ``check`` ->
PlanCheckError (the plan is inconsistent, or does not fit a model, shapes or a mesh,
wherever that is found), ``apply`` -> PlanApplyError (live devices, arrays, checkpoints,
processes), ``argument`` -> ArgumentError (a bad command-line or API argument).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]
Stage = Literal["syntax", "check", "apply", "argument"]


@dataclass(frozen=True)
class Code:
    name: str
    severity: Severity
    stage: Stage
    doc: str


def _e(name: str, stage: Stage, doc: str) -> Code:
    return Code(name, "error", stage, doc)


def _w(name: str, doc: str) -> Code:
    return Code(name, "warning", "check", doc)


CODES: dict[str, Code] = {
    c.name: c
    for c in (
        # the language
        _e("syntax", "syntax", "the text does not follow the grammar (says what was expected)"),
        _e("unknown-axis", "check", "a spec names an axis the mesh lacks (suggests the closest)"),
        _e("axis-reused", "check", "a mesh axis twice in one spec, or two logical axes of one param mapped to it"),
        _e("duplicate-axis", "check", "two mesh axes with one name"),
        _e("reserved-axis-name", "check", "`_` used as a mesh axis name"),
        _e("axis-size", "check", "a mesh size ≤ 0"),
        _e("two-inferred-sizes", "check", "more than one `*`"),
        _e("invalid-regex", "check", "a regex that does not compile"),
        _e(
            "unsupported-regex",
            "check",
            "a regex with lookaround, backreferences, huge repetition counts or groups nested over 100 deep",
        ),
        _e("duplicate-statement", "check", "`mesh`, `batch`, `extends`, ... twice in one file"),
        _e("two-ellipses", "check", "a spec with more than one `...`"),
        _e("pipeline-option", "check", "a `pipeline` setting unknown, repeated, missing or out of range"),
        _e("pipeline-axis", "check", "the pipeline's axis used other than on the stacked layer dim of params"),
        _e(
            "pipeline-layers",
            "check",
            "the pipeline's layers: not one scanned stack, or not divisible by stages x repeats",
        ),
        _e("pipeline-batch", "check", "the batch does not divide into the pipeline's microbatches"),
        _e("misplaced-ellipsis", "check", "`...` in a `batch`, `input` or `axis` statement"),
        _e("duplicate-axis-rule", "check", "one logical axis name mapped twice in one file"),
        _e("unknown-backend", "check", "a backend that is not registered (`auto`, `shard_map`)"),
        _e("no-mesh", "check", "no mesh in the plan, its bases, or the command line"),
        _e("unknown-link", "check", "a mesh axis tagged with a link other than `@ici` or `@dcn`"),
        _e("unknown-axis-type", "check", "a mesh or mesh axis typed other than `explicit` or `auto`"),
        _e("extends-cycle", "check", "a plan extends itself, directly or through its bases"),
        _e("bad-extends", "check", "`extends` naming a file that is not a `.splan` plan file"),
        _e("extends-too-deep", "check", "a chain of `extends` more than 32 files deep"),
        _e("cannot-read", "check", "a plan, base or shapes file that cannot be read"),
        # a plan against shapes and devices
        _e("spec-too-long", "check", "against a model: a spec longer than the array's rank"),
        _e("indivisible", "check", "against a model or batch: a dimension not divisible by its axes' sizes"),
        _e("unmatched-param", "check", "against a model: no rule, annotation or default decides a param"),
        _e("mesh-devices", "check", "against devices: the mesh size does not fit the device count"),
        _e("mesh-needs-devices", "check", "a `*` mesh axis and no device count to infer it from"),
        _e("mesh-mismatch", "check", "mesh sizes or a Mesh whose axes are not the plan's"),
        _e("bad-shapes", "check", "a shapes file that is not in the shapes format"),
        _e("no-such-path", "check", "`explain` of a path the model does not have (closest paths named)"),
        _e("lock-drift", "check", "`check --locked`: the resolved layout differs from the lock file (at its line)"),
        _e("replicated-fraction", "check", "`--max-replicated-fraction`: more parameter bytes whole than allowed"),
        _e("cannot-lower", "apply", "a plan or model the shard_map backend cannot lower"),
        _w("unused-rule", "against a model: a rule matches nothing"),
        _w(
            "shadowed-rule",
            "a rule after a catch-all or a repeated regex; or, against a model, a rule that matches but never decides",
        ),
        _w(
            "large-replicated",
            "a tensor above the threshold (default 64 MiB, `--replicated-threshold`) left replicated",
        ),
        _w("stacked-axis-split", "a rule naming fewer dims than stacked (scanned) arrays splits their layer axis"),
        _w("opt-less-sharded", "optimizer state split less than its param (e.g. Adam moments replicated)"),
        _w("unmapped-logical-axis", "an annotation name with no `axis` rule"),
        _w("annotations-unreachable", "a catch-all param rule with `axis` rules"),
        _w("unused-axis-rule", "against a model: an `axis` rule whose logical name no array is annotated with"),
        _w("annotation-rank", "against a model: an annotation naming fewer dims than the array has"),
        _w("shard-map-fallback", "`check --step`, shard_map backend: an op with no local rule runs on whole operands"),
        # arguments
        _e("bad-mesh-arg", "argument", "a `--mesh` / `mesh=` argument that is not `name=size,...`"),
        _e("bad-model-arg", "argument", "a `--model` that is not `FILE.py:FACTORY` or `module:FACTORY`"),
        _e("bad-argument", "argument", "a command-line or API argument out of range or malformed"),
        _e("unknown-optimizer", "argument", "an optimizer name that is not registered"),
        _e("unknown-chip", "argument", "a `--chip` that is not in the registry of accelerators"),
        _e("bad-target", "argument", "a `--target` that names no compile target, or a `--chip` that disagrees with it"),
        _e(
            "target-compiler-missing",
            "argument",
            "a `--target`'s compiler is not installed (the `pip install` line that brings it is in the hint)",
        ),
        _e("bad-axis-types", "argument", "`axis_types` other than `auto` or `explicit`"),
        _e("model-import", "argument", "the model's module fails to import"),
        _e("model-build", "argument", "the model factory fails under `nnx.eval_shape`"),
        # applying a plan
        _e("not-a-model", "apply", "the object to place is not an NNX Module, State or pytree"),
        _e("not-an-array", "apply", "a leaf that is not an array or shape"),
        _e("not-a-pytree", "apply", "state whose pytree flattening fails"),
        _e("mesh-processes", "apply", "a mesh that cannot be laid out over the processes' devices"),
        _e("no-optimizer", "apply", "a step or restore that needs optimizer state the placement lacks"),
        _e("loss-failed", "apply", "the loss function fails on the model and batch"),
        _e("no-plan-fits", "apply", "suggest: no plan searched fits the device memory"),
        _e("step-out-of-memory", "apply", "exact mode: the target's compiler refuses the step, out of device memory"),
        _e("compiler-failed", "apply", "exact mode: the target's compiler fails on the step with an internal error"),
        _e("model-axis", "apply", "the model's code names a mesh axis the plan's mesh lacks"),
        _e("needs-explicit-axes", "apply", "the model's code types arrays by mesh axes the plan's mesh has as `auto`"),
        _e("sharding-type", "apply", "JAX's sharding type check rejects an operation in the model or loss"),
        _e("act-rank", "apply", "an act rule's spec does not fit the rank of a module's output"),
        _e("loss-not-scalar", "apply", "the loss function does not return a float scalar"),
        _e("kernel-not-compilable", "apply", "exact mode: a custom kernel (Pallas, cuDNN) XLA:CPU cannot compile"),
        _e("layouts-failed", "apply", "`check --layouts`: Shardy's propagation cannot run over the step's lowering"),
        _e("sharding-mismatch", "apply", "a live array placed other than the plan says (`verify`)"),
        _e("not-a-checkpoint", "apply", "a checkpoint directory that is missing, not a directory, or empty"),
        _e("corrupt-checkpoint", "apply", "a checkpoint step shardplan wrote whose files are damaged (file named)"),
        _e("foreign-checkpoint", "apply", "a step folder not written by shardplan (another tool's, or stray)"),
        _e("restore-failed", "apply", "a restore that failed for another reason than damaged files (memory, I/O)"),
        _e("no-such-step", "apply", "a checkpoint step that is not complete in the directory"),
        _e("checkpoint-mismatch", "apply", "a checkpoint whose trees differ from the model's (each path named)"),
        _e("not-a-causal-lm", "apply", "generation on a model without the cache call convention"),
        _e("empty-batch", "apply", "generation with no prompts"),
        _e("empty-prompt", "apply", "generation with an empty prompt"),
        _e("prompt-too-long", "apply", "a prompt longer than the longest bucket"),
        _e("no-key", "apply", "sampling without a PRNG key"),
        _e("cannot-launch", "apply", "`shardplan launch` cannot start the command"),
        _e("bad-cluster-env", "apply", "a cluster environment naming a job but lacking or garbling what joining needs"),
        _e("cannot-join", "apply", "joining a multi-process job failed or timed out (manager and coordinator named)"),
        _e("not-joined", "apply", "one process of several that did not call `distributed.initialize()`"),
    )
}
