"""Tensor, pipeline and hybrid plans, pinned through the planner, train like one process.

Each case is ``autoshard.verify`` of one plan (``one_launch.verify_cases``: verify's own checks, command
line and judgement); the programs run in the session's one torchrun launch per world size. Two cases train
with a recipe of their own (``RECIPES``: written into the program's ``RECIPE``, and the reference's), warmup
then cosine decay, clipped by the whole model's gradient norm at every step: tp 2 x pp 2 with SGD (its step
is the clipped gradient's, so a norm off by a rank's share shows at once) and dp 2 x tp 2 ZeRO-3 with AdamW.
"""

import pytest

import autoshard
from autoshard.ir.recipe import Recipe
from e2e.one_launch import Cases, verify_cases

pytestmark = pytest.mark.e2e

GPT, LLAMA, GPT2 = "examples/gpt.py:build", "tests/models/hf_llama.py:build", "tests/models/hf_gpt2.py:build"
LLAMA4 = "tests/models/hf_llama.py:build_4_layers"  # enough blocks for 4 stages
QWEN3 = "tests/models/hf_causal_zoo.py:build_qwen3"  # per-head q_norm / k_norm on sharded heads

# Llama and GPT-2 at tp=2 and pp=2 on 2 ranks are cases of the model zoo (tests/e2e/test_zoo.py).
CASES = {  # name: (model, ranks, pins)
    "gpt-tp2": (GPT, 2, dict(tp=2)),
    "gpt-pp2-gpipe": (GPT, 2, dict(pp=2, schedule="gpipe")),
    "gpt-pp2-1f1b": (GPT, 2, dict(pp=2, schedule="1f1b")),
    "gpt-pp2-interleaved": (GPT, 2, dict(pp=2, schedule="interleaved-1f1b")),
    "gpt-dp2-tp2-zero3": (GPT, 4, dict(dp=2, tp=2, zero=3)),
    "gpt-dp2-pp2-zero1": (GPT, 4, dict(dp=2, pp=2, zero=1, schedule="1f1b")),
    "llama-pp2-1f1b": (LLAMA, 2, dict(pp=2, schedule="1f1b")),
    # the rotary tables made before layer 0 reach stages 2 and 3 through the stages between; with 4
    # micro-batches even one process drifts 7.5e-5 from the full batch (an embedding gradient near eps)
    "llama-pp2-interleaved": (LLAMA4, 2, dict(pp=2, schedule="interleaved-1f1b", microbatch_size=1)),
    "llama-dp2-tp2-zero3": (LLAMA, 4, dict(dp=2, tp=2, zero=3)),
    "llama-dp2-pp2-zero3": (LLAMA, 4, dict(dp=2, pp=2, zero=3, schedule="gpipe")),
    "gpt2-pp2-1f1b": (GPT2, 2, dict(pp=2, schedule="1f1b")),
    # tp x pp: the search picks sequence parallelism for these models on this cluster; the plain stage form (Megatron's
    # f and g only) is pinned where a case is to keep it, and gpt-tp2-pp2 and qwen3-tp2-pp2 take the search's
    "gpt-tp2-pp2": (GPT, 4, dict(tp=2, pp=2, schedule="1f1b")),
    "llama-tp2-pp2": (LLAMA, 4, dict(tp=2, pp=2, schedule="gpipe", sequence_parallel=False)),
    "gpt2-tp2-pp2": (GPT2, 4, dict(tp=2, pp=2, schedule="1f1b", sequence_parallel=False)),
    "gpt-dp2-tp2-pp2-zero3": (GPT, 8, dict(dp=2, tp=2, pp=2, zero=3, schedule="1f1b", sequence_parallel=False)),
    "llama-dp2-tp2-pp2-zero3": (LLAMA, 8, dict(dp=2, tp=2, pp=2, zero=3, schedule="1f1b", sequence_parallel=False)),
    # the norms' replicated weights get their tp-partial gradients summed: DTensor (SequenceParallel) with
    # FSDP2 on dp; the traced tp_copy on each weight inside pipeline stages
    "qwen3-dp2-tp2-zero3": (QWEN3, 4, dict(dp=2, tp=2, zero=3)),
    "qwen3-tp2-pp2": (QWEN3, 4, dict(tp=2, pp=2, schedule="1f1b")),
    # sequence parallelism inside pipeline stages (runtime.tensor_parallel_stages' sp_* ops): the stage boundary
    # carries each tp rank's half of the tokens. Llama: attention and MLP gathering their input once, the row
    # linears reduce-scattering, the norms' weights summed over tp; GPT-2 with FSDP2 on dp: Conv1D's sequence
    # styles (a row bias meeting half the tokens), a replicated c_attn gathering and c_proj slicing
    "llama-tp2-pp2-sp": (LLAMA, 4, dict(tp=2, pp=2, schedule="gpipe", sequence_parallel=True)),
    "gpt2-dp2-tp2-pp2-zero3-sp": (GPT2, 8, dict(dp=2, tp=2, pp=2, zero=3, schedule="1f1b", sequence_parallel=True)),
    # node groups: two groups of 2 CPU ranks, the first given twice the FLOP/s (HETERO); its stage takes more layers
    "gpt-hetero-dp2-pp2": (GPT, 4, dict(dp=2, pp=2, schedule="1f1b")),
}
HETERO = {"gpt-hetero-dp2-pp2": "tests/clusters/hetero_cpu.yaml"}  # case: its cluster file of node groups

# Plans whose stages, schedule and micro-batches are those of a pp_driver.py case that
# tests/e2e/test_pipeline_parallel.py leaves to them: case -> (split points, micro-batches)
DRIVER_LAYOUTS = {
    "gpt-pp2-interleaved": (("h.1", "h.2", "h.3"), 4),
    "llama-pp2-1f1b": (("model.layers.1",), 4),
    "gpt2-pp2-1f1b": (("transformer.h.1",), 4),
}


# Two steps show a plan's gradients (the first update) and its optimizer state carried into the next step; the
# recipe cases take a third, the first whose learning rate the cosine decay sets after 2 warmup steps.
STEPS, RECIPE_STEPS = 2, 3
MAX_NORM = 0.1  # examples/gpt.py's gradient norm is about 1 in these steps: every step is clipped
RECIPES = {
    "gpt-tp2-pp2": Recipe(
        optimizer="sgd",
        lr=0.5,
        momentum=0.9,
        weight_decay=0.1,
        schedule="cosine",
        warmup_steps=2,
        min_lr_ratio=0.1,
        max_grad_norm=MAX_NORM,
    ),
    "gpt-dp2-tp2-zero3": Recipe(
        lr=0.01, eps=1e-3, weight_decay=0.1, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, max_grad_norm=MAX_NORM
    ),
}


def _plan(case):
    model, ranks, pins = CASES[case]
    if case in HETERO:  # its groups count their own ranks
        return autoshard.plan(model, cluster=HETERO[case], global_batch=8, **pins)
    cluster = "tests/clusters/fast_link_cpu.yaml" if pins.get("tp", 1) > 1 else "local-cpu"
    return autoshard.plan(model, cluster=cluster, devices_per_node=ranks, global_batch=8, **pins)


LAUNCHES = Cases(
    {case: ranks for case, (_, ranks, _) in CASES.items()},
    *verify_cases(_plan, lambda case: RECIPE_STEPS if case in RECIPES else STEPS, recipe_of=RECIPES.get),
    case_of=lambda test, params: params.get("case"),
)


@pytest.fixture(scope="module")
def verified(launches):
    """case -> (plan, verify report)."""
    return lambda case: launches.result(LAUNCHES, case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_plan_trains_like_one_process(verified, case):
    model, ranks, pins = CASES[case]
    plan, report = verified(case)
    for axis in ("dp", "tp", "pp"):
        assert getattr(plan.mesh, axis) == pins.get(axis, 1)
    if "schedule" in pins:
        assert plan.schedule == pins["schedule"] and len(plan.split_points) == plan.mesh.pp * plan.virtual_stages - 1
    if case in DRIVER_LAYOUTS:
        assert (tuple(plan.split_points), plan.num_microbatches) == DRIVER_LAYOUTS[case]
    if plan.mesh.tp > 1:
        assert plan.tensor_parallel, "a tp plan shards something"
    if "sequence_parallel" in pins:
        assert plan.sequence_parallel == pins["sequence_parallel"]
    if model == QWEN3:
        assert plan.tensor_parallel["model.layers.0.self_attn.q_norm"] == "sharded-input-dim2"
    assert report.ok, report.failure
    if case in HETERO:  # the faster group's stage holds more of the blocks
        fast, slow = (plan.stages[i] for i in (0, 1))
        assert [plan.stage_group(s.ranks)["name"] for s in (fast, slow)] == ["fast", "slow"]
        assert sum(m.startswith("h.") for m in fast.modules) > sum(m.startswith("h.") for m in slow.modules)
    if case in RECIPES:  # the program clipped every step (the norm it logged is the one before clipping)
        assert len(report.grad_norms) == RECIPE_STEPS and min(report.grad_norms) > 5 * MAX_NORM, report.grad_norms
    else:
        assert report.grad_norms == (None,) * STEPS
