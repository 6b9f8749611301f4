"""What crosses a pipeline boundary (runtime.pipeline_skips): values that skip stages are passed
through the stages in between, model inputs enter at the first stage, model outputs leave the last,
transfers are contiguous and received in the order sent; a tie is one parameter inside a stage."""

import operator

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

from autoshard.runtime.pipeline_parallel import split_model, state_aliases
from autoshard.runtime.pipeline_skips import misordered_transfers, route_skipped_values, skipped_transfers, stage_nodes


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


# ---------------------------------------------------------------------------- what else crosses a boundary


class LateInputs(nn.Module):
    """forward(x, scale, shift): ``shift`` is read only by the last layer, ``scale`` by the last two
    (nanoGPT's ``targets``); both have x's shape, so a swapped transfer would go unnoticed by shape.
    Returns the output and a view made in the first stage (a model output the last stage must return)."""

    def __init__(self, width: int = 8, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, scale, shift):
        h = torch.tanh(self.layers[0](x))
        early = h.t()  # a non-contiguous view, returned as a model output
        h = torch.tanh(self.layers[1](h)) * scale
        h = self.layers[2](h) * scale + shift
        return h, early


class TransposedHandOff(nn.Module):
    """Each layer hands the next a transposed view and an expanded mask (stride 0), as HF masks are."""

    def __init__(self, width: int = 8, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        mask = (x[:, :1] > 0).float().expand(-1, x.shape[1])
        h = x.t()
        for layer in self.layers:
            h = (torch.tanh(layer(h.t())) * mask).t()
        return h.t()


def run_by_order(pipe, *inputs):
    """Run the stages as p2p delivers: stage 0 gets the model inputs in order, stage s > 0 gets the
    previous stage's outputs positionally, in the order they are sent. Returns the last outputs."""
    outputs = inputs
    for s in range(pipe.num_stages):
        result = pipe.get_stage_module(s)(*outputs)
        outputs = result if isinstance(result, tuple) else (result,)
    return outputs


def late_inputs_case():
    torch.manual_seed(0)
    model = LateInputs()
    x, scale, shift = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    return model, (x, scale, shift)


def test_model_inputs_are_taken_by_the_first_stage_in_order_and_carried():
    model, inputs = late_inputs_case()
    pipe = split_model(model, inputs, ["layers.1", "layers.2"])
    first = stage_nodes(pipe.split_gm.graph)[0]
    assert [arg.name for arg in first.args] == ["x", "scale", "shift"]
    assert skipped_transfers(pipe) == [] and misordered_transfers(pipe) == []


def test_carried_inputs_and_early_outputs_reproduce_the_model_values_and_gradients():
    model, inputs = late_inputs_case()
    expected = model(*inputs)
    (expected[0].square().sum() + expected[1].sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    pipe = split_model(model, inputs, ["layers.1", "layers.2"])
    out = run_by_order(pipe, *inputs)
    assert len(out) == 2  # the last stage returns every model output, in the model's order
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1])
    (out[0].square().sum() + out[1].sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_receives_follow_the_send_order():
    """Stage 2 reads ``scale`` and ``shift`` (same shape): they must arrive in the order sent."""
    model, inputs = late_inputs_case()
    pipe = split_model(model, inputs, ["layers.2"])
    assert misordered_transfers(pipe) == []
    torch.testing.assert_close(run_by_order(pipe, *inputs)[0], model(*inputs)[0])


def test_every_transfer_is_contiguous():
    torch.manual_seed(0)
    model, x = TransposedHandOff(), torch.randn(4, 8)
    pipe = split_model(model, (x,), ["layers.1"])
    sender, receiver = pipe.get_stage_module(0), pipe.get_stage_module(1)
    sent = sender(x)
    sent = sent if isinstance(sent, tuple) else (sent,)
    assert all(t.is_contiguous() for t in sent)
    received = [n.meta["val"] for n in receiver.graph.nodes if n.op == "placeholder"]
    assert all(v.is_contiguous() for v in received)  # the receive buffers are sized from these
    torch.testing.assert_close(run_by_order(pipe, x)[0], model(x))


class TransposingLayer(nn.Module):
    """A layer whose first op transposes its input (DeepSeek-V4's hyper-connection streams are permuted alike), so
    the gradient of its input is a transposed view."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.linear(h.transpose(0, 1)))


def test_every_gradient_sent_back_is_contiguous():
    """A stage's inputs' gradients, which torch's stages send to the stage before (gloo sends only contiguous
    tensors), are contiguous though the stage's first op transposes its input."""
    torch.manual_seed(0)
    model, x = nn.Sequential(TransposingLayer(), TransposingLayer()), torch.randn(2, 4, 8)
    pipe = split_model(model, (x,), ["1"])
    sent = pipe.get_stage_module(0)(x)
    inputs = [t.detach().requires_grad_() for t in (sent if isinstance(sent, tuple) else (sent,))]
    out = pipe.get_stage_module(1)(*inputs)
    grads = torch.autograd.grad((out[0] if isinstance(out, tuple) else out).sum(), inputs)  # as torch's stages do
    assert grads and all(g.is_contiguous() for g in grads), [g.stride() for g in grads]
    whole = x.detach().requires_grad_()
    torch.autograd.grad(model(whole).sum(), whole)  # the same model runs


class TiedThreeWays(nn.Module):
    """One weight as two embeddings in the first stage and the head in the last (T5's ``shared``)."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.enc_embed = nn.Embedding(vocab, width)
        self.dec_embed = nn.Embedding(vocab, width)
        self.dec_embed.weight = self.enc_embed.weight
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.enc_embed.weight

    def forward(self, a, b):
        h = self.layers[0](self.enc_embed(a) + self.dec_embed(b))
        return self.head(torch.tanh(self.layers[1](h)))


def test_a_tie_is_one_parameter_inside_each_stage():
    torch.manual_seed(0)
    model = TiedThreeWays()
    a, b = torch.randint(0, 16, (4, 5)), torch.randint(0, 16, (4, 5))
    pipe = split_model(model, (a, b), ["layers.1"])
    assert pipe.replicated_params  # the head's stage holds a copy
    first = pipe.get_stage_module(0)
    assert first.get_parameter("enc_embed.weight") is first.get_parameter("dec_embed.weight")
    assert state_aliases(model) == (("enc_embed.weight", "dec_embed.weight", "head.weight"),)


class ReadsLaterInputFirst(nn.Module):
    """forward(ids, pixels, scale, unused, *, bias=None): the vision tower reads ``pixels`` first, ``scale``
    is read only by the last layer, ``unused`` by none, and the keyword-only ``bias`` keeps its default."""

    def __init__(self, width: int = 8, layers: int = 3):
        super().__init__()
        self.vision = nn.Linear(6, width)
        self.text = nn.Embedding(10, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, ids, pixels, scale, unused, *, bias=None):
        h = torch.tanh(self.vision(pixels)) + self.text(ids)
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        h = self.layers[-1](h) * scale
        return h if bias is None else h + bias


def test_the_first_stage_takes_inputs_in_the_declared_order_not_the_order_it_reads_them():
    torch.manual_seed(0)
    model = ReadsLaterInputFirst()
    inputs = (torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 6), torch.randn(4, 5, 8), torch.randn(4, 3))
    expected = model(*inputs)
    for cuts in (["layers.1"], ["layers.1", "layers.2"]):
        pipe = split_model(model, inputs, cuts)
        first = stage_nodes(pipe.split_gm.graph)[0]
        assert [arg.name for arg in first.args] == ["ids", "pixels", "scale", "unused"]
        assert skipped_transfers(pipe) == [] and misordered_transfers(pipe) == []
        torch.testing.assert_close(run_by_order(pipe, *inputs)[0], expected)


class VisionFirst(nn.Module):
    """forward(ids, pixels), both read by the first stage, ``pixels`` first (a CLIP-style two-tower model)."""

    def __init__(self, width: int = 8, layers: int = 2):
        super().__init__()
        self.vision = nn.Linear(6, width)
        self.text = nn.Embedding(10, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, ids, pixels):
        h = torch.tanh(self.vision(pixels)) + self.text(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def test_a_first_stage_reading_every_input_out_of_order_is_reordered():
    """``pipeline()`` gives stage 0 the placeholders (pixels, ids); the schedule feeds (ids, pixels)."""
    torch.manual_seed(0)
    model, ids, pixels = VisionFirst(), torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 6)
    raw = pipeline(VisionFirst(), mb_args=(ids, pixels), split_spec={"layers.1": SplitPoint.BEGINNING})
    assert [n.name for n in raw.get_stage_module(0).graph.nodes if n.op == "placeholder"] == ["pixels", "ids"]
    pipe = split_model(model, (ids, pixels), ["layers.1"])
    assert [n.name for n in pipe.get_stage_module(0).graph.nodes if n.op == "placeholder"] == ["ids", "pixels"]
    torch.testing.assert_close(run_by_order(pipe, ids, pixels)[0], model(ids, pixels))


class SharedActivationNet(nn.Module):
    """Blocks whose MLPs share one activation module (OpenAI GPT's ``ACT2FN`` instance, every MLP's ``act``)."""

    class MLP(nn.Module):
        def __init__(self, width: int, act: nn.Module):
            super().__init__()
            self.fc, self.act = nn.Linear(width, width), act

        def forward(self, x):
            return self.act(self.fc(x))

    class Block(nn.Module):
        def __init__(self, width: int, act: nn.Module):
            super().__init__()
            self.attn, self.mlp = nn.Linear(width, width), SharedActivationNet.MLP(width, act)

        def forward(self, x):
            return x + self.mlp(x + self.attn(x))

    def __init__(self, width: int = 8, layers: int = 3):
        super().__init__()
        act = nn.GELU()
        self.h = nn.ModuleList(self.Block(width, act) for _ in range(layers))

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


def test_layers_sharing_a_module_split_with_every_call_under_its_layer():
    """torch's trace records the calls of a split layer that shares a module with another by paths relative to the
    layer (``attn``, ``act`` under ``h.1``), and ``pipeline()`` then stopped ("Child module 'attn' is not a
    descendant of parent module 'h.1'"); ``split_model`` roots them (``root_module_stacks``), and the stages run
    the model."""
    torch.manual_seed(0)
    model, x = SharedActivationNet(), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="is not a descendant of parent module"):
        pipeline(SharedActivationNet(), mb_args=(x,), split_spec={"h.1": SplitPoint.BEGINNING})
    pipe = split_model(model, (x,), ["h.1", "h.2"])
    assert pipe.num_stages == 3
    torch.testing.assert_close(run_adjacent(pipe, x), model(x))
