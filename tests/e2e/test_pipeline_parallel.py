"""Pipeline parallelism (torch.distributed.pipelining) trains exactly like one process (gloo, CPU ranks).

Each case runs tests/e2e/pp_driver.py for 2 AdamW steps (the first update, then one with the optimizer's
state) on the global batch of 8 and checks the step losses (mean over the global batch) and the final
weights with ``autoshard.verify.compare``
against ``train_reference``. The cases run in the session's one torchrun launch per world size
(``one_launch.Cases``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoshard.runtime import load_model_file
from autoshard.runtime.pipeline_parallel import stage_indices
from autoshard.runtime.report import read_weights
from autoshard.verify import compare, train_reference
from e2e.one_launch import Cases, job

pytestmark = pytest.mark.e2e

DRIVER = Path(__file__).with_name("pp_driver.py")
STEPS, GLOBAL_BATCH, LR, SEED = 2, 8, 1e-3, 0

# The same stages, schedule and micro-batches as a pipeline plan of tests/e2e/test_verify_hybrid.py, its program
# verified in the same 2-rank launch through the same runtime calls (``parallel.split_pipeline`` is
# ``build_pipeline_stages``, ``parallel.build_schedule`` is ``make_torch_schedule``), are not repeated here: gpt at
# h.1, h.2, h.3 interleaved-1f1b with 4 micro-batches is its "gpt-pp2-interleaved", Llama at model.layers.1 1F1B
# with 4 its "llama-pp2-1f1b", GPT-2 (tied) at transformer.h.1 1F1B with 4 its "gpt2-pp2-1f1b".
CASES = {  # id: (model spec, split points, dp, pp, virtual stages, schedule, micro-batches)
    "gpt-pp2-gpipe": ("examples/gpt.py:build", "h.2", 1, 2, 1, "gpipe", 4),
    "gpt-pp2-1f1b": ("examples/gpt.py:build", "h.2", 1, 2, 1, "1f1b", 4),
    # the rotary tables made in stage 0 reach stages 2 and 3 through the stages between (8 micro-batches:
    # with 4, even one process drifts 7.5e-5 from the full batch, an embedding gradient near AdamW's eps)
    "llama-pp4-1f1b": (
        "tests/models/hf_llama.py:build_4_layers",
        "model.layers.1,model.layers.2,model.layers.3",
        1,
        4,
        1,
        "1f1b",
        8,
    ),
    # the tie spans pp ranks 0 and 3 only: summed in a 2-rank subgroup
    "gpt2-tied-pp4-1f1b": (
        "tests/models/hf_gpt2.py:build",
        "transformer.h.0,transformer.h.1,transformer.ln_f",
        1,
        4,
        1,
        "1f1b",
        4,
    ),
    "gpt-dp2-pp2-1f1b": ("examples/gpt.py:build", "h.2", 2, 2, 1, "1f1b", 2),
    "gpt2-tied-dp2-pp2-gpipe": ("tests/models/hf_gpt2.py:build", "transformer.h.1", 2, 2, 1, "gpipe", 2),
    # BERT's padded attention mask, expanded to 4-D (a view) in stage 0, crosses to stage 1
    "bert-mask-pp2-1f1b": ("tests/models/hf_bert.py:build", "bert.encoder.layer.1", 1, 2, 1, "1f1b", 4),
    # nanoGPT's forward(idx, targets): the model input targets is read only by the last stage's loss
    "nanogpt-targets-pp2-1f1b": ("tests/models/nanogpt.py:build", "transformer.h.1", 1, 2, 1, "1f1b", 4),
    # T5 cut inside the encoder: the position bias and masks are read by both stages, decoder_input_ids
    # only by stage 1, and encoder_last_hidden_state (a model output) is made by stage 0
    "t5-shared-pp2-gpipe": ("tests/models/hf_t5.py:build", "encoder.block.1", 1, 2, 1, "gpipe", 2),
    # Mixtral's top-2 of 4 experts (transformers' grouped_mm experts)
    "mixtral-moe-pp2-1f1b": ("tests/models/hf_mixtral.py:build", "model.layers.1", 1, 2, 1, "1f1b", 2),
}


def driver_job(
    out: Path, spec: str, splits: str, dp: int, pp: int, virtual: int, schedule: str, microbatches: int
) -> dict:
    return job(
        DRIVER,
        [
            "--model",
            spec,
            "--splits",
            splits,
            "--dp",
            dp,
            "--pp",
            pp,
            "--virtual-stages",
            virtual,
            "--schedule",
            schedule,
            "--microbatches",
            microbatches,
            "--steps",
            STEPS,
            "--lr",
            repr(LR),
            "--seed",
            SEED,
            "--out",
            out,
        ],
        out,
        draws=True,
    )


# case -> (the folder of its metrics, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    {name: c[2] * c[3] for name, c in CASES.items()},
    prepare=lambda names, ranks, folder: {
        name: ([driver_job(folder / name, *CASES[name])], folder / name) for name in names
    },
    finish=lambda name, out, failures: (out, failures[0]),
    case_of=lambda test, params: params.get("case"),
)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_trains_like_one_process(in_repo, launches, case):
    spec = CASES[case][0]
    out, failure = launches.result(LAUNCHES, case)
    assert not failure, failure[-4000:]
    losses = json.loads((out / "metrics.json").read_text())["losses"]
    params = read_weights(out)
    ref_losses, ref_params = train_reference(load_model_file(spec), GLOBAL_BATCH, STEPS, SEED, LR)
    report = compare(STEPS, losses, ref_losses, params, ref_params)
    assert report.ok, report.failure
    assert losses[-1] < losses[0]  # it trains


def test_interleaved_layout():
    assert [stage_indices(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices(r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
