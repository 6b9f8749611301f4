"""Train examples/gpt.py with a recipe (runtime/recipe.py) on 4 CPU ranks, clipping the gradient by the whole
model's norm, and save the result.

Run by tests/e2e/test_recipe_clipping.py, a job of the session's torchrun launch of 4 ranks (``one_launch.py``),
or alone with ``python -m torch.distributed.run --nproc-per-node 4``::

    recipe_driver.py --layout tp-pp|dp-tp-zero3 --recipe RECIPE_JSON --out OUT [--steps 4]

The model is parallelized with the applier's own functions, in the order an emitted program calls them:
``tp-pp`` is tp 2 x pp 2 (TP shards inside the stages, 1F1B over 2 micro-batches), ``dp-tp-zero3`` is dp 2 x
tp 2 with DTensor TP and FSDP2 ZeRO-3 over dp. Each step: backward, ``clip_grad_norm``, ``optimizer.step()``,
``scheduler.step()``. Rank 0 writes ``metrics.json`` (the global mean loss, the gradient norm and the rate of
each step) and every rank its shards of the final weights (``weights/``, as programs write them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from autoshard import runtime
from autoshard.runtime import pipeline_parallel as pp
from autoshard.runtime.checkpoint import save_weights
from autoshard.runtime.parallel import (
    apply_fsdp,
    apply_tp,
    build_optimizer,
    build_schedule,
    init_weights,
    split_pipeline,
)
from autoshard.runtime.recipe import Recipe, build_scheduler, clip_grad_norm

MODEL = "examples/gpt.py:build"
GLOBAL_BATCH, MICROBATCHES = 8, 2
BLOCKS = [f"h.{i}" for i in range(4)]
TP_STYLES = {
    f"{block}.{name}": style
    for block in BLOCKS
    for name, style in {
        "attn.c_proj": "rowwise",
        "attn.k_proj": "colwise",
        "attn.q_proj": "colwise",
        "attn.v_proj": "colwise",
        "mlp.c_fc": "colwise",
        "mlp.c_proj": "rowwise",
    }.items()
} | {"lm_head": "colwise-gather"}  # tests/golden/tp_pp.py's
LAYOUTS = {"tp-pp": {"pp": 2, "dp": 1, "tp": 2}, "dp-tp-zero3": {"pp": 1, "dp": 2, "tp": 2}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=list(LAYOUTS), required=True)
    parser.add_argument("--recipe", required=True, help="Recipe.as_dict() as JSON")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def pipeline(model, mesh, recipe: Recipe, device, model_file):
    """tp 2 x pp 2: TP shards traced into 2 stages cut before h.2 (tests/golden/tp_pp.py's steps)."""
    example = tuple(
        t[: GLOBAL_BATCH // MICROBATCHES].to(device) for t in runtime.global_batch(model_file, GLOBAL_BATCH, 0, 0)[0]
    )
    model = apply_tp(model, mesh["tp"], styles=TP_STYLES, before_split=True)
    stages = split_pipeline(
        model,
        mesh,
        split_points=("h.2",),
        virtual_stages=1,
        tp_styles=TP_STYLES,
        example_microbatch=example,
        device=device,
    )
    stages = init_weights(stages, mesh, device=device)
    optimizer = build_optimizer(stages, mesh["dp"], zero_stage=0, recipe=recipe)
    schedule = build_schedule(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=model_file.loss)
    return stages, optimizer, lambda inputs, targets: pp.pipeline_step(schedule, stages, inputs, targets)


def spmd(model, mesh, recipe: Recipe, device, model_file):
    """dp 2 x tp 2: DTensor TP, then FSDP2 ZeRO-3 over dp (tests/golden/dp_tp_zero2.py's steps, resharded)."""
    model = apply_tp(model, mesh["tp"], styles=TP_STYLES)
    model = apply_fsdp(model, mesh["dp"], blocks=BLOCKS, reshard_after_forward=True)
    model = init_weights(model, mesh, device=device)
    optimizer = build_optimizer(model, mesh["dp"], zero_stage=3, recipe=recipe)

    def step(inputs, targets) -> float:
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        return runtime.mean_over(loss.detach(), mesh.get_group("dp"))

    return model, optimizer, step


def main() -> None:
    args = parse_args()
    dims = LAYOUTS[args.layout]
    ctx = runtime.init_distributed(expected_world_size=4)
    mesh = runtime.build_mesh(ctx.device_type, dims, {})
    recipe = Recipe(**json.loads(args.recipe)).for_run(args.steps)
    model_file = runtime.load_model_file(MODEL)
    model = runtime.build_meta_model(model_file, seed=0, device=ctx.device, fixed_randomness=True)
    build = pipeline if args.layout == "tp-pp" else spmd
    model, optimizer, forward_backward = build(model, mesh, recipe, ctx.device, model_file)
    scheduler = build_scheduler(optimizer, recipe)
    dp_rank, metrics = mesh.get_local_rank("dp"), {"losses": [], "norms": [], "lrs": []}
    for step in range(args.steps):
        batch = runtime.global_batch(model_file, GLOBAL_BATCH, 0, step)
        inputs, targets = runtime.take_shard(batch, dp_rank, dims["dp"], ctx.device)
        metrics["lrs"].append(scheduler.get_last_lr()[0])
        metrics["losses"].append(forward_backward(inputs, targets))
        metrics["norms"].append(clip_grad_norm(model, recipe.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    out = Path(args.out)
    save_weights(out / "weights", model, optimizer, mesh)  # each rank its shards, as programs write them
    if ctx.is_main:
        (out / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
