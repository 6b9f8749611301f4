"""Hand-written data parallel training of the example GPT: DDP, AdamW, gradient accumulation."""

import common
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = DDP(common.build(gpt), bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, rank, world)
    return common.global_loss(common.train_step(model, opt, gpt, x, y, a.microbatches, model.no_sync))


common.run(step, a.steps, a.out)
