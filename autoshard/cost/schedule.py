"""Pipeline schedules as rank × time grids, for review and as a check on the bubble formula.

torch.distributed.pipelining computes a schedule's action order only inside a live schedule
object (which needs stages and process groups), so the orders are restated here, Megatron's
way, and run on a unit-time simulator: each slot, each rank runs its next action if its
inputs are ready (F of micro-batch i on stage s after F on stage s−1; B on stage s after B on
stage s+1, and after its own F), else idles. With F and B one slot each, the idle fraction
of the grid is the bubble (p − 1)/(v·m + p − 1) of NUMBERS.md's (p − 1)/(v·m) overhead.

    GPipe        all forwards, then all backwards
    1F1B         p − r − 1 warm-up forwards on rank r, then one forward one backward, then the rest
    interleaved  v model chunks per rank (stage c·p + r); forwards go through the chunks in
                 rounds of G micro-batches; warm-up (p − r − 1)·2 + (v − 1)·G (Narayanan et al. 2021)

Megatron's interleaved schedule has G = p and needs m mod p = 0. torch's
``ScheduleInterleaved1F1B`` (what the runtime runs, and what ``passes.strategies`` admits) relaxes
that: max(1, ⌊m/p⌋) rounds of G = m / rounds micro-batches, m a multiple of the rounds; with
m mod p = 0 it is Megatron's. The orders here follow torch's, so every schedule the planner can
choose can be drawn. With m ≥ p the idle share is the formula's; with m < p (one round of
G = m < p, which ``autoshard plan`` draws for its first few micro-batches) each of the v − 1 chunk
changes idles every rank 2(p − m) slots more: 2(p − 1) + 2(v − 1)(p − m) idle slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS_PER_ACTION = 8  # the simulator stops (a bug) if a schedule cannot make progress


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def rank_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The order of actions on each pp rank."""
    if schedule == "gpipe":
        return [[Action(r, "F", i) for i in range(microbatches)] + [Action(r, "B", i) for i in range(microbatches)]
                for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, microbatches) for r in range(pp)]
    if schedule == "interleaved-1f1b":
        return [_interleaved(r, pp, microbatches, virtual_stages) for r in range(pp)]
    raise ValueError(f"unknown schedule {schedule!r}")


def simulate(orders: list[list[Action]], num_stages: int) -> list[list[Action | None]]:
    """Unit-time grid: ``grid[rank][slot]`` is the action run then, or None when idle."""
    done: set[tuple[int, str, int]] = set()
    position = [0] * len(orders)
    grid: list[list[Action | None]] = [[] for _ in orders]
    limit = MAX_SLOTS_PER_ACTION * sum(len(o) for o in orders)
    while any(position[r] < len(orders[r]) for r in range(len(orders))):
        assert len(grid[0]) < limit, "schedule cannot make progress"
        ready = [_next_if_ready(orders[r], position[r], done, num_stages) for r in range(len(orders))]
        for r, action in enumerate(ready):
            grid[r].append(action)
            if action is not None:
                position[r] += 1
        done.update((a.stage, a.kind, a.microbatch) for a in ready if a is not None)
    return grid


def makespan_s(orders: list[list[Action]], num_stages: int, forward_s: list[float], backward_s: list[float]) -> float:
    """The step of a schedule whose stages take unequal times: each rank runs its order one
    action after another, an action starting when its rank is free and its inputs are done
    (the dependencies of ``simulate``); F on stage s takes ``forward_s[s]``, B ``backward_s[s]``.
    Transfers take no time here. A check on ``cost.pipeline_step``'s pipeline formula with unequal ranks."""
    finish: dict[tuple[int, str, int], float] = {}
    free_at = [0.0] * len(orders)
    position = [0] * len(orders)
    while any(position[r] < len(orders[r]) for r in range(len(orders))):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                needs = _inputs(a, num_stages)
                if any(n not in finish for n in needs):
                    break
                start = max([free_at[r]] + [finish[n] for n in needs])
                free_at[r] = start + (forward_s if a.kind == "F" else backward_s)[a.stage]
                finish[(a.stage, a.kind, a.microbatch)] = free_at[r]
                position[r] += 1
                progressed = True
        assert progressed, "schedule cannot make progress"
    return max(free_at)


def shared_makespan_s(orders: list[list[Action]], num_stages: int, forward_s: list[float], backward_s: list[float],
                      replicas: int, cores: float, forward_wait_s: list[float] | None = None,
                      backward_wait_s: list[float] | None = None) -> float:
    """``makespan_s`` on one host whose ranks share ``cores`` cores (processor sharing).

    Each pp rank stands for ``replicas`` ranks running in lockstep (its dp × tp group), so
    R = replicas · pp ranks share the host. An action is work, then a wait: the work (``forward_s``,
    ``backward_s``) is timed at the pace of all R ranks busy, as ``autoshard calibrate`` measures it,
    min(1, C/R) of a core each; the wait (``*_wait_s``: its transfers and collectives, blocked in
    the process group) takes its own time and no core. With n ranks working, work progresses at

        speed(n) = min(1, C/n) / min(1, C/R)   ≥ 1,

    so ranks idle in the fill, the drain or a wait lend their cores to the working ones. Simulated
    event by event. With C ≥ R every speed is 1 and this is ``makespan_s`` of work + wait; speeds
    never fall below 1, so it is never more (the orders are fixed: a faster action delays nothing)."""
    stages = range(num_stages)
    wait = {"F": forward_wait_s or [0.0 for _ in stages], "B": backward_wait_s or [0.0 for _ in stages]}
    work = {"F": forward_s, "B": backward_s}
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
                    running[r] = [a, "work", work[a.kind][a.stage]]
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
            if phase == "work" and wait[a.kind][a.stage] > 0:
                running[r] = [a, "wait", wait[a.kind][a.stage]]
            else:
                finish[(a.stage, a.kind, a.microbatch)] = now
                running[r] = None


def _inputs(a: Action, num_stages: int) -> list[tuple[int, str, int]]:
    if a.kind == "F":
        return [] if a.stage == 0 else [(a.stage - 1, "F", a.microbatch)]
    after = (a.stage + 1, "B", a.microbatch) if a.stage < num_stages - 1 else (a.stage, "F", a.microbatch)
    return [after, (a.stage, "F", a.microbatch)]


def bubble_fraction(grid: list[list[Action | None]]) -> float:
    slots = sum(len(row) for row in grid)
    return sum(a is None for row in grid for a in row) / slots


def format_grid(grid: list[list[Action | None]]) -> str:
    """``rank 0 | 0F0 0F1 ... 0B1`` lines; idle slots are dots."""
    width = max(len(str(a)) for row in grid for a in row if a is not None)
    return "\n".join(f"rank {r} | " + " ".join(str(a).rjust(width) if a else ".".rjust(width) for a in row)
                     for r, row in enumerate(grid))


def _next_if_ready(order: list[Action], pos: int, done: set, num_stages: int) -> Action | None:
    if pos >= len(order):
        return None
    a = order[pos]
    if a.kind == "F":
        ok = a.stage == 0 or (a.stage - 1, "F", a.microbatch) in done
    else:
        after = (a.stage + 1, "B", a.microbatch) if a.stage < num_stages - 1 else (a.stage, "F", a.microbatch)
        ok = after in done and (a.stage, "F", a.microbatch) in done
    return a if ok else None


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
        raise ValueError(f"interleaved 1F1B needs the {m} micro-batches to be a multiple of the "
                         f"{rounds} rounds (max(1, m // pp) with pp = {pp}), as torch's ScheduleInterleaved1F1B")
    return m // rounds


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total, group = m * v, interleaved_round_size(pp, m)
    forwards = [Action(_chunk(k, group, v) * pp + rank, "F", _microbatch(k, group, v)) for k in range(total)]
    backwards = [Action((v - 1 - _chunk(k, group, v)) * pp + rank, "B", _microbatch(k, group, v))
                 for k in range(total)]
    warmup = min((pp - rank - 1) * 2 + (v - 1) * group, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup:]


def _chunk(k: int, group: int, v: int) -> int:
    return (k // group) % v


def _microbatch(k: int, group: int, v: int) -> int:
    return (k // (group * v)) * group + k % group
