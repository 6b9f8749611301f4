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
from autoshard.runtime.context_parallel import ContextParallelMode, ring_attention, shard_sequence

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
