"""Values that skip stages are passed through the stages in between (runtime.pipeline_skips)."""

import operator

import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

from autoshard.runtime.pipeline_parallel import split_model
from autoshard.runtime.pipeline_skips import route_skipped_values, skipped_transfers, stage_nodes


class SkipNet(nn.Module):
    """A table made before the first layer and read by all (Llama's rotary), and a U-Net skip
    from the first layer to the output."""

    def __init__(self, width: int = 8, layers: int = 4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        h = self.embed(x)
        table = torch.sin(h)
        first = None
        for layer in self.layers:
            h = torch.tanh(layer(h)) * table
            first = h if first is None else first
        return h + first


def split(model: nn.Module, x: torch.Tensor):
    return split_model(model, (x,), ["layers.1", "layers.2", "layers.3"])


def run_adjacent(pipe, x: torch.Tensor):
    """Run the stages in order, each seeing only the previous stage's outputs (what p2p delivers)."""
    stages = stage_nodes(pipe.split_gm.graph)
    outputs = (x,)
    for s, node in enumerate(stages):
        args = [outputs[_output_index(arg)] if s else outputs[0] for arg in node.args]
        result = pipe.get_stage_module(s)(*args)
        outputs = result if isinstance(result, tuple) else (result,)
    return outputs[0]


def _output_index(arg) -> int:
    return arg.args[1] if arg.target is operator.getitem else 0


def test_every_transfer_is_to_the_next_stage():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    pipe = pipeline(SkipNet(), mb_args=(x,), split_spec={f"layers.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)})
    skipped = {(producer, reader) for _, producer, reader in skipped_transfers(pipe)}
    assert skipped == {(0, 2), (0, 3)}  # the table to stages 2 and 3, the first layer's output to 3
    route_skipped_values(pipe)
    assert skipped_transfers(pipe) == []
    for s, node in enumerate(stage_nodes(pipe.split_gm.graph)[1:], start=1):
        sources = {arg.args[0] if arg.target is operator.getitem else arg for arg in node.args}
        assert sources == {stage_nodes(pipe.split_gm.graph)[s - 1]}


def test_adjacent_stages_reproduce_the_model():
    torch.manual_seed(0)
    model, x = SkipNet(), torch.randn(2, 8)
    expected = model(x)
    pipe = split(model, x)
    torch.testing.assert_close(run_adjacent(pipe, x), expected)
    torch.testing.assert_close(pipe(x)[0], expected)


def test_gradients_through_passed_values_match():
    torch.manual_seed(0)
    model, x = SkipNet(), torch.randn(2, 8)
    model(x).square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    pipe = split(model, x)
    run_adjacent(pipe, x).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)
