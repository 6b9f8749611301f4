"""Measured model profiles in the cost model: a graph's signature, units scaled to measured totals.

The roofline prices an op from its FLOPs and bytes. Narrow models on CPUs (and small
micro-batches anywhere) run far from any roof: their kernels are short, SDPA and GELU run
below the matmul rate, and what the host does between them is most of the time. So
``autoshard calibrate --model SPEC`` also measures the model itself (``model_probes``): for
each micro-batch size b and recompute mode, one micro-batch's forward and forward + backward on
every rank at once (as training runs them), median over calls of the slowest rank. The cluster
file keeps the result under ``profiles`` (``ir.profile.ModelProfile``), keyed by the captured
graph's ``graph_signature``.

When the planned model has a profile, ``CostTables.units`` keeps the cost model's split of the
work over units, forward and backward (roofline + host time, ``cost.units``) and scales it to
the measured totals (``ModelProfile.totals``)::

    F(b) = forward,  W(b) = forward + backward − F(b),  R(b) = (forward + backward)_mode − (…)_none
    forward_s(u) = F · w_f(u) / Σ w_f      backward_s(u) = W · w_b(u) / Σ w_b
    recompute_s(u) = R · w_r(u) / Σ w_r    (host time is then inside the measured figures)

The totals are the least-squares line in b through the measured sizes (``ModelProfile._at``).
Everything distributed (collectives, FSDP2, pipelines, the optimizer) is still the cost model's.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from autoshard.cost.units import Units
from autoshard.ir.graph import OpGraph


def graph_signature(graph: OpGraph) -> str:
    """sha256 of what the cost model reads of a graph: ops, shapes, parameters, blocks, batch."""
    h = hashlib.sha256(f"b{graph.batch_size} s{graph.tokens_per_sample}\n".encode())
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:  # inputs by position or parameter name: node names differ between captures
        inputs = [index.get(i, graph.placeholder_params.get(i, "in")) for i in n.inputs]
        h.update(f"{n.target} {n.shape} {n.dtype} {n.module_path} {inputs}\n".encode())
    for p in graph.params:
        h.update(f"p {p.name} {p.shape} {p.dtype}\n".encode())
    for b in graph.blocks:
        h.update(f"k {b.path}\n".encode())
    return h.hexdigest()[:16]


def scaled_to(units: Units, measured: tuple[float, float, float]) -> Units:
    """``units`` with forward, backward and recompute scaled to the measured totals (module doc)."""
    fwd, bwd, rerun = measured
    weights_f = [d + h for d, h in zip(units.forward_s, units.host_forward_s or (0.0,) * len(units.forward_s))]
    weights_b = [d + h for d, h in zip(units.backward_s, units.host_backward_s or (0.0,) * len(units.forward_s))]
    weights_r = [d + h for d, h in zip(units.recompute_s, units.host_recompute_s or (0.0,) * len(units.forward_s))]
    zeros = (0.0,) * len(units.forward_s)
    return replace(
        units,
        forward_s=_share(fwd, weights_f),
        backward_s=_share(bwd, weights_b),
        recompute_s=_share(rerun, weights_r),
        host_forward_s=zeros,
        host_backward_s=zeros,
        host_recompute_s=zeros,
    )


def _share(total: float, weights: list[float]) -> tuple[float, ...]:
    whole = sum(weights)
    if whole <= 0:
        return (0.0,) * len(weights)
    return tuple(total * w / whole for w in weights)
