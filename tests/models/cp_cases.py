"""Small causal transformers that each mix tokens along the sequence one way besides attention, for the CP
proof (passes/capturing/cp_proof): a cp rank running their code on its s/cp tokens would compute something else.

Factories (model-file contract, docs/design.md), each 2 blocks of width 32 with 4 heads over 16 tokens:

    build                 the plain model: embeddings, causal attention, per-token MLP and head (proven)
    build_mean_pool       the head reads the mean over the sequence (a sequence classifier)
    build_pooler          the head reads token 0 (BERT's pooler: ``x[:, 0]``)
    build_label_shift     the model drops its last position itself (``logits[:, :-1]``)
    build_causal_conv     a causal depthwise conv1d over the tokens before the blocks (Mamba's short conv)
    build_cumsum_positions  positions counted with a cumsum over the sequence, not an arange
    build_position_table  sinusoidal positions precomputed for 16 tokens and sliced ``table[:s]``
    build_position_branch the same table of 8 rows, the angles of ``arange(s)`` when s exceeds it
                          (Llama-style rotary tables: a rank holding at most 8 tokens takes the table)
    build_own_mask        attention given a causal mask the model builds itself (``ones(s, s).tril()``):
                          causal, yet a mask, which the ring cannot take

``example_batch(batch_size, seq_len=16)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, VOCAB, SEQ = 32, 4, 64, 16


class Block(nn.Module):
    def __init__(self, own_mask: bool = False):
        super().__init__()
        self.own_mask = own_mask
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(WIDTH, -1))
        if self.own_mask:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class Model(nn.Module):
    def __init__(self, kind: str = "plain"):
        super().__init__()
        self.kind = kind
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ + 1, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 4, groups=WIDTH, padding=3) if kind == "causal_conv" else None
        self.h = nn.ModuleList(Block(own_mask=kind == "own_mask") for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.pooler = nn.Linear(WIDTH, WIDTH) if kind in ("mean_pool", "pooler") else None
        rows = SEQ // 2 if kind == "position_branch" else SEQ
        self.register_buffer("table", sinusoid(torch.arange(rows)), persistent=False)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if self.kind == "position_table" or (self.kind == "position_branch" and s <= self.table.shape[0]):
            return self.wte(idx) + self.table[:s]
        if self.kind == "position_branch":
            return self.wte(idx) + sinusoid(torch.arange(s, device=idx.device))
        return self.wte(idx) + self.wpe(self.positions(idx))

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        if self.kind == "cumsum_positions":
            return torch.ones_like(idx).cumsum(1) - 1
        return torch.arange(idx.shape[1], device=idx.device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.conv is not None:
            x = self.conv(x.transpose(1, 2))[..., :idx.shape[1]].transpose(1, 2)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if self.kind == "mean_pool":
            return self.head(torch.tanh(self.pooler(x.mean(dim=1))))
        if self.kind == "pooler":
            return self.head(torch.tanh(self.pooler(x[:, 0])))
        logits = self.head(x)
        return logits[:, :-1] if self.kind == "label_shift" else logits


def sinusoid(positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), WIDTH] sinusoidal position embeddings."""
    freq = 1.0 / 10000 ** (torch.arange(0, WIDTH, 2, dtype=torch.float32, device=positions.device) / WIDTH)
    angles = positions.float()[:, None] * freq[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


def build_own_mask() -> Model:
    return Model("own_mask")


def build() -> Model:
    return Model()


def build_mean_pool() -> Model:
    return Model("mean_pool")


def build_pooler() -> Model:
    return Model("pooler")


def build_label_shift() -> Model:
    return Model("label_shift")


def build_causal_conv() -> Model:
    return Model("causal_conv")


def build_cumsum_positions() -> Model:
    return Model("cumsum_positions")


def build_position_table() -> Model:
    return Model("position_table")


def build_position_branch() -> Model:
    return Model("position_branch")


def example_batch(batch_size: int, seq_len: int = SEQ):
    """``((token ids (batch, seq_len),), token ids)``: random tokens (only shapes matter to the proof)."""
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len))
    return (tokens,), tokens
