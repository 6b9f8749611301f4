"""Tensor parallelism with sequence parallelism (chosen on the op graph, applied with DTensor) trains like one
process (gloo, CPU, tp=2, dropout off): the bundled GPT (also with selective recompute), transformers Llama (rotary
embeddings computed outside the blocks) and transformers GPT-2 (Conv1D), all in one run of sp_driver.py, a job of the session's 2-rank
torchrun launch (``one_launch.Cases``)."""

import json
from pathlib import Path

import pytest

from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph
from autoshard.runtime import load_model_file
from autoshard.runtime.report import read_weights
from autoshard.verify import compare, train_reference
from e2e.one_launch import Cases, job

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "sp_driver.py"
TP, STEPS, BATCH, LR = 2, 2, 4, 1e-3
# The compute-bound regime, so that the planner shards (see tests/test_tensor_parallel_choice.py).
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")
FAST_LINK = LinkSpec(100.0, 0.0, "test")

CASES = {  # name: (spec, styles every block must hold, styles outside the blocks)
    "gpt": (
        "examples/gpt.py:build",
        {
            "h.{i}.attn": "gather-seq-module-input-dim1",
            "h.{i}.attn.q_proj": "colwise",
            "h.{i}.attn.c_proj": "rowwise-seq-output-dim1",
            "h.{i}.ln_1": "sharded-input-dim1",
        },
        {"h.0": "scatter-seq-input-dim1", "ln_f": "sharded-input-dim1"},
    ),
    "llama": (
        "tests/models/hf_llama.py:build",
        {
            "model.layers.{i}.self_attn": "gather-seq-module-input-dim1",
            "model.layers.{i}.self_attn.o_proj": "rowwise-seq-output-dim1",
            "model.layers.{i}.mlp.down_proj": "rowwise-seq-output-dim1",
            "model.layers.{i}.input_layernorm": "sharded-input-dim1",
        },
        {"model.layers.0": "scatter-seq-input-dim1", "model.norm": "sharded-input-dim1"},
    ),
    # the same with selective recompute: the blocks keep DTensor's collectives' outputs (runtime.selective), so
    # their gathers and reduce-scatters run once; what they kept must be what a rerun would have computed
    "gpt-selective": (
        "examples/gpt.py:build",
        {"h.{i}.attn": "gather-seq-module-input-dim1", "h.{i}.ln_1": "sharded-input-dim1"},
        {"h.0": "scatter-seq-input-dim1"},
    ),
    "gpt2": (
        "tests/models/hf_gpt2.py:build",
        {
            "transformer.h.{i}.mlp.c_fc": "conv1d-colwise-seq-input-dim1",
            "transformer.h.{i}.mlp.c_proj": "conv1d-rowwise-seq-output-dim1",
            "transformer.h.{i}.attn.c_attn": "gather-seq-input-dim1",
            "transformer.h.{i}.attn.c_proj": "scatter-seq-output-dim1",
        },
        {"transformer.h.0": "scatter-seq-input-dim1", "transformer.ln_f": "gather-seq-input-dim1"},
    ),
}


def sp_case(name: str, spec: str) -> dict:
    """The driver's case: the styles the planner picks, and (name "-selective") selective recompute of every block."""
    graph = capture_graph(spec)[1]
    choice = choose_tp_styles(graph, TP, FAST_LINK, SLOW_DEVICE, sequence_parallel=True)
    assert choice.sequence_parallel, spec
    recompute = {"recompute": "selective", "blocks": [b.path for b in graph.blocks]} if "-selective" in name else {}
    return {"name": name, "spec": spec, "styles": choice.sharded, **recompute}


def _prepare(names, ranks, folder):
    """The one case "all": sp_driver.py over every model, with the styles the planner picks."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        cases = [sp_case(name, spec) for name, (spec, _, _) in CASES.items()]
    except Exception as exc:  # noqa: BLE001  (raised in the test)
        return {"all": exc}
    (folder / "cases.json").write_text(json.dumps(cases))
    return {
        "all": (
            [
                job(
                    DRIVER,
                    [
                        folder / "cases.json",
                        folder / "out",
                        "--tp",
                        TP,
                        "--steps",
                        STEPS,
                        "--batch",
                        BATCH,
                        "--lr",
                        repr(LR),
                    ],
                    folder / "out",
                )
            ],
            (cases, folder / "out"),
        )
    }


# "all" -> (the driver's cases, its folder, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    {"all": TP},
    _prepare,
    finish=lambda name, state, failures: (*state, failures[0]),
    case_of=lambda test, params: "all",
)


def test_sequence_parallel_matches_one_process(in_repo, launches):
    cases, out_dir, failure = launches.result(LAUNCHES, "all")
    for (name, (spec, per_block, rest)), case in zip(CASES.items(), cases):
        styles = case["styles"]
        for i in range(2):
            for module, style in per_block.items():
                assert styles.get(module.format(i=i)) == style, (name, module.format(i=i), styles)
        for module, style in rest.items():
            assert styles.get(module) == style, (name, module, styles)
    assert not failure, failure[-4000:]
    for case in cases:
        out = out_dir / case["name"]
        losses = json.loads((out / "losses.json").read_text())
        params = read_weights(out)
        ref_losses, ref_params = train_reference(
            load_model_file(case["spec"]), BATCH, STEPS, 0, LR, fixed_randomness=True
        )
        report = compare(STEPS, losses, ref_losses, params, ref_params, LR)
        assert report.max_loss_diff < 1e-5, (case["name"], report)
        assert report.max_param_diff < 1e-5, (case["name"], report)
        assert report.ok, (case["name"], report.failure)
        tokens = load_model_file(case["spec"]).example_batch(1)[0][0].shape[1]
        assert json.loads((out / "norm_tokens.json").read_text()) == [tokens // TP], case["name"]  # split
