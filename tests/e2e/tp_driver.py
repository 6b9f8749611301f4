"""Train a model with tensor parallelism (optionally DP × TP) on CPU ranks and save the result.

Run by tests/e2e/test_tensor_parallel.py, a job of the session's torchrun launch of its
world size (``one_launch.py``), or alone with ``python -m torch.distributed.run``::

    tp_driver.py SPEC STYLES_JSON OUT_DIR --tp 2 [--dp 2] [--steps 3] [--batch 8] [--lr 1e-3]

Every rank builds the same weights (seed 0); TP is applied on the "tp" axis of a (dp, tp)
mesh with ``apply_tensor_parallel``; with dp > 1 FSDP2 ``fully_shard`` then shards each block
and the root over the "dp" axis (TP first, then FSDP, as torchtitan does). Each step every TP
rank sees its DP shard of the same global batch. Rank 0 writes ``losses.json`` (the global
mean loss per step) and ``weights/`` (a DCP checkpoint of the final weights, each rank its shards, as
programs write them: ``runtime.read_weights`` reads them whole).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from autoshard.passes.capturing.blocks import block_of
from autoshard.runtime import (
    build_model,
    global_batch,
    init_distributed,
    load_model_file,
    mean_over,
    shutdown,
    take_shard,
)
from autoshard.runtime.checkpoint import save_weights
from autoshard.runtime.tensor_parallel import apply_tensor_parallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("styles_json")
    p.add_argument("out_dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args()


def apply_fsdp_over_dp(model: torch.nn.Module, dp_mesh) -> None:
    """fully_shard every block ("h.3", "model.layers.1") and then the root, over the dp mesh."""
    blocks = sorted(
        {b for name, _ in model.named_modules() if (b := block_of(name)) == name},
        key=lambda b: [int(x) if x.isdigit() else 0 for x in b.split(".")],
    )
    for path in blocks:
        fully_shard(model.get_submodule(path), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def main() -> None:
    args = parse_args()
    ctx = init_distributed(expected_world_size=args.dp * args.tp)
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    model_file = load_model_file(args.spec)
    model = build_model(model_file, seed=0)
    apply_tensor_parallel(model, mesh["tp"], json.loads(Path(args.styles_json).read_text()))
    if args.dp > 1:
        apply_fsdp_over_dp(model, mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_rank, losses = mesh["dp"].get_local_rank(), []
    for step in range(args.steps):
        inputs, targets = take_shard(global_batch(model_file, args.batch, 0, step), dp_rank, args.dp, ctx.device)
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over(loss, mesh["dp"].get_group()))
    out = Path(args.out_dir)
    save_weights(out / "weights", model, optimizer)  # each rank its shards, as programs write them
    if ctx.is_main:
        (out / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    shutdown()  # as emitted programs end (runtime.distributed.shutdown)


if __name__ == "__main__":
    main()
