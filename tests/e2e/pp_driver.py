"""Train a model with pipeline parallelism (optionally × FSDP2 data parallelism) for a few steps.

Run by tests/e2e/test_pipeline_parallel.py, a job of the session's torchrun launch of its
world size (``one_launch.py``), or alone under torchrun; rank 0 writes the step losses
(``metrics.json``) and the final weights (``weights/``, a DCP checkpoint, each rank its shards) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard import runtime
from autoshard.runtime import pipeline_parallel as pp
from autoshard.runtime.checkpoint import StageOptimizers, save_weights

GLOBAL_BATCH = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--splits", required=True, help="comma-separated modules where a stage begins")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = runtime.init_distributed(expected_world_size=args.dp * args.pp)
    mesh = init_device_mesh(ctx.device_type, (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    model_file = runtime.load_model_file(args.model)
    model = runtime.build_model(model_file, seed=args.seed, device=ctx.device)

    microbatch_size = GLOBAL_BATCH // (args.dp * args.microbatches)
    example_inputs = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, 0)[0]
    example = tuple(t[:microbatch_size].to(ctx.device) for t in example_inputs)
    parts = pp.build_pipeline_stages(
        model, example, args.splits.split(","), pp_rank, args.pp, args.virtual_stages, ctx.device, mesh.get_group("pp")
    )
    del model  # the stages hold what this rank needs
    if args.dp > 1:
        runtime.apply_fsdp(parts, mesh["dp"])  # each stage module one FSDP2 unit
    optimizer = StageOptimizers(parts.modules, lr=args.lr)  # one AdamW per stage module, as programs have
    schedule = pp.make_torch_schedule(parts, args.microbatches, model_file.loss, args.schedule)

    losses = []
    for step in range(args.steps):
        batch = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, step)
        inputs, targets = runtime.take_shard(batch, dp_rank, args.dp, ctx.device)
        losses.append(pp.pipeline_step(schedule, parts, inputs, targets))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    out = Path(args.out)
    save_weights(out / "weights", parts, optimizer)  # each rank its stages' shards, as programs write them
    if ctx.is_main:
        (out / "metrics.json").write_text(json.dumps({"losses": losses}))
    dist.barrier()
    runtime.shutdown()  # as emitted programs end


if __name__ == "__main__":
    main()
