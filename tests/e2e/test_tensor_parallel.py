"""Tensor parallelism (chosen by the planner, applied with DTensor) trains like one process (gloo, CPU).

Each case runs tests/e2e/tp_driver.py with the styles ``choose_tp_styles`` picks, in the session's one
torchrun launch per world size (``one_launch.Cases``).
"""

import json
from functools import cache
from pathlib import Path

import pytest

from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph
from autoshard.runtime import load_model_file
from autoshard.runtime.report import read_weights
from autoshard.verify import compare, train_reference
from e2e.one_launch import Cases, attempt, job

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "tp_driver.py"
STEPS, BATCH, LR = 2, 8, 1e-3  # the first update, then one with the optimizer's state
# The compute-bound regime, so that the planner shards (see tests/test_tensor_parallel_choice.py).
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")
FAST_LINK = LinkSpec(100.0, 0.0, "test")

CASES = {  # name: (spec, dp, tp, expected sharded-module count or None for "any")
    "gpt-tp2": ("examples/gpt.py:build", 1, 2, 24),
    "llama-tp2": ("tests/models/hf_llama.py:build", 1, 2, 14),
    "llama-dp2-tp2": ("tests/models/hf_llama.py:build", 2, 2, 14),
    # attention written out (transformers' "eager": q @ kᵀ, the sliding-window mask added, softmax, @ v; GQA's
    # repeat_kv), sharded by heads; Gemma-3's per-head q/k norms (1 + weight) on the sharded heads
    "gemma3-eager-tp2": ("tests/models/hf_attention_forms.py:gemma3_eager", 1, 2, 18),
    # Llama 3's GQA as Meta and torchtitan write it: the KV heads repeated in place (repeat_interleave on the
    # heads dim), each rank repeating its own KV head into its own query heads; the logits gathered
    "llama3-gqa-tp2": ("benchmarks/llama3.py:llama3_tiny", 1, 2, 15),
}


GPT2 = "tests/models/hf_gpt2.py:build"  # transformers' Conv1D


@cache
def tp_choice(spec: str, tp: int):
    return choose_tp_styles(capture_graph(spec)[1], tp, FAST_LINK, SLOW_DEVICE)


def driver_job(spec: str, styles: dict, dp: int, tp: int, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "styles.json").write_text(json.dumps(styles))
    return job(
        DRIVER,
        [
            spec,
            tmp / "styles.json",
            tmp / "out",
            "--tp",
            tp,
            "--dp",
            dp,
            "--steps",
            STEPS,
            "--batch",
            BATCH,
            "--lr",
            repr(LR),
        ],
        tmp / "out",
        draws=True,
    )


ALL_CASES = {**{name: (spec, dp, tp) for name, (spec, dp, tp, _) in CASES.items()}, "gpt2-conv1d-tp2": (GPT2, 1, 2)}


def _prepare(names, ranks, folder):
    return {
        name: attempt(lambda: ([driver_job(spec, tp_choice(spec, tp).sharded, dp, tp, folder / name)], folder / name))
        for name in names
        for spec, dp, tp in [ALL_CASES[name]]
    }


# case -> (the folder of its driver run, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    {name: dp * tp for name, (_, dp, tp) in ALL_CASES.items()},
    _prepare,
    finish=lambda name, folder, failures: (folder, failures[0]),
    case_of=lambda test, params: (
        params.get("case") or ("gpt2-conv1d-tp2" if test == "test_gpt2_conv1d_tp2_matches_one_process" else None)
    ),
)


def check_against_one_process(spec: str, run: tuple[Path, str]) -> None:
    tmp, failure = run
    assert not failure, failure[-3000:]
    losses = json.loads((tmp / "out" / "losses.json").read_text())
    params = read_weights(tmp / "out")
    ref_losses, ref_params = train_reference(load_model_file(spec), BATCH, STEPS, 0, LR)
    report = compare(STEPS, losses, ref_losses, params, ref_params, LR)
    assert report.max_loss_diff < 1e-5, report
    assert report.ok, report.failure


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_matches_one_process(in_repo, launches, case):
    spec, dp, tp, sharded = CASES[case]
    choice = tp_choice(spec, tp)
    assert len(choice.sharded) - ("lm_head" in choice.sharded) == sharded
    check_against_one_process(spec, launches.result(LAUNCHES, case))


def test_gpt2_conv1d_tp2_matches_one_process(in_repo, launches):
    """transformers' Conv1D MLP split by the conv1d-colwise / conv1d-rowwise styles (c_attn, fused, replicated)."""
    choice = tp_choice(GPT2, 2)
    assert choice.sharded == {
        f"transformer.h.{i}.mlp.{m}": style
        for i in range(2)
        for m, style in (("c_fc", "conv1d-colwise"), ("c_proj", "conv1d-rowwise"))
    }
    check_against_one_process(GPT2, launches.result(LAUNCHES, "gpt2-conv1d-tp2"))
