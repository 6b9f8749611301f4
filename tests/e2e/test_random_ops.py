"""verify cannot be fooled by random ops other than dropout.

Two models that draw random numbers without a dropout module (``tests/models/random_layers.py``):
stochastic depth (``bernoulli_``, timm's drop_path) and a ``torch.rand`` token mask with ``randn_like``
noise. Each at dp 2 ZeRO-3 and at pp 2 (1F1B, two micro-batches), three ways in one torchrun launch:

    fixed        the program as verify runs it (``--fixed-randomness``): every random op at its
                 expectation in the program and in both one-process runs -> verified
    drawn        the same program with its random ops drawing, each rank its own numbers -> fails
                 (verify used to pass such a run, judging it against a noise the randomness inflated)
    lr 1 % off   random ops fixed, a step size 1 % off the reference's -> fails
"""

from __future__ import annotations

import json

import pytest

import autoshard
from autoshard.launch import run_torchrun, write_program
from e2e.zoo import DRIVER, GLOBAL_BATCH, LR, RANKS, _verdict, program_case

pytestmark = pytest.mark.e2e

MODELS = {"drop-path": "tests/models/random_layers.py:build_drop_path",
          "rand-mask": "tests/models/random_layers.py:build_rand_mask"}
PINS = {"dp2-zero3": dict(dp=2, zero=3, tp=1, pp=1), "pp2": dict(pp=2, dp=1, tp=1, schedule="1f1b")}
# "drawn" first: the driver runs every case in one process, and the first fixed one fixes randomness for good.
RUNS = {"drawn": dict(fixed_randomness=False), "fixed": dict(), "lr-off": dict(lr=LR * 1.01)}
EXPECTED = {"fixed": "verified", "drawn": "failed", "lr-off": "failed"}


def test_random_ops_are_fixed_in_both_runs_and_a_wrong_run_still_fails(in_repo, tmp_path):
    plans = {(m, p): autoshard.plan(spec, cluster="local-cpu", global_batch=GLOBAL_BATCH, devices_per_node=RANKS,
                                    recompute="none", **pins)
             for m, spec in MODELS.items() for p, pins in PINS.items()}
    cases, where = [], {}
    for run, how in RUNS.items():
        for (m, p), plan in plans.items():
            assert plan.model["random_ops"], f"{m}: the plan lists no random op"
            program = write_program(plan, tmp_path / m / p / "train.py")
            out = tmp_path / m / p / run
            cases.append(program_case(f"{m}/{p}/{run}", program, out, **how))
            where[m, p, run] = out
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = run_torchrun(DRIVER, RANKS, [str(tmp_path / "cases.json")], quiet=True)
    assert proc.returncode == 0, proc.crash or proc.stdout[-2000:]
    verdicts = {key: _verdict(MODELS[key[0]], plans[key[:2]], out) for key, out in where.items()}
    wrong = {key: v for key, v in verdicts.items() if v[0] != EXPECTED[key[2]]}
    assert not wrong, "\n".join(f"{'/'.join(k)}: {s} ({d.splitlines()[0] if d else ''})" for k, (s, d) in wrong.items())
