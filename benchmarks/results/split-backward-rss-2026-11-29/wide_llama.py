"""tests/models/hf_llama.py's Llama at 8 layers, wider and longer: activations dominate a rank's memory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "models"))
import gpt
import hf_llama
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN, VOCAB = 256, 256


def build():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )
    )


def example_batch(batch_size: int):
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB)


loss_fn = hf_llama.loss_fn
