"""Layers run inside an autograd Function that runs them again in its own backward (Reformer's reversible layers, a
reentrant checkpoint): export sees the forward only, under ``no_grad``; the gradients come from the Function's
backward, which calls the layers once more with gradients on. ``build``: the whole stack of blocks inside one such
Function (Reformer's ``_ReversibleFunction``); ``build_per_block``: each block calls one around its layer."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 16
LAYERS = 4


class RunAgainInBackward(torch.autograd.Function):
    """y = module(x) without a graph in forward; backward runs the module's work again on x with gradients on,
    through ``module.again`` where it has one (Reformer's ``backward_pass``: each layer's children called directly,
    not the layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(getattr(ctx.module, "again", ctx.module)(x), grad)
        return x.grad, None


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(self.norm(x)))


class Block(nn.Module):
    def __init__(self, inside: bool):
        super().__init__()
        self.layer, self.inside = Layer(), inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RunAgainInBackward.apply(x, self.layer) if self.inside else self.layer(x)


class Stack(nn.Module):
    """The blocks one after another (what the Function runs when it holds the whole stack)."""

    def __init__(self, blocks: nn.ModuleList):
        super().__init__()
        self.blocks = blocks

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def again(self, h: torch.Tensor) -> torch.Tensor:
        """The blocks' work again, through each block's layer rather than the block."""
        for block in self.blocks:
            h = block.layer(h)
        return h


class Net(nn.Module):
    def __init__(self, per_block: bool):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(inside=per_block) for _ in range(LAYERS))
        self.out = nn.Linear(WIDTH, WIDTH)
        self.per_block = per_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        stack = Stack(self.blocks)  # not a child: the Function's argument, as Reformer hands its layers over
        h = stack(h) if self.per_block else RunAgainInBackward.apply(h, stack)
        return self.out(h)


def build() -> Net:
    return Net(per_block=False)


def build_per_block() -> Net:
    return Net(per_block=True)


def example_batch(batch_size: int):
    """``((x (batch, 16),), x)``: float targets, the default loss (MSE)."""
    x = torch.randn(batch_size, WIDTH)
    return (x,), x
