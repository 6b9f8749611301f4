"""Hand-written data parallel training of the example GPT: DDP, AdamW, gradient accumulation."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import common

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = DDP(common.build(gpt), bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, rank, world)
    total = torch.zeros(())
    for k, (xs, ys) in enumerate(zip(x.chunk(a.microbatches), y.chunk(a.microbatches))):
        with model.no_sync() if k < a.microbatches - 1 else torch.enable_grad():
            loss = gpt.loss_fn(model(xs), ys) / a.microbatches
            loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return common.global_loss(total)


common.run(step, a.steps, a.out)
