"""The layout of ``plan.json``: its version, its sections as records and the names its choices may take.

Pure data and dict reshaping, imported by both ``ir.plan`` (which writes and reads plans) and
``ir.plan_schema`` (which checks them): ``ir.plan`` imports the schema, and the schema never
imports ``ir.plan`` back.

Version 2 (written) groups the plan's fields into sections, in this order::

    version, model, cluster, global_batch
    decisions    ir.decisions.Decisions: mesh, zero_stage, microbatch_size, num_microbatches, schedule,
                 virtual_stages, recompute, recompute_blocks, ddp_bucket_cap_mb, precision, dp_replicate
                 (HSDP; absent: 1), ep (expert parallelism; written only when > 1), compile and float8
                 (written only when on), offload (host offload; written only when cpu)
    layout       PlanLayout: blocks, tensor_parallel, split_points, stages, experts (the expert groups ep
                 shards; written only with ep > 1), float8_linears (the linears float8 converts; written only
                 with float8 on), unread_params (what the forward never reads, by outermost module; written
                 only where there is some)
    predicted    Predicted: step time and memory by part (pipelines: each pp rank's, pp_rank_memory; host
                 offload: the host memory per node, host_memory_bytes_per_node)
    review       PlanReview: alternatives, tensor_parallel_reasons, notes, symbolic, search
    provenance   PlanProvenance: pinned, runtime

Each section is one record (``SECTION_RECORDS``) and ``ir.plan.Plan`` holds one of each; a section's
keys are its record's fields in their order (``SECTIONS``), less those the record does not write:
a ``Decisions`` field without ``in_plan`` metadata (``sequence_parallel``, which the TP styles record),
and a field equal to its value in the record's ``WRITTEN_UNLESS`` (``ep`` 1, ``experts`` none), so plans
made before the field read and write as before.

``runtime`` names what the prediction priced (``PLAN_RUNTIMES``; ``cost.tables.Runtime.named``):
"autoshard", the emitted program, or "megatron-lm", to compare with Megatron-LM's published runs.
The program is autoshard's either way. Plans written before the field read as "autoshard".

Version 1 (read, never written) is the same fields in one flat object: ``flatten`` turns a
version 2 document into that flat form.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from autoshard.ir.decisions import (  # noqa: F401 (re-exported)
    PLAN_RECOMPUTE,
    RECOMPUTE_MODES,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    Decisions,
    Mesh,
)

PLAN_VERSION = 2
READ_VERSIONS = (1, 2)  # versions from_json reads; only PLAN_VERSION is written
PLAN_RUNTIMES = ("autoshard", "megatron-lm")  # cost.tables.RUNTIME_NAMES: what priced the plan


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per rank at the peak of a step, by part."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transient_bytes: int  # unsharded FSDP units, communication buffers, recompute workspace
    peak_bytes: int  # sum of the above, plus allocator slack

    @classmethod
    def from_parts(cls, slack_fraction: float = 0.0, **parts: int) -> Memory:
        total = sum(parts.values())
        return cls(**parts, peak_bytes=int(total * (1.0 + slack_fraction)))


@dataclass(frozen=True)
class Predicted:
    """Predicted step time by part (seconds) and what it buys (``plan.json``'s ``predicted`` section)."""

    step_time_s: float
    compute_s: float  # forward + backward + recompute + optimizer
    comm_exposed_s: float  # communication not hidden behind compute
    bubble_s: float  # pipeline idle time
    memory_peak_bytes_per_rank: int
    memory: Memory
    tokens_per_s: float
    samples_per_s: float
    mfu: float  # model FLOPs (no recompute) / (step time * devices * peak)
    comm_total_s: float = 0.0  # all communication, hidden or not
    # Pipelines: each pp rank's own peak by part, rank r at index r (``memory`` is the largest of them); written
    # only with pp > 1, so plans without pipeline stages, and those made before the field, read and write as before
    pp_rank_memory: tuple[Memory, ...] = ()
    # Host offload (``decisions.offload`` cpu): the offloaded state one node's host memory holds (``cost.offload``);
    # written only then
    host_memory_bytes_per_node: int = 0

    WRITTEN_UNLESS = {"pp_rank_memory": (), "host_memory_bytes_per_node": 0}


@dataclass(frozen=True)
class Stage:
    index: int
    modules: tuple[str, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Alternative:
    """A configuration the planner priced and did not choose, and why."""

    mesh: Mesh
    zero_stage: int
    microbatch_size: int
    recompute: str
    schedule: str
    predicted: Predicted | None  # None where it does not fit
    why_not: str
    float8: str = "off"  # decisions.float8 of the alternative (ir.decisions.FLOAT8_CHOICES)
    offload: str = "none"  # decisions.offload of the alternative (ir.decisions.OFFLOAD_CHOICES)

    WRITTEN_UNLESS = {"float8": "off", "offload": "none"}


@dataclass(frozen=True)
class PlanLayout:
    """Where the decisions land on the model (``plan.json``'s ``layout`` section): the FSDP / recompute
    units, each module's tensor-parallel style, and the pipeline's cuts and stages: ``Plan.layout``."""

    blocks: tuple[str, ...] = ()  # module paths of the repeated blocks (FSDP units, recompute units)
    # module path -> a style of ir.decisions.TP_STYLES (the sharded ones: a module not named stays replicated)
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    split_points: tuple[str, ...] = ()  # module paths where pipeline stages 1 .. pp·v−1 begin
    stages: tuple[Stage, ...] = ()
    experts: tuple[str, ...] = ()  # the expert groups (passes.capturing.experts) the ep axis shards, when ep > 1
    # the linears float8 training converts (cost.float8.float8_linears), when decisions.float8 is a recipe
    float8_linears: tuple[str, ...] = ()
    # the trainable parameters the captured forward never reads, by their outermost module (``ir.graph.unread_params``):
    # DDP leaves them out of its buckets
    unread_params: tuple[str, ...] = ()

    WRITTEN_UNLESS = {"experts": (), "float8_linears": (), "unread_params": ()}


@dataclass(frozen=True)
class PlanReview:
    """What a reviewer reads beside the decisions (``plan.json``'s ``review`` section): ``Plan.review``."""

    alternatives: tuple[Alternative, ...] = ()
    tensor_parallel_reasons: dict[str, str] = field(
        default_factory=dict
    )  # why a module stays replicated, or gathers whole heads
    notes: tuple[str, ...] = ()
    # Step time and memory as sympy expressions (strings) in B, s, dp, tp, pp, b, v with the plan's own
    # values under "symbols" (``cost.symbolic``); empty in plans made before it existed.
    symbolic: dict[str, Any] = field(default_factory=dict)
    # How the plan was found (passes.planning.search.search_report): candidates, priced, optimal, gap.
    search: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanProvenance:
    """How the plan was asked for (``plan.json``'s ``provenance`` section): ``Plan.provenance``."""

    pinned: tuple[str, ...] = ()  # the decisions the user fixed by hand, by their API keyword (ir.pins.PINS)
    runtime: str = "autoshard"  # what the prediction priced (PLAN_RUNTIMES); the program is autoshard's


def written_fields(record: type) -> tuple[str, ...]:
    """The keys a section record writes, in its field order: every field, less a ``Decisions`` field without
    ``in_plan`` metadata (module doc)."""
    return tuple(f.name for f in fields(record) if record is not Decisions or "plan" in f.metadata)


SECTION_RECORDS: dict[str, type] = {  # section -> its record, in the order they are written
    "decisions": Decisions,
    "layout": PlanLayout,
    "review": PlanReview,
    "provenance": PlanProvenance,
}
SECTIONS: dict[str, tuple[str, ...]] = {section: written_fields(r) for section, r in SECTION_RECORDS.items()}
DECISIONS_KEYS, LAYOUT_KEYS, REVIEW_KEYS, PROVENANCE_KEYS = SECTIONS.values()
TOP_KEYS = (
    "version",
    "model",
    "cluster",
    "global_batch",
    "decisions",
    "layout",
    "predicted",
    "review",
    "provenance",
)  # ir.plan.Plan's fields, version first
SECTION_OF = {key: section for section, keys in SECTIONS.items() for key in keys}  # flat key -> its section


def flatten(doc: dict[str, Any]) -> dict[str, Any]:
    """The flat (version 1 shaped) fields of a version 2 document whose sections are mappings
    (``plan_schema.check_plan_dict`` checks that first); a key absent from its section stays absent."""
    flat = {k: v for k, v in doc.items() if k not in SECTIONS}
    for section in SECTIONS:
        flat.update(doc.get(section, {}))
    return flat
