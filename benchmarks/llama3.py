"""Llama-3's architecture, for ``benchmarks/bench_eager.py``: planned on the meta device, never trained here.

The block of Meta's Llama 3 (``meta-llama/llama3`` ``model.py``; torchtitan's ``llama3`` model):
pre-RMSNorm (eps 1e-5), attention with grouped-query heads (q: H heads, k and v: H_kv heads of
d/H each, repeated H/H_kv times before attention, as torchtitan's ``repeat_kv``), rotary position
embeddings on q and k (θ = 500000; the real-valued rotate-half form, so capture needs no complex
dtype), no biases, causal SDPA; a SwiGLU MLP ``w2(silu(w1(x)) · w3(x))``; token embedding, a final
RMSNorm, an untied output projection to the vocabulary.

Factories (``path:factory`` model specs)::

    llama3_8b   32 layers, d = 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, seq 8192
                (Llama-3-8B's published shape, Dubey et al. 2024 Table 3: 8.03B parameters)
    llama3_70b  80 layers, d = 8192, 64 heads, 8 KV heads, FFN 28672 (the same vocab and seq;
                the same Table 3)
    llama3_405b 126 layers, d = 16384, 128 heads, 8 KV heads, FFN 53248 (the same Table 3)
    llama3_1b   16 layers, d = 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256, seq 2048
                (Llama-3.2-1B's block shape, meta-llama/Llama-3.2-1B config.json, with an untied
                output projection: 1.50B parameters; a one-GPU run of benchmarks/gpu_session.sh)
    llama3_tiny  2 layers, d = 256, 4 heads, 2 KV heads, FFN 512, vocab 1024, seq 128 (tests)
    llama3_8b_2l, llama3_8b_4l, llama3_70b_2l, llama3_70b_4l   the 8B and 70B shapes at 2 or 4 layers
                (benchmarks/bench_dryrun.py: a deep model's per-layer figures at a depth a dry run
                on a CPU finishes quickly)

``example_batch(batch_size)`` gives random token ids of the factory's sequence length. The file defines no
``loss_fn``: the default loss (``modelfile.default_loss``) is cross-entropy over the vocabulary for these integer
targets (under autocast it runs in fp32), which loss parallelism can compute on the logits' vocabulary shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN = 8192
VOCAB_SIZE = 128256
ROPE_THETA = 500000.0  # Llama 3's rope_theta
NORM_EPS = 1e-5


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 for the head counts lets tensor parallelism shard heads without code changes
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        repeats = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def rope(seq: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles of positions 0 .. seq − 1, (seq, head_dim)."""
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=inv_freq.device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=NORM_EPS)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=NORM_EPS)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama3(nn.Module):
    def __init__(self, n_layers: int, dim: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int, seq: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, ffn) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=NORM_EPS)
        self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # the angles of the s positions, computed here for any length (--seq-len) and from torch.arange, which
        # context parallelism turns into each rank's global positions (a table sliced [:s] it could not)
        cos, sin = rope(tokens.shape[1], self.inv_freq)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


SHAPES = {  # layers, dim, heads, kv heads, ffn, vocab, seq
    "llama3_8b": (32, 4096, 32, 8, 14336, VOCAB_SIZE, SEQ_LEN),
    "llama3_70b": (80, 8192, 64, 8, 28672, VOCAB_SIZE, SEQ_LEN),
    "llama3_405b": (126, 16384, 128, 8, 53248, VOCAB_SIZE, SEQ_LEN),
    "llama3_1b": (16, 2048, 32, 8, 8192, VOCAB_SIZE, 2048),
    "llama3_tiny": (2, 256, 4, 2, 512, 1024, 128),
}
_seq_len = SEQ_LEN
_vocab = VOCAB_SIZE


def _build(name: str, depth: int | None = None) -> Llama3:
    """The shape called ``name``, at ``depth`` layers when given (else its own)."""
    global _seq_len, _vocab
    layers, dim, heads, kv, ffn, vocab, seq = SHAPES[name]
    layers = depth or layers
    _seq_len, _vocab = seq, vocab
    return Llama3(layers, dim, heads, kv, ffn, vocab, seq)


def llama3_8b() -> Llama3:
    return _build("llama3_8b")


def llama3_70b() -> Llama3:
    return _build("llama3_70b")


def llama3_8b_2l() -> Llama3:
    return _build("llama3_8b", depth=2)


def llama3_8b_4l() -> Llama3:
    return _build("llama3_8b", depth=4)


def llama3_70b_2l() -> Llama3:
    return _build("llama3_70b", depth=2)


def llama3_70b_4l() -> Llama3:
    return _build("llama3_70b", depth=4)


def llama3_405b() -> Llama3:
    return _build("llama3_405b")


def llama3_1b() -> Llama3:
    return _build("llama3_1b")


def llama3_tiny() -> Llama3:
    return _build("llama3_tiny")


def build() -> Llama3:
    return llama3_tiny()


def example_batch(batch_size: int, seq_len: int | None = None):
    """``((token ids (batch, seq),), next tokens)``: random ids of the last built factory's shape (``seq_len``
    tokens when given: ``--seq-len``)."""
    tokens = torch.randint(0, _vocab, (batch_size, (seq_len or _seq_len) + 1))
    return (tokens[:, :-1],), tokens[:, 1:]
