"""A small nanoGPT-style GPT: the bundled example model for autoshard.

Model-file contract (docs/design.md, "The model file contract"): ``build()`` returns the module and works under
``with torch.device("meta")``; ``example_batch(batch_size)`` returns ``(inputs, targets)``;
``loss_fn(outputs, targets)`` is the training loss.

The data is a learnable synthetic language: each sequence is an arithmetic progression
modulo the vocabulary with a random start and a random step from a small set, so the loss
falls quickly from ln(vocab) as the model learns to continue the progression. It is drawn
from torch's global RNG, so seeding before the call makes it reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # sequence length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  # kept 0 so parallel runs match one process bit for bit


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 for the head count lets tensor parallelism shard heads without code changes.
        q = self.q_proj(x).view(b, s, -1, x.shape[-1] // self.n_head).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, x.shape[-1] // self.n_head).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, x.shape[-1] // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


CONFIG = GPTConfig()


def build(**overrides) -> GPT:
    """The example GPT; keyword overrides change the config (e.g. ``n_layer=96``)."""
    cfg = GPTConfig(**{**CONFIG.__dict__, **overrides})
    return GPT(cfg)


def example_batch(batch_size: int, seq_len: int | None = None, vocab_size: int | None = None):
    """``(inputs, targets)``: token ids ``(batch, seq)`` and the next tokens."""
    seq = seq_len or CONFIG.block_size
    vocab = vocab_size or CONFIG.vocab_size
    start = torch.randint(0, vocab, (batch_size, 1))
    step = torch.randint(1, 4, (batch_size, 1))
    tokens = (start + step * torch.arange(seq + 1)) % vocab
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
