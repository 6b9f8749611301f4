"""karpathy's nanoGPT ``model.py``, unchanged (tests/models/third_party/nanogpt), small.

``GPTConfig`` at its defaults except the sizes (2 layers, 4 heads, width 64, block 32, vocab 256)
and dropout 0.1 (nanoGPT's Shakespeare config uses 0.2; its default 0.0 would hide dropout).
``forward(idx, targets)`` returns ``(logits, loss)``: the loss is computed inside the model from
``targets``, a model input only the last pipeline stage reads. ``lm_head`` is tied to ``wte``.

Model-file contract (docs/design.md): ``build``, ``example_batch`` -> ``((idx, targets), targets)`` with
examples/gpt.py's synthetic tokens, ``loss_fn`` -> the model's own loss.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for path in (str(_HERE / "third_party" / "nanogpt"), str(_HERE.parents[1] / "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)
import model as nanogpt  # noqa: E402  (nanoGPT's model.py)

SEQ_LEN, VOCAB_SIZE = 32, 256


def build() -> nanogpt.GPT:
    config = nanogpt.GPTConfig(block_size=SEQ_LEN, vocab_size=VOCAB_SIZE, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        return nanogpt.GPT(config)


def example_batch(batch_size: int):
    (idx,), targets = gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)
    idx, targets = idx.contiguous(), targets.contiguous()  # nanoGPT's loss views targets: its loader's are contiguous
    return (idx, targets), targets


def loss_fn(outputs, targets):
    return outputs[1]
