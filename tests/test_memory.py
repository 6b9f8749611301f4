"""ZeRO model-state memory: the worked examples in docs/reference-numbers.md and monotonicity."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.cost.memory import FP32, MEGATRON_MIXED, model_state_bytes

GB = 1e9


def state_gb(params, stage, dp):
    return sum(model_state_bytes(params, stage, dp, MEGATRON_MIXED)) / GB


def test_zero1_7_5b_on_64_ranks_is_31_4_gb():
    assert state_gb(7.5e9, 1, 64) == pytest.approx(31.4, abs=0.05)


def test_12b_on_8_ranks_dp_192_gb_zero3_24_gb():
    assert state_gb(12e9, 0, 8) == pytest.approx(192.0)
    assert state_gb(12e9, 3, 8) == pytest.approx(24.0)


def test_zero2_is_2_plus_14_over_n():
    psi, n = 1e9, 16
    assert state_gb(psi, 2, n) == pytest.approx((2 * psi + 14 * psi / n) / GB)


@given(params=st.integers(1, 10**12), dp=st.integers(1, 4096), stage=st.integers(0, 2))
def test_memory_never_rises_with_stage_or_dp(params, dp, stage):
    for precision in (MEGATRON_MIXED, FP32):
        here = sum(model_state_bytes(params, stage, dp, precision))
        assert sum(model_state_bytes(params, stage + 1, dp, precision)) <= here
        assert sum(model_state_bytes(params, stage, dp + 1, precision)) <= here
