"""Pipeline schedule grids: every action once, dependencies honoured, bubbles as the formulas say."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.cost.schedule import bubble_fraction, format_grid, makespan_s, rank_orders, shared_makespan_s, simulate


@pytest.mark.parametrize("schedule, pp, m, v", [
    ("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 8, 4),
])
def test_bubble_matches_formula(schedule, pp, m, v):
    grid = simulate(rank_orders(schedule, pp, m, v), pp * v)
    actions = [a for row in grid for a in row if a is not None]
    assert len(actions) == len(set(map(str, actions))) == 2 * pp * v * m  # each F and B once
    # Idle share of the grid = (p−1)/(v·m + p−1) when F and B each take one slot.
    assert bubble_fraction(grid) == pytest.approx((pp - 1) / (v * m + pp - 1), abs=0.02 if v > 1 else 1e-9)


def test_1f1b_grid_text_golden():
    text = format_grid(simulate(rank_orders("1f1b", 2, 3), 2))
    assert text == ("rank 0 | 0F0 0F1   . 0B0 0F2 0B1   . 0B2\n"
                    "rank 1 |   . 1F0 1B0 1F1 1B1 1F2 1B2   .")


def test_interleaved_has_smaller_bubble_than_1f1b():
    plain = bubble_fraction(simulate(rank_orders("1f1b", 4, 8), 4))
    interleaved = bubble_fraction(simulate(rank_orders("interleaved-1f1b", 4, 8, 2), 8))
    assert interleaved < plain


# ---------------------------------------------------------------------------- shared cores

SHARED_CASES = [("gpipe", 4, 4, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1),
                ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2)]


@pytest.mark.parametrize("schedule, pp, m, v", SHARED_CASES)
@pytest.mark.parametrize("replicas, cores", [(1, 2), (1, 1), (2, 2), (2, 3)])
def test_shared_cores_with_equal_actions_is_the_grid_at_each_slots_speed(schedule, pp, m, v, replicas, cores):
    """F = B = 1 everywhere: actions start together and end together, so the span is the unit-time
    grid's slots, each lasting 1/speed(n) = min(1, C/R) / min(1, C/n) with n ranks busy in it."""
    orders = rank_orders(schedule, pp, m, v)
    grid = simulate(orders, pp * v)
    ranks = replicas * pp
    expected = 0.0
    for slot in range(len(grid[0])):
        busy = replicas * sum(row[slot] is not None for row in grid)
        expected += min(1.0, cores / ranks) / min(1.0, cores / busy)
    ones = [1.0] * (pp * v)
    assert shared_makespan_s(orders, pp * v, ones, ones, replicas, cores) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(SHARED_CASES), replicas=st.integers(1, 3), cores=st.integers(1, 12),
       times=st.lists(st.floats(0.1, 3.0), min_size=16, max_size=16),
       waits=st.lists(st.floats(0.0, 1.0), min_size=16, max_size=16))
def test_shared_cores_between_the_work_and_the_unshared_span(case, replicas, cores, times, waits):
    """Never slower than every rank at its calibrated pace (``makespan_s`` of work + wait; equal
    when the node runs every rank at once), never faster than the node allows: it does at most R
    rank-seconds of calibrated work per second, so the span is at least the mean pp rank's work."""
    schedule, pp, m, v = case
    stages = pp * v
    forward, backward = times[:stages], times[8:8 + stages]
    forward_wait, backward_wait = waits[:stages], waits[8:8 + stages]
    orders = rank_orders(schedule, pp, m, v)
    unshared = makespan_s(orders, stages, [f + w for f, w in zip(forward, forward_wait)],
                          [b + w for b, w in zip(backward, backward_wait)])
    shared = shared_makespan_s(orders, stages, forward, backward, replicas, cores, forward_wait, backward_wait)
    assert shared <= unshared * (1 + 1e-12)
    if cores >= replicas * pp:
        assert shared == pytest.approx(unshared, rel=1e-12)
    else:
        work_per_pp_rank = m * sum(f + b for f, b in zip(forward, backward)) / pp
        assert shared >= work_per_pp_rank * (1 - 1e-12)


def test_a_wait_takes_no_core():
    """Three pp ranks on one core (speed 3 alone, 1.5 in pairs), GPipe, two micro-batches, every
    action 1 s of work; stages 0 and 2 wait 1 s after each forward. While rank 0 waits on its second
    send (t = 2..3) rank 2 works alone at speed 3 and finishes its first forward at 7/3, not 8/3:
    that third of a second carries to the end, 20/3 s instead of the 7 s of a wait holding a core."""
    orders = rank_orders("gpipe", 3, 2)
    span = shared_makespan_s(orders, 3, [1.0] * 3, [1.0] * 3, 1, 1.0, [1.0, 0.0, 1.0], [0.0] * 3)
    assert span == pytest.approx(20 / 3)
