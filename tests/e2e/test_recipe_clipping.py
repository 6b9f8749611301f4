"""Gradient clipping by the whole model's norm over every mesh axis trains like one process (gloo, CPU).

tests/e2e/recipe_driver.py trains examples/gpt.py for a few steps with a warmup-cosine recipe whose
max_grad_norm clips every step, in the session's one torchrun launch of 4 ranks (``one_launch.Cases``):

    tp-pp         tp 2 x pp 2, TP shards inside the stages (plain tensors: summed over tp by hand, then over
                  pp), SGD with momentum (its step is proportional to the clipped gradient), weight-decay groups
                  read by name on the stages
    dp-tp-zero3   dp 2 x tp 2, DTensor TP and FSDP2 ZeRO-3 (2-D DTensors, replicated over tp or sharded),
                  AdamW with a large eps (so its step follows the clipped gradient's scale too)

Each is compared with one process running the same recipe (``recipe.build_optimizer``, ``build_scheduler``,
``clip_grad_norm`` on the whole model): the norm of every step, the rates, the losses, and the final weights'
change from their initial values.
"""

import json
from functools import cache
from pathlib import Path

import pytest

from autoshard.runtime import build_model, global_batch, load_model_file
from autoshard.runtime.recipe import Recipe, build_optimizer, build_scheduler, clip_grad_norm, lr_factor
from autoshard.runtime.report import read_weights
from e2e.one_launch import Cases, job

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "recipe_driver.py"
MODEL, GLOBAL_BATCH, STEPS = "examples/gpt.py:build", 8, 4
MAX_NORM = 0.1  # examples/gpt.py's gradient norm is about 1 in these steps: every step is clipped
CASES = {
    "tp-pp": Recipe(
        optimizer="sgd",
        lr=0.5,
        momentum=0.9,
        weight_decay=0.1,
        decay_all=False,
        schedule="cosine",
        warmup_steps=2,
        min_lr_ratio=0.1,
        max_grad_norm=MAX_NORM,
    ),
    "dp-tp-zero3": Recipe(
        optimizer="adamw",
        lr=0.01,
        eps=1e-3,
        weight_decay=0.1,
        decay_all=False,
        schedule="cosine",
        warmup_steps=2,
        min_lr_ratio=0.1,
        max_grad_norm=MAX_NORM,
    ),
}


def _prepare(names, ranks, folder):
    return {
        name: (
            [
                job(
                    DRIVER,
                    [
                        "--layout",
                        name,
                        "--recipe",
                        json.dumps(CASES[name].as_dict()),
                        "--steps",
                        STEPS,
                        "--out",
                        folder / name,
                    ],
                    folder / name,
                )
            ],
            folder / name,
        )
        for name in names
    }


# case -> (the folder of its driver run, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    dict.fromkeys(CASES, 4),
    _prepare,
    finish=lambda name, folder, failures: (folder, failures[0]),
    case_of=lambda test, params: params.get("layout"),
)


@cache
def one_process(layout: str) -> dict:
    """The same recipe in one process on the whole global batch: initial and final weights, norms, losses."""
    recipe = CASES[layout].for_run(STEPS)
    model_file = load_model_file(MODEL)
    model = build_model(model_file, 0, fixed_randomness=True)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, recipe, "cpu")
    scheduler = build_scheduler(optimizer, recipe)
    norms, losses = [], []
    for step in range(STEPS):
        inputs, targets = global_batch(model_file, GLOBAL_BATCH, 0, step)
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        losses.append(loss.item())
        norms.append(clip_grad_norm(model, recipe.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "initial": initial,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "norms": norms,
        "losses": losses,
    }


@pytest.mark.parametrize("layout", list(CASES))
def test_clipping_over_every_mesh_axis_matches_one_process(in_repo, launches, layout):
    folder, failure = launches.result(LAUNCHES, layout)
    assert not failure, failure[-3000:]
    run = json.loads((folder / "metrics.json").read_text())
    reference, recipe = one_process(layout), CASES[layout].for_run(STEPS)
    assert min(reference["norms"]) > 5 * MAX_NORM  # every step clipped, by a factor the weights show
    assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert run["lrs"] == pytest.approx([recipe.lr * lr_factor(t, recipe) for t in range(STEPS)], rel=1e-12)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    weights = read_weights(folder)
    # each tensor's change against the largest change anywhere (a tensor whose gradient is rounding noise, as
    # attention's key bias, has no scale of its own); a norm off by a rank's share would be percents off
    scale = max((reference["final"][k] - v).abs().max().item() for k, v in reference["initial"].items())
    worst = max(((weights[k] - v).abs().max().item() / scale, k) for k, v in reference["final"].items())
    assert worst[0] < 1e-4, worst
