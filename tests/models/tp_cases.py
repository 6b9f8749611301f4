"""Small transformers whose attention code is written the ways real model files write it, for the TP proof.

Factories (model-file contract, docs/design.md), each 2 blocks of width 32 with 4 heads:

    build                  heads from the tensor: ``view(b, s, -1, head_dim)`` (Llama's way)
    build_constant_heads   a head count written as a constant: ``view(b, -1, num_heads, head_dim)``
                           (OPT's way; on a tp shard it keeps all heads and folds the shard into the
                           sequence)
    build_head_norm        a norm over head_dim on each head (Qwen3's q_norm / k_norm): replicated
                           weights acting on heads that tp shards
    build_router           an MLP scaled by a router that is not an nn.Linear (``F.linear`` on a
                           parameter of its own, as MoE routers do)
    build_gqa_repeat       grouped-query attention: 2 KV heads repeated in place to the 4 query heads with
                           ``repeat_interleave(2, dim=1)`` (Meta's and torchtitan's Llama 3 order: KV head j
                           serves query heads 2j and 2j + 1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

WIDTH, HEADS, VOCAB, SEQ = 32, 4, 64, 16


class HeadNorm(nn.Module):
    """RMS norm over the last dim with a weight of its own (per-head when applied to (b, s, h, hd))."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Router(nn.Module):
    """A gate: softmax over 4 scores of ``F.linear(x, self.weight)``, summed back to one scale per token."""

    def __init__(self, dim: int, experts: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(F.linear(x, self.weight), dim=-1).amax(-1, keepdim=True)


class Attention(nn.Module):
    def __init__(self, constant_heads: bool, head_norm: bool, kv_heads: int = HEADS):
        super().__init__()
        self.head_dim, self.repeats = WIDTH // HEADS, HEADS // kv_heads
        kv_width = kv_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(WIDTH, width) for width in (WIDTH, kv_width, kv_width, WIDTH)
        )
        self.constant_heads = constant_heads
        self.q_norm = HeadNorm(self.head_dim) if head_norm else nn.Identity()
        self.k_norm = HeadNorm(self.head_dim) if head_norm else nn.Identity()

    def heads(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        if self.constant_heads:
            return t.view(b, -1, HEADS, self.head_dim)
        return t.view(b, s, -1, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.heads(self.q_proj(x), b, s)).transpose(1, 2)
        k = self.k_norm(self.heads(self.k_proj(x), b, s)).transpose(1, 2)
        v = self.heads(self.v_proj(x), b, s).transpose(1, 2)
        if self.repeats > 1:
            k, v = (t.repeat_interleave(self.repeats, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(
        self, constant_heads: bool, head_norm: bool, router: bool, kv_heads: int = HEADS, in_place: bool = False
    ):
        super().__init__()
        self.in_place = in_place  # the MLP's input added into its output in place (Llama 4's MoE: ``out.add_(...)``)
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(constant_heads, head_norm, kv_heads)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.router = Router(WIDTH) if router else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        y = self.down(F.gelu(self.up(h)))
        if self.in_place:
            y.add_(h)
        return x + (y * self.router(h) if self.router is not None else y)


class TinyLM(nn.Module):
    def __init__(
        self,
        constant_heads: bool = False,
        head_norm: bool = False,
        router: bool = False,
        kv_heads: int = HEADS,
        in_place: bool = False,
    ):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block(constant_heads, head_norm, router, kv_heads, in_place) for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build() -> TinyLM:
    return TinyLM()


def build_constant_heads() -> TinyLM:
    return TinyLM(constant_heads=True)


def build_head_norm() -> TinyLM:
    return TinyLM(head_norm=True)


def build_router() -> TinyLM:
    return TinyLM(router=True)


def build_gqa_repeat() -> TinyLM:
    return TinyLM(kv_heads=2)


def build_in_place_sum() -> TinyLM:
    return TinyLM(in_place=True)


def example_batch(batch_size: int):
    return gpt.example_batch(batch_size, seq_len=SEQ, vocab_size=VOCAB)
