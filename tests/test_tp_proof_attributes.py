"""The TP proof's stood-in modules keep what tensor parallelism keeps (passes/capturing/tp_proof, step 2): attributes and
parameters of the whole module, as ``parallelize_module`` leaves them. Reads that are the same on a shard keep the
layout (Llama-4's ``embed_tokens.weight.device``, Whisper's ``embed_positions.num_embeddings``, Mamba's
``x_proj.weight`` handed to a kernel wrapper); a size read or a computation with a sharded weight outside its
module is refused, naming the model's own line."""

from pathlib import Path

import pytest

from autoshard.passes.capturing.tp_proof import UNEXERCISED
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph
from tests.test_tp_proof import ATTN, FAST_LINK, SLOW_DEVICE

CASES = "tests/models/tp_attribute_cases.py"


def refusals(graph, tp: int = 2) -> dict[str, str]:
    """The proof's refusals at degree tp, less the rules the widest layout did not use."""
    return {k: v for k, v in graph.tp_proofs[str(tp)].items() if not v.startswith(UNEXERCISED)}


def line_of(code: str) -> str:
    """ "tests/models/tp_attribute_cases.py:N" of the line holding ``code``."""
    lines = Path(CASES).read_text().splitlines()
    return f"{CASES}:{next(i for i, line in enumerate(lines, 1) if code in line)}"


@pytest.fixture(scope="module")
def kept(in_repo_module):
    graph = capture_graph(f"{CASES}:build_reads_kept")[1]
    return graph, choose_tp_styles(graph, 2, FAST_LINK, SLOW_DEVICE)


@pytest.fixture(scope="module")
def refused(in_repo_module):
    graph = capture_graph(f"{CASES}:build_reads_refused")[1]
    return graph, choose_tp_styles(graph, 2, FAST_LINK, SLOW_DEVICE)


@pytest.mark.parametrize("tp", [2, 4])
def test_reads_a_shard_gives_as_the_whole_keep_the_layout(kept, tp):
    """``wte.weight.device`` / ``.dtype``, ``arange(wpe.num_embeddings)`` and the weights handed to a kernel
    wrapper that returns None: nothing refused, every block shards as the plain model does."""
    graph, _ = kept
    assert refusals(graph, tp) == {}
    choice = choose_tp_styles(graph, tp, FAST_LINK, SLOW_DEVICE)
    assert not any("_ShardStandIn" in r or "AttributeError" in r for r in choice.reasons.values())
    for i in range(2):
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN)
        assert choice.styles[f"h.{i}.attn.o_proj"] == "rowwise"
        assert choice.styles[f"h.{i}.up"] == "colwise" and choice.styles[f"h.{i}.down"] == "rowwise"


def test_a_size_read_of_a_sharded_weight_is_refused_at_its_line(refused):
    """``self.up.weight.shape[0]``: the whole weight's under DTensor, a slice in pipeline stages; ``up`` stays
    replicated with the model's line as its reason, attention still shards."""
    graph, choice = refused
    where = line_of("y = y.view(*y.shape[:-1], self.up.weight.shape[0]")
    for i in range(2):
        assert choice.styles[f"h.{i}.up"] == "replicate"
        assert choice.reasons[f"h.{i}.up"].startswith(f"{where} (`y = y.view(")
        assert "reads h.0.up.weight.shape outside h.0.up, which tp=2 shards" in choice.reasons[f"h.{i}.up"]
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN)
    assert not any("_ShardStandIn" in r for r in graph.tp_proofs["2"].values())


def test_computing_with_a_sharded_weight_outside_its_module_is_refused_at_its_line(refused):
    """``F.linear(x, self.wte.weight)`` would meet a DTensor (or one rank's rows) at run time: the embedding is
    refused with the line and the op, not a vocab-parallel shard."""
    graph, choice = refused
    reason = refusals(graph)["embedding"]
    where = line_of("return F.linear(self.ln_f(x), self.wte.weight)")
    assert reason.startswith(f"{where} (`return F.linear(")
    assert "computes linear on wte.weight outside wte, which tp=2 shards" in reason
    assert choice.styles["wte"] == "replicate" and choice.reasons["wte"] == reason


def test_whisper_encoder_positions_by_num_embeddings(in_repo):
    """transformers' WhisperEncoder: ``arange(self.embed_positions.num_embeddings)`` on the stood-in table (its
    attention is refused for its own reason: ``view(b, -1, self.num_heads, head_dim)`` on k and v)."""
    graph = capture_graph("tests/models/hf_whisper_encoder.py:build")[1]
    reasons = refusals(graph)
    assert not any("_ShardStandIn" in r or "AttributeError" in r for r in reasons.values())
    assert not any(graph.node(n).module_path.startswith("encoder.layers.0.fc") for n in reasons)
    embedding = next(n for n in graph.nodes if n.module_path == "encoder.embed_positions")
    assert embedding.name not in graph.tp_proofs["2"]


def test_mamba_weights_handed_to_its_kernel_wrapper(in_repo):
    """transformers' MambaMixer hands x_proj / dt_proj / out_proj weights to ``mamba_inner_fn``, which returns
    None without its kernel: the mixer's projections keep their shards."""
    graph = capture_graph("tests/models/hf_mamba.py:build")[1]
    assert refusals(graph) == {}
    choice = choose_tp_styles(graph, 2, FAST_LINK, SLOW_DEVICE)
    assert not any("_ShardStandIn" in r or "AttributeError" in r for r in choice.reasons.values())
