"""Expert parallelism (EP): routing imbalance and the all-to-all of a mixture-of-experts layer.

An MoE layer routes each of T tokens to k of E experts (``top_k``); the n = T·k token-expert
*pairs* are what the experts compute on and what the all-to-all moves. With EP over p ranks each
rank holds E/p experts, and one layer's forward runs (GShard, Lepikhin et al. 2020; the DeepSeek-V3
technical report, arXiv 2412.19437)::

    dispatch   all-to-all: every rank sends its T·k pairs (hidden h each) to the experts' ranks
    experts    grouped GEMM over the pairs the rank received
    combine    all-to-all back: every rank returns the outputs of the pairs it received

**Why the expected maximum, not the mean.** A rank receives the pairs routed to its E/p experts,
a random count. Both all-to-alls are collectives (no rank finishes before the last one has
received), and the combine cannot start before the slowest rank's grouped GEMM is done: the
layer runs at the pace of the most loaded rank. Its load, under uniformly random routing (what
a load-balancing loss or DeepSeek-V3's bias aims at), is balls into bins:

    n balls into m equal bins, n ≥ m·ln m (Raab & Steger, "Balls into bins — a simple and tight
    analysis", RANDOM 1998, Theorem 1; ln the natural log), with high probability:

        max load = n/m + sqrt(2·(n/m)·ln m) · (1 + o(1))

The o(1) is not small at the sizes that matter: against a seeded simulation the leading term
overshoots the excess over n/m by 41 % at m = 8 and 18 % at m = 256, 2.25× at m = 2. The excess
is the extreme of m Gaussian bins: the counts are multinomial, ≈ n/m + sqrt(n/m)·(Z_i − Z̄) with
Z_i iid N(0, 1), and E[max_i (Z_i − Z̄)] = E[max_i Z_i] =: e_m. So, the expected maximum::

    M(n, m) = n/m + sqrt(n/m) · e_m,     e_m ≈ Φ⁻¹((m − 0.375) / (m + 0.25))    ``expected_max_load``

with Blom's approximation of the expected largest normal order statistic (G. Blom, "Statistical
Estimates and Transformed Beta-Variables", Wiley 1958; within 0.03 of the exact e_m, by
quadrature, for every m ≤ 10⁴: exact e_2 = 0.564, Blom 0.589; e_8 = 1.424, Blom 1.434). e_m / sqrt(2·ln m) → 1 as
m → ∞: Raab & Steger's leading term. M is clamped into [⌈n/m⌉, n] (some bin holds at least
⌈n/m⌉ balls; none more than n; the lower end min(n, ⌈n/m⌉) for a fractional n), M(n, 1) = n exactly,
M(0, m) = 0. Below n/m ≈ ln m the counts are Poisson-skewed and M underestimates (256 balls in 256
bins: 3.8 against 4.8 simulated); MoE layers in training sit far above (T·k is thousands per rank).

Rank loads (``rank_load_factor``): the p ranks are p bins of the n_total = p·T·k pairs of all
ranks (each rank sends T·k), mean T·k. A token's k experts are distinct, so its k pairs are not
independent balls: the count a rank gets from one token is hypergeometric (k draws from E without
replacement, E/p of them the rank's), with variance k·(1/p)·(1 − 1/p)·(E − k)/(E − 1), the
binomial one times the finite-population correction (E − k)/(E − 1). The deviation term scales by
its square root, so k = E (every token to every expert) gives exactly the mean::

    load factor λ = 1 + (M(p·T·k, p) / (T·k) − 1) · sqrt((E − k) / (E − 1))
                  = 1 + e_p · sqrt((E − k) / ((E − 1)·T·k))          (≥ 1; 1 at p = 1 or k = E)

It is an optimistic floor: real routers are correlated (the tokens of one sequence pick alike)
and DeepSeek-V3 limits each token to 4 nodes; a capacity factor C would cap λ at C.

**All-to-all time** (``all_to_all_s``), the alpha-beta model of ``cost.comm`` on one link: each
of p ranks sends S bytes in total, S/p of them to itself (no link), in p − 1 pairwise exchanges
(NCCL's all-to-all: p − 1 send/recv pairs, grouped)::

    T_a2a(S, p) = (p − 1)·α + (p − 1)/p · S / B               (0 for p = 1)

**One MoE layer's forward** (``moe_layer_a2a_s``), S = T·k·h·bytes per rank: the most loaded rank
receives λ·S in the dispatch and sends λ·S back in the combine; on full-duplex links the larger
side sets the pace::

    T_layer = T_a2a(λ·S, p) [dispatch] + T_a2a(λ·S, p) [combine]

Worked (``tests/test_moe_cost.py``): T = 4096 tokens per rank, k = 8, h = 7168 (DeepSeek-V3),
bf16, E = 256, p = 8 on NVLink 4 (450 GB/s, 3 µs): S = 4096·8·7168·2 B = 469.8 MB,
λ = 1 + 1.434·sqrt(248 / (255·32768)) ≈ 1.0078, one all-to-all 7·3 µs + 7/8 · 1.0078 · 469.8 MB /
450 GB/s ≈ 0.942 ms, the layer ≈ 1.88 ms.
Across nodes (NDR, 50 GB/s per GPU) the same layer takes ≈ 17 ms: EP belongs inside a node
unless the all-to-all overlaps compute (DeepSeek-V3's DualPipe).

**Backward** repeats both all-to-alls (the gradient of the combine travels as a dispatch, the
gradient of the dispatch as a combine), and autoshard's runtime recomputes the dispatch in
backward instead of keeping its received buffer: a training step costs 2 + 2 + 1 = 5 of these
all-to-alls per MoE layer and micro-batch, 5/2 · ``moe_layer_a2a_s``.

Not modelled: hierarchical (node-then-GPU) dispatch as DeepEP does it, FP8 dispatch (DeepSeek-V3
sends the dispatch in FP8 and combines in bf16: price the two with ``all_to_all_s`` apart), the
overlap of the all-to-alls with the experts' compute.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from autoshard.cost.comm import all_to_all_s  # noqa: F401  (re-exported: the dispatch's collective)
from autoshard.ir.topology import LinkSpec


def expected_max_load(assignments: float, bins: int) -> float:
    """Expected count of the most loaded of ``bins`` equal bins when ``assignments`` balls fall
    uniformly at random: n/m + sqrt(n/m)·e_m (module doc; → Raab & Steger's n/m + sqrt(2·(n/m)·ln m)),
    clamped to [⌈n/m⌉, n]; exactly n for one bin."""
    if bins < 1 or assignments < 0:
        raise ValueError(
            f"balls into bins needs bins >= 1 and assignments >= 0, got bins={bins}, assignments={assignments}"
        )
    if bins == 1:
        return float(assignments)
    mean = assignments / bins
    pigeonhole = min(assignments, math.ceil(mean))  # the fullest bin holds at least ⌈n/m⌉
    return float(min(assignments, max(pigeonhole, mean + math.sqrt(mean) * expected_max_of_normals(bins))))


def expected_max_of_normals(count: int) -> float:
    """e_m = E[max of m iid N(0, 1)] by Blom's approximation Φ⁻¹((m − 0.375)/(m + 0.25)); e_1 = 0."""
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25))


def rank_load_factor(tokens_per_rank: float, top_k: int, experts: int, ep: int) -> float:
    """λ = expected max over the ``ep`` ranks of the pairs a rank receives / the mean T·k: balls
    into ep bins of n_total = ep·T·k pairs, the excess scaled by sqrt((E − k)/(E − 1)) for the k
    distinct experts of a token (module doc). 1 for ep = 1 or k = E."""
    _check_routing(top_k, experts, ep)
    mean = tokens_per_rank * top_k
    if ep == 1 or mean <= 0:
        return 1.0
    excess = expected_max_load(ep * mean, ep) / mean - 1
    return 1 + excess * _without_replacement(top_k, experts)


def _without_replacement(top_k: int, experts: int) -> float:
    """sqrt((E − k)/(E − 1)): a token's k distinct experts spread its pairs more evenly than k
    independent picks (hypergeometric against binomial variance); 0 when k = E, 1 when k = 1."""
    return math.sqrt((experts - top_k) / (experts - 1)) if experts > 1 else 0.0


def _check_routing(top_k: int, experts: int, ep: int) -> None:
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts], got top_k={top_k} with {experts} experts")
    if ep < 1 or experts % ep:
        raise ValueError(
            f"ep must divide the experts: {experts} experts over ep={ep} ranks; pick ep among the divisors of {experts}"
        )


def moe_layer_a2a_s(
    tokens: int, hidden: int, top_k: int, dtype_bytes: int, ep: int, experts: int, link: LinkSpec
) -> float:
    """Dispatch + combine of one MoE layer's forward, ``tokens`` per rank: 2 · T_a2a(λ·T·k·h·bytes, ep)
    (module doc; backward adds 2 more, recompute of the dispatch 1). 0 for ep = 1."""
    sent_bytes = tokens * top_k * hidden * dtype_bytes
    busiest_bytes = rank_load_factor(tokens, top_k, experts, ep) * sent_bytes
    dispatch_s = all_to_all_s(busiest_bytes, ep, link)
    combine_s = all_to_all_s(busiest_bytes, ep, link)
    return dispatch_s + combine_s
