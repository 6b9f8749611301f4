"""Does ``autoshard verify`` catch bugs injected into the ranks of emitted programs? The full matrix.

    python benchmarks/bench_verify_injected.py [--kinds ddp,tp2] [--precisions fp32,bf16] [--bugs none,linear:1:0.001]

Every (plan kind, precision, bug) of ``tests/e2e/injected_cases.py`` (6 plan kinds x fp32 and bf16 x the program
unpatched and 4 bugs, the dp ranks' samples only where dp > 1): each plan's program (and a 16-bit plan's fp32
twin, as verify runs it) under ``tests/e2e/inject_driver.py BUG``, all in one torchrun launch of 2 ranks, judged
by ``verify.judge``. ``--bugs`` takes the matrix's names or inject_driver BUGs (``linear:1:0.003``: rank 1's linear
outputs 0.3 % too large), e.g. to find the smallest bug verify catches (docs/verify.md). Prints one line per
case: whether verify passed it (``ok``) or failed it (``FAILED``), whether that is right (a bug must fail, the
program unpatched must pass); the plan's own run judged alone in its precision (its worst tensor in multiples of
that precision's one-process noise, the K it is judged with, the verdict: what verify did before 16-bit plans
had an fp32 twin); and the fp32 twin's worst tensor (multiples of fp32's noise; K = 50).
Exits 1 when a case is judged wrongly.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e import injected_cases as ic  # noqa: E402
from e2e.one_launch import once_per_arguments, program_run, run_jobs  # noqa: E402

import autoshard.verify  # noqa: E402
from autoshard.ir.recipe import Recipe  # noqa: E402
from autoshard.runtime.data import DataSource  # noqa: E402
from autoshard.verify import DEFAULT_LR, judge  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(ic.KINDS), help=f"plan kinds, of {', '.join(ic.KINDS)}")
    parser.add_argument("--precisions", default=",".join(ic.PRECISIONS), help="fp32, bf16")
    parser.add_argument("--bugs", default=",".join(ic.BUGS), help="bug names (injected_cases.BUGS) or inject BUGs")
    args = parser.parse_args()
    for kind in args.kinds.split(","):
        if kind not in ic.KINDS:
            parser.exit(2, f"error: --kinds: unknown kind {kind!r}; use some of {', '.join(ic.KINDS)}\n")
    return args


def worst(report) -> str:
    """The run's worst tensor in multiples of the noise (``verify._times``), or what ended it."""
    top = report.most_off[0] if report.most_off else None
    return f"{top.excess * report.noise_factor:.3g}x" if top else "crashed"


def twin_worst(report) -> str:
    return worst(report.twin) if report.twin else "-"


def judged_alone(state: tuple, failure: str):
    """The plan's own run judged in its precision alone, without its fp32 twin (what verify did before the twin)."""
    plan, model_file, notes, outs = state
    parallel = program_run(outs[0], failure)
    return judge(plan, model_file, parallel, ic.STEPS, ic.SEED, Recipe(lr=DEFAULT_LR), notes, DataSource())


def row(name: str, report, alone, right: bool) -> str:
    verdict = lambda r: "ok" if r.ok else "FAILED"  # noqa: E731
    return (
        f"{name:<34}{verdict(report):>8}{'yes' if right else 'NO':>7}{worst(alone):>11}{alone.noise_factor:>5g}"
        f"{verdict(alone):>8}{twin_worst(report):>11}"
    )


def main() -> int:
    args = parse_args()
    os.chdir(ROOT)  # the plans' model specs are relative to the repository
    autoshard.verify.train_reference = once_per_arguments(autoshard.verify.train_reference)
    cases = ic.matrix(args.kinds.split(","), args.precisions.split(","), args.bugs.split(","))
    prepare_all, finish = ic.injected_cases(cases)
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="verify-injected-") as tmp:
        start = time.monotonic()
        prepared = prepare_all(list(cases), ic.RANKS, Path(tmp))
        jobs = {
            f"{name}/{i}": j
            for name, case in prepared.items()
            if not isinstance(case, Exception)
            for i, j in enumerate(case[0])
        }
        failures = run_jobs(jobs, ic.RANKS, Path(tmp))
        print(f"{len(cases)} cases, {len(jobs)} program runs in {time.monotonic() - start:.0f} s", flush=True)
        print(f"{'case':<34}{'verify':>8}{'right':>7}{'run alone':>11}{'K':>5}{'alone':>8}{'fp32 twin':>11}")
        for name, case in prepared.items():
            if isinstance(case, Exception):
                print(f"{name:<34} refused: {case}")
                wrong += 1
                continue
            runs = [failures[f"{name}/{i}"] for i in range(len(case[0]))]
            plan, report = finish(name, case[1], runs)
            right = report.ok == (cases[name][2] == "none")
            wrong += not right
            print(row(name, report, judged_alone(case[1], runs[0]), right), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
