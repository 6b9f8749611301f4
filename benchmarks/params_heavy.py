"""A GPT whose parameters dominate its activations, for plan-choice benchmarks on CPU ranks.

Width 256 and 4 layers (3.2M parameters) on 16-token sequences: per sample the activations are
a few hundred KB while the weights, gradients and AdamW state are ~50 MB, so where the example
GPT (width 64, 64 tokens) is bound by compute and host time, this one is bound by moving and
updating parameters: ZeRO stages and DDP buckets matter here. Model file contract as
examples/gpt.py (whose GPT it builds).
"""

from __future__ import annotations

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402

SEQ_LEN = 16
loss_fn = gpt.loss_fn


def build() -> gpt.GPT:
    return gpt.build(n_layer=4, n_head=4, n_embd=256, block_size=SEQ_LEN)


def example_batch(batch_size: int):
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN)
