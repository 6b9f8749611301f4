"""Six layers of one structure, one of which (or the parent after it, by the layer's index) centres the activations
over the batch: a coupling a reduced copy that keeps three layers would cut away (``passes.capturing.reduced_copy``).

- ``build``: no layer couples the samples;
- ``build_parent``: the parent centres after layer ``MIX_AT`` (a branch on the index, in no layer's settings);
- ``build_parent_last``: the same after the last layer (the glue before the head);
- ``build_tuple``: layer ``MIX_AT``'s mode, a tuple setting, says to centre;
- ``build_object``: layer ``MIX_AT``'s mode is an object (no setting shows it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, SEQ, DIM, LAYERS, MIX_AT = 64, 8, 16, 6, 4


class Mode:
    def __init__(self, over_batch: bool):
        self.over_batch = over_batch


class Block(nn.Module):
    def __init__(self, index: int, mode):
        super().__init__()
        self.layer_idx = index
        self.mode = mode
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.proj(x))
        if (self.mode[0] == "batch") if isinstance(self.mode, tuple) else self.mode.over_batch:
            x = x - x.mean(0, keepdim=True)
        return x


class Net(nn.Module):
    def __init__(self, parent_mix_at: int | None = None, modes=None):
        super().__init__()
        self.mix_at = parent_mix_at
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(i, modes[i] if modes else ("token",)) for i in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.mix_at:
                x = x - x.mean(0, keepdim=True)
        return self.head(x)


def build() -> Net:
    return Net()


def build_parent() -> Net:
    return Net(parent_mix_at=MIX_AT)


def build_parent_last() -> Net:
    return Net(parent_mix_at=LAYERS - 1)


def build_tuple() -> Net:
    return Net(modes=[("batch",) if i == MIX_AT else ("token",) for i in range(LAYERS)])


def build_object() -> Net:
    return Net(modes=[Mode(i == MIX_AT) for i in range(LAYERS)])


def example_batch(batch_size: int, seq_len: int | None = None):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, (seq_len or SEQ) + 1), generator=g)
    return (ids[:, :-1],), ids[:, 1:]
