"""The example GPT (examples/gpt.py) trained on real text: Jane Austen's *Northanger Abbey* as bytes.

Model-file contract (docs/usage.md, "The model file"): ``build`` and ``loss_fn`` are examples/gpt.py's;
``example_batch`` is its synthetic draw, which planning and capture read (shapes only);
``dataset(seq_len)`` is what emitted programs train on: the book (examples/data/, public domain) as
byte-level tokens (vocabulary 256, one token per byte), cut into non-overlapping windows of
``seq_len`` tokens, each with the next ``seq_len`` tokens as its target.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gpt import CONFIG, build, example_batch, loss_fn  # noqa: F401  (the contract's names)

TEXT = Path(__file__).resolve().parent / "data" / "northanger_abbey.txt"


class ByteWindows(torch.utils.data.Dataset):
    """Sample i: inputs ``(t[i·s : i·s+s],)``, target ``t[i·s+1 : i·s+s+1]``, t the text's bytes as int64."""

    def __init__(self, text: bytes, seq_len: int):
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int):
        window = self.tokens[index * self.seq_len:(index + 1) * self.seq_len + 1]
        return (window[:-1],), window[1:]


def dataset(seq_len: int | None = None) -> ByteWindows:
    """The book in windows of ``seq_len`` bytes (None: the model's block size, 64)."""
    return ByteWindows(TEXT.read_bytes(), seq_len or CONFIG.block_size)
