"""After one micro-batch's forward and backward on a stage of two MLP blocks, which tensors its forward saved
for backward are still alive: with one backward call, and split as torch's zero-bubble schedules split it
(``stage_backward_input``, then ``stage_backward_weight``); each alone and under torch's ``MemTracker`` (the tracker
``autoshard dryrun`` reads). Weak references taken by a saved-tensors pack hook; the parameters left out."""

import contextlib
import gc
import weakref

import torch
import torch.nn as nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

torch.manual_seed(0)
D, TOKENS = 64, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


def alive_after(stage: nn.Module, split: bool, tracked: bool) -> tuple[int, list]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker() if tracked else contextlib.nullcontext()
    with tracker:
        return _step(stage, split)


def _step(stage: nn.Module, split: bool) -> tuple[int, list]:
    params = {id(p) for p in stage.parameters()}
    refs = []

    def pack(t):
        if id(t) not in params:
            refs.append((weakref.ref(t), tuple(t.shape)))
        return t

    x = torch.randn(TOKENS, D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x.view_as(x))
    if split:
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
        stage_backward_weight(stage.parameters(), groups)
        del groups
    else:
        out.backward(torch.ones_like(out))
    del out, x
    gc.collect()
    for p in stage.parameters():
        p.grad = None
    return len(refs), [shape for ref, shape in refs if ref() is not None]


stage = nn.Sequential(Block(), Block())
for tracked in (False, True):
    for split in (False, True):
        saved, alive = alive_after(stage, split, tracked)
        how = ("split" if split else "one call") + (", under MemTracker" if tracked else "")
        print(f"{how}: {saved} saved, {len(alive)} alive after the step: {alive}")
