"""A tiny Hugging Face ``MambaForCausalLM``: 2 layers, width 32, inner width 64, state 4, vocab 64.

Model-file contract (docs/design.md): ``build()``, ``example_batch(batch_size)`` (examples/gpt.py's synthetic tokens)
and ``loss_fn``. Mamba's mixer hands ``self.x_proj.weight``, ``self.dt_proj.weight`` and
``self.out_proj.weight`` to ``mamba_inner_fn``, which returns None without its CUDA kernel, so the TP proof
meets reads of sharded modules' weights that compute nothing. No download: the config is written here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import MambaConfig, MambaForCausalLM

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

VOCAB, SEQ = 64, 8


def build() -> MambaForCausalLM:
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, state_size=4,
                                        num_hidden_layers=2, use_cache=False))


def example_batch(batch_size: int):
    return gpt.example_batch(batch_size, seq_len=SEQ, vocab_size=VOCAB)


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))
