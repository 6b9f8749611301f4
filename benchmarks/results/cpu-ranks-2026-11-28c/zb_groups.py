"""Reruns of the example GPT's blocks in a split backward (stage_backward_input + stage_backward_weight), full
recompute: how many block forwards the weight pass runs, against the ops that read a parameter (the cost model's g)."""

import sys

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, "examples")
import gpt

model = gpt.build()
calls = [0]
blocks = model.h
for blk in blocks:
    f = blk.forward

    def counted(*a, _f=f, **k):
        calls[0] += 1
        return _f(*a, **k)

    blk.forward = counted
x0 = torch.randn(2, 64, 64, requires_grad=True)


def stage(x):
    for blk in blocks:
        x = checkpoint(blk, x, use_reentrant=False)
    return x


params = [p for blk in blocks for p in blk.parameters()]
out = stage(x0)
calls[0] = 0
_, groups = stage_backward_input([out], [torch.ones_like(out)], [x0], iter(params))
inp, calls[0] = calls[0], 0
stage_backward_weight(iter(params), groups)
print(
    "blocks",
    len(blocks),
    "param groups",
    len(groups),
    "input pass forwards per block",
    inp / len(blocks),
    "weight pass per block",
    calls[0] / len(blocks),
)
from autoshard.cost.tp_units import weight_groups  # noqa: E402
from autoshard.pipeline import capture_graph  # noqa: E402

_, g = capture_graph("examples/gpt.py:build")
print("cost model g per block", [weight_groups(g, b.node_names) for b in g.blocks])
