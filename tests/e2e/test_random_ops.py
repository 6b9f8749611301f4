"""verify cannot be fooled by random ops other than dropout.

Two models that draw random numbers without a dropout module (``tests/models/random_layers.py``):
stochastic depth (``bernoulli_``, timm's drop_path) and a ``torch.rand`` token mask with ``randn_like``
noise. Each at dp 2 ZeRO-3 and at pp 2 (1F1B, two micro-batches), three ways in the session's 2-rank
torchrun launch (``one_launch.Cases``; the drawing runs before every run that fixes randomness):

    fixed        the program as verify runs it (``--fixed-randomness``): every random op at its
                 expectation in the program and in both one-process runs -> verified
    drawn        the same program with its random ops drawing, each rank its own numbers -> fails
                 (verify used to pass such a run, judging it against a noise the randomness inflated)
    lr 1 % off   random ops fixed, a step size 1 % off the reference's -> fails
"""

from __future__ import annotations

import pytest

import autoshard
from autoshard.launch import write_program
from e2e.one_launch import Cases, attempt, program_job
from e2e.zoo import GLOBAL_BATCH, LR, RANKS, _verdict

pytestmark = pytest.mark.e2e

MODELS = {
    "drop-path": "tests/models/random_layers.py:build_drop_path",
    "rand-mask": "tests/models/random_layers.py:build_rand_mask",
}
PINS = {"dp2-zero3": dict(dp=2, zero=3, tp=1, pp=1), "pp2": dict(pp=2, dp=1, tp=1, schedule="1f1b")}
# "drawn" first: a launch runs every case in one process, and the first fixed one fixes randomness for good
# (one_launch runs every job that draws before every job that fixes).
RUNS = {"drawn": dict(fixed_randomness=False), "fixed": dict(), "lr-off": dict(lr=LR * 1.01)}
EXPECTED = {"fixed": "verified", "drawn": "failed", "lr-off": "failed"}
PLANS = {f"{m}/{p}": (m, p) for m in MODELS for p in PINS}


def _prepare(names, ranks, folder):
    """Per (model, pins): its three runs; state: (plan, {run: its metrics folder})."""

    def one(name):
        m, p = PLANS[name]
        plan = autoshard.plan(
            MODELS[m],
            cluster="local-cpu",
            global_batch=GLOBAL_BATCH,
            devices_per_node=RANKS,
            recompute="none",
            **PINS[p],
        )
        program = write_program(plan, folder / m / p / "train.py")
        where = {run: folder / m / p / run for run in RUNS}
        return [program_job(program, where[run], **how) for run, how in RUNS.items()], (plan, where)

    return {name: attempt(lambda: one(name)) for name in names}


LAUNCHES = Cases(
    dict.fromkeys(PLANS, RANKS),
    _prepare,
    finish=lambda name, state, failures: (*state, failures),
    case_of=lambda test, params: list(PLANS),
)


def test_random_ops_are_fixed_in_both_runs_and_a_wrong_run_still_fails(in_repo, launches):
    plans, where, failures = {}, {}, {}
    for name, (m, p) in PLANS.items():
        plan, outs, runs = launches.result(LAUNCHES, name)
        assert plan.model["random_ops"], f"{m}: the plan lists no random op"
        plans[m, p] = plan
        where |= {(m, p, run): out for run, out in outs.items()}
        failures |= {f"{name}/{run}": failure for run, failure in zip(RUNS, runs) if failure}
    assert not failures, "\n".join(f"{k}: {v[-2000:]}" for k, v in failures.items())  # every run ran to its end
    verdicts = {key: _verdict(MODELS[key[0]], plans[key[:2]], out) for key, out in where.items()}
    wrong = {key: v for key, v in verdicts.items() if v[0] != EXPECTED[key[2]]}
    assert not wrong, "\n".join(f"{'/'.join(k)}: {s} ({d.splitlines()[0] if d else ''})" for k, (s, d) in wrong.items())
