"""Pricing ahead on a second core: the search's candidates priced by two processes, the search unchanged.

``passes.planning.search`` prices candidates one by one in increasing lower bound LB and stops at the first
k with LB(k) > T*(k), T*(k) the fastest fitting price among positions < k. Pricing is most of a plan's time
(GPT-3 175B on 1024 GPUs: ~2.9 s of ~7 s; DeepSeek-V3 on 2048: ~10 s of ~20 s) and each candidate's price is
a pure function of the graph, the cluster and the candidate (``cost.tables.CostTables`` only caches).

**How.** ``price_ahead`` forks one worker; it and this process take the next position from a shared counter,
price it and lower a shared T_shared to the fitting prices it finds; each stops at the first position it takes
whose LB exceeds T_shared. The worker sends its prices back through a pipe; the search then
runs its own loop on them, pricing in this process any position it needs that neither priced, so the
candidates priced, the plan and its alternatives are those of the one-process search, byte for byte.

Before that, the per-unit cost tables the bounds read are split between two processes too
(``units_on_two_cores``): the worker computes half and sends them back, so neither computes the other's.

**Why nothing it needs is missed.** A process skips position k only if LB(k) > T_shared. T_shared is some
candidate j's price: if j precedes k, T*(k) ≤ T_j < LB(k) and the search stops at or before k; if j follows k,
T_j ≥ LB(j) ≥ LB(k) (a bound is below its price; positions are in bound order), a contradiction. So every
position the search reaches was priced (and a bound off by rounding is caught by the loop's own pricing).

**When.** Only where forking is safe and pays: ``os.fork`` exists, one Python thread runs, the machine has a
second core for this process, at least ``MIN_CANDIDATES`` candidates, and ``AUTOSHARD_PRICE_AHEAD`` is not
"0". The worker is a ``passes.forked.Forked``; one that dies answers nothing and the search prices alone.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

from autoshard.passes.forked import Forked

MIN_CANDIDATES = 64  # fewer are priced in well under a second: a fork (~10-50 ms) would not pay


def forking_pays(candidates: int) -> bool:
    """Fork exists, this process has another core, one Python thread runs, enough candidates, not turned off."""
    return (
        hasattr(os, "fork")
        and candidates >= MIN_CANDIDATES
        and len(os.sched_getaffinity(0)) >= 2
        and threading.active_count() == 1
        and os.environ.get("AUTOSHARD_PRICE_AHEAD", "1") != "0"
    )


def price_ahead(
    order: list[int], bounds: list[float], price_one: Callable[[int], list[Any]], fastest_of: Callable[[list], float]
) -> dict[int, list[Any]]:
    """Candidate index -> ``price_one(index)`` for the positions of ``order`` this process and one forked worker
    priced (module doc): every position the search's loop will reach, and maybe a few after it; nothing where
    the machine cannot fork (the loop then prices alone). Each process takes the next position: splitting by the
    cost tables a candidate needs (its TP layout, its recompute) instead was tried and balanced worse
    (DeepSeek-V3: 7.6 and 9.5 s against 7.4 and 7.4 s per process)."""
    try:
        context = multiprocessing.get_context("fork")
        taken, fastest, lock = context.RawValue("q", 0), context.RawValue("d", math.inf), context.Lock()
    except OSError:  # no shared memory or semaphores here: the loop prices alone
        return {}
    worker = Forked.start(lambda: _take(order, bounds, price_one, fastest_of, taken, fastest, lock))
    if worker is None:  # memory or process limits: the loop prices alone
        return {}
    try:
        mine = _take(order, bounds, price_one, fastest_of, taken, fastest, lock)
        theirs = worker.result() or {}  # a worker that raised or died: the loop prices what it took
    finally:
        worker.stop()
    return theirs | mine


LOCK_WAIT_S = 5.0  # the other process holds the counter for microseconds; longer, it died holding it


def _take(order, bounds, price_one, fastest_of, taken, fastest, lock) -> dict[int, list[Any]]:
    """Price the next position of ``order`` not taken yet, until none is left or its bound exceeds the shared
    fastest price. The fastest price is one aligned double, written without the lock: a write that loses a race
    only leaves it higher than it could be (less pruning; still some candidate's price, as the module doc needs).
    A worker killed while holding the lock stops this process's taking, not the search (the loop prices the rest)."""
    out: dict[int, list[Any]] = {}
    while True:
        if not lock.acquire(timeout=LOCK_WAIT_S):
            return out
        k = taken.value
        taken.value = k + 1
        lock.release()
        if k >= len(order) or bounds[order[k]] > fastest.value:
            return out
        i = order[k]
        out[i] = price_one(i)
        found = fastest_of(out[i])
        if found < fastest.value:
            fastest.value = found


def units_on_two_cores(tables, configs) -> None:
    """Fill ``tables`` with the per-unit costs every configuration's bound reads (``CostTables.config_units``, one
    table per micro-batch, recompute and autocast: GPT-3 175B's 2,808 candidates read 23), half of them computed
    by a forked worker meanwhile and sent back: the bounds then cost next to nothing, and the pricing worker forked
    after them inherits every table. A worker that cannot be forked or dies leaves its half to be computed here."""
    keys = sorted({tables.unit_args(c) for c in configs if c.recompute != "mixed"}, key=repr)
    if len(keys) < 2:
        return
    worker = Forked.start(lambda: {args: tables.units(*args) for args in keys[1::2]})
    try:
        for args in keys[0::2]:
            tables.units(*args)
        theirs = worker.result() if worker is not None else None
    finally:
        if worker is not None:
            worker.stop()
    for args, units in (theirs or {}).items():
        tables.adopt_units(args, units)
