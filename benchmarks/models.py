"""Model files for benchmarks: published model shapes built from examples/gpt.py's GPT.

Factories (each a model-file factory, e.g. ``benchmarks/models.py:gpt3_175b``)::

    gpt3_175b        96 layers, d = 12288, 96 heads, vocab 51200      ≈ 175B parameters (GPT-3)
    gpt_1t           128 layers, d = 25600, 160 heads, vocab 51200   ≈ 1.0T parameters
    llama3_8b_shape  32 layers, d = 4096, 32 heads, vocab 128256     ≈ 7.5B: Llama-3-8B's width,
                     depth and vocabulary in the GPT block (4d GELU MLP, learned positions,
                     full multi-head attention), not Llama's SwiGLU / GQA / RoPE

They are meant for planning on the meta device; ``example_batch`` gives 2048-token
sequences (ids below 51200, valid for every factory here).
"""

from __future__ import annotations

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py, found through the path above)

SEQ_LEN = 2048
VOCAB_SIZE = 51200
loss_fn = gpt.loss_fn


def gpt3_175b() -> gpt.GPT:
    return gpt.build(n_layer=96, n_head=96, n_embd=12288, block_size=SEQ_LEN, vocab_size=VOCAB_SIZE)


def gpt_1t() -> gpt.GPT:
    return gpt.build(n_layer=128, n_head=160, n_embd=25600, block_size=SEQ_LEN, vocab_size=VOCAB_SIZE)


def llama3_8b_shape() -> gpt.GPT:
    return gpt.build(n_layer=32, n_head=32, n_embd=4096, block_size=8192, vocab_size=128256)


def example_batch(batch_size: int):
    """``((token ids (batch, 2048),), next tokens)``: examples/gpt.py's synthetic sequences."""
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)


def __getattr__(name: str):
    """``gpt_l{layers}_d{width}``: the GPT block at that depth and width (width / 128 heads), for sweeps
    such as ``benchmarks/bench_planner_speed.py``; e.g. ``benchmarks/models.py:gpt_l48_d4096``."""
    import re

    match = re.fullmatch(r"gpt_l(\d+)_d(\d+)", name)
    if match is None:
        raise AttributeError(name)
    layers, width = int(match.group(1)), int(match.group(2))
    return lambda: gpt.build(
        n_layer=layers, n_head=max(1, width // 128), n_embd=width, block_size=SEQ_LEN, vocab_size=VOCAB_SIZE
    )
