"""Plan JSON: round trip byte for byte, version 1 files read as version 2, and clear errors for corrupted
or foreign files."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from autoshard.cost.hardware import PRESETS
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.plan import Memory, Plan, PlanLayout, Predicted, Stage, load_plan
from autoshard.ir.plan_format import PLAN_VERSION, SECTION_RECORDS, SECTIONS, TOP_KEYS
from autoshard.passes.lowering.codegen import blocks_expression

REQUIRED_KEYS = [
    "version",
    "model",
    "cluster",
    "global_batch",
    "decisions",
    "layout",
    "predicted",
    "review",
    "provenance",
]
DECISIONS = [
    "mesh",
    "zero_stage",
    "microbatch_size",
    "num_microbatches",
    "schedule",
    "virtual_stages",
    "recompute",
    "recompute_blocks",
    "ddp_bucket_cap_mb",
    "precision",
    "dp_replicate",
]
LAYOUT = ["blocks", "tensor_parallel", "split_points", "stages"]
REVIEW = ["alternatives", "tensor_parallel_reasons", "notes", "symbolic", "search"]
PROVENANCE = ["pinned", "runtime"]
# written only when the plan has them (expert parallelism, compiled blocks): a dense eager plan's sections are the
# lists above
# written only when they differ from WRITTEN_UNLESS: ep, compile, float8, offload, async_tp, compile_loss; experts,
# float8_linears, unread_params
DECISIONS_EP, LAYOUT_EP = (
    DECISIONS + ["ep", "compile", "float8", "offload", "async_tp", "compile_loss"],
    LAYOUT + ["experts", "float8_linears", "unread_params"],
)
GOLDEN_V1 = Path(__file__).resolve().parent / "plan_v1" / "dp_zero1.plan.json"  # version 1 files, kept as is


CLUSTER = PRESETS["dgx-h100"].to_dict()  # a loaded plan's cluster is checked like a cluster file


def make_plan(**overrides):
    memory = Memory.from_parts(
        0.05, params_bytes=100, grads_bytes=100, optimizer_bytes=200, activations_bytes=50, transient_bytes=0
    )
    predicted = Predicted(
        step_time_s=0.1234567891,
        compute_s=0.1,
        comm_exposed_s=0.0234567891,
        bubble_s=0.0,
        memory_peak_bytes_per_rank=memory.peak_bytes,
        memory=memory,
        tokens_per_s=1000.0,
        samples_per_s=10.0,
        mfu=0.5,
    )
    fields = dict(
        model={"spec": "m.py:build", "hash": "abc", "params": 10, "layers": 2},
        cluster=CLUSTER,
        global_batch=8,
        mesh=Mesh(dp=2),
        zero_stage=1,
        microbatch_size=2,
        num_microbatches=2,
        schedule="none",
        recompute="none",
        stages=(Stage(0, ("a",), (0, 1)),),
        tensor_parallel={},
        predicted=predicted,
    )
    return Plan.of(**{**fields, **overrides})


def test_round_trip_is_byte_identical(tmp_path):
    plan = make_plan()
    plan.save(tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again.to_json() == plan.to_json() == (tmp_path / "p.json").read_text()
    doc = json.loads(plan.to_json())
    assert list(doc) == REQUIRED_KEYS == list(TOP_KEYS) and doc["version"] == PLAN_VERSION == 2
    assert (list(doc["decisions"]), list(doc["layout"]), list(doc["review"]), list(doc["provenance"])) == (
        DECISIONS,
        LAYOUT,
        REVIEW,
        PROVENANCE,
    )
    assert {k: list(v) for k, v in SECTIONS.items()} == {
        "decisions": DECISIONS_EP,
        "layout": LAYOUT_EP,
        "review": REVIEW,
        "provenance": PROVENANCE,
    }


def test_the_runtime_that_priced_a_plan_round_trips_and_older_files_read_as_autoshard(tmp_path):
    """provenance.runtime: what the prediction priced (``cost.tables.RUNTIME_NAMES``); a file without it
    (written before the field, version 1 or 2) was priced for autoshard's own program."""
    from autoshard.cost.tables import RUNTIME_NAMES
    from autoshard.ir.plan_format import PLAN_RUNTIMES

    assert PLAN_RUNTIMES == RUNTIME_NAMES
    plan = make_plan(runtime="megatron-lm")
    plan.save(tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again.runtime == "megatron-lm" and again.to_json() == plan.to_json()
    data = json.loads(make_plan().to_json())
    assert data["provenance"]["runtime"] == "autoshard"
    del data["provenance"]["runtime"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "old.json").runtime == "autoshard"
    assert "runtime" not in json.loads(GOLDEN_V1.read_text()) and load_plan(GOLDEN_V1).runtime == "autoshard"
    with pytest.raises(AutoshardError, match="runtime='deepspeed' must be one of autoshard, megatron-lm"):
        make_plan(runtime="deepspeed")


def test_the_plan_is_one_record_per_section_of_its_json():
    """Plan's fields are the JSON's top keys; each section's keys are its record's fields in their order (less
    sequence_parallel and loss_parallel, which the TP styles record); every field of a section reads flat and
    read-only."""
    assert [f.name for f in fields(Plan)] == [*TOP_KEYS[1:], "version"]
    assert list(SECTION_RECORDS) == list(SECTIONS) and [f.name for f in fields(Decisions)] == [
        *SECTIONS["decisions"],
        "sequence_parallel",
        "loss_parallel",
    ]
    for section in ("layout", "review", "provenance"):
        assert [f.name for f in fields(SECTION_RECORDS[section])] == list(SECTIONS[section])
    plan = make_plan(
        recompute="mixed",
        recompute_blocks={"h.0": "full", "h.1": "none"},
        blocks=("h.0", "h.1"),
        notes=("a note",),
        pinned=("dp",),
    )
    for section, record in SECTION_RECORDS.items():
        for f in fields(record):
            if f.name != "recompute_blocks":
                assert getattr(plan, f.name) is getattr(getattr(plan, section), f.name), f.name
            with pytest.raises(AttributeError):
                setattr(plan, f.name, None)
    assert plan.recompute_blocks == {"h.0": "full", "h.1": "none"} and plan.decisions.recompute_blocks == (
        "full",
        "none",
    )
    assert Plan.of(**{f.name: getattr(plan, f.name) for f in fields(Plan)}) == plan
    with pytest.raises(TypeError, match="unknown field 'colour'"):
        make_plan(colour="blue")


def test_a_version_1_file_loads_and_saves_as_version_2(tmp_path):
    text = GOLDEN_V1.read_text()
    assert json.loads(text)["version"] == 1 and "zero_stage" in json.loads(text)
    old = load_plan(GOLDEN_V1)
    assert old.version == PLAN_VERSION
    old.save(tmp_path / "v2.json")
    saved = json.loads((tmp_path / "v2.json").read_text())
    assert saved["version"] == 2 and saved["decisions"]["zero_stage"] == json.loads(text)["zero_stage"]
    new = load_plan(tmp_path / "v2.json")
    assert new == old
    assert {f.name: getattr(new, f.name) for f in fields(Plan)} == {f.name: getattr(old, f.name) for f in fields(Plan)}
    assert new.to_json() == old.to_json() == (tmp_path / "v2.json").read_text()
    flat = json.loads(text)  # every field of the version 1 file, under its version 2 path
    for section, keys in SECTIONS.items():
        for key in keys:
            if key in flat:
                assert saved[section][key] == flat[key], key
    assert saved["predicted"] == flat["predicted"] and saved["model"] == flat["model"]


def test_decisions_and_layout_are_the_flat_fields():
    plan = load_plan(GOLDEN_V1)
    # sequence_parallel is a decision the plan records in its TP styles (Plan.sequence_parallel reads them)
    assert {f.name for f in fields(Decisions)} == {*DECISIONS_EP, "sequence_parallel", "loss_parallel"}
    assert [f.name for f in fields(PlanLayout)] == LAYOUT_EP
    decisions = plan.decisions
    for name in DECISIONS_EP:
        if name != "recompute_blocks":
            assert getattr(decisions, name) == getattr(plan, name), name
    assert plan.layout == PlanLayout(**{k: getattr(plan, k) for k in LAYOUT_EP})
    assert decisions.mesh == plan.mesh and decisions.zero_stage == plan.zero_stage == 1
    mixed = load_plan(GOLDEN_V1.with_name("mixed_recompute.plan.json")).decisions
    assert mixed.recompute == "mixed" and mixed.recompute_blocks == ("full", "selective", "none", "full")
    assert mixed.block_modes(4) == mixed.recompute_blocks
    assert plan.layout.tensor_parallel is plan.tensor_parallel  # the plan's own record
    with pytest.raises(AttributeError):
        plan.decisions.zero_stage = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.layout = plan.layout  # type: ignore[misc]


@pytest.mark.parametrize("section", ["decisions", "layout", "review", "provenance"])
def test_unknown_keys_in_a_section_refused_in_one_line(tmp_path, section):
    data = json.loads(make_plan().to_json())
    data[section]["colour"] = "blue"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=f"plan field '{section}' has an unknown key 'colour'") as err:
        load_plan(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(colour=1), "plan has an unknown key 'colour'"),
        (lambda d: d.update(zero_stage=3), "unknown key 'zero_stage', which belongs in 'decisions' in version 2"),
        (
            lambda d: d["layout"].update(mesh={"dp": 2}),
            "'layout' has an unknown key 'mesh', which belongs in 'decisions'",
        ),
        (
            lambda d: d["review"].update(global_batch=8),
            "'review' has an unknown key 'global_batch', which belongs in the top of the plan",
        ),
        (lambda d: d.pop("layout"), "plan field 'layout' is missing"),
        (lambda d: d.update(decisions=[1]), "plan field 'decisions' must be a mapping, got \\[1\\]"),
        (lambda d: d["decisions"].pop("zero_stage"), "plan field 'decisions.zero_stage' is missing"),
        (lambda d: d["decisions"]["mesh"].update(sp=2), "plan field 'decisions.mesh' has an unknown key 'sp'"),
        (
            lambda d: d["layout"]["tensor_parallel"].update({"h.0.attn.q": "diagonal"}),
            "plan field 'layout.tensor_parallel.h.0.attn.q' must be one of colwise",
        ),
        (
            lambda d: d["layout"]["stages"][0]["ranks"].append(9),
            "plan field 'layout.stages\\[0\\].ranks\\[2\\]' must be a rank",
        ),
        (lambda d: d["review"]["notes"].append(3), "plan field 'review.notes\\[0\\]' must be a string"),
        (
            lambda d: d["provenance"]["pinned"].append("a'b"),
            "plan field 'provenance.pinned\\[0\\]' must be a printable",
        ),
        (
            lambda d: d["provenance"].update(runtime="deepspeed"),
            "plan field 'provenance.runtime' must be one of autoshard, megatron-lm, got 'deepspeed'",
        ),
        (lambda d: d["predicted"]["memory"].update(vram=1), "plan field 'predicted.memory' has an unknown key 'vram'"),
    ],
)
def test_version_2_fields_named_by_their_path(tmp_path, edit, message):
    data = json.loads(make_plan().to_json())
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=message) as err:
        load_plan(path)
    assert "\n" not in str(err.value)


def test_floats_rounded_for_stable_bytes():
    assert json.loads(make_plan().to_json())["predicted"]["step_time_s"] == 0.123457


def test_batch_arithmetic_checked():
    with pytest.raises(AutoshardError, match="not the global batch 8"):
        make_plan(num_microbatches=3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a plan is a JSON object"),
        ('{"version": 99}', "plan version 99, this autoshard reads versions 1 and 2"),
        ('{"version": 3}', "plan version 3, this autoshard reads versions 1 and 2"),
        ('{"version": 1, "model": {}}', "plan field 'model.spec' is missing"),
        ('{"version": 2, "model": {}}', "plan field 'decisions' is missing"),
    ],
)
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(AutoshardError, match=message):
        load_plan(path)


def test_tampered_zero_stage_rejected(tmp_path):
    data = json.loads(make_plan().to_json())
    data["decisions"]["zero_stage"] = 7
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match="'decisions.zero_stage' must be one of 0, 1, 2, 3, got 7"):
        load_plan(path)


def test_tampered_version_1_field_named_by_its_flat_path(tmp_path):
    data = json.loads(GOLDEN_V1.read_text())
    data["zero_stage"] = 7
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match="plan field 'zero_stage' must be one of 0, 1, 2, 3, got 7"):
        load_plan(path)


def test_blocks_expression_compresses_numbered_runs():
    assert blocks_expression(("h.0", "h.1", "h.2")) == '[f"h.{i}" for i in range(3)]'
    assert blocks_expression(("a", "b.1")) == "['a', 'b.1']"
    assert eval(blocks_expression(tuple(f"model.layers.{i}" for i in range(5)))) == [
        f"model.layers.{i}" for i in range(5)
    ]
