import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402


def build():
    return gpt.build(n_layer=48, n_embd=8192, n_head=64, vocab_size=50304)


def example_batch(batch_size):
    return gpt.example_batch(batch_size, vocab_size=50304)
