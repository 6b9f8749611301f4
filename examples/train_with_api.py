"""Train the example GPT with autoshard's Python API inside your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_with_api.py

Every rank plans (planning is deterministic, so all ranks get the same plan), builds the
model from the same seed, and lets ``autoshard.parallelize`` apply the plan. ``train_step``
takes each step's global batch and runs it the plan's way (this rank's samples, micro-batches,
gradient sync, context parallelism's tokens, a pipeline's schedule); the optimizer is yours.
"""

import os
import sys

import torch
import torch.distributed as dist

import autoshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (the model file next to this script)

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py") + ":build"
GLOBAL_BATCH = 16
STEPS = 20


def main():
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = autoshard.plan(MODEL, cluster="local-cpu", devices_per_node=world_size, global_batch=GLOBAL_BATCH)
    torch.manual_seed(0)
    model = gpt.build()  # the same weights on every rank
    p = autoshard.parallelize(model, plan)
    optimizer = torch.optim.AdamW(p.parameters(), lr=1e-3)  # or p.optimizer: the plan's recipe
    for step in range(STEPS):
        torch.manual_seed(1000 + step)  # the same global batch on every rank
        inputs, targets = gpt.example_batch(GLOBAL_BATCH)
        loss = p.train_step(inputs, targets)  # the global batch's mean loss
        p.clip_grad_norm(1.0)  # the whole model's gradient norm, over every rank
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step:3d} | loss {loss:.4f} | plan {plan.mesh}, ZeRO-{plan.zero_stage}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
