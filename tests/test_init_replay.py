"""runtime.init_replay: a factory's initialisation recorded on the meta device and replayed gives the weights of
one process's CPU build bit for bit, holding about one tensor at a time; what cannot be replayed is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.modelfile import load_model_file
from autoshard.runtime import init_replay
from autoshard.runtime.init_replay import NotReplayable, record_build, replay
from autoshard.runtime.model import build_meta_model, build_model

# Models nobody here wrote, each with its library's own initialisation: transformers' post_init (a second
# init of every weight), trunc_normal_ (ViT: draws until in range), rotary and position buffers, Mamba's
# arange-made A_log, nanoGPT's scaled projections, BatchNorm's buffers, T5's tied embeddings.
MODELS = [
    "examples/gpt.py:build",
    "tests/models/hf_gpt2.py:build_with_dropout",
    "tests/models/hf_llama.py:build",
    "tests/models/hf_t5.py:build_with_dropout",
    "tests/models/hf_vit.py:build_with_dropout",
    "tests/models/hf_bert.py:build_with_dropout",
    "tests/models/nanogpt_upstream.py:build",
    "tests/models/bn_cnn.py:build",
    "tests/models/hf_causal_zoo.py:build_mamba",
]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("spec", MODELS)
def test_replay_is_the_cpu_build_bit_for_bit(spec):
    model_file = load_model_file(spec)
    want = _state(build_model(model_file, seed=11))
    meta, record = record_build(lambda: model_file.build(None))
    assert all(t.is_meta for t in meta.parameters())
    assert set(record.state) == set(want)
    got: dict[str, torch.Tensor] = {}
    replay(record, 11, take=lambda name, value: got.__setitem__(name, value.clone()))
    differ = [name for name in want if not torch.equal(want[name].detach(), got[name])]
    assert not differ, f"{spec}: replayed values differ from the CPU build: {differ[:5]}"
    other: dict[str, torch.Tensor] = {}  # another seed gives other weights: the seed is what decides them
    replay(record, 12, names=[next(iter(want))], take=lambda name, value: other.__setitem__(name, value.clone()))
    name, value = next(iter(other.items()))
    assert value.numel() < 2 or value.std() == 0 or not torch.equal(value, got[name])


@pytest.mark.parametrize("spec", ["tests/models/hf_llama.py:build", "examples/gpt.py:build"])
def test_replay_holds_about_one_tensor_at_a_time(spec):
    """transformers initialises each weight twice (the layer's own init, then post_init): the first values are
    dead and must not be kept; peak ≈ the largest tensor, far below the model."""
    model_file = load_model_file(spec)
    meta, record = record_build(lambda: model_file.build(None))
    sizes = [t.numel() * t.element_size() for t in _state(meta).values()]
    peak_bytes = replay(record, 0)
    assert peak_bytes <= 2 * max(sizes) + 64 * 1024
    assert peak_bytes < sum(sizes) / 4


def test_replay_serves_a_subset_and_leaves_the_generator_alone():
    model_file = load_model_file("tests/models/hf_llama.py:build")
    want = _state(build_model(model_file, seed=5))
    _, record = record_build(lambda: model_file.build(None))
    names = [name for name in want if name.startswith("model.layers.1.")]
    before = torch.random.get_rng_state()
    got: dict[str, torch.Tensor] = {}
    replay(record, 5, names=names, take=lambda name, value: got.__setitem__(name, value.clone()))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert set(got) == set(names)
    assert all(torch.equal(got[name], want[name].detach()) for name in names)


def test_draws_after_the_last_kept_one_are_skipped():
    """A rank holding the first layer only (a first pipeline stage) replays no draw after the last it keeps."""
    model_file = load_model_file("examples/gpt.py:build")
    _, record = record_build(lambda: model_file.build(None))
    first = [name for name in record.state if name.startswith("h.0.")]
    plan = init_replay._plan(record, {record.state[name].storage for name in first})
    draws = [i for i, op in enumerate(record.ops) if op.random]
    kept = [i for i in draws if plan.run[i] == "real"]
    assert kept and all(plan.run[i] == "skip" for i in draws if i > max(kept))
    assert sum(plan.run[i] != "skip" for i in draws) < len(draws)


class _SeedsItself(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.proj = nn.Linear(4, 4)


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("factory, why", [(_SeedsItself, "seeds"), (_OwnGenerator, "Generator")])
def test_what_cannot_be_replayed_is_refused_with_the_reason(factory, why):
    with pytest.raises(NotReplayable, match=why):
        record_build(factory)


def test_build_meta_model_falls_back_to_the_whole_cpu_build_and_says_why(tmp_path, capsys):
    path = tmp_path / "seeds.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\ndef build():\n    torch.manual_seed(1)\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\n\n\n"
        "def example_batch(batch_size):\n    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 2)\n"
    )
    model_file = load_model_file(f"{path}:build")
    model = build_meta_model(model_file, seed=0)
    assert not init_replay.is_pending(model)
    assert all(not t.is_meta for t in model.parameters())
    want = build_model(model_file, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))
    assert "built whole on each rank's CPU" in capsys.readouterr().err


def test_build_meta_model_builds_nothing_but_shapes():
    model_file = load_model_file("tests/models/hf_llama.py:build")
    model = build_meta_model(model_file, seed=0)
    assert init_replay.is_pending(model)
    assert all(t.is_meta for t in _state(model).values())


class _TablePerKind(nn.Module):
    """A table per attention kind, made in ``__init__`` as a non-persistent buffer (transformers 5's Gemma3-style
    rotary embedding), and called once per kind: ``torch.export`` unflattens the second call as ``tables@1``."""

    def __init__(self):
        super().__init__()
        for kind, base in (("local", 10.0), ("full", 1000.0)):
            self.register_buffer(f"{kind}_freq", base ** -(torch.arange(0, 8, 2).float() / 8), persistent=False)

    def forward(self, x, kind: str):
        return x * getattr(self, f"{kind}_freq").repeat(2)


class _ScaledBlock(nn.Module):
    """A constant the forward makes from Python data (ALiBi's slopes): export lifts it (``lifted_tensor_0``)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) * torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 4.0, 0.75])


class _StagedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = _TablePerKind()
        self.blocks = nn.ModuleList([_ScaledBlock(), _ScaledBlock()])

    def forward(self, x):
        local, full = self.tables(x, "local"), self.tables(x, "full")
        return self.blocks[1](self.blocks[0](x) + local) + full


def test_pipeline_stages_start_with_the_state_the_split_names_its_own_way(one_rank):
    """A stage holds state under names the factory never gave: a model buffer under the name of a module's second
    call (beside its first name, which stays on the tensor the stage reads) and export's lifted constants.
    Initialised on meta, the stages compute what one process's build computes."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.parallel import init_weights, split_pipeline

    x = torch.randn(2, 8)
    torch.manual_seed(0)
    want = _StagedNet()(x)
    model, record = record_build(_StagedNet)
    init_replay.attach(model, record, seed=0)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    stages = split_pipeline(model, mesh, ("blocks.1",), 2, {}, (x,), torch.device("cpu"))
    held = {name for module in stages.modules for name, _ in module.named_buffers(remove_duplicate=False)}
    assert any("@1" in name for name in held) and any("lifted_tensor" in name for name in held)
    init_weights(stages, mesh, torch.device("cpu"))
    out = (x,)
    for module in stages.modules:
        out = module(*out)
        out = out if isinstance(out, tuple) else (out,)
    assert torch.equal(out[0], want)
