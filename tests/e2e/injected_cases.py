"""``autoshard verify`` of emitted programs with bugs injected into their ranks (``inject_driver.py``): the plans,
the bugs and the shared-launch cases that ``test_verify_injected.py`` takes a subset of and
``benchmarks/bench_verify_injected.py`` runs in full.

A case is (plan kind, precision, bug): the plan's program (and a 16-bit plan's fp32 twin, as ``verify`` runs it) run
under ``inject_driver.py BUG`` for STEPS steps, judged by ``verify.judge`` against the one-process runs. Every
plan is of 2 ranks and 2 micro-batches per step on a global batch of 8; the bugs sit on rank 1, the last (a
pipeline's last stage, the rank whose replica DCP does not write).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import autoshard
from autoshard.ir.recipe import Recipe
from autoshard.runtime.data import DataSource
from autoshard.verify import DEFAULT_LR, judge, prepare
from e2e.one_launch import attempt, job, program_run, verify_jobs

DRIVER = Path(__file__).with_name("inject_driver.py")
FAST_LINK = str(Path(__file__).resolve().parents[1] / "clusters" / "fast_link_cpu.yaml")
GPT, MOE = "examples/gpt.py:build", "tests/models/hf_causal_zoo.py:build_qwen2_moe"
STEPS, SEED, GLOBAL_BATCH, MICROBATCHES, RANKS = 2, 0, 8, 2, 2
KINDS = {  # kind: (model, cluster, pins)
    "ddp": (GPT, "local-cpu", dict(dp=2, tp=1, pp=1, zero=0)),
    "fsdp": (GPT, "local-cpu", dict(dp=2, tp=1, pp=1, zero=3)),
    "tp2": (GPT, FAST_LINK, dict(dp=1, tp=2, pp=1, zero=0)),  # a link where TP pays, so the layout shards
    "pp2": (GPT, "local-cpu", dict(dp=1, tp=1, pp=2, zero=0, schedule="1f1b")),
    "cp2": (GPT, "local-cpu", dict(dp=1, tp=1, pp=1, cp=2, zero=1)),
    "ep2": (MOE, "local-cpu", dict(dp=2, ep=2, tp=1, pp=1, zero=3)),
}
PRECISIONS = ("fp32", "bf16")  # --precision pins: bf16 is bf16 autocast
BUGS = {  # name: inject_driver.py's BUG
    "none": "none",
    "linear-1pct": "linear:1:0.01",  # rank 1's linear outputs 1 % too large
    "loss-grad-x2": "loss-grad:1:2",  # rank 1's loss gradient doubled
    "step-1pct": "step:1:1.01",  # rank 1's optimizer steps 1 % further
    "same-samples": "same-samples",  # the dp ranks read the same samples (where dp > 1)
}


def applies(kind: str, bug: str) -> bool:
    """Whether ``bug`` is one for a plan of ``kind`` (the dp ranks' samples only where there are dp ranks)."""
    return bug != "same-samples" or KINDS[kind][2]["dp"] > 1


def matrix(kinds=KINDS, precisions=PRECISIONS, bugs=BUGS) -> dict[str, tuple[str, str, str]]:
    """name -> (kind, precision, inject_driver BUG) of every case that applies."""
    return {
        f"{kind}-{precision}-{bug}": (kind, precision, BUGS.get(bug, bug))
        for kind in kinds
        for precision in precisions
        for bug in bugs
        if applies(kind, bug)
    }


@cache
def plan_of(kind: str, precision: str):
    model, cluster, pins = KINDS[kind]
    return autoshard.plan(
        model,
        cluster=cluster,
        devices_per_node=RANKS,
        global_batch=GLOBAL_BATCH,
        microbatch_size=GLOBAL_BATCH // (pins["dp"] * MICROBATCHES),
        recompute="none",
        precision=precision,
        **pins,
    )


@cache
def _prepared(kind: str, precision: str):
    plan = plan_of(kind, precision)
    return plan, *prepare(plan, STEPS, SEED)  # verify's checks, once per plan


def injected_cases(cases: dict[str, tuple[str, str, str]]) -> tuple[Callable, Callable]:
    """``one_launch.Cases``' prepare and finish for ``cases`` (name -> (kind, precision, BUG)): each case's jobs
    are the runs verify makes of its plan (``one_launch.verify_jobs``) under ``inject_driver.py BUG``; its result
    is (plan, ``VerifyReport``)."""
    recipe = Recipe(lr=DEFAULT_LR)

    def prepare_all(names: list[str], ranks: int, folder: Path) -> dict[str, Any]:
        def one(name):
            kind, precision, bug = cases[name]
            plan, model_file, notes = _prepared(kind, precision)
            wrap = lambda j: job(DRIVER, [bug, j["program"], *j["args"]], j["out"])  # noqa: E731
            jobs, outs = verify_jobs(plan, STEPS, folder / name, SEED, recipe, DataSource(), wrap)
            return jobs, (plan, model_file, notes, outs)

        return {name: attempt(lambda: one(name)) for name in names}

    def finish(name: str, state: tuple, failures: list[str]) -> tuple:
        plan, model_file, notes, outs = state
        parallel, *twin = (program_run(out, failure) for out, failure in zip(outs, failures))
        return plan, judge(plan, model_file, parallel, STEPS, SEED, recipe, notes, DataSource(), *twin)

    return prepare_all, finish
