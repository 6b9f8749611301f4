"""Pipeline schedule grids: every action once, dependencies honoured, bubbles as the formulas say."""

import pytest

from autoshard.cost.schedule import bubble_fraction, format_grid, rank_orders, simulate


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
