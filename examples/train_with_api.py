"""Train the example GPT with autoshard's Python API inside your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_with_api.py

Every rank plans (planning is deterministic, so all ranks get the same plan), builds the
model from the same seed, and lets ``autoshard.parallelize`` apply the plan. The loop is
ordinary PyTorch around the runtime's data helpers: ``autoshard.layout(plan)`` names the mesh
axes it reads, as the emitted program's loop does: the samples of this rank's place on the data
axis, the tokens of its place on the sequence axis (context parallelism; nothing without it),
the loss averaged over the loss axis.
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
    spec = autoshard.layout(plan)  # the axes this loop reads
    ctx = runtime.init_distributed(expected_world_size=plan.world_size)
    torch.manual_seed(0)
    model = gpt.build()
    model, optimizer, mesh = autoshard.parallelize(model, plan, lr=1e-3)
    micro = plan.num_microbatches
    for step in range(STEPS):
        torch.manual_seed(1000 + step)  # the same global batch on every rank
        batch = gpt.example_batch(GLOBAL_BATCH)
        inputs, targets = runtime.take_samples(batch, mesh, spec.data_axis, ctx.device)  # this rank's samples
        step_loss = torch.zeros((), device=ctx.device)
        for i, (x, y) in enumerate(runtime.split_microbatches(inputs, targets, micro)):
            x, y = runtime.take_sequence_shard(x, y, mesh, spec.sequence_axis, spec.tokens_per_sample)
            with runtime.grad_sync(model, enabled=i == micro - 1), \
                    runtime.context_parallel(mesh, spec.sequence_axis, spec.tokens_per_sample):
                with runtime.autocast(plan.precision, ctx.device):
                    loss = gpt.loss_fn(model(*x), y) / micro
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = runtime.mean_over(step_loss, mesh.get_group(spec.loss_axis))  # the global batch's loss
        if ctx.is_main:
            print(f"step {step:3d} | loss {loss:.4f} | plan {plan.mesh}, ZeRO-{plan.zero_stage}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
