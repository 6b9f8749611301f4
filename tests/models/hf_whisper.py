"""A small transformers ``WhisperForConditionalGeneration``: an encoder-decoder speech model at its defaults.

80 log-mel bins are transformers' default; here 16 bins, 32 frames (two convolutions, the second with
stride 2, give the encoder 16 positions), 2 encoder and 2 decoder layers of width 32, a 64-token
vocabulary, decoder sequences of 8 tokens. Every other setting is the library's (sinusoidal encoder
positions it reads by ``embed_positions.weight``, learned decoder positions, GELU, pre-LN). No download:
the config is written here.

Model-file contract (docs/design.md): ``example_batch`` gives noisy spectrograms of 4 "words" (fixed random
patterns) with their 8-token transcripts as decoder inputs and labels shifted by one; ``loss_fn``
cross-entropy on the decoder's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf

MELS, FRAMES, SEQ_LEN, VOCAB_SIZE, WORDS = 16, 32, 8, 64, 4


class SpeechToText(torch.nn.Module):
    """``WhisperForConditionalGeneration`` called with its spectrogram and its decoder's tokens (its forward
    takes ``attention_mask`` second)."""

    def __init__(self):
        super().__init__()
        self.whisper = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            vocab_size=VOCAB_SIZE, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=FRAMES // 2, max_target_positions=SEQ_LEN * 2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1, use_cache=False))

    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.whisper(input_features=input_features, decoder_input_ids=decoder_input_ids).logits


def build():
    return SpeechToText()


def example_batch(batch_size: int):
    """``((input features (batch, 16, 32), decoder token ids (batch, 8)), next tokens (batch, 8))``."""
    gen = torch.Generator().manual_seed(0)
    sounds = torch.randn(WORDS, MELS, FRAMES, generator=gen)
    transcripts = torch.randint(3, VOCAB_SIZE, (WORDS, SEQ_LEN + 1), generator=gen)
    words = torch.randint(0, WORDS, (batch_size,))
    features = sounds[words] + 0.3 * torch.randn(batch_size, MELS, FRAMES)
    tokens = transcripts[words]
    return (features, tokens[:, :-1]), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
