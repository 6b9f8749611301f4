"""A tiny Hugging Face ``GPT2LMHeadModel``: 2 layers, n_embd 64, 4 heads, vocab 256.

Model-file contract (docs/design.md): ``build()`` (works under ``torch.device("meta")``),
``example_batch(batch_size)`` with examples/gpt.py's synthetic tokens, ``loss_fn`` on
``outputs.logits``. GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``.

Config flags: dropout probabilities 0.0 (parallel runs match one process), ``use_cache=False``,
``attn_implementation="sdpa"``; bos/eos ids set inside the small vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 32
VOCAB_SIZE = 256


def config(layers: int = 2) -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=64, n_embd=64, n_layer=layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=VOCAB_SIZE - 1, eos_token_id=VOCAB_SIZE - 1,
        use_cache=False, attn_implementation="sdpa",
    )


def build() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(config())


def build_4_layers() -> GPT2LMHeadModel:
    """Enough blocks for two stages per rank at pp = 2, the tied embedding and head on rank 0 in a V."""
    return GPT2LMHeadModel(config(layers=4))


def build_with_dropout() -> GPT2LMHeadModel:
    """GPT-2's default dropout (0.1 on embeddings, attention and residuals)."""
    c = config()
    c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.1
    return GPT2LMHeadModel(c)


def example_batch(batch_size: int):
    """``((token ids (batch, 32),), next tokens)``."""
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
