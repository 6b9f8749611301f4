"""Pipeline schedule grids: every action once, dependencies honoured, bubbles as the formulas say."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.cost.rank_memory import in_flight
from autoshard.cost.schedule import (
    Action,
    backward_held,
    bubble_fraction,
    draw,
    format_grid,
    idle_slots,
    makespan_s,
    peak_in_flight,
    rank_orders,
    rank_stages,
    shared_makespan_s,
    simulate,
    stage_owners,
)


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [
        ("gpipe", 2, 4, 1),
        ("gpipe", 4, 8, 1),
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 16, 1),
        ("interleaved-1f1b", 2, 4, 2),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 4, 8, 4),
    ],
)
def test_bubble_matches_formula(schedule, pp, m, v):
    grid = simulate(rank_orders(schedule, pp, m, v), pp * v)
    actions = [a for row in grid for a in row if a is not None]
    assert len(actions) == len(set(map(str, actions))) == 2 * pp * v * m  # each F and B once
    # Idle share of the grid = (p−1)/(v·m + p−1) when F and B each take one slot.
    assert bubble_fraction(grid) == pytest.approx((pp - 1) / (v * m + pp - 1), abs=0.02 if v > 1 else 1e-9)


def test_1f1b_grid_text_golden():
    text = format_grid(simulate(rank_orders("1f1b", 2, 3), 2))
    assert text == ("rank 0 | 0F0 0F1   . 0B0 0F2 0B1   . 0B2\nrank 1 |   . 1F0 1B0 1F1 1B1 1F2 1B2   .")


def test_interleaved_has_smaller_bubble_than_1f1b():
    plain = bubble_fraction(simulate(rank_orders("1f1b", 4, 8), 4))
    interleaved = bubble_fraction(simulate(rank_orders("interleaved-1f1b", 4, 8, 2), 8))
    assert interleaved < plain


# ---------------------------------------------------------------------------- shared cores

ZERO_BUBBLE = ["interleaved-zb", "zbv", "dualpipev"]

SHARED_CASES = [
    ("gpipe", 4, 4, 1),
    ("1f1b", 4, 4, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 2, 4, 1),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 8, 2),
]


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
@given(
    case=st.sampled_from(SHARED_CASES + [("interleaved-zb", 2, 4, 2), ("zbv", 2, 4, 2), ("dualpipev", 4, 8, 2)]),
    replicas=st.integers(1, 3),
    cores=st.integers(1, 12),
    times=st.lists(st.floats(0.1, 3.0), min_size=16, max_size=16),
    waits=st.lists(st.floats(0.0, 1.0), min_size=16, max_size=16),
)
def test_shared_cores_between_the_work_and_the_unshared_span(case, replicas, cores, times, waits):
    """Never slower than every rank at its calibrated pace (``makespan_s`` of work + wait; equal
    when the node runs every rank at once), never faster than the node allows: it does at most R
    rank-seconds of calibrated work per second, so the span is at least the mean pp rank's work."""
    schedule, pp, m, v = case
    stages = pp * v
    forward, backward = times[:stages], times[8 : 8 + stages]
    forward_wait, backward_wait = waits[:stages], waits[8 : 8 + stages]
    orders = rank_orders(schedule, pp, m, v)
    weight = [b / 2 for b in backward] if schedule in ZERO_BUBBLE else None  # W: half the backward's work
    unshared = makespan_s(
        orders,
        stages,
        [f + w for f, w in zip(forward, forward_wait)],
        [b + w for b, w in zip(backward, backward_wait)],
        weight,
    )
    shared = shared_makespan_s(orders, stages, forward, backward, replicas, cores, forward_wait, backward_wait, weight)
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


# ---------------------------------------------------------------------------- zero bubble (split backward)


def _zero_bubble_cases(pp_degrees=(2, 3, 4), most=4):
    """(schedule, pp, m) for every m torch's schedule takes up to most·pp (``strategies.microbatch_refusal``)."""
    for schedule in ZERO_BUBBLE:
        for pp in pp_degrees:
            for m in range(2 * pp if schedule == "dualpipev" else pp, most * pp + 1):
                if schedule == "interleaved-zb" and m % max(1, m // pp):
                    continue
                yield schedule, pp, m


def _torch_orders(schedule: str, pp: int, m: int, v: int = 2) -> list[list[Action]]:
    """torch's own ``_calculate_single_rank_operations`` per rank, on an object with only the fields it
    reads (a live schedule needs stages and process groups); an overlapped F + B is its F, then its B."""
    from torch.distributed.pipelining import schedules as S

    kinds = {S.FORWARD: "F", S.FULL_BACKWARD: "B", S.BACKWARD_INPUT: "I", S.BACKWARD_WEIGHT: "W"}
    cls = {
        "interleaved-zb": S.ScheduleInterleavedZeroBubble,
        "zbv": S.ScheduleZBVZeroBubble,
        "dualpipev": S.ScheduleDualPipeV,
    }[schedule]
    obj = object.__new__(cls)
    obj.pp_group_size, obj._n_microbatches, obj.n_local_stages = pp, m, v
    obj.num_stages = obj._num_stages = v * pp
    obj.number_of_rounds = max(1, m // pp)
    obj.microbatches_per_round = m // obj.number_of_rounds
    orders = []
    for rank in range(pp):
        obj.rank = rank
        order = []
        for a in obj._calculate_single_rank_operations(rank):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                order.append(Action(sub.stage_index, kinds[sub.computation_type], sub.microbatch_index))
        orders.append(order)
    return orders


@pytest.mark.parametrize("schedule, pp, m", list(_zero_bubble_cases()))
def test_zero_bubble_orders_are_torchs(schedule, pp, m):
    assert rank_orders(schedule, pp, m, 2) == _torch_orders(schedule, pp, m)


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 6), (3, 9), (4, 8), (4, 12)])
def test_interleaved_zero_bubble_with_3_stages_per_rank_is_torchs(pp, m):
    assert rank_orders("interleaved-zb", pp, m, 3) == _torch_orders("interleaved-zb", pp, m, 3)
    assert idle_slots(draw("interleaved-zb", pp, m, 3)) == [pp - 1] * pp


@pytest.mark.parametrize("schedule, pp, m", list(_zero_bubble_cases()))
def test_zero_bubble_runs_every_backward_once_in_order(schedule, pp, m):
    """Each (stage, micro-batch) has one F and either a full B or an I then a W, on the rank holding it."""
    orders = rank_orders(schedule, pp, m, 2)
    grid = draw(schedule, pp, m, 2)  # finishes: the dependencies never deadlock
    assert len(grid) == pp
    for r, order in enumerate(orders):
        assert {a.stage for a in order} == set(rank_stages(schedule, pp, 2, r))
        for stage in rank_stages(schedule, pp, 2, r):
            for mb in range(m):
                kinds = [a.kind for a in order if (a.stage, a.microbatch) == (stage, mb)]
                assert kinds in (["F", "B"], ["F", "I", "W"]), (stage, mb, kinds)


@pytest.mark.parametrize(
    "schedule, pp, m", [(s, pp, m) for s in ZERO_BUBBLE for pp in (2, 3, 4, 8) for m in (2 * pp, 4 * pp, 8 * pp)]
)
def test_zero_bubble_idles_a_third_of_1f1b(schedule, pp, m):
    """F, I, W one slot each, B two: each rank idles p − 1 slots, 1F1B and interleaved 1F1B 3(p − 1);
    the bubble is (p − 1)·T/(3v) with T = 3v slots of work per micro-batch (``cost.schedule`` doc)."""
    assert idle_slots(draw(schedule, pp, m, 2)) == [pp - 1] * pp
    for legacy, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        assert idle_slots(simulate(rank_orders(legacy, pp, m, v), pp * v, backward_slots=2)) == [3 * (pp - 1)] * pp
    grid = draw(schedule, pp, m, 2)
    assert len(grid[0]) == m * 6 + (pp - 1)  # the span: m·T + (p − 1) slots


def test_zbv_below_2p_micro_batches_idles_more():
    """torch's ZBV is written for 2p − 1 or more micro-batches; at m = p each rank idles 2(p − 1)."""
    assert idle_slots(draw("zbv", 4, 4, 2)) == [6] * 4


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-zb", 4, 8, 2),
        ("zbv", 4, 8, 2),
        ("dualpipev", 4, 8, 2),
        ("zbv", 3, 4, 2),
    ],
)
def test_makespan_with_unit_actions_is_the_grid(schedule, pp, m, v):
    """F = I = W = 1 s and B = 2 s: the timed run is the unit grid (B two slots)."""
    stages = pp * v
    span = makespan_s(rank_orders(schedule, pp, m, v), stages, [1.0] * stages, [2.0] * stages, [1.0] * stages)
    assert span == len(simulate(rank_orders(schedule, pp, m, v), stages, backward_slots=2)[0])
    shared = shared_makespan_s(
        rank_orders(schedule, pp, m, v), stages, [1.0] * stages, [2.0] * stages, 1, 64.0, weight_s=[1.0] * stages
    )
    assert shared == pytest.approx(span, rel=1e-12)  # every rank its own core: no sharing


def test_weight_gradients_fill_the_bubble_only_when_split():
    """With W = 0 the I carries the whole backward and zbv's span is longer than with W = B/2."""
    orders = rank_orders("zbv", 4, 8, 2)
    ones, twos = [1.0] * 8, [2.0] * 8
    assert makespan_s(orders, 8, ones, twos, [1.0] * 8) < makespan_s(orders, 8, ones, twos, [0.0] * 8)


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [
        ("gpipe", 4, 8, 1),
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 16, 1),
        ("interleaved-1f1b", 2, 4, 2),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 4, 16, 2),
    ],
)
def test_peak_in_flight_from_the_order_is_the_formula(schedule, pp, m, v):
    """Counting F until B action by action gives ``rank_memory.in_flight``'s micro-batches."""
    for r, order in enumerate(rank_orders(schedule, pp, m, v)):
        assert peak_in_flight(order, {s: 1 / v for s in range(pp * v)}) == pytest.approx(
            in_flight(schedule, m, pp, v, r)
        )


@pytest.mark.parametrize("schedule, peak", [("interleaved-zb", 4.0), ("zbv", 4.0), ("dualpipev", 4.5)])
def test_zero_bubble_holds_p_micro_batches_on_every_rank(schedule, peak):
    """W runs late, so a stage keeps its inputs longer: p micro-batches on every rank (1F1B: p − r)."""
    orders = rank_orders(schedule, 4, 16, 2)
    assert [peak_in_flight(o, {s: 0.5 for s in range(8)}) for o in orders] == [peak] * 4


def test_v_placement_is_the_runtimes():
    """Pricing and the runtime agree on which stages each rank holds: a V for zbv and dualpipev."""
    from autoshard.runtime.pipeline_parallel import stage_indices

    assert rank_stages("zbv", 4, 2, 0) == [0, 7] == stage_indices(0, 4, 2, "v")
    assert stage_owners("dualpipev", 2, 2) == [0, 1, 1, 0]
    assert stage_owners("interleaved-zb", 2, 2) == [0, 1, 0, 1]
    for schedule, placement in (("zbv", "v"), ("interleaved-zb", "loop"), ("interleaved-1f1b", "loop")):
        for r in range(4):
            assert rank_stages(schedule, 4, 2, r) == stage_indices(r, 4, 2, placement)


def test_zbv_grid_text_golden():
    assert format_grid(draw("zbv", 2, 4, 2)) == (
        "rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3   .\n"
        "rank 1 |   . 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"
    )


def test_a_split_backwards_moments_count_the_weight_passes_still_to_run():
    """``backward_held``'s vectors: per stage the micro-batches held (F to B or W), then those whose input pass
    has run and weight pass not (I to W, the action's own from its I), at every B, I and W. ZBV, pp 2, m 4,
    rank 0 (stages 0 and 3) runs F0 F0 F0 F3 I3 W3 F3 I3 W3 F0 I0 W0 ...: as stage 3's first I begins it holds
    three micro-batches on stage 0 and one on 3, whose weight pass is pending; at stage 0's first I, four
    and none, one pending on 0. 1F1B splits nothing: nothing is ever pending."""
    head = [(a.kind, a.stage) for a in rank_orders("zbv", 2, 4, 2)[0][:12]]
    assert head == [("F", 0)] * 3 + [("F", 3), ("I", 3), ("W", 3)] * 2 + [("F", 0), ("I", 0), ("W", 0)]
    stages, at = backward_held("zbv", 2, 4, 2, 0)
    assert stages == (0, 3)
    assert at[3] == ((3, 1, 0, 1),)
    assert at[0] == ((4, 0, 1, 0),)
    _, one_f_one_b = backward_held("1f1b", 2, 4, 1, 0)
    assert all(v[1:] == (0,) for vs in one_f_one_b.values() for v in vs)
