"""Sequence parallelism is a layout of the TP model (passes/layouts/sequence.py, layout Q), proven on the model's code
(passes/capturing/tp_proof): which modules gather, reduce-scatter and run on sequence shards, what it costs, and where it
is refused. No processes: tests/e2e/test_sequence_parallel.py trains the same choices on gloo ranks."""

import ast
import textwrap

import pytest

from autoshard.cost.comm import allreduce_s
from autoshard.ir.decisions import TP_STYLES
from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.allowed import SP_REFUSED
from autoshard.passes.layouts.boundary import sp_boundary
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph

SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")  # compute-bound: TP pays
FAST_LINK = LinkSpec(100.0, 0.0, "test")


@pytest.fixture(scope="module")
def gpt_graph(in_repo_module):
    return capture_graph("examples/gpt.py:build")[1]


@pytest.fixture(scope="module")
def llama_graph(in_repo_module):
    return capture_graph("tests/models/hf_llama.py:build")[1]


def choices(graph, tp=2):
    """(without, with) sequence parallelism."""
    return (
        choose_tp_styles(graph, tp, FAST_LINK, SLOW_DEVICE),
        choose_tp_styles(graph, tp, FAST_LINK, SLOW_DEVICE, sequence_parallel=True),
    )


def test_gpt_layers_reduce_scatter_gather_and_norms_run_on_sequence_shards(gpt_graph):
    plain, sp = choices(gpt_graph)
    assert sp.sequence_parallel and not plain.sequence_parallel
    for i in range(4):
        b = f"h.{i}"
        # attention reads its input's whole shape (b, s, _ = x.shape): gathered once at its input, as a DTensor
        assert sp.styles[f"{b}.attn"] == sp.styles[f"{b}.mlp"] == "gather-seq-module-input-dim1"
        assert all(sp.styles[f"{b}.attn.{m}"] == "colwise" for m in ("q_proj", "k_proj", "v_proj"))
        assert sp.styles[f"{b}.mlp.c_fc"] == "colwise"
        # the row linears reduce-scatter over the sequence (dim 1 of (b, s, h)) instead of all-reducing
        assert sp.styles[f"{b}.attn.c_proj"] == sp.styles[f"{b}.mlp.c_proj"] == "rowwise-seq-output-dim1"
        # the norms run on 1/tp of the tokens, their replicated weights' gradients summed over tp
        assert sp.styles[f"{b}.ln_1"] == sp.styles[f"{b}.ln_2"] == "sharded-input-dim1"
    # wte + wpe is replicated: sliced at the first block's input; the head gathers the tokens back
    assert sp.styles["h.0"] == "scatter-seq-input-dim1" and "h.1" not in sp.styles
    assert sp.styles["ln_f"] == "sharded-input-dim1" and sp.styles["lm_head"] == "colwise-gather-seq-input-dim1"
    assert plain.styles["wte"] == sp.styles["wte"] == "replicate"


def test_gpt_collectives_are_megatrons_all_reduces_split_in_two(gpt_graph):
    """Per block, S = the (2, 64, 64) fp32 residual: sequence parallelism runs Megatron's 4 all-reduces (forward g
    after each row linear, backward f before each col module) as a reduce-scatter plus an all-gather each: the same
    bytes per rank and the same α-β time. Without it DTensor all-reduces the input gradient of q, k and v
    separately (6 all-reduces); with it they add up as a DTensor and are reduce-scattered once."""
    plain, sp = choices(gpt_graph)
    size = 2 * 64 * 64 * 4
    block_plain, block_sp = plain.segments[0], sp.segments[0]
    assert block_plain.comm_bytes == 6 * size and block_sp.comm_bytes == 8 * size  # Σ S: 6 AR; 4 RS + 4 AG
    ring = allreduce_s(size, 2, FAST_LINK)
    assert block_sp.comm_s == pytest.approx(4 * ring, rel=1e-12)
    assert block_plain.comm_s == pytest.approx(block_sp.comm_s + 2 * ring, rel=1e-12)
    wire = lambda all_reduces, halves, p=2: (all_reduces * 2 + halves) * (p - 1) / p * size  # noqa: E731
    assert wire(0, 8) == wire(4, 0)  # bytes each rank sends: 8 half rings = 4 ring all-reduces


def test_llama_rotary_embeddings_stay_replicated(llama_graph):
    """cos / sin are computed outside the blocks from positions of the whole sequence and meet q and k after the
    gather: they enter every layer replicated. The embedding cannot reduce-scatter: LlamaModel computes
    ``arange(inputs_embeds.shape[1])``, so a sequence shard of the embedding makes the positions wrong; the proof
    refuses it and the embedding is sliced at the first layer's input instead."""
    plain, sp = choices(llama_graph)
    assert sp.sequence_parallel
    refused = llama_graph.tp_proofs["2sp"]
    assert "model.rotary_emb" in refused["embedding:vocabq"]
    boundary = sp_boundary(llama_graph, 2)
    rotary = [n.name for n in llama_graph.nodes if n.module_path == "model.rotary_emb" and n.shape]
    assert rotary and not any(boundary.layout(name) == "Q" for name in rotary)
    assert boundary.layout("embedding") == "Q" and sp.styles["model.layers.0"] == "scatter-seq-input-dim1"
    for i in range(2):
        b = f"model.layers.{i}"
        assert sp.styles[f"{b}.self_attn"] == sp.styles[f"{b}.mlp"] == "gather-seq-module-input-dim1"
        assert sp.styles[f"{b}.self_attn.o_proj"] == sp.styles[f"{b}.mlp.down_proj"] == "rowwise-seq-output-dim1"
        assert sp.styles[f"{b}.input_layernorm"] == sp.styles[f"{b}.post_attention_layernorm"] == "sharded-input-dim1"
    # per block (S = 2·32·64·4 bytes): 7 all-reduces without (q, k, v, gate, up input gradients one each), the
    # 4 of Megatron with, as reduce-scatter + all-gather pairs
    size, ring = 2 * 32 * 64 * 4, allreduce_s(2 * 32 * 64 * 4, 2, FAST_LINK)
    assert plain.segments[0].comm_bytes == 7 * size and sp.segments[0].comm_bytes == 8 * size
    assert sp.segments[0].comm_s == pytest.approx(4 * ring, rel=1e-12)


def test_sequence_parallel_keeps_block_activations_smaller(gpt_graph):
    """Per GPT block, in units of s·b·h: 18 unsharded (ln 1+1, q k v 3, sdpa 1, c_fc 4, gelu 4, two row outputs
    and two residuals 4). Megatron without SP keeps 12 per rank (the S values halved); with SP the norms,
    residuals and row outputs are halved too (9), plus the whole input each gathering module keeps for its
    backward (attention and MLP: 2)."""
    plain, sp = choices(gpt_graph)
    assert plain.block_activation_fraction == pytest.approx(12 / 18)
    assert sp.block_activation_fraction == pytest.approx(11 / 18)


def test_default_is_todays_layout(gpt_graph):
    plain, sp = choices(gpt_graph)
    assert not plain.sequence_parallel
    assert not any("seq" in s or s.startswith("sharded-input") for s in plain.styles.values())
    assert [s.comm_bytes for s in plain.segments] == [6 * 2 * 64 * 64 * 4, plain.segments[1].comm_bytes]
    assert choose_tp_styles(gpt_graph, 1, FAST_LINK, SLOW_DEVICE, sequence_parallel=True).sharded == {}


def test_not_a_token_model_is_refused(in_repo):
    graph = capture_graph("tests/models/mlp.py:build")[1]
    plain, sp = choices(graph)
    assert "not a token model" in graph.tp_proofs["2sp"][SP_REFUSED]
    assert not sp.sequence_parallel and sp.styles == plain.styles


MODEL = """
import sys
from pathlib import Path
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, {examples!r})
import gpt

SEQ, WIDTH = 16, 32


class Block(nn.Module):
    def __init__(self, constant: bool, table: bool):
        super().__init__()
        self.constant, self.ln = constant, nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH)) if table else None

    def forward(self, x):
        if self.constant:  # the sequence length written as a constant: wrong on 1/tp of the tokens
            x = x.view(x.shape[0], SEQ, -1)
        if self.pos is not None:  # a learned table over the positions, added inside the block
            x = x + self.pos
        return x + self.down(F.gelu(self.up(self.ln(x))))


class LM(nn.Module):
    def __init__(self, constant=False, table=False):
        super().__init__()
        self.wte = nn.Embedding(64, WIDTH)
        self.h = nn.ModuleList(Block(constant, table) for _ in range(2))
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def build():
    return LM()


def build_constant():
    return LM(constant=True)


def build_table():
    return LM(table=True)


def example_batch(batch_size):
    return gpt.example_batch(batch_size, seq_len=SEQ, vocab_size=64)
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, in_repo_module):
    path = tmp_path_factory.mktemp("sp_models") / "sp_models.py"
    path.write_text(textwrap.dedent(MODEL.format(examples=str(in_repo_module / "examples"))))
    return str(path)


def test_a_plain_block_runs_sequence_parallel(model_file):
    _, sp = choices(capture_graph(f"{model_file}:build")[1])
    assert sp.sequence_parallel
    assert sp.styles["h.0.down"] == "rowwise-seq-output-dim1" and sp.styles["h.0.ln"] == "sharded-input-dim1"


def test_a_constant_sequence_length_is_refused_by_the_proof(model_file):
    """view(b, SEQ, -1) keeps the shape on the whole model, so the graph alone allows it on a sequence shard; the
    model's code run on a shard gives (b, SEQ, width / tp), on which the norm after it fails: the view's sequence
    rule is refused (the norm's input, arriving wrong, names its producer), and with it every sequence shard of
    the blocks."""
    graph = capture_graph(f"{model_file}:build_constant")[1]
    plain, sp = choices(graph)
    refused = graph.tp_proofs["2sp"]
    assert "in h.0.ln" in refused["view:seq"] and "[2, 16, 16]" in refused["view:seq"]
    assert SP_REFUSED in refused
    assert not sp.sequence_parallel and sp.styles == plain.styles
    assert plain.styles["h.0.up"] == "colwise" and plain.styles["h.0.down"] == "rowwise"


def test_a_position_table_inside_the_blocks_keeps_them_replicated(model_file):
    """x + pos with pos a (SEQ, width) parameter: each token needs its own row of the table, which a sequence shard
    does not select; the planner gives the add no sequence rule, so no block can take a sequence shard."""
    plain, sp = choices(capture_graph(f"{model_file}:build_table")[1])
    assert not sp.sequence_parallel and sp.styles == plain.styles


def test_every_style_is_printable_python():
    """Emitted programs print each style's constructor (``TPStyle.source``) in a comment next to its name; the
    runtime builds the same row."""
    from autoshard.runtime.tensor_parallel import parallel_style

    for name, row in TP_STYLES.items():
        ast.parse(row.source)
        assert parallel_style(name) is not None, name


def test_partial_gradients_are_settled_once_in_one_all_reduce(one_rank, monkeypatch):
    """Gradients DTensor leaves Partial (sequence parallelism's norms) become Replicate after the step's
    backward, summed in one all-reduce per mesh dimension and dtype (train_step.settle_partial_grads), so the
    optimizer's ops no longer redistribute each of them again; sharded and plain gradients are left alone."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autoshard.runtime import train_step

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.ModuleDict(
        {"norm": torch.nn.LayerNorm(4), "proj": torch.nn.Linear(4, 2), "plain": torch.nn.Linear(2, 2)}
    )
    for name in ("norm", "proj"):
        for pname, p in list(model[name].named_parameters()):
            placement = Replicate() if name == "norm" else Shard(0)
            setattr(model[name], pname, torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [placement])))
    grads = {n: torch.randn_like(p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if n.startswith("norm"):
            p.grad = DTensor.from_local(grads[n], mesh, [Partial()], run_check=False)
        elif n.startswith("proj"):
            p.grad = DTensor.from_local(grads[n], mesh, [Shard(0)], run_check=False)
        else:
            p.grad = grads[n].clone()
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k))
    assert train_step.settle_partial_grads(model) == 2
    assert calls == [4 + 4]  # the norm's weight and bias in one bucket
    for n, p in model.named_parameters():
        g = p.grad
        if n.startswith("norm"):
            assert g.placements == (Replicate(),) and torch.equal(g.to_local(), grads[n])
        elif n.startswith("proj"):
            assert g.placements == (Shard(0),) and torch.equal(g.to_local(), grads[n])
        else:
            assert torch.equal(g, grads[n])
    assert train_step.settle_partial_grads(model) == 0  # nothing left Partial


def test_tp_figures_read_from_memo_are_the_walks(gpt_graph):
    """The shard flow and parameters per TP rank are kept once per set of styles (``cost.tp``): equal to a fresh walk
    of the graph, whichever object holds the styles; a module's gathering holders found by lookup are the modules a
    prefix test finds; equal styles give one memo key object (lookups compare by identity)."""
    from dataclasses import replace

    from autoshard.cost import tp as tp_cost

    plain, sp = choices(gpt_graph)
    gathered = dict(sp.styles, **{"h.1.mlp": "gather-seq-input-dim1"})  # a module gathering its input's tokens
    for styles in (plain.styles, sp.styles, gathered):
        copy = dict(styles)
        assert tp_cost.shard_flow(gpt_graph, copy) == tp_cost._shard_flow(gpt_graph, styles)
        assert tp_cost.shard_flow(gpt_graph, styles) is tp_cost.shard_flow(gpt_graph, copy)
        sharded = {m: s for m, s in styles.items() if s != "replicate"}
        by_block = tp_cost.local_params_by_block(gpt_graph, sharded, 2)
        assert by_block == tp_cost._local_params_by_block(gpt_graph, sharded, 2)
        by_block.clear()  # the caller's copy
        assert tp_cost.local_params_by_block(gpt_graph, sharded, 2) == tp_cost._local_params_by_block(
            gpt_graph, sharded, 2
        )
    assert tp_cost.shard_flow(gpt_graph, gathered) != tp_cost.shard_flow(gpt_graph, sp.styles)
    for node in gpt_graph.nodes:
        holders = set(tp_cost.module_and_holders(node.module_path))
        for p in gathered:
            assert (p in holders) == (node.module_path == p or node.module_path.startswith(p + "."))
    assert tp_cost.styles_key(replace(sp, styles=dict(sp.styles))) is tp_cost.styles_key(sp)
