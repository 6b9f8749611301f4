"""passes/capturing/annotate: FLOPs and bytes per node from shapes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autoshard.ir.graph import OpGraph, OpNode, tensor_bytes
from autoshard.modelfile import load_model_file
from autoshard.passes.capturing.annotate import annotate, is_alias, node_bytes, node_flops
from autoshard.passes.capturing.capture import capture, capture_module

ROOT = Path(__file__).resolve().parent.parent
B, S, D, L, V = 2, 64, 64, 4, 256  # examples/gpt.py's default config at batch 2
MATMUL_TARGETS = ("aten.linear", "aten.scaled_dot_product_attention")


@pytest.fixture(scope="module")
def gpt_graph():
    return annotate(capture(load_model_file(f"{ROOT / 'examples/gpt.py'}:build"), batch_size=B))


def test_every_linear_is_2_b_s_in_out(gpt_graph):
    linears = [n for n in gpt_graph.nodes if n.target == "aten.linear.default"]
    assert len(linears) == 6 * L + 1
    for node in linears:
        out_features, in_features = gpt_graph.value_meta(node.inputs[1])[0]
        assert node.flops == 2 * B * S * in_features * out_features


def test_gpt_forward_flops_match_the_analytic_count(gpt_graph):
    """2·N·tokens (N: weights that multiply, embeddings excluded) + 4·L·B·S²·d for attention."""
    n_matmul_weights = 12 * D * D * L + V * D
    attention = 4 * L * B * S * S * D
    analytic = 2 * n_matmul_weights * B * S + attention
    matmul = sum(n.flops for n in gpt_graph.nodes if n.target.startswith(MATMUL_TARGETS))
    assert matmul == analytic
    assert gpt_graph.flops_fwd == pytest.approx(analytic, rel=0.05)  # + norms, GELU, adds
    assert gpt_graph.flops_fwd > analytic


def test_sdpa_counts_qk_and_pv(gpt_graph):
    sdpa = next(n for n in gpt_graph.nodes if n.target.startswith("aten.scaled_dot_product_attention"))
    assert sdpa.flops == 2 * 2 * B * S * S * D  # heads · head_dim = D


def test_views_cost_nothing(gpt_graph):
    views = [n for n in gpt_graph.nodes if n.target.split(".")[1] in ("view", "transpose", "reshape")]
    assert views and all((n.flops, n.bytes_read, n.bytes_written) == (0, 0, 0) for n in views)


def test_linear_bytes_are_its_input_weight_bias_and_output(gpt_graph):
    node = next(n for n in gpt_graph.nodes if n.module_path == "h.0.mlp.c_fc")
    expected_read = 4 * (B * S * D + 4 * D * D + 4 * D)
    assert (node.bytes_read, node.bytes_written) == (expected_read, 4 * B * S * 4 * D)


def test_pointwise_ops_are_charged_per_element(gpt_graph):
    gelu = next(n for n in gpt_graph.nodes if n.target == "aten.gelu.default")
    add = next(n for n in gpt_graph.nodes if n.target == "aten.add.Tensor" and n.module_path == "h.0")
    assert gelu.flops == 8 * B * S * 4 * D
    assert add.flops == B * S * D and add.bytes_read == 2 * 4 * B * S * D


def test_registry_formula_for_addmm_in_gpt2():
    graph = annotate(capture(load_model_file(f"{ROOT / 'tests/models/hf_gpt2.py'}:build"), batch_size=B))
    addmm = [n for n in graph.nodes if n.target == "aten.addmm.default"]
    assert addmm
    for node in addmm:
        (m, k), (_, n) = graph.value_meta(node.inputs[1])[0], graph.value_meta(node.inputs[2])[0]
        assert node.flops == 2 * m * k * n


def test_gqa_attention_counts_query_heads():
    graph = annotate(capture(load_model_file(f"{ROOT / 'tests/models/hf_llama.py'}:build"), batch_size=B))
    sdpa = [n for n in graph.nodes if n.target.startswith("aten.scaled_dot_product_attention")]
    assert len(sdpa) == 2
    assert all(n.flops == 4 * B * 4 * 32 * 32 * 16 for n in sdpa)  # 4 query heads of 16, seq 32


def test_conv2d_flops_from_shapes():
    model = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, padding=1, groups=1), nn.ReLU())
    graph = annotate(capture_module(model, (torch.randn(2, 3, 10, 10),)))
    conv = graph.nodes[0]
    assert conv.target == "aten.conv2d.default"
    assert conv.flops == 2 * (2 * 8 * 10 * 10) * 3 * 3 * 3


def test_grouped_matmuls_of_a_captured_moe_count_every_expert_row():
    """Mixtral (tests/models/hf_mixtral.py): per layer S = tokens·top_k rows, gate_up K=H N=2I, down K=I N=H."""
    from autoshard.passes.capturing.annotate import ESTIMATED, GROUPED_MM_TARGETS

    model_file = load_model_file(f"{ROOT / 'tests/models/hf_mixtral.py'}:build")
    graph = annotate(capture(model_file, batch_size=B))
    hf_mixtral = model_file.module
    cfg = hf_mixtral.config()
    hidden, inter, top_k, experts = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_experts_per_tok,
        cfg.num_local_experts,
    )
    pairs = B * hf_mixtral.SEQ_LEN * top_k
    grouped = [n for n in graph.nodes if n.target.startswith(GROUPED_MM_TARGETS)]
    assert len(grouped) == 2 * cfg.num_hidden_layers
    per_layer = 2 * pairs * hidden * 2 * inter + 2 * pairs * inter * hidden
    assert sum(n.flops for n in grouped) == cfg.num_hidden_layers * per_layer
    assert not any(n.attrs.get(ESTIMATED) for n in grouped)
    for node in grouped:  # the whole [E, N, K] weight is read, whichever expert each row meets
        weight_shape = graph.value_meta(node.inputs[1])[0]
        assert weight_shape[0] == experts
        assert node.bytes_read >= graph.value_bytes(node.inputs[1]) + graph.value_bytes(node.inputs[0])


class _GroupedMM(nn.Module):
    """``F.grouped_mm`` as transformers calls it on GPUs: a[S, K] · weight[E, N, K]ᵀ, offs by expert."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 24, 16, dtype=torch.bfloat16))  # [E, N, K]

    def forward(self, x):
        offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
        return nn.functional.grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


def test_aten_grouped_mm_is_2_s_k_n():
    graph = annotate(capture_module(_GroupedMM(), (torch.randn(12, 16, dtype=torch.bfloat16),)))
    (gmm,) = [n for n in graph.nodes if n.target == "aten._grouped_mm.default"]
    assert gmm.flops == 2 * 12 * 16 * 24
    assert gmm.bytes_read >= 2 * (4 * 24 * 16 + 12 * 16) and gmm.bytes_written == 2 * 12 * 24


# ---------------------------------------------------------------------------- hand-made graphs


def tiny_graph(*nodes: OpNode, placeholders=None) -> OpGraph:
    placeholders = placeholders or {"x": ((4, 8), "float32"), "y": ((8, 16), "float32")}
    return OpGraph(
        nodes=list(nodes),
        params=[],
        input_shapes=[],
        batch_size=4,
        tokens_per_sample=1,
        input_names=list(placeholders),
        placeholders=placeholders,
    )


def node(name, target, inputs, shape, dtype="float32", **attrs) -> OpNode:
    return OpNode(
        name=name, target=target, module_path="", module_type="", inputs=inputs, shape=shape, dtype=dtype, attrs=attrs
    )


def test_matmul_and_einsum():
    mm = node("mm", "aten.matmul.default", ("x", "y"), (4, 16))
    es = node("es", "aten.einsum.default", ("x", "y"), (4, 16), equation="ik,kj->ij")
    graph = tiny_graph(mm, es)
    assert node_flops(graph, mm) == node_flops(graph, es) == 2 * 4 * 8 * 16


def test_grouped_mm_shapes_torch_allows():
    """a[S,K]·b[E,K,N], a[E,M,K]·b[E,K,N], a[E,M,K]·b[K,N]: 2·numel(out)·K; a[M,K]·b[K,N] split on K: 2·M·K·N."""
    shapes = {
        "a2": ((12, 16), "bfloat16"),
        "b3": ((4, 16, 24), "bfloat16"),
        "a3": ((4, 3, 16), "bfloat16"),
        "b2": ((16, 24), "bfloat16"),
        "offs": ((4,), "int32"),
    }
    rows = node("rows", "aten._grouped_mm.default", ("a2", "b3", "offs"), (12, 24), "bfloat16")
    batched = node("bmm", "aten._grouped_mm.default", ("a3", "b3"), (4, 3, 24), "bfloat16")
    cols = node("cols", "aten._grouped_mm.default", ("a3", "b2", "offs"), (3, 24), "bfloat16")
    k_split = node("k", "aten._grouped_mm.default", ("a2", "b2", "offs"), (4, 12, 24), "bfloat16")
    fallback = node("fb", "transformers.grouped_mm_fallback.default", ("a2", "b3", "offs"), (12, 24), "bfloat16")
    graph = tiny_graph(rows, batched, cols, k_split, fallback, placeholders=shapes)
    assert [node_flops(graph, n) for n in (rows, batched, cols, k_split, fallback)] == [
        2 * 12 * 16 * 24,
        2 * 4 * 3 * 16 * 24,
        2 * 3 * 16 * 24,
        2 * 12 * 16 * 24,
        2 * 12 * 16 * 24,
    ]


def test_reductions_count_input_elements():
    total = node("s", "aten.sum.dim_IntList", ("x",), (4,))
    graph = tiny_graph(total)
    assert node_flops(graph, total) == 4 * 8
    assert node_bytes(graph, total) == (4 * 4 * 8, 4 * 4)


def test_conditional_aliases():
    same = node("to", "aten.to.dtype", ("x",), (4, 8), "float32")
    cast = node("to_1", "aten.to.dtype", ("x",), (4, 8), "bfloat16")
    off = node("drop", "aten.dropout.default", ("x",), (4, 8), p=0.0, train=True)
    on = node("drop_1", "aten.dropout.default", ("x",), (4, 8), p=0.1, train=True)
    graph = tiny_graph(same, cast, off, on)
    assert [is_alias(graph, n) for n in (same, cast, off, on)] == [True, False, True, False]
    assert node_bytes(graph, cast) == (4 * 32, 2 * 32)


def test_creation_reads_nothing_and_inplace_ops_use_their_table():
    ones = node("ones", "aten.ones.default", (), (4, 8))
    add_ = node("add_", "aten.add_.Tensor", ("x", "x"), (4, 8))
    annotate(tiny_graph(ones, add_))
    assert (ones.flops, ones.bytes_read, ones.bytes_written) == (0, 0, 4 * 32)
    assert add_.flops == 32 and add_.bytes_read == 4 * 32  # x read once


def test_unknown_ops_are_charged_for_memory_only():
    odd = node("odd", "mylib.frobnicate.default", ("x",), (4, 8))
    annotate(tiny_graph(odd))
    assert (odd.flops, odd.bytes_read, odd.bytes_written) == (0, 128, 128)


def test_tensor_bytes():
    assert tensor_bytes((2, 3), "bfloat16") == 12
    assert tensor_bytes((), "float32") == 4
    assert tensor_bytes((5,), "") == 0
    assert math.prod((2, 3)) * 8 == tensor_bytes((2, 3), "int64")


# ---------------------------------------------------------------------------- formulas that fail


class _AddmmBaddbmm(nn.Module):
    """addmm and baddbmm called with keyword-only beta and alpha (2·M·N·K each)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 12))
        self.b = nn.Parameter(torch.randn(12))

    def forward(self, x):
        y = torch.addmm(self.b, x.view(-1, 16), self.w, beta=0.5, alpha=2.0)  # [8, 12]
        z = y.view(2, 4, 12)
        return torch.baddbmm(z.new_zeros(2, 4, 4), z, z.transpose(1, 2), beta=0.0, alpha=3.0)


def _kw_graph():
    return capture_module(_AddmmBaddbmm(), (torch.randn(2, 4, 16),))


def _raise(*args, **kwargs):
    raise TypeError("formula failed")


def test_addmm_and_baddbmm_with_beta_and_alpha_are_counted_exactly():
    from autoshard.passes.capturing.annotate import ESTIMATED

    graph = annotate(_kw_graph())
    addmm = next(n for n in graph.nodes if n.target == "aten.addmm.default")
    baddbmm = next(n for n in graph.nodes if n.target == "aten.baddbmm.default")
    assert addmm.flops == 2 * 8 * 12 * 16
    assert baddbmm.flops == 2 * 2 * 4 * 4 * 12
    assert not any(n.attrs.get(ESTIMATED) for n in graph.nodes)


def test_a_formula_that_raises_gives_an_estimate_not_a_traceback(monkeypatch):
    import torch.utils.flop_counter as flop_counter

    from autoshard.passes.capturing.annotate import ESTIMATED, estimated_ops

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, _raise)
    graph = annotate(_kw_graph())
    (addmm,) = estimated_ops(graph)
    assert addmm.target == "aten.addmm.default" and addmm.attrs[ESTIMATED] is True
    last_dims = [graph.value_meta(name)[0][-1] for name in addmm.inputs]
    assert addmm.flops == 2 * addmm.output_numel * max(last_dims) >= 2 * 8 * 12 * 16  # a bound for matmuls
    assert (addmm.bytes_read, addmm.bytes_written) == node_bytes(graph, addmm)
    baddbmm = next(n for n in graph.nodes if n.target == "aten.baddbmm.default")
    assert baddbmm.flops == 2 * 2 * 4 * 4 * 12 and ESTIMATED not in baddbmm.attrs  # the others keep theirs


KW_MODEL = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0).relu()


def build():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), torch.randn(batch_size, 16)
"""


def test_a_plan_reports_and_inspect_shows_the_estimated_ops(tmp_path, monkeypatch, capsys):
    import torch.utils.flop_counter as flop_counter

    from autoshard.cli import main
    from autoshard.cost.hardware import load_cluster
    from autoshard.ir.plan import load_plan
    from autoshard.pipeline import PlanRequest, plan_model

    (tmp_path / "kw.py").write_text(KW_MODEL)
    cluster = load_cluster("local-cpu", devices_per_node=2)
    exact = plan_model(PlanRequest(f"{tmp_path}/kw.py:build", cluster, 8, cache=False))
    assert "ops_estimated" not in exact.model
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, _raise)
    plan = plan_model(PlanRequest(f"{tmp_path}/kw.py:build", cluster, 8, cache=False))
    assert plan.model["ops_estimated"] == {"count": 1, "ops": ["aten.addmm.default"]}
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").to_json() == plan.to_json()
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "plan.json")]) == 0
    shown = capsys.readouterr().out
    assert "1 op costed by an estimate" in shown and "aten.addmm.default" in shown
    exact.save(tmp_path / "exact.json")
    assert main(["inspect", str(tmp_path / "exact.json")]) == 0
    assert "estimate" not in capsys.readouterr().out


def test_a_plan_file_with_a_malformed_ops_estimated_is_refused_in_one_line(tmp_path):
    import json

    from autoshard.cost.hardware import load_cluster
    from autoshard.errors import AutoshardError
    from autoshard.ir.plan import load_plan
    from autoshard.pipeline import PlanRequest, plan_model

    (tmp_path / "kw.py").write_text(KW_MODEL)
    plan = plan_model(
        PlanRequest(f"{tmp_path}/kw.py:build", load_cluster("local-cpu", devices_per_node=2), 8, cache=False)
    )
    d = json.loads(plan.to_json())
    d["model"]["ops_estimated"] = {"count": 0, "ops": []}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(AutoshardError, match="model.ops_estimated.count"):
        load_plan(tmp_path / "bad.json")
