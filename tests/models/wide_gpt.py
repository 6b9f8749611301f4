"""A wide, shallow GPT (≈ 40B parameters) for planner tests on the meta device: 8 blocks of
d = 20480 with 160 heads. Each block holds ≈ 5B parameters, so ZeRO-3's unsharded units alone
overflow an 80 GiB device with pure data parallelism on 16 GPUs: the planner needs tp or pp."""

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
