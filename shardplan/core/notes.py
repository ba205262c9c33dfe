"""Notes on a figure as data: what a step's cost (or a search) approximated, assumed or left out.

A note is a code from ``NOTE_CODES`` with the words a report prints and, where it is about one
op, that op and its source line. Code that acts on a note reads its code, never its words; the
CLI and the JSON output print both. docs/stepcost.md's table of note codes is checked against
this registry by the tests, so adding a note touches this file and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoteCode:
    name: str
    doc: str


NOTE_CODES: dict[str, NoteCode] = {
    c.name: c
    for c in (
        # fast mode (the auto backend's propagation)
        NoteCode(
            "fast-how",
            "fast mode's figures come from propagating the plan's layouts through the step's jaxpr (or, with "
            "`--propagation xla`, from Shardy's layouts)",
        ),
        NoteCode("fast-2d-params", "params split over a batch axis and another axis, and no activation pinned"),
        NoteCode("fast-lookup-ways", "a lookup whose table and indices share an axis: XLA picks among several ways"),
        NoteCode("fast-loop-trips", "a while loop whose trip count the step does not fix, costed for one trip"),
        NoteCode("fast-not-modelled", "primitives fast mode does not model: outputs taken as replicated"),
        # Pallas kernels (either mode's fast figures)
        NoteCode("kernel-outside-shard-map", "a Pallas kernel on split operands outside shard_map: gathered whole"),
        NoteCode("kernel-dynamic-grid", "a kernel grid dimension set at run time, counted as 1"),
        NoteCode("kernel-manual-copy", "a kernel operand it copies itself (memory_space=ANY), counted as read once"),
        NoteCode("kernel-index-map", "a kernel block index map not evaluated ahead, counted as a copy per grid step"),
        NoteCode("kernel-dynamic-loop", "a loop in a kernel with a run-time trip count, counted once per grid step"),
        # activation rules and names
        NoteCode("act-names-unmapped", "logical names the model constrains that no axis rule maps"),
        NoteCode("act-rules-idle", "act rules matched modules only called inside an nnx transform"),
        # exact mode
        NoteCode("exact-cpu-reduce-scatter", "XLA:CPU's all-reduces sliced per device read as reduce-scatters"),
        NoteCode("exact-offline", "the step compiled offline for a target whose devices are not present"),
        NoteCode("exact-cached", "the compiled program read from shardplan's compile cache"),
        NoteCode("exact-flops-from-hlo", "a compiler without cost analysis: FLOPs counted from its program's HLO"),
        NoteCode("exact-matmul-rings", "matmul loops with rings of permutes (windowed einsums): timed serially"),
        NoteCode("exact-estimate-loops", "the compiler's own time estimate counts loop bodies once: not shown"),
        NoteCode("exact-loop-flops", "FLOPs of loop iterations XLA's cost analysis leaves out, added"),
        # the shard_map backend
        NoteCode("shard-map-how", "the shard_map backend's collectives are its partitioner's own"),
        NoteCode("shard-map-fallback", "an op the partitioner ran on whole operands"),
        NoteCode("grouped-routed", "grouped kernels on each device's experts: timed by the rows routed to them"),
        NoteCode("grouped-dense", "grouped matmuls the compiler runs densely: every row through each expert"),
        NoteCode(
            "expert-load-static",
            "grouped matmuls on each device's experts that the compiler runs densely: their work does not follow "
            "the routing",
        ),
        # check and suggest
        NoteCode("mesh-star-resolved", "a '*' mesh axis sized from this machine's devices"),
        NoteCode("suggest-confirmed-on-cpu", "the --chip's own compiler cannot confirm here: XLA:CPU does"),
        NoteCode("suggest-exact-failed", "a candidate exact mode could not compile"),
        NoteCode("suggest-over-budget", "a candidate whose compiled peak did not fit: left out"),
        NoteCode("suggest-reranked", "exact mode re-ranked fast mode's best candidates"),
        NoteCode("suggest-unconfirmed", "candidates not confirmed in exact mode (more devices than simulated)"),
    )
}


@dataclass(frozen=True)
class Note:
    """One note: its ``code`` (a key of ``NOTE_CODES``), the words a report prints, and the op and
    source line it is about, where it is about one."""

    code: str
    text: str
    op: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.code not in NOTE_CODES:
            raise ValueError(f"note code {self.code!r} is not in shardplan.core.notes.NOTE_CODES")

    def __str__(self) -> str:
        return self.text

    def to_json(self) -> dict[str, str]:
        out = {"code": self.code, "text": self.text}
        if self.op:
            out["op"] = self.op
        if self.source:
            out["source"] = self.source
        return out

    @staticmethod
    def from_json(doc: dict[str, str]) -> Note:
        return Note(doc["code"], doc["text"], doc.get("op", ""), doc.get("source", ""))
