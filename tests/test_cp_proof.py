"""Context parallelism is proven on the model's own code (passes/capturing/cp_proof): what it computes on a rank's tokens."""

from dataclasses import replace

import pytest

import autoshard
from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.modelfile import load_model_file
from autoshard.passes.capturing.capture import capture
from autoshard.passes.capturing.capture_cache import decode_graph, encode_graph
from autoshard.passes.capturing.cp_proof import NO_SEQUENCE, prove_context_parallel
from autoshard.passes.capturing.front import CAPTURE_BATCH, capture_front
from autoshard.passes.planning.context_parallel import cp_refusal
from autoshard.passes.planning.pin_checks import check_graph_pins
from autoshard.passes.planning.strategies import Pins

CASES = "tests/models/cp_cases.py"


def proven(spec: str, seq_len: int | None = None):
    """capture (folded, as the front does) and the proof, without annotate and the TP proof."""
    model_file = load_model_file(spec, seq_len)
    return prove_context_parallel(model_file, capture(model_file, CAPTURE_BATCH, fold=True), prove=True)


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    done: list[str] = []
    _, graph = capture_front("examples/gpt.py:build", done, True, False, prove_cp=True)
    return graph, done


def test_the_front_proves_the_example_gpt_for_every_degree(gpt):
    graph, done = gpt
    # a 64-token model defers the proof in the capture; asked for (prove_cp), it runs last
    assert done[-1] == "cp_proof" and done.index("tp_proof") < done.index("cp_proof")
    assert graph.cp_proofs == {"*": "", "pipeline": ""}  # one symbolic export covers every s/cp >= 2
    assert all(cp_refusal(graph, cp) is None for cp in (2, 4, 8, 16))
    assert decode_graph(encode_graph(graph)).cp_proofs == graph.cp_proofs  # the capture cache keeps it


def test_a_capture_below_the_searched_length_defers_the_proof_and_refuses_every_cp(in_repo):
    """Below CP_SEARCH_MIN_TOKENS the search never offers cp, so the capture skips the symbolic export; cp is
    then refused with the fix (pin --cp), never assumed, and a request pinning cp gets the proof run."""
    from autoshard.passes.layouts.context_parallel import DEFERRED, proof_deferred

    _, graph = capture_front("examples/gpt.py:build", [], True, False)
    assert proof_deferred(graph) and graph.cp_proofs == {"*": DEFERRED}
    assert "fix: pin --cp N" in cp_refusal(graph, 2)
    plan = autoshard.plan(
        "examples/gpt.py:build", cluster="local-cpu", devices_per_node=2, global_batch=4, cp=2, cache=False
    )
    assert plan.mesh.cp == 2  # pinned: proven, then planned


def test_degrees_read_their_own_entry_then_the_default(gpt):
    graph, _ = gpt
    graph = replace(graph, cp_proofs={"*": "why not cp={cp}", "2": ""})
    assert cp_refusal(graph, 2) is None
    assert cp_refusal(graph, 4) == "why not cp=4"
    assert "the sequence length 64 is not a multiple of cp=3" == cp_refusal(graph, 3)
    ones = replace(graph, cp_proofs={"*": ""})
    assert cp_refusal(ones, 32) is None and "rank would hold 1 of the 64 tokens" in cp_refusal(ones, 64)
    assert cp_refusal(replace(graph, cp_proofs=None), 4) is None  # hand-built graphs: the graph checks alone


@pytest.mark.parametrize("spec", ["tests/models/hf_llama.py:build", "tests/models/hf_gpt2.py:build", f"{CASES}:build"])
def test_models_that_work_token_by_token_are_proven(in_repo, spec):
    """Llama's traced causal mask (aranges, a cumsum over position differences, index ops) only feeds SDPA's
    attn_mask and is exempt; its rotary angles, computed inside a no-grad wrapper, are checked op by op."""
    graph = proven(spec)
    assert graph.cp_proofs == {"*": "", "pipeline": ""}
    assert cp_refusal(graph, 2) is None and cp_refusal(graph, 4) is None


@pytest.mark.parametrize(
    "factory, reason",
    [
        ("build_mean_pool", "mean in the root reduces over the sequence (dim 1 of [2, t, 32])"),
        ("build_pooler", "select in the root takes some of the tokens (dim 1 of [2, t, 32])"),
        ("build_causal_conv", "conv1d in conv has a dim of t + 3 where the sequence has t tokens"),
        ("build_cumsum_positions", "cumsum in the root accumulates along the sequence (dim 1 of [2, t])"),
    ],
)
def test_ops_that_mix_tokens_are_refused_with_the_op(in_repo, factory, reason):
    graph = proven(f"{CASES}:{factory}")
    assert graph.cp_proofs == {"*": reason}
    assert cp_refusal(graph, 2) == reason and cp_refusal(graph, 8) == reason


def test_a_label_shift_inside_the_model_is_refused_at_each_degree(in_repo):
    """``logits[:, :-1]`` has t − 1 rows, which export specializes at t = 2: the symbolic export fails and
    each degree is checked on its own length."""
    graph = proven(f"{CASES}:build_label_shift")
    assert cp_refusal(graph, 2) == "slice in the root has a dim of 7 on 8 tokens and 15 on 16"
    assert cp_refusal(graph, 4) == "slice in the root has a dim of 3 on 4 tokens and 15 on 16"


def test_a_position_table_sliced_by_length_is_refused(in_repo):
    """``table[:s]``: each rank would take the first rank's rows."""
    graph = proven(f"{CASES}:build_position_table")
    assert graph.cp_proofs["*"].startswith(
        "slice in the root slices 16 rows out of a tensor that does not carry the sequence ([t, 32] on a cp rank"
    )
    assert cp_refusal(graph, 2) == graph.cp_proofs["*"]


def test_a_table_taken_on_the_local_length_is_refused_at_every_degree(in_repo):
    """At 16 tokens the model computes its angles (16 > its 8-row table), but a cp rank holds at most 8
    tokens, and on those the same code slices the table: another path, at every degree."""
    graph = proven(f"{CASES}:build_position_branch", seq_len=16)
    why = graph.cp_proofs["*"]
    assert why.startswith(
        "the model's code takes another path on t tokens: slice in the root where the captured graph has arange"
    )
    assert cp_refusal(graph, 2) == why and cp_refusal(graph, 4) == why


def test_a_branch_on_the_length_is_proven_degree_by_degree(in_repo):
    """At 64 tokens, cp=2 ranks hold 32 (> 8: the angles of an arange the runtime shifts) and are proven;
    cp=8 ranks hold 8 and would slice the table. One static export at s/2 would have accepted cp=8 too.
    cp=4 ranks hold 16 tokens, as many as the frequencies' own arange(0, 32, 2), which the runtime would
    shift: refused by ``cp_refusal``'s arange check."""
    graph = proven(f"{CASES}:build_position_branch", seq_len=64)
    assert "it branches on the local length t: 9 <= t and t <= 32" in graph.cp_proofs["*"]
    assert graph.cp_proofs["2"] == "" and cp_refusal(graph, 2) is None
    assert "an arange of 16 elements, which a cp=4 rank would take for its token positions" in cp_refusal(graph, 4)
    assert cp_refusal(graph, 8) == "the model's code takes another path on 8 tokens than on 64: slice in the root"


def test_bert_is_refused_for_its_padding_mask(in_repo):
    why = cp_refusal(proven("tests/models/hf_bert.py:build"), 2)
    assert why == (
        "scaled_dot_product_attention in bert.encoder.layer.0.attention.self takes a mask computed from "
        "the model input attention_mask (a padding mask?), which the ring cannot split along the sequence"
    )


def test_attention_dropout_is_refused(in_repo):
    """The code is proven token by token; the graph check on SDPA's dropout_p refuses."""
    graph = proven("tests/models/hf_gpt2.py:build_with_dropout")
    assert graph.cp_proofs == {"*": "", "pipeline": ""}
    assert "drops out with p=0.1" in cp_refusal(graph, 2)


def test_a_model_without_a_sequence_is_not_exported(in_repo):
    graph = proven("tests/models/mlp.py:build")
    assert graph.cp_proofs == {"*": NO_SEQUENCE} and cp_refusal(graph, 2) == NO_SEQUENCE


def _windowed(tmp_path, kind: str, window: int):
    """A saved transformers config (``hf:DIR``) whose attention slides a window of ``window`` tokens."""
    import transformers as tf

    sizes = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=window,
    )  # fmt: skip
    if kind == "mistral":  # every layer slides
        config = tf.MistralConfig(**sizes)
    else:  # Qwen2 with layer 0 full and layer 1 sliding
        config = tf.Qwen2Config(**sizes, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"])
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


@pytest.mark.parametrize(
    "kind, window, layer, query",
    [
        ("mistral", 48, 0, 48),  # s/cp = 32 < 48 < 64: a rank's code skips the window and trained causally
        ("mistral", 16, 0, 16),  # 16 < s/cp: a rank's code passed the mask, which the runtime refused mid-run
        ("qwen2", 48, 1, 48),  # only the sliding layer differs from causal
    ],
)
def test_a_sliding_window_shorter_than_the_sequence_is_refused(in_repo, tmp_path, kind, window, layer, query):
    """One process at s = 64 masks keys more than ``window`` tokens back; a rank's code on s/cp tokens
    passes ``is_causal`` alone wherever they fit the window (transformers skips the mask then), and the
    ring attends causally over all 64: the plan trained unlike one process (``autoshard verify`` failed at
    step 0 for Mistral, window 48, cp 2). The mask of the program at s is computed and compared with causal."""
    graph = proven(_windowed(tmp_path, kind, window), seq_len=64)
    why = (
        f"scaled_dot_product_attention in model.layers.{layer}.self_attn masks its 64 tokens other than causally "
        f"(query {query} does not see key 0, an earlier token: a sliding window?), while a cp rank's code attends "
        f"causally over them as a ring"
    )
    assert graph.cp_proofs == {"*": why}
    assert cp_refusal(graph, 2) == why and cp_refusal(graph, 4) == why
    with pytest.raises(AutoshardError) as pinned:  # as `autoshard plan ... --cp 2` says it
        check_graph_pins(graph, load_cluster("local-cpu", devices_per_node=2), Pins(cp=2))
    assert str(pinned.value) == f"--cp 2: {why}; pin --cp 1"


def test_a_window_that_covers_the_sequence_is_proven(in_repo, tmp_path):
    """At s = 32 <= 48 the window masks nothing: one process and every rank attend causally."""
    graph = proven(_windowed(tmp_path, "mistral", 48), seq_len=32)
    assert graph.cp_proofs == {"*": "", "pipeline": ""} and cp_refusal(graph, 2) is None


def test_masks_are_compared_with_causal_element_by_element():
    """Boolean (True attends) and additive (0 attends, -inf not) masks, broadcast over batch and heads."""
    import torch

    from autoshard.passes.capturing.cp_proof import _not_causal

    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~causal, float("-inf"))
    assert _not_causal(causal.expand(2, 1, 4, 4), 4) is None and _not_causal(additive, 4) is None
    assert _not_causal(additive.clamp(min=torch.finfo(torch.float32).min), 4) is None
    assert _not_causal(torch.ones(4, 4, dtype=torch.bool), 4) == "query 0 sees key 1, a later token"
    window = causal & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)  # each query sees itself and 1 key back
    assert _not_causal(window, 4) == "query 2 does not see key 0, an earlier token: a sliding window?"
    assert _not_causal(~causal, 4) == "query 0 does not see its own key"
    assert _not_causal(additive + 1, 4) == "it adds values other than 0 and -inf to the scores"
    assert _not_causal(causal[:, :2], 4) == "a mask of shape [4, 2]"


def test_attention_that_still_takes_a_mask_as_a_cp_rank_runs_it_is_refused(in_repo):
    """A causal mask the model builds itself passes steps 1-5 (mask-only ops, and the causal mask), but a cp rank
    would hand it to the ring, which takes none: step 6 traces the program as a cp rank runs it and refuses every
    degree at plan time, not mid-run. transformers' own mask is not built under the ring's key: proven above."""
    graph = proven(f"{CASES}:build_own_mask")
    assert "takes a mask" in graph.cp_proofs["*"] and "pipeline" not in graph.cp_proofs
    assert cp_refusal(graph, 2) == graph.cp_proofs["*"]
