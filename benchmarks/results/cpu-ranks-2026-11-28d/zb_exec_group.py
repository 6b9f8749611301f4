"""The weight pass of a split backward under one GraphExecGroup: block reruns and gradients against the plain pass."""

import sys
import time

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import GraphExecGroup, checkpoint

sys.path.insert(0, "examples")
import gpt


def run(grouped: bool, b: int = 4):
    torch.manual_seed(0)
    model = gpt.build()
    model.eval()  # no dropout: the two passes compare exactly
    calls = [0]
    for blk in model.h:
        f = blk.forward

        def counted(*a, _f=f, **k):
            calls[0] += 1
            return _f(*a, **k)

        blk.forward = counted
    torch.manual_seed(1)
    x0 = torch.randn(b, 64, 64, requires_grad=True)
    out = x0
    for blk in model.h:
        out = checkpoint(blk, out, use_reentrant=False)
    params = [p for blk in model.h for p in blk.parameters()]
    t0 = time.perf_counter()
    calls[0] = 0
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x0], iter(params))
    inp = calls[0]
    calls[0] = 0
    t1 = time.perf_counter()
    if grouped:
        with GraphExecGroup():
            stage_backward_weight(iter(params), groups)
    else:
        stage_backward_weight(iter(params), groups)
    t2 = time.perf_counter()
    return inp, calls[0], [p.grad.clone() for p in params], x0.grad.clone(), (t1 - t0) * 1e3, (t2 - t1) * 1e3


for _ in range(2):
    a = run(False)
    g = run(True)
    print("plain: input-pass forwards", a[0], "weight-pass forwards", a[1], f"input {a[4]:.1f} ms weight {a[5]:.1f} ms")
    print("group: input-pass forwards", g[0], "weight-pass forwards", g[1], f"input {g[4]:.1f} ms weight {g[5]:.1f} ms")
    print("grads equal:", all(torch.equal(x, y) for x, y in zip(a[2], g[2])), torch.equal(a[3], g[3]))
