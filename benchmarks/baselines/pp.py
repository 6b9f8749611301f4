"""Hand-written pipeline training of the example GPT: torch.distributed.pipelining, 1F1B, even split."""

import common
import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

a = common.args()
rank, world = common.init()
gpt = common.load_gpt()
model = common.build(gpt)
blocks = len(model.h)
split_at = a.splits.split(",") if a.splits else [f"h.{k * blocks // world}" for k in range(1, world)]
splits = {name: SplitPoint.BEGINNING for name in split_at}
x0, _ = common.batch(gpt, a.global_batch, 0, 0, 1)
pipe = pipeline(model, mb_args=(x0.chunk(a.microbatches)[0],), split_spec=splits)
stage = pipe.build_stage(rank, torch.device("cpu"))
opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)
schedule = Schedule1F1B(stage, a.microbatches, loss_fn=gpt.loss_fn, scale_grads=True)


def step(i):
    x, y = common.batch(gpt, a.global_batch, i, 0, 1)
    losses = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = torch.stack(losses).mean() if losses else torch.zeros(())
    dist.broadcast(loss, src=world - 1)
    return loss.item()


common.run(step, a.steps, a.out)
