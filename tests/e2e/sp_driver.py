"""Train several models with tensor + sequence parallelism on CPU ranks, one after another, and save each result.

Run once by tests/e2e/test_sequence_parallel.py, a job of the session's 2-rank torchrun launch
(``one_launch.py``), or alone with ``python -m torch.distributed.run`` (starting processes costs seconds,
so every case shares one run)::

    sp_driver.py CASES_JSON OUT_DIR --tp 2 [--steps 2] [--batch 4] [--lr 1e-3]

CASES_JSON is a list of ``{"name", "spec", "styles"}`` (with ``"recompute"`` and ``"blocks"``: that recompute mode
on those blocks, after the styles, as programs apply them). For each case every rank builds the same weights (seed 0,
dropout off: ``build_model(fixed_randomness=True)``), applies ``styles`` with ``apply_tensor_parallel`` on a tp mesh,
and trains with AdamW on the same global batch; rank 0 writes ``OUT_DIR/<name>/losses.json``,
``OUT_DIR/<name>/weights/`` (a DCP checkpoint of the final weights, each rank its shards) and ``norm_tokens.json`` (the
sequence lengths the sequence-parallel norms received: the tokens really are split).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.runtime import build_model, global_batch, init_distributed, load_model_file, shutdown, take_shard
from autoshard.runtime.checkpoint import save_weights
from autoshard.runtime.parallel import apply_recompute
from autoshard.runtime.tensor_parallel import apply_tensor_parallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("cases_json")
    p.add_argument("out_dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args()


def train(case: dict, mesh, args, ctx) -> tuple[list[float], dict, list[int]]:
    model_file = load_model_file(case["spec"])
    model = build_model(model_file, seed=0, fixed_randomness=True)
    seen = watch_norm_inputs(model, case["styles"])
    apply_tensor_parallel(model, mesh, case["styles"])
    if case.get("recompute"):
        apply_recompute(model, case["blocks"], case["recompute"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        inputs, targets = take_shard(global_batch(model_file, args.batch, 0, step), 0, 1, ctx.device)
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, (model, optimizer), seen


def watch_norm_inputs(model: torch.nn.Module, styles: dict) -> list[int]:
    """The sequence length each module styled ``sharded-input-dim1`` (the norms under sequence parallelism)
    receives, as its local tensor: the proof that the run really splits the tokens (hooks registered before
    the styles', so they see the input as it arrives)."""
    seen: list[int] = []
    for path, style in styles.items():
        if style == "sharded-input-dim1":
            model.get_submodule(path).register_forward_pre_hook(lambda m, a: seen.append(int(a[0].shape[1])))
    return seen


def main() -> None:
    args = parse_args()
    ctx = init_distributed(expected_world_size=args.tp)
    mesh = init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
    for case in json.loads(Path(args.cases_json).read_text()):
        losses, (model, optimizer), seen = train(case, mesh, args, ctx)
        out = Path(args.out_dir) / case["name"]
        save_weights(out / "weights", model, optimizer)  # each rank its shards, as programs write them
        if ctx.is_main:
            (out / "losses.json").write_text(json.dumps(losses))
            (out / "norm_tokens.json").write_text(json.dumps(sorted(set(seen))))
        dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
