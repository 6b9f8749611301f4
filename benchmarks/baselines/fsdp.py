"""Hand-written ZeRO-3 training of the example GPT: FSDP2 fully_shard on each block, then the root."""

import common
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = common.build(gpt)
mesh = init_device_mesh("cpu", (world,))
for block in model.h:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, rank, world)
    return common.global_loss(common.train_step(model, opt, gpt, x, y, a.microbatches))


common.run(step, a.steps, a.out)
