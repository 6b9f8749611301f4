"""Train the example GPT with autoshard's Python API inside your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_with_api.py

Every rank plans (planning is deterministic, so all ranks get the same plan), builds the
model from the same seed, and lets ``autoshard.parallelize`` apply the plan. The loop is
ordinary PyTorch: each rank trains on its data-parallel slice of every global batch.
"""

import os
import sys

import torch
import torch.distributed as dist

import autoshard
from autoshard import runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (the model file next to this script)

GLOBAL_BATCH = 16
STEPS = 20


def main():
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model_spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py") + ":build"
    plan = autoshard.plan(model_spec, cluster="local-cpu", devices_per_node=world_size, global_batch=GLOBAL_BATCH)
    torch.manual_seed(0)
    model = gpt.build()
    model, optimizer, mesh = autoshard.parallelize(model, plan, lr=1e-3)
    dp_rank, dp = mesh.get_local_rank("dp"), plan.mesh.dp
    share = GLOBAL_BATCH // dp
    for step in range(STEPS):
        torch.manual_seed(1000 + step)  # the same global batch on every rank
        (tokens,), targets = gpt.example_batch(GLOBAL_BATCH)
        tokens, targets = tokens[dp_rank * share:(dp_rank + 1) * share], targets[dp_rank * share:(dp_rank + 1) * share]
        total = 0.0
        chunks = list(zip(tokens.chunk(plan.num_microbatches), targets.chunk(plan.num_microbatches)))
        for i, (x, y) in enumerate(chunks):
            with runtime.grad_sync(model, enabled=i == len(chunks) - 1):  # DDP: all-reduce once per step
                loss = gpt.loss_fn(model(x), y) / plan.num_microbatches
                loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step:3d} | loss {total:.4f} (rank 0's share) | plan {plan.mesh}, ZeRO-{plan.zero_stage}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
