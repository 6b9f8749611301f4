"""A GPT whose blocks run twice per forward (weights shared across depth, as in the Universal
Transformer or ALBERT): ``for _ in range(2): for block in h: x = block(x)``.

A pipeline stage cannot begin at such a block: torch's split begins a stage at every call of
the module, so each cut would be crossed twice. The planner keeps such models in one stage.
Model-file contract (docs/design.md) as examples/gpt.py, whose blocks and data it uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: blocks and synthetic data)

ROUNDS = 2
CONFIG = gpt.GPTConfig(block_size=32, n_layer=2)


class LoopedGPT(nn.Module):
    def __init__(self, cfg: gpt.GPTConfig = CONFIG, rounds: int = ROUNDS):
        super().__init__()
        self.rounds = rounds
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(gpt.Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(self.rounds):
            for block in self.h:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def build() -> LoopedGPT:
    return LoopedGPT()


def example_batch(batch_size: int):
    return gpt.example_batch(batch_size, seq_len=CONFIG.block_size, vocab_size=CONFIG.vocab_size)


loss_fn = gpt.loss_fn
