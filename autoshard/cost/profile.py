"""Measured model profiles: one model's forward and backward on this machine's devices.

The roofline prices an op from its FLOPs and bytes. Narrow models on CPUs (and small
micro-batches anywhere) run far from any roof: their kernels are short, SDPA and GELU run
below the matmul rate, and what the host does between them is most of the time. So
``autoshard calibrate --model SPEC`` also measures the model itself (``model_profile``): for
each micro-batch size b and recompute mode, one micro-batch's forward and forward + backward on
every rank at once (as training runs them), median over calls of the slowest rank. The cluster
file keeps the result under ``profiles``, keyed by the captured graph's ``graph_signature``.

When the planned model has a profile, ``CostTables.units`` keeps the cost model's split of the
work over units, forward and backward (roofline + host time, ``cost.units``) and scales it to
the measured totals (``ModelProfile.totals``)::

    F(b) = forward,  W(b) = forward + backward − F(b),  R(b) = (forward + backward)_mode − (…)_none
    forward_s(u) = F · w_f(u) / Σ w_f      backward_s(u) = W · w_b(u) / Σ w_b
    recompute_s(u) = R · w_r(u) / Σ w_r    (host time is then inside the measured figures)

Between measured sizes the totals are linear in b; beyond them the nearest two extend.
Everything distributed (collectives, FSDP2, pipelines, the optimizer) is still the cost model's.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph

MODES = ("none", "selective", "full")


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


@dataclass(frozen=True)
class ModelProfile:
    """One model measured on one cluster's devices (module doc)."""

    model: str  # the model spec, for people
    signature: str  # ``graph_signature`` of its captured graph
    ranks: int  # how many ranks ran at once
    times: Mapping[int, Mapping[str, tuple[float, float]]]  # b -> mode -> (forward_s, forward_backward_s)
    source: str
    optimizer_s: float = 0.0  # one AdamW step over all the parameters; 0: not measured

    def __hash__(self) -> int:  # clusters are cache keys; ``times`` is a dict, the rest names it
        return hash((self.model, self.signature, self.ranks, self.source))

    def totals(self, microbatch_size: int, recompute: str) -> tuple[float, float, float] | None:
        """(forward, backward, recompute) seconds of one micro-batch of b (module doc); None when
        the mode was not measured."""
        if recompute not in MODES or any(recompute not in modes for modes in self.times.values()):
            return None
        fwd, fwd_bwd = (self._at(microbatch_size, "none", i) for i in (0, 1))
        rerun = self._at(microbatch_size, recompute, 1) - fwd_bwd if recompute != "none" else 0.0
        return max(fwd, 0.0), max(fwd_bwd - fwd, 0.0), max(rerun, 0.0)

    def _at(self, b: int, mode: str, index: int) -> float:
        """Linear in b between the measured sizes; beyond them the nearest two extend."""
        sizes = sorted(self.times)
        if len(sizes) == 1:
            return self.times[sizes[0]][mode][index] * b / sizes[0]
        right = next((i for i, s in enumerate(sizes) if s >= b), len(sizes) - 1)
        lo, hi = sizes[max(0, right - 1)], sizes[max(1, right)]
        y0, y1 = self.times[lo][mode][index], self.times[hi][mode][index]
        return y0 + (y1 - y0) * (b - lo) / (hi - lo)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "signature": self.signature, "ranks": self.ranks,
                "times": {b: {m: list(v) for m, v in modes.items()} for b, modes in sorted(self.times.items())},
                "optimizer_s": self.optimizer_s, "source": self.source}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ModelProfile:
        """Inverse of ``to_dict``; a mistake is one line naming the field and the fix."""
        fix = "fix: run `autoshard calibrate --model MODEL` again, or delete the profiles section"
        if not isinstance(d, Mapping) or set(d) != {"model", "signature", "ranks", "times", "optimizer_s", "source"}:
            raise AutoshardError(f"{where}: a profile must have model, signature, ranks, times, optimizer_s and "
                                 f"source; {fix}")
        optimizer = d["optimizer_s"]
        if isinstance(optimizer, bool) or not isinstance(optimizer, (int, float)) or not 0 <= optimizer < 1e6:
            raise AutoshardError(f"{where}: profile {d.get('model')!r}: optimizer_s must be seconds >= 0; {fix}")
        if not all(isinstance(d[k], str) for k in ("model", "signature", "source")) or \
                not isinstance(d["ranks"], int) or isinstance(d["ranks"], bool) or d["ranks"] < 1:
            raise AutoshardError(f"{where}: profile {d.get('model')!r} has a malformed model, signature, ranks or "
                                 f"source; {fix}")
        return cls(d["model"], d["signature"], d["ranks"], _times(d["times"], f"{where}: profile {d['model']!r}", fix),
                   d["source"], float(optimizer))


def _times(raw: Any, where: str, fix: str) -> dict[int, dict[str, tuple[float, float]]]:
    if not isinstance(raw, Mapping) or not raw:
        raise AutoshardError(f"{where}: times must map micro-batch sizes to modes; {fix}")
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for b, modes in raw.items():
        b = int(b) if isinstance(b, str) and b.isdigit() else b  # JSON (plan.json) keys are strings
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or not isinstance(modes, Mapping) or \
                not modes or not set(modes) <= set(MODES) or "none" not in modes:
            raise AutoshardError(f"{where}: times[{b!r}] must be a positive micro-batch size mapping none (and "
                                 f"selective, full) to [forward_s, forward_backward_s]; {fix}")
        out[b] = {m: _pair(v, f"{where}: times[{b}][{m}]", fix) for m, v in modes.items()}
    return out


def _pair(v: Any, where: str, fix: str) -> tuple[float, float]:
    ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e6 for x in v)
    if not ok:
        raise AutoshardError(f"{where} must be [forward_s, forward_backward_s], two seconds >= 0; {fix}")
    return float(v[0]), float(v[1])


def scaled_to(units, measured: tuple[float, float, float]):
    """``units`` with forward, backward and recompute scaled to the measured totals (module doc)."""
    fwd, bwd, rerun = measured
    weights_f = [d + h for d, h in zip(units.forward_s, units.host_forward_s or (0.0,) * len(units.forward_s))]
    weights_b = [d + h for d, h in zip(units.backward_s, units.host_backward_s or (0.0,) * len(units.forward_s))]
    weights_r = [d + h for d, h in zip(units.recompute_s, units.host_recompute_s or (0.0,) * len(units.forward_s))]
    zeros = (0.0,) * len(units.forward_s)
    return replace(units, forward_s=_share(fwd, weights_f), backward_s=_share(bwd, weights_b),
                   recompute_s=_share(rerun, weights_r), host_forward_s=zeros, host_backward_s=zeros,
                   host_recompute_s=zeros)


def _share(total: float, weights: list[float]) -> tuple[float, ...]:
    whole = sum(weights)
    if whole <= 0:
        return (0.0,) * len(weights)
    return tuple(total * w / whole for w in weights)


# --------------------------------------------------------------------------- measuring (calibrate)


@dataclass(frozen=True)
class ProfileRequest:
    """A model ``autoshard calibrate --model`` measures: its spec, graph signature and block paths."""

    spec: str
    signature: str
    blocks: tuple[str, ...]
    microbatch_sizes: tuple[int, ...]


def profile_request(spec: str, microbatch_sizes: tuple[int, ...]) -> ProfileRequest:
    """Capture the model (on meta, as ``plan`` does) for its signature and blocks."""
    from autoshard.pipeline import capture_graph

    _, graph = capture_graph(spec)
    return ProfileRequest(spec, graph_signature(graph), tuple(b.path for b in graph.blocks), microbatch_sizes)


def measure_model(time_op, request: ProfileRequest, device) -> dict[str, Any]:
    """Worker side: {"times": b -> mode -> [forward_s, forward_backward_s], "optimizer_s"} of the real
    model with the runtime's own recompute wrappers (``runtime.parallel.apply_recompute``) and
    AdamW, on every rank at once."""
    import torch

    from autoshard.runtime.model import build_model, load_model_file
    from autoshard.runtime.parallel import apply_recompute

    model_file = load_model_file(request.spec)
    models = {mode: apply_recompute(build_model(model_file, seed=0, device=device), list(request.blocks), mode)
              for mode in MODES}
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    out: dict[int, dict[str, list[float]]] = {}
    for b in request.microbatch_sizes:
        torch.manual_seed(b)
        inputs, targets = model_file.example_batch(b)
        inputs = tuple(t.to(device) for t in inputs)
        targets = targets.to(device) if isinstance(targets, torch.Tensor) else targets

        def forward(model):
            with autocast:  # as the emitted program runs on GPUs (bf16), a no-op on CPUs
                return model_file.loss(model(*inputs), targets)

        out[b] = {mode: [time_op(lambda m=model: forward(m)), time_op(lambda m=model: forward(m).backward())]
                  for mode, model in models.items()}
    optimizer = torch.optim.AdamW(models["none"].parameters(), lr=1e-3)  # the gradients are there
    return {"times": out, "optimizer_s": time_op(optimizer.step)}


def model_profile(request: ProfileRequest, measured: Mapping, ranks: int, source: str) -> ModelProfile:
    """The worker's ``measure_model`` result as a profile, figures to 4 significant digits."""
    rounded = {int(b): {m: tuple(_sig(x) for x in v) for m, v in modes.items()}
               for b, modes in measured["times"].items()}
    return ModelProfile(request.spec, request.signature, ranks, rounded, source, _sig(measured["optimizer_s"]))


def _sig(x: float) -> float:
    return float(f"{x:.4g}")
