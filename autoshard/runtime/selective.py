"""Selective recompute's policy: which op outputs a recomputed region keeps (torchtitan's op-level SAC).

"selective" keeps the outputs of the ops that cost FLOPs (matmuls, attention) or communication (the
traced TP collectives of pipeline stages) and recomputes the
cheap ones (norms, activations, dropout, reshapes) in backward; "full" keeps only the region's
inputs. Shared by block recompute (``runtime.parallel.apply_recompute``) and recompute inside
pipeline stages (``runtime.stage_recompute``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoshard.runtime.tensor_parallel_stages import tp_gather, tp_reduce  # noqa: F401  (registers the ops)

SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    # the forward TP collectives of pipeline stages (tensor_parallel_stages): rerunning them would repeat
    # communication, which the cost model charges to full recompute only
    torch.ops.autoshard.tp_reduce.default,
    torch.ops.autoshard.tp_gather.default,
}


def selective_kwargs(mode: str) -> dict:
    """checkpoint()'s keyword arguments for a recompute mode: a context_fn for "selective", none for "full"."""
    if mode == "selective":
        return {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)}
    return {}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE
