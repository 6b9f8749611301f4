"""How often a zero-bubble schedule's split backward reruns a fully recomputed block (one process, no ranks).

    python benchmarks/experiments/split_backward_recompute.py

torch's zero-bubble schedules (interleaved-zb, zbv, dualpipev) split a stage's backward into the inputs'
gradient (``stage_backward_input``) and the weights' (``stage_backward_weight``, one ``autograd`` call per
parameter group). A block under non-reentrant activation checkpointing (``--recompute full``) recomputes its
forward in each of those calls. This counts the block forwards each pass runs, for blocks of K linears, and
the weight pass's again under one ``GraphExecGroup``, as emitted programs run it
(``runtime.pipeline_parallel._recompute_once_per_weight_pass``), with its gradients against the plain pass's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import GraphExecGroup, checkpoint

BLOCKS, WIDTH = 3, 8


class Block(nn.Module):
    def __init__(self, linears: int, calls: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(linears))
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Stage(nn.Module):
    def __init__(self, linears: int, calls: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(Block(linears, calls) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def recomputes(linears: int) -> tuple[int, int, int, int, bool]:
    """Per block: forwards in the one-call backward, in the input pass, in the weight pass, in the weight pass
    under one ``GraphExecGroup``; and whether the two weight passes' gradients are bitwise equal."""
    calls = [0]
    torch.manual_seed(0)
    stage = Stage(linears, calls)
    x = torch.randn(4, WIDTH, requires_grad=True)
    stage(x).backward(torch.ones(4, WIDTH))
    plain, calls[0] = calls[0] - BLOCKS, 0
    weight_pass, grads = {}, {}
    for grouped in (False, True):
        stage.zero_grad()
        out = stage(x)
        calls[0] = 0
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
        input_pass, calls[0] = calls[0], 0
        with GraphExecGroup() if grouped else contextlib.nullcontext():
            stage_backward_weight(stage.parameters(), groups)
        weight_pass[grouped] = calls[0] // BLOCKS
        grads[grouped] = [p.grad.clone() for p in stage.parameters()]
    equal = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    return plain // BLOCKS, input_pass // BLOCKS, weight_pass[False], weight_pass[True], equal


def main() -> None:
    print(f"torch {torch.__version__}; per block, forwards rerun by the backward:")
    print(
        "| linears per block | one backward call | split: input pass | split: weight pass | weight pass, one group | gradients equal |"
    )
    print("|---|---|---|---|---|---|")
    for linears in (1, 2, 4, 7):
        plain, input_pass, weight_pass, grouped, equal = recomputes(linears)
        print(f"| {linears} | {plain} | {input_pass} | {weight_pass} | {grouped} | {equal} |")


if __name__ == "__main__":
    main()
