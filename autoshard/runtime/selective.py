"""Selective recompute's policy: which op outputs a recomputed region keeps (torchtitan's op-level SAC).

"selective" keeps the outputs of the ops that cost FLOPs (matmuls, attention) or communication (the
traced TP collectives of pipeline stages, DTensor's collectives) and recomputes the
cheap ones (norms, activations, dropout, reshapes) in backward; "alternate" is torchtitan's op-level policy
(its ``selective_ac_option = "op"``, ``torchtitan/models/llama3/infra/parallelize.py``): it keeps attention and
every other weight matmul (``mm`` / ``addmm`` as they run: the 1st, 3rd, ... of each region, counted apart in
the forward and in the recomputation) and the reduce-scatters, and recomputes the rest, batched matmuls, all-reduces
and all-gathers included; "full" keeps only the
region's inputs. Shared by block recompute (``runtime.parallel.apply_recompute``) and recompute inside
pipeline stages (``runtime.stage_recompute``).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoshard.runtime.tensor_parallel_stages import sp_gather, sp_scatter, tp_gather, tp_reduce  # noqa: F401 (the ops)

SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    # the forward TP collectives of pipeline stages (tensor_parallel_stages) and DTensor's (its redistributions
    # run c10d functional collectives: the rowwise outputs' all-reduces, sequence parallelism's all-gathers and
    # reduce-scatters): rerunning them would repeat communication, which the cost model charges to full recompute
    # only (torchtitan keeps reduce_scatter_tensor for the same reason). A gathered input kept costs no more
    # than ``TPChoice.block_activation_fraction`` prices: the module that reads it keeps it for its backward.
    # The wait after each is recomputed: on a kept output it has nothing to wait for.
    torch.ops.autoshard.tp_reduce.default,
    torch.ops.autoshard.tp_gather.default,
    torch.ops.autoshard.sp_gather.default,
    torch.ops.autoshard.sp_scatter.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


# alternate (module doc): the 2-D matmuls counted, every other one kept; attention and, of the TP collectives, the
# reduce-scatters kept, as torchtitan's save list holds ``reduce_scatter_tensor`` and no other collective: the
# all-reduces and the all-gathers (a column-parallel linear's gathered input, b·s·h whole per region) are rerun in
# the backward, so the gathered tokens are never kept whole (``cost.memory._selective_kept``, ``scatters_only``)
COUNTED_IN_ALTERNATE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
RERUN_IN_ALTERNATE = {
    torch.ops.autoshard.tp_reduce.default,
    torch.ops.autoshard.tp_gather.default,
    torch.ops.autoshard.sp_gather.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}
SAVE_IN_ALTERNATE = (
    SAVE_IN_SELECTIVE
    - COUNTED_IN_ALTERNATE
    - RERUN_IN_ALTERNATE
    - {
        torch.ops.aten.bmm.default,
        torch.ops.aten.linear.default,
    }
)


def selective_kwargs(mode: str) -> dict:
    """checkpoint()'s keyword arguments for a recompute mode: its context_fn (``recompute_contexts``)."""
    return {"context_fn": partial(recompute_contexts, mode)}


def recompute_mode(wrapper: torch.nn.Module) -> str:
    """The recompute mode a ``checkpoint_wrapper`` made with ``selective_kwargs`` runs ("" for any other)."""
    context_fn = getattr(getattr(wrapper, "checkpoint_fn", None), "keywords", {}).get("context_fn")
    is_ours = isinstance(context_fn, partial) and context_fn.func is recompute_contexts
    return context_fn.args[0] if is_ours else ""


def recompute_contexts(mode: str) -> tuple:
    """(the forward's context, the recomputation's) of one region's run (checkpoint calls this as the region's
    forward begins): "selective" and "alternate" their policies' (``create_selective_checkpoint_contexts``),
    "full" none; and the recomputation runs under the torch function modes the forward ran under that ask for it
    (``RERUN_UNDER``).

    Autograd runs the recomputation inside the backward, where no torch function mode is active: a mode entered
    around the forward and the backward (context parallelism's ring attention and global positions,
    ``runtime.context_parallel``; the dry run's attention) would see the forward's calls but not their
    recomputation, which then computed attention on the rank's own tokens alone, and checkpoint refused the
    program ("Recomputed values ... have different metadata").

    Under torch.compile (compiled blocks; beside context parallelism the recompute stays eager around the compiled
    block, ``runtime.compiled``) checkpoint takes only dispatch modes:
    the policies' own, and for "full" a policy that keeps nothing, which is full recompute."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_policy(mode) or _keep_nothing)
    policy = _policy(mode)
    forward, recompute = (
        create_selective_checkpoint_contexts(policy) if policy else (contextlib.nullcontext(), contextlib.nullcontext())
    )
    modes = [m for m in torch.overrides._get_current_function_mode_stack() if getattr(m, RERUN_UNDER, False)]
    return forward, (UnderModes(modes, recompute) if modes else recompute)


# A torch function mode with this attribute true is entered again around a recomputation (``recompute_contexts``):
# context parallelism's, the dry run's attention. Others are not: each would see every op of every recomputation
# (verify's fixed randomness has its dispatch-level twin for that: ``runtime.randomness``).
RERUN_UNDER = "rerun_under_recompute"


def _policy(mode: str):
    """The selective policy of a recompute mode (None for "full": no policy, everything rerun)."""
    if mode == "selective":
        return _selective_policy
    if mode == "alternate":
        return partial(_alternate_policy, {"forward": 0, "recompute": 0})  # this region's own matmul counts
    return None


def _keep_nothing(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


class UnderModes:
    """``inner`` entered with ``modes`` (a function-mode stack, outermost first) active again around it; entered
    as often as the region is recomputed (a split backward reruns it for its input and its weight pass)."""

    def __init__(self, modes: list, inner):
        self.modes, self.inner = list(modes), inner
        self._open: list[contextlib.ExitStack] = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        for mode in self.modes:
            stack.enter_context(mode)
        stack.enter_context(self.inner)
        self._open.append(stack)
        return self

    def __exit__(self, *exc) -> bool:
        return self._open.pop().__exit__(*exc)


def _alternate_policy(counts: dict[str, int], ctx, op, *args, **kwargs):
    if op in COUNTED_IN_ALTERNATE:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in SAVE_IN_ALTERNATE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE
