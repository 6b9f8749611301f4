"""ZeRO model-state memory: the worked examples in docs/reference-numbers.md and monotonicity."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.cost.memory import FP32, MEGATRON_MIXED, model_state_bytes

ROOT = Path(__file__).resolve().parents[1]

GB = 1e9


def state_gb(params, stage, dp):
    return sum(model_state_bytes(params, stage, dp, MEGATRON_MIXED)) / GB


def test_zero1_7_5b_on_64_ranks_is_31_4_gb():
    assert state_gb(7.5e9, 1, 64) == pytest.approx(31.4, abs=0.05)


def test_12b_on_8_ranks_dp_192_gb_zero3_24_gb():
    assert state_gb(12e9, 0, 8) == pytest.approx(192.0)
    assert state_gb(12e9, 3, 8) == pytest.approx(24.0)


def test_zero2_is_2_plus_14_over_n():
    psi, n = 1e9, 16
    assert state_gb(psi, 2, n) == pytest.approx((2 * psi + 14 * psi / n) / GB)


@given(params=st.integers(1, 10**12), dp=st.integers(1, 4096), stage=st.integers(0, 2))
def test_memory_never_rises_with_stage_or_dp(params, dp, stage):
    for precision in (MEGATRON_MIXED, FP32):
        here = sum(model_state_bytes(params, stage, dp, precision))
        assert sum(model_state_bytes(params, stage + 1, dp, precision)) <= here
        assert sum(model_state_bytes(params, stage, dp + 1, precision)) <= here


# ---------------------------------------------------------------------------- saved tensors, op by op


def _llama_tiny():
    from autoshard.pipeline import capture_graph

    return capture_graph(str(ROOT / "benchmarks" / "llama3.py") + ":llama3_tiny", use_cache=True, proofs=False)[1]


def test_a_block_keeps_what_its_ops_backward_formulas_read_not_every_output():
    """Llama's block at bf16 (ratio 2/4): the two norms' fp32 upcast and x·rstd (8 B each), the norms'
    bf16 outputs (read by the projections), q after rotary, k and v repeated, attention's output and
    log-sum-exp, w1's and w3's outputs, silu's and the product: not the projections' q/k/v outputs, the
    rotary intermediates or the residual sums (no backward formula reads them)."""
    from autoshard.cost.memory import block_saved_bytes

    graph = _llama_tiny()
    block, b, s, d, ffn, heads = graph.blocks[0], graph.batch_size, 128, 256, 512, 4
    tokens = b * s
    bf16 = 2
    expected = (
        2 * (tokens * d * (4 + 4 + bf16) + tokens * 4)  # norms: upcast, x·rstd, output, rstd
        + 3 * tokens * d * bf16
        + tokens * d * bf16
        + b * heads * s * 4  # q, k, v, attention out, lse
        + 4 * tokens * ffn * bf16
    )  # w1, w3, silu, the product
    assert block_saved_bytes(graph, block, "none", ratio=0.5) == expected


def test_selective_keeps_the_runtime_policys_outputs_and_full_the_block_input():
    """selective: the block input and the outputs of the ops ``runtime.selective`` saves (matmuls,
    attention and its log-sum-exp); full: the block input; the recompute workspace is what the block keeps
    without recompute less what selective kept."""
    from autoshard.cost.memory import block_saved_bytes, block_workspace_bytes

    graph = _llama_tiny()
    block, b, s, d, ffn, kv = graph.blocks[0], graph.batch_size, 128, 256, 512, 128
    tokens = b * s
    matmuls = tokens * (d + 2 * kv + d + 2 * ffn + d) * 2  # wq, wk, wv, wo, w1, w3, w2 at bf16
    attention = tokens * d * 2 + b * 4 * s * 4
    assert block_saved_bytes(graph, block, "full", 0.5) == tokens * d * 2
    assert block_saved_bytes(graph, block, "selective", 0.5) == tokens * d * 2 + matmuls + attention
    none = block_saved_bytes(graph, block, "none", 0.5)
    assert block_workspace_bytes(graph, block, "full", 0.5) == none
    assert block_workspace_bytes(graph, block, "selective", 0.5) < none


def test_the_peak_is_the_largest_moment_and_the_loss_workspace_is_transient():
    """ZeRO-3 over 8 with one micro-batch: at the loss's backward no gradient exists yet (zero_grad sets
    them to None) and the loss's two fp32 gradients (8 bytes per logit) are transient, not activations;
    the plan's parts are those of its largest moment."""
    from autoshard.cost.hardware import load_cluster
    from autoshard.cost.rank_memory import memory_spmd, spmd_moments
    from autoshard.cost.tables import CostTables
    from autoshard.ir.decisions import Decisions, Mesh

    graph = _llama_tiny()
    tables = CostTables(graph, load_cluster("dgx-h100"))
    config = Decisions(Mesh(8, 1, 1), 3, 1, 1)
    local = graph.param_count
    state = (local * 4 // 8, local * 4 // 8, local * 8 // 8)
    moments = spmd_moments(tables, config, local, state)
    logits = 128 * 1024
    assert moments["loss"]["grads_bytes"] == 0
    assert moments["loss"]["transient_bytes"] == 8 * logits
    memory = memory_spmd(tables, config, local)
    worst = max(moments.values(), key=lambda parts: sum(parts.values()))
    assert memory.activations_bytes == int(worst["activations_bytes"])
    assert memory.transient_bytes == int(worst["transient_bytes"])


def test_fsdp2_gathers_weights_in_the_policys_bf16():
    """ZeRO-1 beside tp keeps every unit gathered from forward to backward, in bf16 (2 B per parameter),
    beside the fp32 shard."""
    from autoshard.cost.hardware import load_cluster
    from autoshard.cost.rank_memory import gathered_param_bytes, keeps_gathered
    from autoshard.cost.tables import CostTables
    from autoshard.ir.decisions import Decisions, Mesh

    graph = _llama_tiny()
    assert gathered_param_bytes(CostTables(graph, load_cluster("dgx-h100"))) == 2
    assert gathered_param_bytes(CostTables(graph, load_cluster("local-cpu"))) == 4
    assert keeps_gathered(Decisions(Mesh(4, 2, 1), 1, 1, 2))
    assert not keeps_gathered(Decisions(Mesh(4, 2, 1), 3, 1, 2))


# ---------------------------------------------------------------------------- a tensor-parallel rank's shapes


def _tp_styles(sequence_parallel: bool) -> dict[str, str]:
    """Megatron's layout of llama3_tiny over tp ranks: q, k, v, w1, w3 column-parallel, wo and w2 row-parallel;
    with sequence parallelism the norms on 1/tp of the tokens and each attention and MLP gathering its input."""
    styles = {}
    for k in range(2):
        p = f"layers.{k}"
        styles |= {f"{p}.attention.{w}": "colwise" for w in ("wq", "wk", "wv")}
        styles |= {f"{p}.feed_forward.{w}": "colwise" for w in ("w1", "w3")}
        row = "rowwise-seq-output-dim1" if sequence_parallel else "rowwise"
        styles |= {f"{p}.attention.wo": row, f"{p}.feed_forward.w2": row}
        if sequence_parallel:
            styles |= {
                f"{p}.attention_norm": "sharded-input-dim1",
                f"{p}.ffn_norm": "sharded-input-dim1",
                f"{p}.attention": "gather-seq-module-input-dim1",
                f"{p}.feed_forward": "gather-seq-module-input-dim1",
            }
    if sequence_parallel:
        styles |= {
            "tok_embeddings": "vocab-parallel-embedding-seq-output-dim1",
            "norm": "sharded-input-dim1",
            "output": "colwise-gather-seq-input-dim1",
        }
    return styles


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tp_rank_keeps_its_shards_of_what_the_ops_keep(sequence_parallel):
    """tp = 2, bf16: q, k, v, attention's output and log-sum-exp, w1, w3, silu and the product are split (half);
    the two norm outputs the column-parallel linears read are kept whole (gathered once per module under
    sequence parallelism); the norms' fp32 upcast, x·rstd and rstd are whole without sequence parallelism and
    half with it, and so is the block input full recompute keeps."""
    from autoshard.cost.memory import block_saved_bytes
    from autoshard.cost.tp import _rank_share

    graph = _llama_tiny()
    block, b, s, d, ffn, heads, tp = graph.blocks[0], graph.batch_size, 128, 256, 512, 4, 2
    tokens = b * s
    share = _rank_share(graph, _tp_styles(sequence_parallel), tp)
    norms = 2 * (tokens * d * (4 + 4) + tokens * 4) // (tp if sequence_parallel else 1)
    split = (3 * tokens * d * 2 + tokens * d * 2 + b * heads * s * 4 + 4 * tokens * ffn * 2) // tp
    assert block_saved_bytes(graph, block, "none", 0.5, share) == norms + 2 * tokens * d * 2 + split
    block_input = tokens * d * 2 // (tp if sequence_parallel else 1)
    assert block_saved_bytes(graph, block, "full", 0.5, share) == block_input


def test_a_gathered_input_is_one_copy_per_gathering_module_or_per_linear():
    """The matmuls reading a split value through a module's gather share one whole copy (``value:gathered``);
    a linear gathering its own input (``colwise-gather-seq-input``) keeps its own; a row-parallel one never
    gathers."""
    from autoshard.cost.saved import RankShare

    graph = _llama_tiny()
    node = graph.nodes[0]
    share = RankShare(2, frozenset({"x", "y"}), frozenset({"op"}), frozenset({node.name}), frozenset())
    assert share.entry(graph, node, "x", 100) == ("x:gathered", 100)
    assert share.entry(graph, node, "z", 100) == ("z", 100)
    own = RankShare(2, frozenset({"x"}), frozenset(), frozenset({node.name}), frozenset({node.name}))
    assert own.entry(graph, node, "x", 100) == (f"{node.name}:gathered", 100)
    other = graph.nodes[1]
    assert share.entry(graph, other, "y", 100) == ("y", 50)
    assert share.entry(graph, other, "op:lse", 100) == ("op:lse", 50)
    assert share.entry(graph, other, "op:ids", 100) == ("op:ids", 100)


def test_fsdp2_shards_weights_at_every_stage_and_zero1_sums_gradients_whole_in_fp32():
    """fully_shard holds every parameter as its dp shard (ZeRO-1 beside tp too: what it keeps between forward
    and backward is the bf16 copy); ZeRO-1 sums the gradients whole in fp32 until the last micro-batch and
    holds its shard after the reduce; ZeRO-3 holds its synchronised shard between micro-batches."""
    from autoshard.cost.memory import BF16_AUTOCAST
    from autoshard.cost.rank_memory import accumulated_grad_bytes, rank_state_bytes
    from autoshard.ir.decisions import Decisions, Mesh

    psi = 1_000_000
    zero1 = Decisions(Mesh(4, 2, 1), 1, 1, 2)
    assert rank_state_bytes(BF16_AUTOCAST, zero1, psi, 4) == (psi, psi, 2 * psi)
    assert accumulated_grad_bytes(BF16_AUTOCAST, zero1, psi, psi) == 4 * psi
    zero3 = Decisions(Mesh(4, 2, 1), 3, 1, 2)
    assert rank_state_bytes(BF16_AUTOCAST, zero3, psi, 4) == (psi, psi, 2 * psi)
    assert accumulated_grad_bytes(BF16_AUTOCAST, zero3, psi, psi) == psi
    assert accumulated_grad_bytes(BF16_AUTOCAST, Decisions(Mesh(4, 2, 1), 1, 1, 1), psi, psi) == 0
    ddp = Decisions(Mesh(8, 1, 1), 0, 1, 2)
    assert rank_state_bytes(BF16_AUTOCAST, ddp, psi, 8) == (4 * psi, 4 * psi, 8 * psi)
