"""cost/moe: routing imbalance (balls into bins) against simulation, and the EP all-to-all."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.cost import moe
from autoshard.cost.hardware import NDR_PER_GPU, NVLINK4
from autoshard.ir.topology import LinkSpec

# ---------------------------------------------------------------------------- balls into bins


def simulated_max_load(balls: int, bins: int, trials: int = 200, seed: int = 0) -> float:
    """Mean over seeded trials of the fullest bin's count, balls thrown uniformly."""
    counts = np.random.default_rng(seed).multinomial(balls, [1 / bins] * bins, size=trials)
    return float(counts.max(axis=1).mean())


@pytest.mark.parametrize("balls, bins", [(4096, 8), (65536, 64), (10**6, 256), (64, 8), (1000, 2)])
def test_expected_max_load_matches_a_simulation(balls, bins):
    simulated, mean = simulated_max_load(balls, bins), balls / bins
    predicted = moe.expected_max_load(balls, bins)
    assert predicted == pytest.approx(simulated, rel=0.02)
    assert predicted - mean == pytest.approx(simulated - mean, rel=0.15)  # the excess itself, not just the total


@pytest.mark.parametrize("bins", [8, 256, 10**4, 10**8, 10**12])
def test_the_excess_tends_to_raab_stegers_leading_term_from_below(bins):
    ratio = moe.expected_max_of_normals(bins) / math.sqrt(2 * math.log(bins))
    assert 0.7 < ratio < 1
    assert moe.expected_max_of_normals(bins * 100) / math.sqrt(2 * math.log(bins * 100)) > ratio


def test_expected_max_load_limits():
    assert moe.expected_max_load(1234.5, 1) == 1234.5  # one bin holds everything
    assert moe.expected_max_load(0, 64) == 0
    assert moe.expected_max_load(1, 1000) == 1  # one ball: the fullest bin holds it
    assert moe.expected_max_load(0.5, 1000) == 0.5  # never above n
    assert moe.expected_max_load(10, 4) >= 3  # pigeonhole: some bin holds ⌈10/4⌉
    assert moe.expected_max_of_normals(1) == 0
    with pytest.raises(ValueError, match="bins=0"):
        moe.expected_max_load(10, 0)
    with pytest.raises(ValueError, match="assignments=-1"):
        moe.expected_max_load(-1, 4)


@given(st.floats(0, 1e9), st.integers(1, 4096))
def test_expected_max_load_lies_between_the_mean_and_all(balls, bins):
    assert balls / bins * (1 - 1e-12) <= moe.expected_max_load(balls, bins) <= balls


@given(st.floats(1, 1e9), st.integers(2, 4096))
def test_expected_max_load_grows_with_the_balls(balls, bins):
    assert moe.expected_max_load(balls * 2, bins) >= moe.expected_max_load(balls, bins)


# ---------------------------------------------------------------------------- rank load factor


def simulated_load_factor(tokens: int, top_k: int, experts: int, ep: int, trials: int = 200) -> float:
    """ep·tokens tokens each route to top_k distinct experts (uniform); rank r holds experts
    [r·E/ep, (r+1)·E/ep). Mean over trials of the busiest rank's pairs / (tokens·top_k)."""
    rng = np.random.default_rng(1)
    factors = []
    for _ in range(trials):
        chosen = rng.random((ep * tokens, experts)).argpartition(top_k - 1, axis=1)[:, :top_k]
        per_rank = np.bincount((chosen // (experts // ep)).ravel(), minlength=ep)
        factors.append(per_rank.max() / (tokens * top_k))
    return float(np.mean(factors))


@pytest.mark.parametrize("tokens, top_k, experts, ep", [(512, 8, 64, 8), (1024, 2, 8, 4), (256, 6, 8, 8)])
def test_rank_load_factor_matches_a_simulation_of_top_k_routing(tokens, top_k, experts, ep):
    simulated = simulated_load_factor(tokens, top_k, experts, ep)
    predicted = moe.rank_load_factor(tokens, top_k, experts, ep)
    assert predicted - 1 == pytest.approx(simulated - 1, rel=0.15)


def test_rank_load_factor_limits():
    assert moe.rank_load_factor(4096, 8, 256, 1) == 1  # one rank holds every expert
    assert moe.rank_load_factor(4096, 8, 8, 2) == 1  # every token to every expert: no randomness
    assert moe.rank_load_factor(0, 8, 256, 8) == 1
    # the closed form: 1 + e_p·sqrt((E − k)/((E − 1)·T·k))
    assert moe.rank_load_factor(4096, 8, 256, 8) == pytest.approx(
        1 + moe.expected_max_of_normals(8) * math.sqrt(248 / (255 * 4096 * 8))
    )


def test_rank_load_factor_grows_with_ep_and_shrinks_with_tokens():
    by_ep = [moe.rank_load_factor(4096, 8, 256, ep) for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert by_ep == sorted(by_ep) and by_ep[0] == 1 < by_ep[1]
    by_tokens = [moe.rank_load_factor(t, 8, 256, 8) for t in (64, 256, 1024, 4096, 16384)]
    assert by_tokens == sorted(by_tokens, reverse=True)


@pytest.mark.parametrize(
    "top_k, experts, ep, message",
    [
        (8, 256, 3, "ep must divide the experts: 256 experts over ep=3"),
        (9, 8, 2, "top_k must be in"),
        (0, 8, 2, "top_k must be in"),
    ],
)
def test_rank_load_factor_refuses_impossible_routing(top_k, experts, ep, message):
    with pytest.raises(ValueError, match=message):
        moe.rank_load_factor(128, top_k, experts, ep)


# ---------------------------------------------------------------------------- all-to-all


def test_all_to_all_is_pairwise_exchange():
    link = LinkSpec(100.0, 10.0, "test")
    # 8 ranks, 800 MB each: 7·10 µs + 7/8·800 MB / 100 GB/s = 70 µs + 7 ms
    assert moe.all_to_all_s(800e6, 8, link) == pytest.approx(70e-6 + 7e-3)
    assert moe.all_to_all_s(800e6, 1, link) == 0


def test_all_to_all_grows_with_bytes_and_ranks_and_is_slower_between_nodes():
    sizes = [moe.all_to_all_s(s, 8, NVLINK4) for s in (0, 1e3, 1e6, 1e9)]
    assert sizes == sorted(sizes) and sizes[0] > 0  # latency alone
    ranks = [moe.all_to_all_s(1e8, p, NVLINK4) for p in (1, 2, 4, 8, 64)]
    assert ranks == sorted(ranks)
    assert moe.all_to_all_s(1e8, 8, NVLINK4) < moe.all_to_all_s(1e8, 8, NDR_PER_GPU)


# ---------------------------------------------------------------------------- one MoE layer


def test_moe_layer_worked_example_deepseek_v3_ep8_on_nvlink():
    """Module doc: T = 4096, k = 8, h = 7168, bf16, E = 256, ep = 8 on NVLink 4 (450 GB/s, 3 µs)."""
    sent_bytes = 4096 * 8 * 7168 * 2
    assert sent_bytes == pytest.approx(469.8e6, rel=1e-3)
    load = moe.rank_load_factor(4096, 8, 256, 8)
    assert load == pytest.approx(1.0078, abs=1e-4)
    one_a2a_s = 7 * 3e-6 + 7 / 8 * load * sent_bytes / 450e9
    assert one_a2a_s == pytest.approx(0.942e-3, rel=1e-3)
    layer_s = moe.moe_layer_a2a_s(4096, 7168, 8, 2, ep=8, experts=256, link=NVLINK4)
    assert layer_s == pytest.approx(2 * one_a2a_s) == pytest.approx(1.88e-3, rel=2e-3)
    across_nodes_s = moe.moe_layer_a2a_s(4096, 7168, 8, 2, ep=8, experts=256, link=NDR_PER_GPU)
    assert across_nodes_s == pytest.approx(16.65e-3, rel=2e-3)


def test_moe_layer_without_ep_communicates_nothing():
    assert moe.moe_layer_a2a_s(4096, 7168, 8, 2, ep=1, experts=256, link=NDR_PER_GPU) == 0


def test_moe_layer_grows_with_every_size_and_with_ep():
    base = dict(tokens=1024, hidden=1024, top_k=4, dtype_bytes=2, ep=8, experts=64, link=NVLINK4)
    t0 = moe.moe_layer_a2a_s(**base)
    for name in ("tokens", "hidden", "top_k", "dtype_bytes"):
        assert moe.moe_layer_a2a_s(**{**base, name: base[name] * 2}) > t0, name
    by_ep = [moe.moe_layer_a2a_s(**{**base, "ep": ep}) for ep in (1, 2, 4, 8, 16, 32, 64)]
    assert by_ep == sorted(by_ep) and by_ep[0] == 0
