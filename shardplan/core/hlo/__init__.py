"""Reading a compiled step: XLA's optimized HLO text, Jax-free.

A package of one concern per module:
- ``text``: computations, instructions, shapes and bytes (the parser the others share);
- ``groups``: a collective's device groups;
- ``loops``: trip counts and how often each computation runs, matmul loops with rings
  (``matmul_rings``: XLA:TPU's windowed einsums);
- ``frames``: the source line each instruction comes from;
- ``collectives``: the collectives per kind, bytes, count, groups, mesh axes and source
  (``parse``, ``with_axes``, ``summarize``, ``report``);
- ``flops``: FLOPs as XLA's cost analysis counts them, loops included (``program_flops``,
  ``loop_flops``), and its matmuls' by source line (``matmul_by_source``);
- ``traffic``: memory traffic and kernel launches (``memory_bytes``, ``kernel_count``);
- ``schedule``: kernels in program order with the collectives beside them (``schedule``, ``Step``).
"""

from __future__ import annotations

from shardplan.core.hlo.collectives import CollectiveOp, parse, report, summarize, with_axes
from shardplan.core.hlo.flops import loop_flops, matmul_by_source, program_flops
from shardplan.core.hlo.frames import LIBRARY_PATHS
from shardplan.core.hlo.loops import matmul_rings
from shardplan.core.hlo.schedule import Step, schedule
from shardplan.core.hlo.text import KINDS
from shardplan.core.hlo.traffic import kernel_count, memory_bytes

__all__ = [
    "KINDS",
    "LIBRARY_PATHS",
    "CollectiveOp",
    "Step",
    "kernel_count",
    "loop_flops",
    "matmul_by_source",
    "matmul_rings",
    "memory_bytes",
    "parse",
    "program_flops",
    "report",
    "schedule",
    "summarize",
    "with_axes",
]
