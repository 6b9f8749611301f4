"""passes/capturing/capture: torch.export on meta tensors -> OpGraph, and its one-line errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autoshard.errors import AutoshardError
from autoshard.modelfile import load_model_file
from autoshard.passes.capturing.capture import _clean_path, capture

ROOT = Path(__file__).resolve().parent.parent


def spec(relative: str) -> str:
    return f"{ROOT / relative}"


@pytest.fixture(scope="module")
def gpt_graph():
    return capture(load_model_file(spec("examples/gpt.py:build")), batch_size=2)


@pytest.fixture(scope="module")
def gpt2_graph():
    return capture(load_model_file(spec("tests/models/hf_gpt2.py:build")), batch_size=2)


@pytest.fixture(scope="module")
def llama_graph():
    return capture(load_model_file(spec("tests/models/hf_llama.py:build")), batch_size=2)


def real_param_count(relative_spec: str) -> int:
    torch.manual_seed(0)
    model = load_model_file(spec(relative_spec)).build("cpu")
    return sum(p.numel() for p in model.parameters())


def write_model(tmp_path: Path, body: str) -> str:
    path = tmp_path / "model.py"
    header = "import torch\nimport torch.nn as nn\n\n"
    path.write_text(header + textwrap.dedent(body))
    return f"{path}:build"


def test_gpt_params_equal_the_module(gpt_graph):
    assert gpt_graph.param_count == real_param_count("examples/gpt.py:build")
    names = [p.name for p in gpt_graph.params]
    assert len(names) == len(set(names))
    assert {p for n in gpt_graph.nodes for p in n.param_inputs} <= set(names)


def test_gpt_inputs_and_token_count(gpt_graph):
    assert gpt_graph.batch_size == 2
    assert gpt_graph.input_shapes == [(2, 64)]
    assert gpt_graph.tokens_per_sample == 64
    assert gpt_graph.placeholders[gpt_graph.input_names[0]] == ((2, 64), "int64")


def test_gpt_nodes_carry_module_paths_types_and_shapes(gpt_graph):
    q = next(n for n in gpt_graph.nodes if n.module_path == "h.0.attn.q_proj")
    assert q.target == "aten.linear.default"
    assert q.module_type == "torch.nn.modules.linear.Linear"
    assert q.param_inputs == ("h.0.attn.q_proj.weight", "h.0.attn.q_proj.bias")
    assert (q.shape, q.dtype) == ((2, 64, 64), "float32")
    residual = [n for n in gpt_graph.nodes if n.module_path == "h.1" and n.target == "aten.add.Tensor"]
    assert len(residual) == 2 and residual[0].module_type == "gpt.Block"
    assert gpt_graph.module_types["h"] == "torch.nn.modules.container.ModuleList"
    assert gpt_graph.nodes[-1].module_path == "lm_head"


def test_every_input_name_resolves(gpt_graph, llama_graph):
    for graph in (gpt_graph, llama_graph):
        for node in graph.nodes:
            for name in node.inputs:
                shape, dtype = graph.value_meta(name)
                assert isinstance(shape, tuple)


def test_attrs_hold_non_tensor_arguments(gpt_graph):
    transpose = next(n for n in gpt_graph.nodes if n.target == "aten.transpose.int")
    assert transpose.attrs == {"dim0": 1, "dim1": 2}
    sdpa = next(n for n in gpt_graph.nodes if n.target.startswith("aten.scaled_dot_product_attention"))
    assert sdpa.attrs["is_causal"] is True and sdpa.attrs["attn_mask"] is None


def test_gpt2_tied_embedding_appears_once(gpt2_graph):
    wte = gpt2_graph.param("transformer.wte.weight")
    assert wte.tied_to == ("lm_head.weight",)
    assert gpt2_graph.param("lm_head.weight") is wte
    assert gpt2_graph.param_count == real_param_count("tests/models/hf_gpt2.py:build")
    head = gpt2_graph.nodes[-1]
    assert head.module_path == "lm_head" and head.param_inputs == ("transformer.wte.weight",)


def test_llama_gqa_capture(llama_graph):
    assert llama_graph.param_count == real_param_count("tests/models/hf_llama.py:build")
    buffers = [p for p in llama_graph.params if p.is_buffer]
    assert "model.rotary_emb.inv_freq" in {b.name for b in buffers}
    k_proj = next(n for n in llama_graph.nodes if n.module_path == "model.layers.0.self_attn.k_proj")
    assert k_proj.shape == (2, 32, 32)  # 2 KV heads of 16
    assert llama_graph.tokens_per_sample == 32


def test_float_inputs_are_one_token_per_sample():
    graph = capture(load_model_file(spec("tests/models/mlp.py:build")), batch_size=3)
    assert graph.tokens_per_sample == 1 and graph.batch_size == 3
    assert graph.module_types["0"] == "mlp.ResidualBlock"
    assert {n.module_path for n in graph.nodes} >= {"0.fc1", "3.fc2"}


def test_data_dependent_control_flow_is_one_line_with_the_fix(tmp_path, capsys):
    model_spec = write_model(
        tmp_path,
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                if y.sum() > 0:
                    return y * 2
                return y

        def build():
            return Model()

        def example_batch(batch_size):
            return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
    """,
    )
    with pytest.raises(AutoshardError) as info:
        capture(load_model_file(model_spec))
    message = str(info.value)
    assert "\n" not in message
    assert "data-dependent control flow" in message
    assert "model.py:12" in message and "if y.sum() > 0:" in message
    assert "torch.where" in message and "torch.cond" in message
    assert info.value.__cause__ is not None
    assert "def forward" not in capsys.readouterr().err  # torch's partial-graph dump is held back


def test_factory_that_fails_on_meta_says_so(tmp_path):
    model_spec = write_model(
        tmp_path,
        """
        def build():
            lin = nn.Linear(4, 4)
            lin.scale = float(lin.weight.abs().max())  # reads a value: impossible on meta
            return lin

        def example_batch(batch_size):
            return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
    """,
    )
    with pytest.raises(AutoshardError) as info:
        capture(load_model_file(model_spec))
    message = str(info.value)
    assert "\n" not in message
    assert "meta device" in message and "model.py:7" in message
    assert info.value.__cause__ is not None


def test_unflattenable_output_names_the_class_and_use_cache(tmp_path):
    model_spec = write_model(
        tmp_path,
        """
        class Cache:
            def __init__(self, t):
                self.t = t

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                return self.lin(x), Cache(x)

        def build():
            return Model()

        def example_batch(batch_size):
            return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
    """,
    )
    with pytest.raises(AutoshardError, match="returns a Cache.*use_cache=False"):
        capture(load_model_file(model_spec))


def test_op_without_meta_kernel_is_named(tmp_path):
    model_spec = write_model(
        tmp_path,
        """
        lib = torch.library.Library("autoshard_test_capture", "DEF")
        lib.define("frob(Tensor x) -> Tensor")
        lib.impl("frob", lambda x: x * 2, "CPU")

        class Model(nn.Module):
            def forward(self, x):
                return torch.ops.autoshard_test_capture.frob(x)

        def build():
            return Model()

        def example_batch(batch_size):
            return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
    """,
    )
    with pytest.raises(AutoshardError) as info:
        capture(load_model_file(model_spec))
    message = str(info.value)
    assert "\n" not in message
    assert "autoshard_test_capture::frob" in message and "model.py:11" in message
    assert "fake (meta) kernel" in message


def test_factory_pinned_to_cpu_is_moved_to_meta(tmp_path):
    model_spec = write_model(
        tmp_path,
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4, device="cpu")
                self.register_buffer("scale", torch.ones(4, device="cpu"))

            def forward(self, x):
                return self.lin(x) * self.scale

        def build():
            return Model()

        def example_batch(batch_size):
            return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
    """,
    )
    graph = capture(load_model_file(model_spec))
    assert graph.param_count == 20
    assert [p.name for p in graph.params if p.is_buffer] == ["scale"]
    mul = graph.nodes[-1]
    assert mul.param_inputs == ("scale",)


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("h.0.attn", "h.0.attn"),
        ("_orig_mod.h.0", "h.0"),
        ("L['self'].h[0].attn", "h.0.attn"),
        ("model.layers.3@1", "model.layers.3"),
        ("", ""),
    ],
)
def test_module_paths_are_normalised(raw, clean):
    assert _clean_path(raw) == clean


@pytest.mark.parametrize("seq, refused", [(16, False), (17, True)])
def test_positions_past_a_learned_position_table_are_refused(seq, refused):
    """HF GPT-2 numbers its positions ``arange(seq) + past``: at 17 tokens its 16-row ``wpe`` would be read out of
    range when the program runs; capture (on meta, without values) refuses it with the limit."""
    import transformers

    from autoshard.passes.capturing.capture import capture_module

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    if not refused:
        assert capture_module(model, (ids,), "gpt2").nodes
        return
    with pytest.raises(
        AutoshardError,
        match=r"'transformer\.wpe' looks up positions up to 16 in a table of 16 "
        r"rows.*--seq-len 16 or less",
    ):
        capture_module(model, (ids,), "gpt2")


def test_loading_a_model_file_leaves_no_bytecode_in_its_folder(tmp_path, monkeypatch):
    """The user's folder is theirs: importing their model file (and a module beside it that it imports) writes no
    ``__pycache__`` there, even where Python writes bytecode; the setting is restored after."""
    (tmp_path / "layers.py").write_text("import torch\nWIDTH = 8\n")
    (tmp_path / "net.py").write_text(
        textwrap.dedent(
            """
            import torch
            from layers import WIDTH

            def build():
                return torch.nn.Linear(WIDTH, WIDTH)

            def example_batch(batch_size):
                return (torch.randn(batch_size, WIDTH),), torch.randn(batch_size, WIDTH)
            """
        )
    )
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    monkeypatch.delitem(sys.modules, "layers", raising=False)
    load_model_file(f"{tmp_path / 'net.py'}:build")
    assert not (tmp_path / "__pycache__").exists()
    assert sys.dont_write_bytecode is False
