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


def test_every_tied_copy_is_found_in_its_stage_under_the_name_the_split_lists(one_rank):
    """CamemBERT's last stage holds its copy of the word embeddings under their name, listed in
    ``Pipe.replicated_params``, while its graph reads it as ``lm_head.decoder.weight``: that name stays, so the
    gradient sum after the schedule finds every copy."""
    import transformers

    config = transformers.CamembertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    model = transformers.CamembertForCausalLM(config)
    ids = torch.randint(2, 64, (2, 6))
    parts = pp.build_pipeline_stages(model, (ids,), ["roberta.encoder.layer.1"], 0, 1, 2, torch.device("cpu"))
    assert parts.tied
    for tie in parts.tied:
        copies = [parts.stages[position].submod.get_parameter(name) for position, name in tie.copies]
        assert len(copies) == 2
    last = parts.stages[1].submod
    assert last.get_parameter("lm_head.decoder.weight") is last.get_parameter(
        "roberta.embeddings.word_embeddings.weight"
    )


def test_each_unit_is_priced_for_the_parameters_no_graph_reads_that_its_stage_holds():
    """``cost.units.unit_params``: a layer's unread cross-attention in that layer's unit, a head outside every
    layer in the first (the stage that holds it, as above); all together the model's parameters, as SPMD counts."""
    from autoshard.cost.units import node_units, unit_params
    from autoshard.modelfile import load_model_file
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.blocks import find_blocks
    from autoshard.passes.capturing.capture import capture

    graph = find_blocks(annotate(capture(load_model_file("tests/models/unread_cross.py:build"), 2)))
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    layer = linear(16, 16) + linear(16, 48)  # mix, and cross (never called)
    embed_and_unused_head, out = linear(16, 16) + linear(16, 5), linear(16, 16)
    assert unit_params(graph, node_units(graph)) == (embed_and_unused_head, layer, layer, layer, layer, out)
    assert sum(unit_params(graph, node_units(graph))) == graph.param_count
