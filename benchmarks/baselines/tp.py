"""Hand-written tensor parallel training of the example GPT: Megatron's layout with parallelize_module."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import common

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = common.build(gpt)
mesh = init_device_mesh("cpu", (world,))
for block in model.h:
    parallelize_module(block, mesh, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                     "attn.v_proj": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                     "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
# the head split over the vocabulary, logits gathered for the loss (the layout the planner picks here)
parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, 0, 1)  # every TP rank sees the whole batch
    return common.train_step(model, opt, gpt, x, y, a.microbatches).item()


common.run(step, a.steps, a.out)
