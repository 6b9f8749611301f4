"""A two-block attention model with a key bias and dropout 0.1, and two variants that break it.

``build``: self-attention whose key projection has a bias (its true gradient is zero: softmax
ignores a shift that is the same for every key), attention dropout through
``scaled_dot_product_attention(dropout_p=...)`` and residual ``nn.Dropout``, both 0.1.
``build_perturbed``: under torch.distributed, from the second forward on, every forward first
adds 1e-3 (one AdamW step at lr 1e-3) to ``h.1.mlp.bias``: a parallel program whose
update of one layer is slightly wrong. ``build_crash_on_rank1``: rank 1 of a distributed run
raises in forward. Token data as examples/gpt.py's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ, DROPOUT = 64, 32, 4, 16, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(DROPOUT)
        self.attention_dropout = DROPOUT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout if self.training else 0.0,
                                           is_causal=True)
        x = x + self.drop(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.drop(F.gelu(self.mlp(x)))


class TinyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.h:
            x = block(x)
        return self.head(x)


class Perturbed(TinyAttention):
    forwards = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.forwards > 0:
            with torch.no_grad():
                self.h[1].mlp.bias.add_(1e-3)
        self.forwards += 1
        return super().forward(tokens)


class CrashOnRank1(TinyAttention):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("tiny attention refuses to run on rank 1")
        return super().forward(tokens)


def build() -> nn.Module:
    return TinyAttention()


def build_perturbed() -> nn.Module:
    return Perturbed()


def build_crash_on_rank1() -> nn.Module:
    return CrashOnRank1()


def example_batch(batch_size: int):
    start = torch.randint(0, VOCAB, (batch_size, 1))
    step = torch.randint(1, 4, (batch_size, 1))
    tokens = (start + step * torch.arange(SEQ + 1)) % VOCAB
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
