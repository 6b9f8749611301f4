"""Async TP (``--async-tp on``, ``runtime.compiled.apply_async_tp``): TP collectives overlapped with their matmuls.

Inductor's micro-pipeline TP pass rewrites each sequence-parallel all-gather that feeds a matmul into one
``fused_all_gather_matmul`` and each matmul whose output is reduce-scattered into one
``fused_matmul_reduce_scatter``: the operand moves in tp chunks over symmetric memory while the matmul of the
chunks already there runs. Per micro-batch on one rank, with C the layout's TP collectives (``cost.tp``:
forward, backward, full recompute's rerun), M the rank's 2-D matmul time (forward, backward, recompute: the
column- and row-parallel linears those collectives feed and drain, and the rest of the block's matmuls beside
them), n the collectives (one per gathering or reduce-scattering style of the layout, forward and backward,
× ``tp_comm_factor``) and ``eager.LAUNCH_US`` per chunk::

    exposed(C) = max(0, C − M) + min(C, M) / tp + n · tp · LAUNCH_US

a two-stage pipeline over tp chunks: the longer of the two streams runs whole, the shorter overlaps it but for
one chunk (the first transfer before any matmul, or the last matmul after every transfer). The overlap is taken
over the micro-batch as a whole (a collective longer than its own matmul borrows from another's slack), and a
chunked matmul is priced at the whole one's efficiency: a lower bound on what async TP leaves exposed. Symmetric memory's buffers (a chunked copy of each
fused operand) are not priced in memory. Only compiled blocks run the pass (``ir.decisions.async_tp_refusal``).
"""

from __future__ import annotations

from autoshard.cost import eager
from autoshard.cost.compute import ComputeTime
from autoshard.ir.decisions import TP_STYLES

FORWARD_AND_BACKWARD = 2  # each fused collective runs once forward, its mirror once backward


def exposed_tp_comm_s(comm_s: float, matmul_s: float, collectives: float, tp: int) -> float:
    """exposed(C) of the module doc: TP collectives ``comm_s`` beside ``matmul_s`` of matmuls, ``collectives``
    fused collectives each in ``tp`` chunks."""
    return max(0.0, comm_s - matmul_s) + min(comm_s, matmul_s) / tp + collectives * tp * eager.LAUNCH_US * 1e-6


def fused_collectives(styles: dict[str, str], blocks: tuple[str, ...], comm_factor: float) -> float:
    """n of the module doc: the sequence-parallel gathers and reduce-scatters of the layout's ``styles`` on
    modules inside the (compiled) ``blocks``, forward and backward, × ``comm_factor`` (full recompute's rerun of
    the forward ones)."""
    inside = tuple(block + "." for block in blocks)
    per_pass = sum(1 for path, style in styles.items() if path.startswith(inside) and _fuses(style))
    return per_pass * FORWARD_AND_BACKWARD * comm_factor


def matmul_s(compute: ComputeTime, matmul_fraction: float) -> float:
    """M of the module doc: the micro-batch's compute on the rank × the share of it in 2-D matmuls."""
    return compute.total_s * matmul_fraction


def _fuses(style: str) -> bool:
    """Whether a TP style issues a collective the pass fuses with a matmul: a module's input all-gathered over
    the tokens (``gather-seq-*``) or a row-parallel output reduce-scattered over them."""
    row = TP_STYLES.get(style)
    gathers = style.startswith(("gather-seq-", "colwise-seq-input", "colwise-gather-seq-", "conv1d-colwise-seq-"))
    return gathers or bool(row and row.leaves_seq_shard and "rowwise" in style)
