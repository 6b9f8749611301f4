"""Train models with context parallelism (optionally dp x cp) on CPU ranks and save the results.

Run by tests/e2e/test_context_parallel.py, a job of the session's torchrun launches (``one_launch.py``),
or alone under torchrun::

    cp_driver.py OUT_DIR --cp 2 [--dp 2] [--steps 2] [--batch 4] [--lr 1e-3] [--check-op] [--model NAME=SPEC ...]

One launch trains every model given (process start-up is the slow part on a small machine).
Ranks form a (dp, cp) mesh: each dp row draws its slice of the global batch, and its cp ranks
take contiguous chunks of those sequences (``shard_sequence``; the emitted programs' head-tail chunks are
their own cases, and ``--check-op`` checks the ring on both). The forward and backward run
under ``ContextParallelMode``; the plain (unwrapped) model's gradients are averaged over all
ranks (``average_gradients``), then AdamW steps. Rank 0 writes ``NAME/losses.json`` (the global
mean loss per step) and ``NAME/params.pt``. ``--check-op`` first compares ring attention with
one-process SDPA on random tensors (causal and not, GQA) and writes ``op_check.json``: the
largest differences of the output and of the three input gradients.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autoshard.runtime import (
    build_model,
    global_batch,
    init_distributed,
    load_model_file,
    mean_over,
    shutdown,
    take_shard,
)
from autoshard.runtime.context_parallel import ContextParallelMode, average_gradients, shard_sequence


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--model", action="append", default=[], help="NAME=SPEC, e.g. gpt=examples/gpt.py:build")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check-op", action="store_true")
    return p.parse_args()


def check_op(cp_group, cp_rank: int, cp: int) -> dict:
    """Largest |ring - one process| of out, dq, dk, dv over this cp group, per is_causal and layout (contiguous
    chunks, and head-tail pairs of chunks: torch's load-balanced ring)."""
    result = {}
    for is_causal, balanced in ((True, False), (False, False), (True, True), (False, True)):
        torch.manual_seed(1)  # the same full tensors on every rank
        q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
        weight = torch.randn(2, 4, 16, 8)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*full, is_causal=is_causal, enable_gqa=True)
        (out * weight).sum().backward()
        local = [shard_sequence(t, 2, cp_rank, cp, balanced).clone().requires_grad_() for t in (q, k, v)]
        with ContextParallelMode(cp_group, cp_rank, cp, local[0].shape[2], balanced):
            local_out = F.scaled_dot_product_attention(*local, is_causal=is_causal, enable_gqa=True)
            (local_out * shard_sequence(weight, 2, cp_rank, cp, balanced)).sum().backward()
        pairs = [(local_out, out)] + [(mine.grad, whole.grad) for mine, whole in zip(local, full)]
        diffs = torch.tensor([(a - shard_sequence(b, 2, cp_rank, cp, balanced)).abs().max().item() for a, b in pairs])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=cp_group)
        name = ("causal" if is_causal else "full") + ("-head-tail" if balanced else "")
        result[name] = dict(zip(("out", "dq", "dk", "dv"), diffs.tolist()))
    return result


def train(spec: str, args, mesh, device) -> tuple[list[float], dict]:
    model_file = load_model_file(spec)
    model = build_model(model_file, seed=0, fixed_randomness=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_rank, cp_rank, cp_group = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank(), mesh["cp"].get_group()
    losses = []
    for step in range(args.steps):
        inputs, targets = take_shard(global_batch(model_file, args.batch, 0, step), dp_rank, args.dp, device)
        inputs = tuple(shard_sequence(t, 1, cp_rank, args.cp) for t in inputs)
        targets = shard_sequence(targets, 1, cp_rank, args.cp)
        with ContextParallelMode(cp_group, cp_rank, args.cp, inputs[0].shape[1]):
            loss = model_file.loss(model(*inputs), targets)  # the mean over this rank's tokens
            loss.backward()
        average_gradients(model.parameters())  # over dp x cp: equal token counts, so the global mean
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over(loss, None))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    args = parse_args()
    ctx = init_distributed(expected_world_size=args.dp * args.cp)
    mesh = init_device_mesh("cpu", (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    out = Path(args.out_dir)
    if args.check_op:
        result = check_op(mesh["cp"].get_group(), mesh["cp"].get_local_rank(), args.cp)
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "op_check.json").write_text(json.dumps(result))
    for item in args.model:
        name, spec = item.split("=", 1)
        losses, params = train(spec, args, mesh, ctx.device)
        if ctx.is_main:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "losses.json").write_text(json.dumps(losses))
            torch.save(params, out / name / "params.pt")
    dist.barrier()
    shutdown()  # as emitted programs end (runtime.distributed.shutdown)


if __name__ == "__main__":
    main()
