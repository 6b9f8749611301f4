"""Which stage holds which of the model's tensors (runtime.pipeline_parallel): every one of them is held by one
stage, those no graph reads (a causal-LM decoder's cross-attention) included, so the final weights are whole."""

import torch
import torch.nn as nn

from autoshard.runtime import checkpoint
from autoshard.runtime import pipeline_parallel as pp
from autoshard.runtime.recipe import Recipe, build_optimizer


class Layer(nn.Module):
    """A block holding a module its forward never calls (Blenderbot's ``encoder_attn`` without an encoder)."""

    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.cross = nn.Linear(width, width)  # never called
        self.register_buffer("cross_scale", torch.ones(width))  # never read, persistent

    def forward(self, x):
        return torch.tanh(self.mix(x))


class Decoder(nn.Module):
    def __init__(self, width: int = 8, layers: int = 4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.unused_head = nn.Linear(width, 2)  # never called, outside any layer

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h


def _stages():
    torch.manual_seed(0)
    model = Decoder()
    parts = pp.build_pipeline_stages(model, (torch.randn(2, 8),), ["layers.2"], 0, 1, 2, torch.device("cpu"))
    return model, parts


def test_state_no_graph_reads_is_held_by_the_stage_of_its_layer_else_the_first(one_rank):
    model, parts = _stages()
    held = [
        {name: t for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]}
        for m in parts.modules
    ]
    for name, tensor in model.state_dict(keep_vars=True).items():
        holders = [i for i, names in enumerate(held) if name in names]
        assert len(holders) == 1, (name, holders)
        assert held[holders[0]][name] is tensor
    assert "layers.0.cross.weight" in held[0] and "layers.3.cross.weight" in held[1]
    assert "layers.3.cross_scale" in held[1] and "unused_head.weight" in held[0]


def test_final_weights_of_the_stages_are_the_whole_models(one_rank, tmp_path):
    model, parts = _stages()
    checkpoint.save_weights(tmp_path / "weights", parts, build_optimizer(parts, Recipe(), "cpu"))
    saved = checkpoint.read_weights(tmp_path / "weights")
    assert set(saved) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor)
