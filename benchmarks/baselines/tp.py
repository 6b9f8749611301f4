"""Hand-written tensor parallel training of the example GPT with parallelize_module, in the layout
given by ``--tp-styles`` (module -> colwise / rowwise / colwise-gather), e.g. Megatron's."""

import json

import common
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = common.build(gpt)
mesh = init_device_mesh("cpu", (world,))
STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise-gather": lambda: ColwiseParallel(output_layouts=Replicate()),
}  # logits gathered for the loss
parallelize_module(model, mesh, {name: STYLES[style]() for name, style in json.loads(a.tp_styles).items()})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, 0, 1)  # every TP rank sees the whole batch
    return common.train_step(model, opt, gpt, x, y, a.microbatches).item()


common.run(step, a.steps, a.out)
