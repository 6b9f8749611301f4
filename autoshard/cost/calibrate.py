"""Fit the alpha-beta link of ``autoshard.cost.comm`` to measured collective times.

``autoshard calibrate`` (``autoshard/calibrate.py``) times each collective c over p ranks at
message sizes S₁ … S_n. The cost model prices every one of them with the same two numbers of
a ``LinkSpec``, α (``latency_us``) and B (``bandwidth_gbps``), linearly::

    t_c(S) = k_α(c, p)·α + k_β(c, p)·S/B

    c                k_α(c, p)                 k_β(c, p)    (comm.py)
    all_reduce       2·min(p−1, ⌈log2 p⌉)      2(p−1)/p     ``allreduce_s`` = min(ring, tree)
    reduce_scatter   p−1                       (p−1)/p      ``reduce_scatter_s``
    all_gather       p−1                       (p−1)/p      ``all_gather_s``
    broadcast        p−1                       1            ``broadcast_s``
    p2p              1                         1            ``p2p_s``
    all_to_all       p−1                       (p−1)/p      ``all_to_all_s`` (S: what one rank sends)

The coefficients are not copied from this table: ``coefficients`` reads them off the comm.py
functions themselves (k_α = t(0 bytes) on a link of α = 1 µs; k_β = t(1 GB) on a link of
1 GB/s and α = 0), so a fit always matches the formulas the planner prices with. (The
all-reduce's min(ring, tree) is still linear in α and β: ring and tree share k_β and differ
only in k_α.)

With x = (α, β = 1/B), measurement i (collective c_i, size S_i, time t_i) is the row
a_i = (k_α(c_i, p), k_β(c_i, p)·S_i), and the fit minimises relative errors::

    x* = argmin_x Σ_i ((a_i·x − t_i) / t_i)²                                  ``fit_link``

— a linear least squares in x on the rows a_i / t_i against 1 (numpy ``lstsq``, columns
scaled to unit norm first). Relative, not absolute: an absolute fit is decided by the 64 MiB
points alone and says nothing about α, while a 4 KiB bucket matters as much to a plan.
If the best α is negative, α = 0 and β is the one-variable fit
β = Σ_i u_i / Σ_i u_i² with u_i = k_β·S_i / t_i. The fit error is reported as the largest
and the root-mean-square of |a_i·x* − t_i| / t_i. Fitting the rows of several collectives
together gives the one link that the cost model uses for all of them (``intra_node``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.cost import comm
from autoshard.errors import AutoshardError
from autoshard.ir.topology import LinkSpec

GB = 1e9

COST_FUNCTIONS: dict[str, Callable[[float, int, LinkSpec], float]] = {
    "all_reduce": comm.allreduce_s,
    "reduce_scatter": comm.reduce_scatter_s,
    "all_gather": comm.all_gather_s,
    "broadcast": comm.broadcast_s,
    "all_to_all": comm.all_to_all_s,
    "p2p": lambda size_bytes, ranks, link: comm.p2p_s(size_bytes, link),
}
COLLECTIVES = tuple(COST_FUNCTIONS)


@dataclass(frozen=True)
class Sample:
    """One measured time: ``collective`` of ``size_bytes`` (comm.py's S) over ``ranks`` took ``time_s``."""

    collective: str
    ranks: int
    size_bytes: float
    time_s: float

    def __post_init__(self):
        assert self.collective in COST_FUNCTIONS, self.collective
        assert self.ranks >= 2 and self.size_bytes > 0 and self.time_s > 0, self


@dataclass(frozen=True)
class LinkFit:
    """The fitted α, B and how well they reproduce the samples they were fitted to."""

    latency_us: float
    bandwidth_gbps: float
    max_rel_error: float
    rms_rel_error: float
    samples: int

    def link(self, source: str) -> LinkSpec:
        return LinkSpec(bandwidth_gbps=self.bandwidth_gbps, latency_us=self.latency_us, source=source)


def coefficients(collective: str, ranks: int) -> tuple[float, float]:
    """(k_α, k_β) of ``collective`` over ``ranks``, read off comm.py (module doc)."""
    price = COST_FUNCTIONS[collective]
    k_alpha = price(0.0, ranks, LinkSpec(bandwidth_gbps=1.0, latency_us=1.0, source="unit")) / 1e-6
    k_beta = price(GB, ranks, LinkSpec(bandwidth_gbps=1.0, latency_us=0.0, source="unit"))
    return k_alpha, k_beta


def predict_s(collective: str, ranks: int, size_bytes: float, link: LinkSpec) -> float:
    """What the cost model says ``collective`` takes on ``link`` (comm.py, by name)."""
    return COST_FUNCTIONS[collective](size_bytes, ranks, link)


def fit_link(samples: Sequence[Sample]) -> LinkFit:
    """α and B minimising the relative squared error of t = k_α·α + k_β·S/B over ``samples``."""
    assert samples, "nothing to fit"
    rows = np.array([_row(s) for s in samples])
    times = np.array([s.time_s for s in samples])
    alpha_s, beta_s_per_byte = _weighted_fit(rows, times)
    if beta_s_per_byte <= 0:
        raise AutoshardError(
            "the measured collective times do not grow with the message size, so no bandwidth "
            "can be fitted; fix: rerun `autoshard calibrate` on a less loaded machine"
        )
    errors = np.abs(rows @ np.array([alpha_s, beta_s_per_byte]) - times) / times
    return LinkFit(
        latency_us=alpha_s * 1e6,
        bandwidth_gbps=1.0 / (beta_s_per_byte * GB),
        max_rel_error=float(errors.max()),
        rms_rel_error=float(math.sqrt(np.mean(errors**2))),
        samples=len(samples),
    )


def _row(sample: Sample) -> tuple[float, float]:
    """(k_α, k_β·S) with α in seconds and β in seconds per byte."""
    k_alpha, k_beta = coefficients(sample.collective, sample.ranks)
    return k_alpha, k_beta * sample.size_bytes


def _weighted_fit(rows: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """argmin Σ((row·x − t)/t)² over x = (α ≥ 0, β)."""
    scaled = rows / times[:, None]
    norms = np.linalg.norm(scaled, axis=0)
    if len(times) >= 2 and norms[0] > 0:
        x, *_ = np.linalg.lstsq(scaled / norms, np.ones(len(times)), rcond=None)
        alpha, beta = x / norms
        if alpha >= 0:
            return float(alpha), float(beta)
    u = scaled[:, 1]
    return 0.0, float(u.sum() / (u**2).sum())
