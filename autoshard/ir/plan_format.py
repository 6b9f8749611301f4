"""The layout of ``plan.json``: its version, its sections and the names its choices may take.

Pure data and dict reshaping, imported by both ``ir.plan`` (which writes and reads plans) and
``ir.plan_schema`` (which checks them): ``ir.plan`` imports the schema, and the schema never
imports ``ir.plan`` back.

Version 2 (written) groups the plan's fields into sections, in this order::

    version, model, cluster, global_batch
    decisions    mesh, zero_stage, microbatch_size, num_microbatches, schedule, virtual_stages,
                 recompute, recompute_blocks, ddp_bucket_cap_mb, precision, dp_replicate (HSDP; absent: 1),
                 ep (expert parallelism; written only when > 1)
    layout       blocks, tensor_parallel, split_points, stages, experts (the expert groups ep shards;
                 written only with ep > 1)
    predicted    step time and memory by part (``ir.plan.Predicted``)
    review       alternatives, tensor_parallel_reasons, notes, symbolic, search
    provenance   pinned, runtime

``runtime`` names what the prediction priced (``PLAN_RUNTIMES``; ``cost.tables.Runtime.named``):
"autoshard", the emitted program, or "megatron-lm", to compare with Megatron-LM's published runs.
The program is autoshard's either way. Plans written before the field read as "autoshard".

Version 1 (read, never written) is the same fields in one flat object: ``flatten`` turns a
version 2 document into that flat form, ``sectioned`` the flat form into version 2.
"""

from __future__ import annotations

from typing import Any

PLAN_VERSION = 2
READ_VERSIONS = (1, 2)  # versions from_json reads; only PLAN_VERSION is written

RECOMPUTE_MODES = ("none", "selective", "full")
PLAN_RECOMPUTE = (*RECOMPUTE_MODES, "mixed")  # mixed: each block's own mode in Plan.recompute_blocks
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")  # backward split into input and weight gradients
V_SCHEDULES = ("zbv", "dualpipev")  # 2 stages per rank in a V: rank r holds stages r and 2·pp − 1 − r
PLAN_RUNTIMES = ("autoshard", "megatron-lm")  # cost.tables.RUNTIME_NAMES: what priced the plan

DECISIONS_KEYS = ("mesh", "zero_stage", "microbatch_size", "num_microbatches", "schedule", "virtual_stages",
                  "recompute", "recompute_blocks", "ddp_bucket_cap_mb", "precision", "dp_replicate", "ep")
LAYOUT_KEYS = ("blocks", "tensor_parallel", "split_points", "stages", "experts")
# Keys written only when they differ from these values, so plans without them read and write as before.
WRITTEN_UNLESS = {"ep": 1, "experts": []}
REVIEW_KEYS = ("alternatives", "tensor_parallel_reasons", "notes", "symbolic", "search")
PROVENANCE_KEYS = ("pinned", "runtime")
SECTIONS: dict[str, tuple[str, ...]] = {  # section -> its keys, in the order they are written
    "decisions": DECISIONS_KEYS,
    "layout": LAYOUT_KEYS,
    "review": REVIEW_KEYS,
    "provenance": PROVENANCE_KEYS,
}
TOP_KEYS = ("version", "model", "cluster", "global_batch", "decisions", "layout", "predicted", "review",
            "provenance")
SECTION_OF = {key: section for section, keys in SECTIONS.items() for key in keys}  # flat key -> its section


def sectioned(flat: dict[str, Any]) -> dict[str, Any]:
    """The version 2 document of a plan's flat fields (every key of ``SECTION_OF`` and of ``TOP_KEYS``
    that is not a section), in the written order; ``version`` is ``PLAN_VERSION``."""
    out: dict[str, Any] = {"version": PLAN_VERSION}
    for key in TOP_KEYS[1:]:
        out[key] = {k: flat[k] for k in SECTIONS[key] if k not in WRITTEN_UNLESS or flat[k] != WRITTEN_UNLESS[k]} \
            if key in SECTIONS else flat[key]
    return out


def flatten(doc: dict[str, Any]) -> dict[str, Any]:
    """The flat (version 1 shaped) fields of a version 2 document whose sections are mappings
    (``plan_schema.check_plan_dict`` checks that first); a key absent from its section stays absent."""
    flat = {k: v for k, v in doc.items() if k not in SECTIONS}
    for section in SECTIONS:
        flat.update(doc.get(section, {}))
    return flat
