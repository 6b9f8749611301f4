"""Small transformers whose code reads the modules tensor parallelism shards, for the TP proof.

Both factories are ``tp_cases.TinyLM`` (2 blocks of width 32, 4 heads) with a position table, reading the styled
modules the ways real model files do:

    build_reads_kept      what a tp rank's module gives as the whole module does (the layout stays):
                          ``self.wte(idx.to(self.wte.weight.device)).to(self.wte.weight.dtype)`` (Llama-4's text
                          model), positions ``torch.arange(self.wpe.num_embeddings)`` looked up in an
                          ``nn.Embedding`` (Whisper's encoder), and an MLP that reads ``self.up.weight.device.type``
                          and hands ``self.up.weight`` / ``self.down.weight`` to a fused-kernel wrapper that returns
                          None without its kernel (Mamba's mixer and ``mamba_inner_fn``)
    build_reads_refused   what differs on a shard (those modules stay replicated, the rest shards): a view sized by
                          ``self.up.weight.shape[0]``, and logits ``F.linear(x, self.wte.weight)`` (a head tied to
                          the embedding by hand, computing with its weight outside it)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import tp_cases  # noqa: E402
from tp_cases import SEQ, VOCAB, WIDTH, Block, TinyLM  # noqa: E402


def fused_mlp(x: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor):
    """A fused kernel's wrapper: None where the kernel is not installed (transformers' ``mamba_inner_fn``)."""
    return None


class ReadingBlock(Block):
    def __init__(self, refused: bool):
        super().__init__(False, False, False)
        self.refused = refused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        if not self.refused:
            if "cuda" in self.up.weight.device.type:
                return x + fused_mlp(h, self.up.weight, self.down.weight)
            fused = fused_mlp(h, self.up.weight, self.down.weight)
            if fused is not None:
                return x + fused
        y = F.gelu(self.up(h))
        if self.refused:
            y = y.view(*y.shape[:-1], self.up.weight.shape[0] // 4, 4).flatten(-2)
        return x + self.down(y)


class ReadingLM(TinyLM):
    def __init__(self, refused: bool):
        super().__init__()
        self.refused = refused
        self.h = nn.ModuleList(ReadingBlock(refused) for _ in range(2))
        self.wpe = nn.Embedding(SEQ, WIDTH)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx.to(self.wte.weight.device)).to(self.wte.weight.dtype)
        positions = torch.arange(self.wpe.num_embeddings, device=x.device)
        x = x + self.wpe(positions)
        for block in self.h:
            x = block(x)
        if self.refused:
            return F.linear(self.ln_f(x), self.wte.weight)
        return self.lm_head(self.ln_f(x))


def build_reads_kept() -> ReadingLM:
    return ReadingLM(refused=False)


def build_reads_refused() -> ReadingLM:
    return ReadingLM(refused=True)


def example_batch(batch_size: int):
    return tp_cases.example_batch(batch_size)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
