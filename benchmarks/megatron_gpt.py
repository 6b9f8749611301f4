"""Megatron-LM's GPT as Narayanan et al. (SC21) trained it, for ``benchmarks/bench_megatron.py``.

The block of Megatron-LM's ``ParallelTransformerLayer`` (2021): pre-LayerNorm, attention with
biased q, k, v and output projections, causal softmax, attention dropout 0.1 on the scores,
hidden dropout 0.1 before each residual add, a 4h GELU MLP; learned position embeddings, a
final LayerNorm, sequence 2048, vocabulary 51200 (Megatron's ``--attention-dropout`` and
``--hidden-dropout`` default to 0.1; the run scripts do not change them).

q, k and v come from one [3h] linear laid out per head, as Megatron's (a column shard holds
whole heads, so the backward all-reduces its input gradient once, not three times). One
departure, so that autoshard's tensor-parallel layout model can shard the vocabulary projection
(``passes.layouts.rules`` keeps a tied weight replicated): the head is its own weight, not the
word embedding's as in Megatron: V·h more parameters (0.12B of 1.7B, 0.63B of 145.6B), the same
FLOPs.

Factories (``path:factory`` model specs), one per row of SC21 Table 1
(``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM gives the configurations), and the
four models of Korthikanti et al. 2022 (arXiv 2205.05198, Table 3)::

    sc21_1_7b  sc21_3_6b  sc21_7_5b  sc21_18_4b  sc21_39_1b  sc21_76_1b  sc21_145_6b
    sc21_310_1b  sc21_529_6b  sc21_1008b          k22_22b  k22_175b  k22_530b  k22_1t

each also as ``<factory>_written``, its attention written out as Megatron-LM's 2021 ``CoreAttention`` computes
it (``WrittenOutAttention``: ``q @ kᵀ``, ``masked_fill``, softmax, dropout, ``@ v``) instead of SDPA.
``build(n_layer=..., n_head=..., n_embd=...)`` builds any other shape; every factory works
under ``with torch.device("meta")``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN = 2048
VOCAB_SIZE = 51200
DROPOUT = 0.1  # Megatron-LM's default --attention-dropout and --hidden-dropout


class Attention(nn.Module):
    """Megatron-LM's ``ParallelAttention``: one [3h] projection laid out per head as [q | k | v] of
    size hd each (``view(b, s, heads, 3·hd)``, then split), so a column shard holds whole heads."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3 * (h // self.n_head)).split(h // self.n_head, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class WrittenOutAttention(Attention):
    """``Attention`` with the scores written out as Megatron-LM's ``CoreAttention`` (2021) computes them:
    ``q @ kᵀ / √hd``, the causal mask by ``masked_fill`` (Megatron: -10000), softmax, dropout on the
    probabilities, ``@ v``; the same parameters, FLOPs and outputs as the SDPA form (up to dropout's
    draws), the scores held in memory (b · heads · s² per block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.n_head
        q, k, v = self.qkv(x).view(b, s, -1, 3 * hd).split(hd, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(scores.masked_fill(causal, -10000.0).softmax(dim=-1), self.dropout, self.training)
        return self.c_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))


ATTENTIONS = {"sdpa": Attention, "written": WrittenOutAttention}


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, attention: str = "sdpa"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = ATTENTIONS[attention](n_embd, n_head, dropout)
        self.drop_1 = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop_2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_1(self.attn(self.ln_1(x)))
        return x + self.drop_2(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class MegatronGPT(nn.Module):
    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = DROPOUT,
        seq_len: int = SEQ_LEN,
        vocab_size: int = VOCAB_SIZE,
        attention: str = "sdpa",
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(n_layer: int = 2, n_head: int = 4, n_embd: int = 64, attention: str = "sdpa") -> MegatronGPT:
    return MegatronGPT(n_layer, n_head, n_embd, attention=attention)


def build_written(n_layer: int = 2, n_head: int = 4, n_embd: int = 64) -> MegatronGPT:
    """``build`` with the attention written out (``WrittenOutAttention``)."""
    return build(n_layer, n_head, n_embd, attention="written")


def example_batch(batch_size: int, seq_len: int = SEQ_LEN):
    """``((token ids (batch, seq_len),), next tokens)``: random ids, for shapes only (2048 tokens, as trained)."""
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len + 1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# (layers, heads, hidden) of each published model
SHAPES = {
    "sc21_1_7b": (24, 24, 2304),
    "sc21_3_6b": (30, 32, 3072),
    "sc21_7_5b": (36, 32, 4096),
    "sc21_18_4b": (40, 48, 6144),
    "sc21_39_1b": (48, 64, 8192),
    "sc21_76_1b": (60, 80, 10240),
    "sc21_145_6b": (80, 96, 12288),
    "sc21_310_1b": (96, 128, 16384),
    "sc21_529_6b": (105, 128, 20480),
    "sc21_1008b": (128, 160, 25600),
    "k22_22b": (48, 64, 6144),
    "k22_175b": (96, 96, 12288),
    "k22_530b": (105, 128, 20480),
    "k22_1t": (128, 160, 25600),
}


def _factory(name: str, attention: str = "sdpa"):
    layers, heads, hidden = SHAPES[name]

    def factory() -> MegatronGPT:
        return MegatronGPT(layers, heads, hidden, attention=attention)

    factory.__name__ = name if attention == "sdpa" else f"{name}_{attention}"
    factory.__doc__ = (
        f"{layers} layers, {heads} heads, hidden {hidden} (Megatron-LM's GPT, module doc), {attention} attention."
    )
    return factory


for _name in SHAPES:
    globals()[_name] = _factory(_name)
    globals()[f"{_name}_written"] = _factory(_name, "written")  # the attention written out (WrittenOutAttention)
