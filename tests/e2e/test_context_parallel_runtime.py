"""Context parallelism (runtime.context_parallel: ring attention on CPU ranks, gloo) trains like one process.

These tests run in this process on a one-rank gloo group: the kernel pair against SDPA, the
refusals, the position shift. The multi-process test (tests/e2e/cp_driver.py at cp=2 and dp=2 x
cp=2, training examples/gpt.py and the tiny transformers Llama for 2 AdamW steps against one
process on the whole batch) is ``test_context_parallel_matches_one_process`` in
test_context_parallel.py, in the launches of that file's emitted programs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.errors import AutoshardError
from autoshard.runtime import load_model_file
from autoshard.runtime.context_parallel import (
    CP_ATTENTION,
    ContextParallelMode,
    cp_attention_refusal,
    head_tail_positions,
    ring_attention,
    shard_sequence,
    use_cp_attention,
)

MODELS = {"gpt": "examples/gpt.py:build", "llama": "tests/models/hf_llama.py:build"}


# --------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process (the ring's collectives need one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0])
    if owned:
        dist.destroy_process_group()


@pytest.mark.parametrize("is_causal", [True, False])
def test_one_rank_ring_is_sdpa_forward_and_backward(group, is_causal):
    """The CPU kernel pair through torch's ring templates: same output and gradients as SDPA."""
    torch.manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 8, 16) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ref, is_causal=is_causal, scale=0.3) * w).sum().backward()
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, group, is_causal=is_causal, scale=0.3)
    (out * w).sum().backward()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3))
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    assert _cp_options.enable_load_balance  # torch's default, restored after the ring


def test_mode_repeats_gqa_heads(group):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with ContextParallelMode(group, 0, 1, 8):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def test_mode_shifts_only_local_positions(group):
    """Rank 1 of 2 with 8 local tokens: an arange of 8 numbers tokens 8..15; other aranges are left alone."""
    with ContextParallelMode(group, 1, 2, 8):
        assert torch.arange(8).tolist() == list(range(8, 16))
        assert torch.arange(0, 8).tolist() == list(range(8, 16))
        assert (torch.arange(8) + 0).unsqueeze(0).tolist() == [list(range(8, 16))]  # transformers' position_ids
        assert torch.arange(8, dtype=torch.float32).tolist() == [float(i) for i in range(8, 16)]
        assert torch.arange(0, 16, 2).tolist() == list(range(0, 16, 2))  # step 2: not positions
        assert torch.arange(5).tolist() == list(range(5))
        assert torch.arange(16).tolist() == list(range(16))


class MaskedAttention(torch.nn.Module):
    """Attention that passes its own (causal, but explicit) boolean mask."""

    def forward(self, x):
        mask = torch.ones(x.shape[2], x.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def test_explicit_mask_dropout_and_cross_attention_are_refused(group):
    x = torch.randn(1, 2, 8, 4)
    with ContextParallelMode(group, 0, 1, 8):
        with pytest.raises(AutoshardError, match=r"explicit attn_mask \(shape \(8, 8\)\).*plan without context"):
            MaskedAttention()(x)
        with pytest.raises(AutoshardError, match=r"dropout_p=0.1.*set the model's attention dropout to 0"):
            F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)
        with pytest.raises(AutoshardError, match=r"8 queries and 4 keys"):
            F.scaled_dot_product_attention(x, x[:, :, :4], x[:, :, :4])
        with pytest.raises(AutoshardError, match=r"over 4 tokens, not this rank's 8-token chunk"):
            F.scaled_dot_product_attention(x[:, :, :4], x[:, :, :4], x[:, :, :4])


def test_padded_llama_batch_is_refused(group, in_repo):
    """transformers turns a padding attention_mask into an explicit SDPA mask: refused, not silently wrong."""
    model = load_model_file(MODELS["llama"]).build()
    ids, padding = torch.randint(0, 256, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    padding[0, :2] = 0
    with ContextParallelMode(group, 0, 1, 8), pytest.raises(AutoshardError, match="explicit attn_mask"):
        model(ids, attention_mask=padding)


def test_shard_sequence_takes_contiguous_chunks():
    t = torch.arange(24).reshape(2, 12)
    assert shard_sequence(t, 1, 2, 3).tolist() == [[8, 9, 10, 11], [20, 21, 22, 23]]
    with pytest.raises(AutoshardError, match="divisible by 5, got 12"):
        shard_sequence(t, 1, 0, 5)


@pytest.mark.parametrize("cp", [2, 4])
def test_head_tail_shards_are_torchs_load_balanced_ones(cp):
    """Rank r's tokens are chunks r and 2cp − 1 − r: the indices of torch's head-tail load balancer, which its
    balanced ring assumes; the sharding of a batch and the positions read the same definition."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    s = 8 * cp
    torchs = _HeadTailLoadBalancer(s, cp, torch.device("cpu"))._generate_indices()[0].view(cp, s // cp)
    batch = torch.arange(2 * s).reshape(2, s)
    for rank in range(cp):
        assert head_tail_positions(rank, cp, s // cp).tolist() == torchs[rank].tolist()
        assert shard_sequence(batch, 1, rank, cp, balanced=True).tolist() == [
            torchs[rank].tolist(),
            (torchs[rank] + s).tolist(),
        ]
    with pytest.raises(AutoshardError, match=f"divisible by {2 * cp}, got {2 * cp + cp}"):
        shard_sequence(torch.zeros(1, 3 * cp), 1, 0, cp, balanced=True)


def test_mode_numbers_head_tail_positions(group):
    """Rank 0 of 2 holding a head-tail pair of 4-token chunks of 16: an arange of its 8 local tokens numbers
    0..3 then 12..15, also from an offset (``arange(c) + past``) and into ``out=``."""
    with ContextParallelMode(group, 0, 2, 8, balanced=True):
        assert torch.arange(8).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert torch.arange(5, 13).tolist() == [5, 6, 7, 8, 17, 18, 19, 20]
        assert torch.arange(8, dtype=torch.float64).tolist() == [0.0, 1.0, 2.0, 3.0, 12.0, 13.0, 14.0, 15.0]
        out = torch.empty(8, dtype=torch.long)
        torch.arange(8, out=out)
        assert out.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert torch.arange(4).tolist() == [0, 1, 2, 3]  # not the local length: not positions


def _sdpa_calls(monkeypatch) -> list:
    """Record (attn_mask, is_causal) of every SDPA call transformers makes."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def test_llama_under_the_cp_attention_builds_no_mask_for_jumping_positions(monkeypatch, in_repo):
    """Head-tail positions jump (0..3 then 12..15). Under "sdpa" transformers reads the jump as two packed
    documents and masks across it (what a cp rank must not do: its second chunk attends to its first); under the
    ring's key (``use_cp_attention``) it builds no mask, never looks for packed sequences, and calls SDPA with
    ``is_causal`` and no mask, which the mode turns into the ring. On ordinary positions both compute the same."""
    import transformers.masking_utils as masking

    model = load_model_file(MODELS["llama"]).build().eval()
    ids, jumping = torch.randint(0, 256, (1, 8)), torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]])
    calls = _sdpa_calls(monkeypatch)
    plain = model(ids).logits
    model(ids, position_ids=jumping)
    assert any(mask is not None for mask, _ in calls), "sdpa masks packed positions: the test would prove nothing"
    use_cp_attention(model)
    assert model.config._attn_implementation == CP_ATTENTION
    assert use_cp_attention(model) is model  # idempotent

    def packed(*args, **kwargs):
        raise AssertionError("packed-sequence detection ran under the ring's attention")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", packed)
    calls.clear()
    model(ids, position_ids=jumping)
    assert calls and all(mask is None and causal for mask, causal in calls), calls
    torch.testing.assert_close(model(ids).logits, plain)


def test_the_cp_attention_refuses_padding_and_attention_of_its_own(in_repo):
    """Under the ring's key transformers would drop a padding mask silently: refused at the forward (a mask of
    ones is no padding); a model built with eager attention is not switched to SDPA behind its back."""
    import transformers

    model_file = load_model_file(MODELS["llama"])
    model = use_cp_attention(model_file.build())
    ids, padding = torch.randint(0, 256, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    model(ids, attention_mask=padding)
    padding[0, :2] = 0
    with pytest.raises(AutoshardError, match="padding attention_mask"):
        model(ids, attention_mask=padding)
    eager = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    assert "attends with 'eager'" in cp_attention_refusal(eager)
    with pytest.raises(AutoshardError, match="attends with 'eager'.*plan without context parallelism"):
        use_cp_attention(eager)
    gpt = load_model_file(MODELS["gpt"]).build()
    assert cp_attention_refusal(gpt) is None and use_cp_attention(gpt) is gpt  # SDPA called by its own code


@pytest.mark.parametrize("mode", ["full", "selective", "alternate"])
def test_a_recomputed_block_recomputes_under_the_ring(group, mode):
    """Autograd recomputes a checkpointed block inside the backward, where no torch function mode is active: the
    recomputation must run the ring and the global positions as the forward did (``runtime.selective``
    ``recompute_contexts``). It ran plain SDPA instead, and checkpoint refused it ("Recomputed values ... have
    different metadata"); every plan with context parallelism and recompute crashed so."""
    from torch import nn

    from autoshard.runtime.parallel import apply_recompute

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
            positions = torch.arange(x.shape[1]).float()  # shifted by the mode to the global positions
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1) + positions[:, None]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    torch.manual_seed(0)
    reference, recomputed = Model(), Model()
    recomputed.load_state_dict(reference.state_dict())
    apply_recompute(recomputed, ["block"], mode)
    x = torch.randn(2, 8, 16)
    for model in (reference, recomputed):
        with ContextParallelMode(group, 0, 1, 8):
            model(x).square().sum().backward()
    for a, b in zip(recomputed.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
