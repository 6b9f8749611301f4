"""Selective recompute's policy: which op outputs a recomputed region keeps (torchtitan's op-level SAC).

"selective" keeps the outputs of the ops that cost FLOPs (matmuls, attention) and recomputes the
cheap ones (norms, activations, dropout, reshapes) in backward; "full" keeps only the region's
inputs. Shared by block recompute (``runtime.parallel.apply_recompute``) and recompute inside
pipeline stages (``runtime.stage_recompute``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def selective_kwargs(mode: str) -> dict:
    """checkpoint()'s keyword arguments for a recompute mode: a context_fn for "selective", none for "full"."""
    if mode == "selective":
        return {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)}
    return {}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE
