"""Pipeline schedules as rank × time grids, for review and as a check on the bubble formula.

torch.distributed.pipelining computes a schedule's action order only inside a live schedule
object (which needs stages and process groups), so the orders are restated here, Megatron's
way, and run on a unit-time simulator: each slot, each rank runs its next action if its
inputs are ready (F of micro-batch i on stage s after F on stage s−1; B on stage s after B on
stage s+1, and after its own F), else idles. With F and B one slot each, the idle fraction
of the grid is the bubble (p − 1)/(v·m + p − 1) of docs/reference-numbers.md's (p − 1)/(v·m) overhead.

    GPipe        all forwards, then all backwards
    1F1B         p − r − 1 warm-up forwards on rank r, then one forward one backward, then the rest
    interleaved  v model chunks per rank (stage c·p + r); forwards go through the chunks in
                 rounds of G micro-batches; warm-up (p − r − 1)·2 + (v − 1)·G (Narayanan et al. 2021)

Megatron's interleaved schedule has G = p and needs m mod p = 0. torch's
``ScheduleInterleaved1F1B`` (what the runtime runs, and what ``passes.planning.strategies`` admits) relaxes
that: max(1, ⌊m/p⌋) rounds of G = m / rounds micro-batches, m a multiple of the rounds; with
m mod p = 0 it is Megatron's. The orders here follow torch's, so every schedule the planner can
choose can be drawn. With m ≥ p the idle share is the formula's; with m < p (one round of
G = m < p, which ``autoshard plan`` draws for its first few micro-batches) each of the v − 1 chunk
changes idles every rank 2(p − m) slots more: 2(p − 1) + 2(v − 1)(p − m) idle slots per rank.

**Zero bubble** (Qi et al. 2024) splits a backward B into I, the gradient of the stage's input
(what the previous stage waits for), and W, its weights' gradient (which nothing waits for),
so W fills the slots where 1F1B idles. Their orders are torch's, restated action for action
(``tests/test_schedule.py`` compares them with torch's own ``_calculate_single_rank_operations``):

    interleaved-zb  ``ScheduleInterleavedZeroBubble`` (ZB1P): interleaved 1F1B's chunks and rounds,
                    warm-up (v − 1)·G + p − r − 1, then F I pairs; rank r runs W of the
                    backward r places before (W trailing I by r actions), the rest at the end
    zbv             ``ScheduleZBVZeroBubble``: 2 stages per rank in a V, rank r holds stages r and
                    2p − 1 − r (the first and the last stage on rank 0)
    dualpipev       ``ScheduleDualPipeV`` (DeepSeek): the V too, F of one stage next to a full
                    backward B of the other ("overlapped"; one after the other here and on gloo);
                    needs m ≥ 2p

In the grid each of F, I and W takes one slot and a full B two (B = I + W; ``backward_slots``), the
zero-bubble paper's T_F = T_I = T_W. Each rank then idles p − 1 slots (interleaved-zb at any m it
admits; zbv and dualpipev at m ≥ 2p; zbv 2(p − 1) at m = p), against 1F1B's and interleaved 1F1B's
3(p − 1) at the same slot sizes (one F and one B, 1 + 2 slots, per hop of the fill and the drain):
with T = 3v slots of work per micro-batch on a rank, the bubble is (p − 1)·T/(3v).
Activations held at the peak (``peak_in_flight``, stage s from its F to its W or B): p micro-batches
on every rank for interleaved-zb and zbv, p + 1/2 for dualpipev, against 1F1B's p − r.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoshard.ir.plan_format import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES

MAX_SLOTS_PER_ACTION = 8  # the simulator stops (a bug) if a schedule cannot make progress


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F", "B" (full backward), "I" (input gradient) or "W" (weight gradient)
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def rank_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The order of actions on each pp rank (fresh lists of the cached orders: the search asks for the
    same (schedule, pp, m, v) once per configuration and stage-cut trial)."""
    return [list(order) for order in _rank_orders(schedule, pp, microbatches, virtual_stages)]


@functools.lru_cache(maxsize=1024)
def _rank_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(order) for order in _build_orders(schedule, pp, microbatches, virtual_stages))


def _build_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    if schedule == "gpipe":
        return [
            [Action(r, "F", i) for i in range(microbatches)] + [Action(r, "B", i) for i in range(microbatches)]
            for r in range(pp)
        ]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, microbatches) for r in range(pp)]
    if schedule == "interleaved-1f1b":
        return [_interleaved(r, pp, microbatches, virtual_stages) for r in range(pp)]
    if schedule == "interleaved-zb":
        return [_interleaved_zero_bubble(r, pp, microbatches, virtual_stages) for r in range(pp)]
    if schedule == "zbv":
        return [_zbv(r, pp, microbatches) for r in range(pp)]
    if schedule == "dualpipev":
        return [_dualpipev(r, pp, microbatches) for r in range(pp)]
    raise ValueError(f"unknown schedule {schedule!r}")


@functools.lru_cache(maxsize=1024)
def split_backward_share(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """Per stage, the share of its micro-batches whose backward its rank's order splits into I and W (the rest
    run one full B): 1 on every stage of interleaved-zb and zbv; DualPipeV splits only some (its overlapped
    F + B pairs run full backwards), 0 for the schedules that never split."""
    split: dict[int, int] = {}
    whole: dict[int, int] = {}
    for order in _rank_orders(schedule, pp, microbatches, virtual_stages):
        for action in order:
            if action.kind == "I":
                split[action.stage] = split.get(action.stage, 0) + 1
            elif action.kind == "B":
                whole[action.stage] = whole.get(action.stage, 0) + 1
    stages = max([*split, *whole], default=-1) + 1
    return tuple(split.get(s, 0) / max(1, split.get(s, 0) + whole.get(s, 0)) for s in range(stages))


def rank_stages(schedule: str, pp: int, virtual_stages: int, pp_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: looped r, r + pp, r + 2·pp, ...; in a V r and 2·pp − 1 − r."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_owners(schedule: str, pp: int, virtual_stages: int) -> list[int]:
    """The rank of each stage (the inverse of ``rank_stages``)."""
    owner = {s: r for r in range(pp) for s in rank_stages(schedule, pp, virtual_stages, r)}
    return [owner[s] for s in range(pp * virtual_stages)]


def backward_slots(schedule: str) -> int:
    """Grid slots of a full backward B: 2 (= I + W) where the schedule splits backward, else 1 (F = B)."""
    return 2 if schedule in ZERO_BUBBLE_SCHEDULES else 1


def draw(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action | None]]:
    """The schedule's unit-time grid (``simulate`` with its ``backward_slots``)."""
    return simulate(
        rank_orders(schedule, pp, microbatches, virtual_stages), pp * virtual_stages, backward_slots(schedule)
    )


def simulate(orders: list[list[Action]], num_stages: int, backward_slots: int = 1) -> list[list[Action | None]]:
    """Unit-time grid: ``grid[rank][slot]`` is the action run then, or None when idle.

    F, I and W take one slot, a full backward B ``backward_slots`` (it fills each of them)."""
    slots = {"F": 1, "I": 1, "W": 1, "B": backward_slots}
    done: set[tuple[int, str, int]] = set()
    position = [0] * len(orders)
    running: list[list | None] = [None] * len(orders)  # [action, slots left]
    grid: list[list[Action | None]] = [[] for _ in orders]
    limit = MAX_SLOTS_PER_ACTION * sum(len(o) for o in orders)
    while any(position[r] < len(orders[r]) or running[r] for r in range(len(orders))):
        assert len(grid[0]) < limit, "schedule cannot make progress"
        finished = []
        for r, order in enumerate(orders):
            if (
                running[r] is None
                and position[r] < len(order)
                and all(n in done for n in _inputs(order[position[r]], num_stages))
            ):
                running[r] = [order[position[r]], slots[order[position[r]].kind]]
                position[r] += 1
            grid[r].append(running[r][0] if running[r] else None)
            if running[r]:
                running[r][1] -= 1
                if running[r][1] == 0:
                    finished.append(running[r][0])
                    running[r] = None
        done.update(_key(a) for a in finished)
    return grid


def _action_seconds(a: Action, forward_s: list[float], backward_s: list[float], weight_s: list[float] | None) -> float:
    """F: forward; B: the whole backward; W: ``weight_s`` of it; I: the rest."""
    if a.kind == "F":
        return forward_s[a.stage]
    weight = weight_s[a.stage] if weight_s is not None else 0.0
    return {"B": backward_s[a.stage], "I": backward_s[a.stage] - weight, "W": weight}[a.kind]


def makespan_s(
    orders: list[list[Action]],
    num_stages: int,
    forward_s: list[float],
    backward_s: list[float],
    weight_s: list[float] | None = None,
) -> float:
    """The step of a schedule whose stages take unequal times: each rank runs its order one
    action after another, an action starting when its rank is free and its inputs are done
    (the dependencies of ``simulate``); F on stage s takes ``forward_s[s]``, B ``backward_s[s]``,
    and where backward is split W ``weight_s[s]`` and I ``backward_s[s] − weight_s[s]``.
    Transfers take no time here. A check on ``cost.pipeline_step``'s pipeline formula with unequal
    ranks, and the zero-bubble schedules' span."""
    return _run(_compile(orders, num_stages), len(orders), forward_s, backward_s, weight_s)


def schedule_makespan_s(
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int,
    forward_s: list[float],
    backward_s: list[float],
    weight_s: list[float] | None = None,
) -> float:
    """``makespan_s`` of a named schedule's orders, their dependency walk worked out once per
    (schedule, pp, m, v): the search prices many configurations of one schedule shape."""
    compiled = _compiled_orders(schedule, pp, microbatches, virtual_stages, len(forward_s))
    return _run(compiled, pp, forward_s, backward_s, weight_s)


@functools.lru_cache(maxsize=1024)
def _compiled_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int, num_stages: int) -> tuple:
    return _compile([list(o) for o in _rank_orders(schedule, pp, microbatches, virtual_stages)], num_stages)


def _compile(orders: list[list[Action]], num_stages: int) -> tuple:
    """The actions in an order that respects every rank's sequence and every input (the walk of
    ``makespan_s``), each as (rank, kind, stage, output slot, input slots). A rank waits on the first
    input not yet made and resumes when it is, so each action is visited a bounded number of times;
    any such walk gives the same finish times (an action's depends only on what precedes it).
    What an action makes is numbered ((stage·3 + what)·M + micro-batch), a list not a dict: the
    search compiles every (schedule, pp, m, v) it prices."""
    width = 1 + max((a.microbatch for order in orders for a in order), default=0)
    made = [-1] * (3 * num_stages * width)  # slot of each product, -1 until made
    what = {"F": 0, "B": 1, "I": 1, "W": 2}

    def product(stage: int, kind: int, microbatch: int) -> int:
        return (stage * 3 + kind) * width + microbatch

    def inputs(a: Action) -> tuple[int, ...]:
        if a.kind == "F":
            return () if a.stage == 0 else (product(a.stage - 1, 0, a.microbatch),)
        if a.kind == "W":
            return (product(a.stage, 1, a.microbatch),)
        after = product(a.stage + 1, 1, a.microbatch) if a.stage < num_stages - 1 else product(a.stage, 0, a.microbatch)
        return after, product(a.stage, 0, a.microbatch)

    position = [0] * len(orders)
    waiting: dict[int, list[int]] = {}
    walk: list[tuple] = []
    ready = list(range(len(orders)))
    while ready:
        r = ready.pop()
        order = orders[r]
        while position[r] < len(order):
            a = order[position[r]]
            needs = inputs(a)
            missing = next((n for n in needs if made[n] < 0), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            out = product(a.stage, what[a.kind], a.microbatch)
            made[out] = len(walk)
            walk.append((r, a.kind, a.stage, made[out], tuple(made[n] for n in needs)))
            position[r] += 1
            ready.extend(waiting.pop(out, ()))
    assert all(position[r] == len(o) for r, o in enumerate(orders)), "schedule cannot make progress"
    return tuple(walk)


def _run(
    compiled: tuple, ranks: int, forward_s: list[float], backward_s: list[float], weight_s: list[float] | None
) -> float:
    """Finish times along a compiled walk: each action starts when its rank is free and its inputs are done."""
    weight = weight_s if weight_s is not None else [0.0] * len(backward_s)
    seconds = {"F": forward_s, "B": backward_s, "W": weight, "I": [b - w for b, w in zip(backward_s, weight)]}
    finish = [0.0] * len(compiled)
    free_at = [0.0] * ranks
    for r, kind, stage, out, needs in compiled:
        start = free_at[r]
        for n in needs:
            if finish[n] > start:
                start = finish[n]
        free_at[r] = finish[out] = start + seconds[kind][stage]
    return max(free_at)


def shared_makespan_s(
    orders: list[list[Action]],
    num_stages: int,
    forward_s: list[float],
    backward_s: list[float],
    replicas: int,
    cores: float,
    forward_wait_s: list[float] | None = None,
    backward_wait_s: list[float] | None = None,
    weight_s: list[float] | None = None,
) -> float:
    """``makespan_s`` on one host whose ranks share ``cores`` cores (processor sharing).

    Each pp rank stands for ``replicas`` ranks running in lockstep (its dp × tp group), so
    R = replicas · pp ranks share the host. An action is work, then a wait: the work (``forward_s``,
    ``backward_s``) is timed at the pace of all R ranks busy, as ``autoshard calibrate`` measures it,
    min(1, C/R) of a core each; the wait (``*_wait_s``: its transfers and collectives, blocked in
    the process group) takes its own time and no core. With n ranks working, work progresses at

        speed(n) = min(1, C/n) / min(1, C/R)   ≥ 1,

    so ranks idle in the fill, the drain or a wait lend their cores to the working ones. Simulated
    event by event. With C ≥ R every speed is 1 and this is ``makespan_s`` of work + wait; speeds
    never fall below 1, so it is never more (the orders are fixed: a faster action delays nothing).
    A split backward's W is ``weight_s`` of the work and waits on nothing; I is the rest and the wait."""
    stages = range(num_stages)
    waits = {"F": forward_wait_s or [0.0 for _ in stages], "B": backward_wait_s or [0.0 for _ in stages]}
    ranks = replicas * len(orders)
    calibrated = min(1.0, cores / ranks)
    finish: dict[tuple[int, str, int], float] = {}
    position = [0] * len(orders)
    running: list[list | None] = [None] * len(orders)  # [action, "work" | "wait", left]
    now = 0.0
    while True:
        for r, order in enumerate(orders):
            if running[r] is None and position[r] < len(order):
                a = order[position[r]]
                if all(n in finish for n in _inputs(a, num_stages)):
                    running[r] = [a, "work", _action_seconds(a, forward_s, backward_s, weight_s)]
                    position[r] += 1
        active = [r for r in range(len(orders)) if running[r] is not None]
        if not active:
            assert all(position[r] == len(o) for r, o in enumerate(orders)), "schedule cannot make progress"
            return now
        working = sum(running[r][1] == "work" for r in active)
        speed = min(1.0, cores / (replicas * working)) / calibrated if working else 1.0
        rates = {r: speed if running[r][1] == "work" else 1.0 for r in active}
        step = min(running[r][2] / rates[r] for r in active)
        now += step
        for r in active:
            running[r][2] -= step * rates[r]
            if running[r][2] > 1e-15:
                continue
            a, phase, _ = running[r]
            wait = 0.0 if a.kind == "W" else waits["F" if a.kind == "F" else "B"][a.stage]
            if phase == "work" and wait > 0:
                running[r] = [a, "wait", wait]
            else:
                finish[_key(a)] = now
                running[r] = None


def _key(a: Action) -> tuple[int, str, int]:
    """What an action makes: F its output, B or I the gradient of its input ("G"), W its weights' gradient."""
    return a.stage, "F" if a.kind == "F" else "W" if a.kind == "W" else "G", a.microbatch


def _inputs(a: Action, num_stages: int) -> list[tuple[int, str, int]]:
    """F on s after F on s − 1; B or I on s after its own F and the gradient from s + 1; W after its I."""
    if a.kind == "F":
        return [] if a.stage == 0 else [(a.stage - 1, "F", a.microbatch)]
    if a.kind == "W":
        return [(a.stage, "G", a.microbatch)]
    after = (a.stage + 1, "G", a.microbatch) if a.stage < num_stages - 1 else (a.stage, "F", a.microbatch)
    return [after, (a.stage, "F", a.microbatch)]


def bubble_fraction(grid: list[list[Action | None]]) -> float:
    slots = sum(len(row) for row in grid)
    return sum(a is None for row in grid for a in row) / slots


def idle_slots(grid: list[list[Action | None]]) -> list[int]:
    """Idle slots of each rank between the grid's start and its last action anywhere."""
    return [sum(a is None for a in row) for row in grid]


def format_grid(grid: list[list[Action | None]]) -> str:
    """``rank 0 | 0F0 0F1 ... 0B1`` lines; idle slots are dots (a two-slot B is printed twice)."""
    width = max(len(str(a)) for row in grid for a in row if a is not None)
    return "\n".join(
        f"rank {r} | " + " ".join(str(a).rjust(width) if a else ".".rjust(width) for a in row)
        for r, row in enumerate(grid)
    )


def schedule_peak_in_flight(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, pp_rank: int, stage_bytes: dict[int, float]
) -> float:
    """``peak_in_flight`` of a named schedule's order on ``pp_rank``: the most of Σ_s bytes_s · held_s(t)
    over the order's held-count vectors after each forward that no other one exceeds in every stage
    (bytes are ≥ 0), worked out once per schedule shape and rank."""
    stages, vectors = _held_counts(schedule, pp, microbatches, virtual_stages, pp_rank)
    return max(sum(stage_bytes[s] * c for s, c in zip(stages, counts)) for counts in vectors)


@functools.lru_cache(maxsize=65536)
def _held_counts(schedule: str, pp: int, microbatches: int, virtual_stages: int, pp_rank: int) -> tuple:
    order = _rank_orders(schedule, pp, microbatches, virtual_stages)[pp_rank]
    stages = tuple(sorted({a.stage for a in order}))
    held = dict.fromkeys(stages, 0)
    vectors = {tuple(held.values())}
    for a in order:  # the peak follows a forward: record the counts after each
        if a.kind == "F":
            held[a.stage] += 1
            vectors.add(tuple(held[s] for s in stages))
        elif a.kind in "BW":
            held[a.stage] -= 1
    return stages, _undominated(vectors)


def backward_held(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, pp_rank: int
) -> tuple[tuple[int, ...], dict[int, tuple[tuple[int, ...], ...]]]:
    """(the stages of ``pp_rank``, for each of them the micro-batches held as one of its backward actions begins:
    B, I or W; the undominated vectors). A vector holds, per stage, the micro-batches it holds from F until B or W
    (``peak_in_flight``), then, per stage, those whose input pass has run and weight pass not (I to W, the
    action's own micro-batch counted from its I: its weight pass's inputs are made during it)."""
    return _backward_held(schedule, pp, microbatches, virtual_stages, pp_rank)


@functools.lru_cache(maxsize=65536)
def _backward_held(schedule: str, pp: int, microbatches: int, virtual_stages: int, pp_rank: int) -> tuple:
    order = _rank_orders(schedule, pp, microbatches, virtual_stages)[pp_rank]
    stages = tuple(sorted({a.stage for a in order}))
    held = dict.fromkeys(stages, 0)
    pending = dict.fromkeys(stages, 0)
    at: dict[int, set[tuple[int, ...]]] = {s: set() for s in stages}
    for a in order:
        if a.kind == "I":
            pending[a.stage] += 1
        if a.kind in "BIW":
            at[a.stage].add(tuple(held[s] for s in stages) + tuple(pending[s] for s in stages))
        if a.kind == "F":
            held[a.stage] += 1
        elif a.kind in "BW":
            held[a.stage] -= 1
        if a.kind == "W":
            pending[a.stage] -= 1
    return stages, {s: _undominated(vectors) for s, vectors in at.items() if vectors}


def _undominated(vectors: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one exceeds in every entry: bytes are ≥ 0, so the peak is at one of them."""
    kept: list[tuple[int, ...]] = []
    for v in sorted(vectors, key=lambda v: (-sum(v), v)):
        if not any(all(k >= x for k, x in zip(other, v)) for other in kept):
            kept.append(v)
    return tuple(sorted(kept))


def peak_in_flight(order: list[Action], stage_bytes: dict[int, float]) -> float:
    """The most activation bytes the rank running ``order`` holds at once: stage s's ``stage_bytes[s]``
    from its F of a micro-batch until that micro-batch's B or W (after I the weights' gradient still
    needs the stage's saved inputs). With every stage 1 it counts the (stage, micro-batch) pairs."""
    held, peak = 0.0, 0.0
    for a in order:
        held += stage_bytes[a.stage] if a.kind == "F" else -stage_bytes[a.stage] if a.kind in "BW" else 0.0
        peak = max(peak, held)
    return peak


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    return order + [Action(rank, "B", i) for i in range(m - warmup, m)]


def interleaved_round_size(pp: int, m: int) -> int:
    """G: micro-batches per round of torch's interleaved 1F1B (module doc); p when m mod p = 0."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(
            f"interleaved 1F1B needs the {m} micro-batches to be a multiple of the "
            f"{rounds} rounds (max(1, m // pp) with pp = {pp}), as torch's ScheduleInterleaved1F1B"
        )
    return m // rounds


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total, group = m * v, interleaved_round_size(pp, m)
    forwards = [Action(_chunk(k, group, v) * pp + rank, "F", _microbatch(k, group, v)) for k in range(total)]
    backwards = [Action((v - 1 - _chunk(k, group, v)) * pp + rank, "B", _microbatch(k, group, v)) for k in range(total)]
    warmup = min((pp - rank - 1) * 2 + (v - 1) * group, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup :]


def _chunk(k: int, group: int, v: int) -> int:
    return (k // group) % v


def _microbatch(k: int, group: int, v: int) -> int:
    return (k // (group * v)) * group + k % group


def _interleaved_zero_bubble(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """torch's ``ScheduleInterleavedZeroBubble`` (ZB1P) on one rank: interleaved 1F1B's chunks and
    rounds with one forward per hop of warm-up, each backward split into I and a W run r
    backwards later (``_get_1f1b_rank_ops`` with zero bubble)."""
    group = interleaved_round_size(pp, m)
    warmup = min((v - 1) * group + (pp - 1 - rank), m * v)
    total = m * v + warmup  # warm-up F, then F + I pairs, then the cool-down's I
    counts: dict[tuple[int, str], int] = {}
    order: list[Action] = []
    backwards: list[int] = []

    def stage_f(step: int) -> int:
        return (step // group) % v * pp + rank

    def stage_b(step: int) -> int:
        return (v - 1 - ((step - warmup) // group) % v) * pp + rank

    def add(stage: int, kind: str) -> None:
        counts[(stage, kind)] = counts.get((stage, kind), 0) + 1
        order.append(Action(stage, kind, counts[(stage, kind)] - 1))

    for step in range(total):
        if step < m * v:
            add(stage_f(step), "F")
        if step >= warmup:
            add(stage_b(step), "I")
            backwards.append(step)
            if step - warmup >= rank:
                add(stage_b(backwards[len(backwards) - 1 - rank]), "W")
    for step in backwards[len(backwards) - rank :] if rank else []:
        add(stage_b(step), "W")
    return order


def _zbv(rank: int, pp: int, m: int) -> list[Action]:
    """torch's ``ScheduleZBVZeroBubble`` on one rank (stages r and 2p − 1 − r). It is written for
    n = max(2p − 1, m) micro-batches; the actions of micro-batches ≥ m are left out, as torch does."""
    n = max(2 * pp - 1, m)
    first, second = rank, 2 * pp - 1 - rank
    count = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    order: list[Action] = []

    def run(stage: int, kinds: str, counter: str) -> None:
        for kind in kinds:
            order.append(Action(stage, kind, count[counter]))
        count[counter] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(first, "F", "f0")
    for _ in range(rank):
        run(second, "F", "f1")
        run(first, "F", "f0")
    for _ in range(pp - rank):
        run(second, "F", "f1")
        run(second, "IW", "b1")
    while count["f1"] < count["f0"] or count["f0"] < n:
        if count["f0"] < n:
            run(first, "F", "f0")
        run(first, "IW", "b0")
        run(second, "F", "f1")
        run(second, "IW", "b1")
    w0, w1 = count["b0"], count["b1"]
    for _ in range(rank):
        run(first, "I", "b0")
        run(second, "I", "b1")
    for _ in range(pp - rank):
        run(first, "I", "b0")
        order.append(Action(first, "W", w0))
        w0 += 1
    order += [Action(second, "W", i) for i in range(w1, count["b1"])]
    order += [Action(first, "W", i) for i in range(w0, count["b0"])]
    return [a for a in order if a.microbatch < m]


def _dualpipev(rank: int, pp: int, m: int) -> list[Action]:
    """torch's ``ScheduleDualPipeV`` on one rank (stages r and 2p − 1 − r); an overlapped F + B is
    the F, then the full B."""
    first, second = rank, 2 * pp - 1 - rank
    counts: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []  # (stage, micro-batch) of the I whose W is still to run
    order: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = counts.get(key, 0)
        order.append(Action(stage, kind, mb))
        counts[key] = mb + 1
        if kind == "I":
            weights.append((stage, mb))

    def weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            order.append(Action(stage, "W", mb))

    for _ in range(2 * (pp - rank - 1)):
        add(first, "F")
    for _ in range(rank + 1):
        add(first, "F")
        add(second, "F")
    for _ in range(pp - rank - 1):
        add(second, "I")
        weight()
        add(second, "F")
    for _ in range(m - 2 * pp + rank + 1):
        add(first, "F")
        add(second, "B")
        add(second, "F")
        add(first, "B")
    for _ in range(pp - rank - 1):
        add(second, "B")
        add(second, "F")
        add(first, "B")
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add(second, "I" if split else "B")
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add(first, "I" if split else "B")
    for _ in range(pp - rank - 1):
        weight()
        add(first, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return order
