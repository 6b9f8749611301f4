"""A wide, shallow GPT (≈ 40B parameters) for planner tests on the meta device: 8 blocks of
d = 20480 with 160 heads, ≈ 5B parameters each. ``build_deep`` has 12: pure data parallelism over 16
80 GiB GPUs cannot hold it (FSDP2 gathers a block in bf16, so the 8 blocks of ``build`` fit), and the
planner needs tp or pp."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

SEQ_LEN = 1024
VOCAB = 51200
loss_fn = gpt.loss_fn


def build():
    return gpt.build(n_layer=8, n_embd=20480, n_head=160, block_size=SEQ_LEN, vocab_size=VOCAB)


def example_batch(batch_size):
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB)


def build_deep():
    """12 of the same blocks (≈ 60B parameters): over 16 data-parallel ranks ZeRO-3's fp32 shards (16 B per
    parameter: 56 GiB), a block gathered in bf16 and one micro-batch's activations overflow an 80 GiB device;
    tp 2 fits."""
    return gpt.build(n_layer=12, n_embd=20480, n_head=160, block_size=SEQ_LEN, vocab_size=VOCAB)
