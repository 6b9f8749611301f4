"""Elastic runs: ``autoshard run PLAN --elastic MIN:MAX`` re-plans for the ranks it has and goes on.

The job runs under a supervisor, this module's ``run_elastic``: it launches torchrun with the plan's
ranks (``launch.run_torchrun``, no torchrun restarts of its own) and, when the job fails, launches it
again, every attempt resuming from the newest complete checkpoint (``runtime.checkpoint``):

    a rank killed outright (SIGKILL: its process, device or host went away)   a lost worker: the next
                                                                                attempt has W - lost ranks,
                                                                                on the devices left
    an error of the program on a rank (an exception: exit status 1; any       the job stops in one line,
    positive status but a peer fault's), and no rank lost                     with the run's failure code:
                                                                                the same plan would fail again
    any other failure (a crash by another signal, ranks stopped by torchrun   the same W ranks again, as
    or by a peer fault: a lost peer, a timed-out collective, exit 3,          torchrun's own restarts do
    ``runtime.faults.PEER_FAULT_EXIT``)

The devices: torchrun runs local rank r on ``cuda:r`` of the devices ``CUDA_VISIBLE_DEVICES`` shows (all of them
when it is unset), so a relaunch after a loss sets it to the surviving ranks' devices (``surviving_devices``):
rank r of the next attempt runs on the r-th device left, and a device that went away is not used again.

Each attempt with another world size W' runs a plan re-planned for W' (``replan``): the same model,
cluster (its devices per node set to W', one node), global batch, precision and float8 recipe, every
other decision searched again from the capture cache (``passes.capturing.capture_cache``: no capture, no
torch import in the search). Of MIN ≤ W' ≤ W - lost, the largest whose plan keeps the global batch B is
taken; where none does, the job stops with one line. DCP loads the checkpoint into the new plan's sharding
(state is keyed by the model's parameter names, whatever the plan), and the data position is a function
of the step and B (``runtime.data``: the global batch of step k is the same samples whatever dp is), so
the resumed attempt trains on exactly the samples the lost one would have: none skipped, none repeated.
What changes with W' is how B is split (more micro-batches or larger ones per rank) and the order of the
reductions, so the run is the same computation up to fp32 rounding. Except where the split is the computation:
BatchNorm normalises over each micro-batch (its dp·b samples, statistics synchronised over dp), so a model with
BatchNorm keeps its micro-batch count m (``PlanRequest.num_microbatches``), and for m > 1 its dp as well, since
which samples share micro-batch j depends on dp (rank r takes slice r of the step's samples, then its j-th b);
where no plan at W' keeps them, that W' is refused like one that cannot keep B.

Why a supervisor and not torchrun's own elastic rendezvous (``--nnodes MIN:MAX``): torchrun's agents
re-rendezvous and start the *same* program with a new ``WORLD_SIZE``, but a program is one plan's, compiled
for its world size; re-planning inside every rank would put the planner in the runtime (which imports only
ir, errors and modelfile) and make W' ranks plan at once. ``autoshard run`` runs one machine's ranks
(``launch.check_runs_here``), so one supervisor on it sees every rank's end. Growing back (workers that
return) needs a source of new capacity, which one machine has not: the supervisor only shrinks.

The re-planned plans and programs are kept in ``CHECKPOINT_DIR/elastic/`` (``plan-<W'>ranks.json``,
``train-<W'>ranks.py``), so the run after a loss can be read, and repeated, as any plan.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.recipe import Recipe

ELASTIC_FOLDER = "elastic"  # under the checkpoint folder: the re-planned plans and programs
DEFAULT_ELASTIC_RESTARTS = 3  # --elastic without --max-restarts: this many relaunches at most
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"  # the GPUs a launch's local ranks 0, 1, ... run on, in order


@dataclass(frozen=True)
class ElasticRange:
    """``--elastic MIN:MAX``: the world sizes the job may run at."""

    min_ranks: int
    max_ranks: int

    @classmethod
    def parse(cls, text: str) -> ElasticRange:
        """``"2:4"`` -> ElasticRange(2, 4); anything else is one line naming the fix."""
        low, sep, high = text.partition(":")
        if not sep or not low.isdigit() or not high.isdigit() or int(low) < 1 or int(low) > int(high):
            raise AutoshardError(
                f"--elastic {text!r} must be MIN:MAX, two rank counts with 1 <= MIN <= MAX; e.g. --elastic 2:4"
            )
        return cls(int(low), int(high))

    def check_plan(self, world_size: int) -> None:
        """The plan's world size is one the range allows."""
        if not self.min_ranks <= world_size <= self.max_ranks:
            raise AutoshardError(
                f"the plan runs on {world_size} ranks, outside --elastic {self.min_ranks}:{self.max_ranks}; "
                f"fix: give a range that holds {world_size}, e.g. --elastic {min(self.min_ranks, world_size)}:"
                f"{max(self.max_ranks, world_size)}"
            )


def lost_ranks(failures: dict[int, int]) -> list[int]:
    """The ranks whose process was killed outright (exit status -SIGKILL), of ``failures`` (rank -> torchrun's
    exit status of the rank: negative, the signal that ended it). torchrun stops the others with SIGTERM."""
    return sorted(rank for rank, exitcode in failures.items() if exitcode == -signal.SIGKILL)


def program_errors(failures: dict[int, int]) -> list[int]:
    """The ranks of ``failures`` (rank -> exit status) that failed by an error of their own: a positive status
    other than ``PEER_FAULT_EXIT`` (a rank that a peer's fault ended: ``runtime.faults.guard``)."""
    from autoshard.runtime.faults import PEER_FAULT_EXIT

    return sorted(rank for rank, exitcode in failures.items() if exitcode > 0 and exitcode != PEER_FAULT_EXIT)


def visible_devices(world_size: int, environ=os.environ) -> list[str]:
    """The devices local ranks 0 .. W-1 run on, in order: the first W of ``CUDA_VISIBLE_DEVICES`` (indices or
    UUIDs), or 0 .. W-1 when it is unset."""
    listed = [device.strip() for device in environ.get(VISIBLE_DEVICES_ENV, "").split(",") if device.strip()]
    return listed[:world_size] if listed else [str(rank) for rank in range(world_size)]


def surviving_devices(devices: list[str], lost: list[int], world_size: int) -> list[str]:
    """The devices of the next attempt's ``world_size`` ranks: local rank r ran on ``devices[r]``; the lost
    ranks' devices are left out and the first ``world_size`` of the others kept, in order."""
    return [device for rank, device in enumerate(devices) if rank not in lost][:world_size]


def replan(plan: Plan, world_size: int) -> Plan:
    """``plan``'s request at ``world_size`` ranks on one node of the same devices (module doc): the model, the
    global batch and the precision and float8 pins kept, the rest searched; for a model with BatchNorm the
    micro-batches too (``batch_norm_pins``). A re-plan whose precision or float8 recipe would differ from
    ``plan``'s (they follow the model and the devices, so they should not) is refused: it would train another
    computation."""
    from autoshard.ir.decisions import PIN_OF_PRECISION
    from autoshard.ir.pins import Pins
    from autoshard.ir.topology import Cluster
    from autoshard.passes.planning.pin_checks import check_pins
    from autoshard.passes.planning.strategies import graph_batch_norm
    from autoshard.pipeline import PlanRequest, plan_graph, request_graph

    cluster = Cluster.from_dict(
        {**plan.cluster, "nodes": 1, "devices_per_node": world_size}, where="the plan's cluster"
    )
    pinned = plan.provenance.pinned
    kept = {"precision": PIN_OF_PRECISION[plan.decisions.precision]} if "precision" in pinned else {}
    kept |= {"float8": plan.decisions.float8} if "float8" in pinned else {}
    request = PlanRequest(
        model_spec=plan.model["spec"],
        cluster=cluster,
        global_batch=plan.global_batch,
        pins=Pins(**kept),
        runtime=plan.provenance.runtime,
        seq_len=plan.model.get("seq_len"),
    )
    check_pins(request.pins, request.cluster, request.global_batch)
    done: list[str] = []
    model_file, graph = request_graph(request, done)
    if graph_batch_norm(graph):
        pins, count = batch_norm_pins(plan, world_size)
        request = replace(request, pins=Pins(**kept, **pins), num_microbatches=count)
        check_pins(request.pins, request.cluster, request.global_batch)
    new = plan_graph(request, model_file, graph, done)
    before, after = (plan.decisions.precision, plan.decisions.float8), (new.decisions.precision, new.decisions.float8)
    if after != before:
        raise AutoshardError(
            f"re-planned at {world_size} ranks, the precision and float8 recipe would be {after}, not {before}"
        )
    return new


def batch_norm_pins(plan: Plan, world_size: int) -> tuple[dict[str, int], int]:
    """(pins, micro-batch count) that keep a BatchNorm model's batches of statistics those of ``plan``.

    BatchNorm normalises over each micro-batch j, the j-th b samples of every dp rank (statistics synchronised
    over dp: ``runtime.model.sync_batch_norm``). With m micro-batches of B samples, micro-batch j holds B/m
    samples, so m is kept. For m = 1 that is the whole step at any dp; for m > 1, rank r takes slice r of the
    step's samples (``runtime.data.take_shard``) and micro-batch j its j-th b of them, so which samples
    share micro-batch j depends on dp: dp is kept too, and a ``world_size`` it does not divide is refused."""
    d = plan.decisions
    if d.num_microbatches == 1:
        return {}, 1
    if world_size % d.mesh.dp:
        raise AutoshardError(
            f"the model's BatchNorm normalises over each of the plan's {d.num_microbatches} micro-batches, whose "
            f"samples follow dp, so dp {d.mesh.dp} is kept, which {world_size} ranks cannot hold"
        )
    return {"dp": d.mesh.dp}, d.num_microbatches


def plan_for_ranks(plan: Plan, available: int, elastic: ElasticRange) -> tuple[Plan, float]:
    """The plan for the most ranks of ``elastic.min_ranks`` .. ``available`` that keeps the global batch, and the
    seconds its re-planning took (the failed tries included); one line when none does."""
    if available < elastic.min_ranks:
        raise AutoshardError(
            f"{available} rank(s) left, fewer than --elastic {elastic.min_ranks}:{elastic.max_ranks} allows; fix: "
            f"resume from the newest checkpoint when more ranks are back, or lower --elastic MIN"
        )
    start = time.perf_counter()
    reasons = []
    for world_size in range(min(available, elastic.max_ranks), elastic.min_ranks - 1, -1):
        if world_size == plan.world_size:
            return plan, time.perf_counter() - start
        try:
            return replan(plan, world_size), time.perf_counter() - start
        except AutoshardError as exc:
            reasons.append(f"{world_size} ranks: {str(exc).splitlines()[0]}")
    raise AutoshardError(
        f"{available} rank(s) left and no plan of {elastic.min_ranks} to {min(available, elastic.max_ranks)} ranks "
        f"keeps the global batch of {plan.global_batch} ({'; '.join(reasons)}); "
        f"fix: resume from the checkpoint with a plan of another global batch, or lower --elastic MIN"
    )


def describe(plan: Plan) -> str:
    """How a plan splits the global batch: ``dp=2 tp=1 pp=1 zero=2, 2 micro-batch(es) of 2 sample(s) per rank``."""
    d = plan.decisions
    mesh = f"dp={d.mesh.dp} tp={d.mesh.tp} pp={d.mesh.pp}" + (f" cp={d.mesh.cp}" if d.mesh.cp > 1 else "")
    return f"{mesh} zero={d.zero_stage}, {d.num_microbatches} micro-batch(es) of {d.microbatch_size} sample(s) per rank"


def elastic_paths(checkpoint_dir: str | Path, world_size: int) -> tuple[Path, Path]:
    """Where the plan re-planned for ``world_size`` ranks and its program are kept."""
    folder = Path(checkpoint_dir) / ELASTIC_FOLDER
    return folder / f"plan-{world_size}ranks.json", folder / f"train-{world_size}ranks.py"


@dataclass(frozen=True)
class Attempt:
    """One torchrun launch of the elastic job: its plan and the program emitted for it."""

    plan: Plan
    program: Path


def run_elastic(
    first: Attempt,
    elastic: ElasticRange,
    program_args: list[str],
    checkpoint_dir: str,
    max_restarts: int,
    recipe: Recipe | None = None,
) -> int:
    """Run ``first`` and relaunch it after each failure, re-planned where ranks were lost (module doc); the exit
    status of the last attempt. At most ``max_restarts`` relaunches."""
    from autoshard.launch import run_torchrun, write_program
    from autoshard.runtime.faults import ELASTIC_ATTEMPT_ENV, ELASTIC_LEFT_ENV

    threading.Thread(target=warm_planner, name="autoshard-warm-planner", daemon=True).start()
    attempt, relaunches = first, 0
    devices, device_env = visible_devices(first.plan.world_size), {}  # the first launch: the caller's devices
    while True:
        launch_env = {ELASTIC_ATTEMPT_ENV: str(relaunches), ELASTIC_LEFT_ENV: str(max_restarts - relaunches)}
        launch_env |= device_env
        result = run_torchrun(attempt.program, attempt.plan.world_size, program_args, extra_env=launch_env)
        if result.returncode == 0 or result.returncode == AutoshardError.exit_code or result.returncode >= 128:
            return result.returncode  # done, bad input (said in one line), or stopped by a signal (said too)
        lost = lost_ranks(result.failures)
        errors = program_errors(result.failures)
        if errors and not lost:
            _say(
                f"rank(s) {', '.join(map(str, errors))} failed with an error of the program, not a lost rank: the "
                f"same plan would fail again, so the job stops and the newest checkpoint is kept; fix: mend what "
                f"the error above names, then run the same command to resume"
            )
            return result.returncode
        if relaunches >= max_restarts:
            _say(f"the job failed and its {max_restarts} relaunch(es) are spent; the newest checkpoint is kept")
            return result.returncode
        relaunches += 1
        world_size = attempt.plan.world_size
        if not lost:
            _say(f"relaunch {relaunches} of {max_restarts}: no rank was lost; {world_size} ranks resume")
            continue
        try:
            plan, seconds = plan_for_ranks(first.plan, world_size - len(lost), elastic)
        except AutoshardError as exc:
            _say(f"lost rank(s) {', '.join(map(str, lost))}: {exc}")
            return result.returncode
        devices = surviving_devices(devices, lost, plan.world_size)
        device_env = {VISIBLE_DEVICES_ENV: ",".join(devices)}
        attempt = _attempt_for(plan, first, checkpoint_dir, recipe, write_program)
        _say(
            f"relaunch {relaunches} of {max_restarts}: lost rank(s) {', '.join(map(str, lost))}; re-planned for "
            f"{plan.world_size} ranks in {seconds:.2f} s ({describe(plan)}; global batch {plan.global_batch} "
            f"kept); resuming from the newest checkpoint"
        )


def warm_planner() -> None:
    """Import what a re-plan runs (the search, OR-Tools, sympy's symbolic cost: most of a first re-plan's time in a
    fresh process, seconds) while the first launch trains, so that a re-plan after a loss takes only its search.
    (The console script imported OR-Tools' ``cp_model`` already, without pandas: ``cli.entry``.)"""
    import autoshard.cost.symbolic  # noqa: F401
    import autoshard.pipeline  # noqa: F401


def _attempt_for(plan: Plan, first: Attempt, checkpoint_dir: str, recipe, write_program) -> Attempt:
    """The attempt running ``plan``: ``first`` for its own plan, else the re-planned plan written beside the
    checkpoints with its program."""
    if plan is first.plan:
        return first
    plan_file, program = elastic_paths(checkpoint_dir, plan.world_size)
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan.save(plan_file)
    write_program(plan, program, plan_file=str(plan_file), recipe=recipe)
    return Attempt(plan, program)


def _say(line: str) -> None:
    print(f"elastic: {line}", file=sys.stderr, flush=True)
