"""A test file's multi-process cases, one torchrun launch per world size.

A launch costs a process start, torch and ``autoshard.runtime`` imported in every rank, and a
process group: several seconds per rank on a small machine, more than a small case's training.
``zoo_driver.py`` runs files with a ``main()`` one after another in one launch, each with its own
command line: emitted programs, and the tests' own drivers (``pp_driver.py``, ``tp_driver.py``,
``cp_driver.py``), whose ``runtime.init_distributed`` then returns the launch's process group and
whose ``runtime.shutdown`` waits for the last job.

    run_jobs(jobs, ranks, folder)          every job in one launch; {name: "" or why it did not finish}
    verify_in_one_launch(cases, folder)    ``autoshard.verify`` for several plans of one world size: the
                                           same checks, program command line and judgement
                                           (``verify.prepare``, ``program_args``, ``judge``), one launch
    plan_and_verify(names, ...)            planned, then verified in one launch; (plan, report) each
    PerWorldSize(ranks_of, make)           a module fixture's value: the cases of one world size made
                                           together, the first time a test asks for one of them

A job that raises ends the launch (a rank left inside a collective could not go on): its own test
fails with the traceback, and each later job's test with the launch's end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from autoshard.errors import AutoshardError
from autoshard.launch import run_torchrun, write_program
from autoshard.verify import DEFAULT_LR, judge, prepare, program_args, read_run

DRIVER = Path(__file__).with_name("zoo_driver.py")


def job(program: str | Path, args: list, out: str | Path) -> dict:
    """One run of ``program`` (a file with a ``main()``) with ``args`` as its command line; a traceback it
    raises goes to ``out/error-rank{r}.txt``."""
    return {"program": str(program), "args": [str(a) for a in args], "metrics_out": str(out)}


def run_jobs(jobs: dict[str, dict], ranks: int, folder: Path) -> dict[str, str]:
    """``jobs`` (name: ``job(...)``) in their order in one torchrun launch of ``ranks`` ranks; each job's failure:
    "" when it ran to its end, else the traceback it raised or why the launch ended before it."""
    if not jobs:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    listing = folder / f"launch-{ranks}-ranks.json"
    listing.write_text(json.dumps([{"name": name, **j} for name, j in jobs.items()], indent=1))
    proc = run_torchrun(DRIVER, ranks, [str(listing)], quiet=True)
    raised = {name: _traceback(Path(j["metrics_out"])) for name, j in jobs.items()}
    first = next((i for i, name in enumerate(jobs) if raised[name]), None)
    ended = f"the launch ended before it (exit {proc.returncode}): {proc.crash or proc.stdout[-3000:]}"
    return {name: raised[name] or (ended if proc.returncode != 0 and (first is None or i > first) else "")
            for i, name in enumerate(jobs)}


def _traceback(out: Path) -> str:
    errors = sorted(out.glob("error-rank*.txt"))
    return f"{errors[0].stem.removeprefix('error-')} raised:\n{errors[0].read_text()}" if errors else ""


def verify_in_one_launch(cases: dict[str, tuple], folder: Path, seed: int = 0, lr: float = DEFAULT_LR) -> dict:
    """``autoshard.verify.verify(plan, steps, seed, lr)`` for each case (name: (plan, steps)), every program in one
    launch; name: its ``VerifyReport``, or the ``AutoshardError`` verify raised before launching."""
    results, prepared, jobs = {}, {}, {}
    for name, (plan, steps) in cases.items():
        try:
            prepared[name] = prepare(plan, steps, seed)
        except AutoshardError as exc:
            results[name] = exc
            continue
        program = write_program(plan, folder / name / "train.py")
        jobs[name] = job(program, program_args(steps, seed, lr, folder / name / "metrics"), folder / name / "metrics")
    if jobs:
        (ranks,) = {cases[name][0].world_size for name in jobs}
        failures = run_jobs(jobs, ranks, folder)
        for name in jobs:
            plan, steps = cases[name]
            model_file, notes = prepared[name]
            parallel = f"the emitted program failed:\n{failures[name]}" if failures[name] else \
                read_run(folder / name / "metrics")
            results[name] = judge(plan, model_file, parallel, steps, seed, lr, notes)
    return results


def plan_and_verify(names: list[str], make_plan: Callable[[str], Any], steps_of: Callable[[str], int],
                    folder: Path) -> dict[str, Any]:
    """Each name's plan (``make_plan(name)``) verified for ``steps_of(name)`` steps, every program in one launch;
    name: (plan, report), or the exception planning or verify raised."""
    plans = {name: attempt(lambda: make_plan(name)) for name in names}
    good = {name: (plan, steps_of(name)) for name, plan in plans.items() if not isinstance(plan, Exception)}
    reports = verify_in_one_launch(good, folder)
    return {name: (plan, reports[name]) if name in good and not isinstance(reports[name], Exception)
            else reports.get(name, plan) for name, plan in plans.items()}


def assert_trains_like_one_process(name: str, spec: str, plan, out: Path, failure: str) -> None:
    """``zoo.run_and_judge``'s checks of one program run (``zoo.program_case``, metrics in ``out``): it did not
    crash, it ran, and it trains like one process (``zoo._verdict``: fp32 and float64 one-process runs)."""
    from e2e.zoo import _last_lines, _verdict

    errors = sorted(out.glob("error-rank*.txt"))
    assert not errors, f"{name} crashed: {_last_lines(errors[0].read_text())}"
    assert (out / "metrics.json").exists(), f"{name} did not run: {failure[-3000:]}"
    status, detail = _verdict(spec, plan, out)
    assert status == "verified", f"{name}: {detail}"


class PerWorldSize:
    """A test file's cases (name: world size), made one world size at a time by ``make(names, ranks)`` (name:
    result), the first time a test asks for a case of that size. Only the cases of the tests pytest selected
    are made when ``selected`` names them; a result that is an exception is raised in the test that asks."""

    def __init__(self, ranks_of: dict[str, int], make: Callable[[list[str], int], dict[str, Any]],
                 selected: set[str] | None = None):
        self.ranks_of, self.make, self.selected, self.made = ranks_of, make, selected, {}

    def __call__(self, name: str) -> Any:
        ranks = self.ranks_of[name]
        if ranks not in self.made:
            names = [n for n, r in self.ranks_of.items()
                     if r == ranks and (self.selected is None or n in self.selected or n == name)]
            self.made[ranks] = self.make(names, ranks)
        result = self.made[ranks][name]
        if isinstance(result, BaseException):
            raise result
        return result


def selected_cases(request: pytest.FixtureRequest, case_of: Callable[[str, dict], str | None]) -> set[str]:
    """The cases of this module's tests that pytest will run: ``case_of(test function name, its parameters)``
    names a test's case (None: it has none)."""
    return {case for item in request.session.items if getattr(item, "module", None) is request.module
            and (case := case_of(item.originalname, getattr(getattr(item, "callspec", None), "params", {})))}


def attempt(make: Callable[[], Any]) -> Any:
    """``make()``, or the exception it raised (raised later, in the test that asks for it)."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001
        return exc
