"""Fast mode: what the auto backend's step costs, from the step's jaxpr (no XLA compile).

The step (forward, backward and optimizer update: the auto backend's ``pure_step``) is
traced over abstract values. The plan's shardings of params, optimizer state and batch
are then propagated through the jaxpr's equations the way GSPMD does for the common
cases, and every collective it needs is recorded with why:

- a contraction over a dimension split on both sides runs locally and leaves a partial
  sum (an all-reduce, or a reduce-scatter where the consumer is split on that axis, as a
  data-parallel gradient feeding an FSDP-split optimizer update is);
- an operand split where the consumer needs it whole is all-gathered (an FSDP weight
  before its matmul; gathered once, reused by the backward pass as XLA's CSE does);
- a mesh axis moving from one dimension to another is an all-to-all;
- a lookup in a table split over its rows is a masked local lookup and an all-reduce.

Per-device FLOPs count 2*M*N*K per matmul and one per element of other ops, divided by
how the iteration space is split, as XLA's cost analysis counts them (transcendental functions
apart, a reduction one per element reduced, an all-reduce one per element). What it does not
model (an unknown primitive) is listed in the result's notes, never silently dropped.

The package, in the order a costing runs:

- ``costing``: the entry points (``step_cost``, ``cost``, ``propagate_function``): the plan's
  layouts of the step's inputs, one walk, the step's outputs set to their layouts, the result.
- ``walker``: the interpreter (``Walker``): one loop over a jaxpr's equations, each by the rule
  book, with the memory an equation's results hold and the traffic its kernel moves observed on
  the same walk.
- ``rules``: the rule book (primitive -> rule), and what fast mode declares it does not model.
- The rules, a file per concern: ``elementwise`` (elementwise, layout, reduction and
  along-a-dim ops), ``matmul`` (``dot_general`` and grouped matmuls), ``lookups`` (gather and
  scatter), ``calls`` (calls, scans, shard_map regions, kernels, manual collectives).
- ``relayout``: pending sums resolved and values moved between layouts (the collectives).
- ``claims``: layouts propagated backwards (wanted splits, constraints' claims).
- ``memory``: what XLA fuses, recomputes and holds (kernels, liveness).
- ``values``: the vocabulary (``Val``, the walk's context, layout helpers).
- ``books``: what each target compiler does differently (``Compiler``, ``COMPILERS``).
- ``opsets``: fast mode's sets of primitives, as policy over the primitive catalogue.
"""

from shardplan.runtime.fast.books import COMPILERS, Compiler
from shardplan.runtime.fast.costing import (
    Ledger,
    cost,
    dense_grouped_note,
    merge_communication,
    propagate_function,
    step_cost,
)
from shardplan.runtime.fast.rules import rule_book

__all__ = [
    "COMPILERS",
    "dense_grouped_note",
    "Compiler",
    "Ledger",
    "cost",
    "merge_communication",
    "propagate_function",
    "rule_book",
    "step_cost",
]
