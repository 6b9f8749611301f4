"""Multi-process test cases that share torchrun launches: one launch per world size for the whole session.

A launch costs a process start, torch and the runtime imported in every rank and a process group:
about 3 s of CPU per rank (4 to 5 once a program imports FSDP2 and DCP), 13 s of wall for 8 ranks on
2 idle cores, more than a small case's training.
``jobs_driver.py`` runs files with a ``main()`` one after another in one launch, each with its own
command line: emitted programs, and the tests' own drivers (``pp_driver.py``, ``tp_driver.py``,
``cp_driver.py``, ``sp_driver.py``), whose ``runtime.init_distributed`` then returns the launch's
process group and whose ``runtime.shutdown`` waits for the last job.

    Cases(ranks_of, prepare, finish, case_of)   a test module's cases (module-level ``LAUNCHES``):
                                       ``prepare(names, ranks, folder)`` -> name: (jobs, state) or an
                                       exception; ``finish(name, state, failures)`` -> the result its
                                       test asserts on
    SharedLaunches (fixture ``launches`` of tests/e2e/conftest.py)
                                       the first time a test asks for a case of a world size, the cases
                                       of that size of every selected test module are prepared, run in
                                       one launch and finished; ``launches.result(LAUNCHES, name)``
    run_jobs(jobs, ranks, folder)      jobs in one launch; {name: "" or why it did not finish}
    verify_cases(make_plan, steps_of, data_of=None)
                                       prepare / finish that are ``autoshard.verify`` of each case's plan:
                                       its checks, its program command line, its judgement
                                       (``verify.prepare``, ``program_args``, ``judge``), on the data
                                       ``data_of(name, folder)`` names (``verify --data``)
    program_cases(make_plan)           prepare / finish for emitted programs run as the zoo runs them,
                                       judged by ``assert_trains_like_one_process`` (``zoo.run_and_judge``'s
                                       checks, one program at a time)
    timing_lines()                     seconds per world size and module: prepare, jobs, finish; then the
                                       slowest jobs (printed at the end of the session; a test's duration
                                       holds its whole launch)
    once_per_arguments(train_reference)
                                       the one-process reference runs with random ops fixed, each computed
                                       once per session (tests/e2e/conftest.py): many cases train the same
                                       model on the same batches for the same steps

Jobs that draw random numbers (``job(..., draws=True)``: programs run without ``--fixed-randomness``,
drivers that do not fix it) run first in a launch: the first job that fixes randomness leaves it fixed
for the rest of the process (``runtime.randomness``). A job that raises ends the launch (a rank left
inside a collective could not go on): it fails its own test with its traceback, and the jobs after it
run in a new launch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoshard.ir.recipe import Recipe
from autoshard.launch import run_torchrun, write_program
from autoshard.runtime.data import DataSource
from autoshard.verify import DEFAULT_LR, Run, fp32_twin, judge, prepare, program_args, read_run

DRIVER = Path(__file__).with_name("jobs_driver.py")
JOB_SECONDS: dict[str, float] = {}  # job name -> seconds on rank 0, of every shared launch (``timing_lines``)
ROOT = DRIVER.parents[2]
SLOWEST_JOBS = 15  # listed by ``timing_lines``
MAX_LAUNCHES = 4  # per world size: the first, and again after each of up to 3 jobs that ended theirs


def job(program: str | Path, args: list, out: str | Path, copy: tuple | None = None, draws: bool = False) -> dict:
    """One run of ``program`` (a file with a ``main()``) with ``args`` as its command line; a traceback it raises
    goes to ``out/error-rank{r}.txt``; ``copy`` (src, dst) is copied before it starts; ``draws``: it draws random
    numbers (runs before every job that fixes them)."""
    return {
        "program": str(program),
        "args": [str(a) for a in args],
        "out": str(out),
        "copy": [str(p) for p in copy] if copy else None,
        "draws": draws,
    }


def run_jobs(jobs: dict[str, dict], ranks: int, folder: Path) -> dict[str, str]:
    """``jobs`` (name: ``job(...)``) in their order in one torchrun launch of ``ranks`` ranks, and the jobs after
    one that ended it in another; each job's failure: "" when it ran to its end on every rank, else the
    traceback it raised or why its launch ended before it."""
    failures, left, launches = {}, list(jobs), 0
    folder.mkdir(parents=True, exist_ok=True)
    while left:
        launches += 1
        listing = folder / f"launch-{ranks}-ranks-{launches}.json"
        listing.write_text(json.dumps([{"name": name, **jobs[name]} for name in left], indent=1))
        proc = run_torchrun(DRIVER, ranks, [str(listing)], quiet=True)
        done = [
            dict(line.split("\t") for line in _lines(listing.with_name(f"{listing.name}.done-rank{r}")))
            for r in range(ranks)
        ]
        for name, seconds in done[0].items():
            JOB_SECONDS[name] = float(seconds)
        finished = [name for name in left if all(name in d for d in done)]
        failures |= dict.fromkeys(finished, "")
        if proc.returncode == 0 and len(finished) == len(left):
            break
        why = f"its launch ended (exit {proc.returncode}): {proc.crash or proc.stdout[-3000:]}"
        ended = next((name for name in left if name not in finished), left[-1])  # all finished: the exit is the last's
        failures[ended] = _traceback(Path(jobs[ended]["out"])) or why
        left = left[left.index(ended) + 1 :]
        if launches == MAX_LAUNCHES:
            failures |= dict.fromkeys(left, f"not run: {MAX_LAUNCHES} launches ended early; the last: {why}")
            break
    return {name: failures[name] for name in jobs}


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _traceback(out: Path) -> str:
    """What each rank that raised wrote (the first to fail may not be the first rank)."""
    return "\n".join(
        f"{error.stem.removeprefix('error-')} raised:\n" + "\n".join(error.read_text().splitlines()[-40:])
        for error in sorted(out.glob("error-rank*.txt"))
    )


def attempt(make: Callable[[], Any]) -> Any:
    """``make()``, or the exception it raised (raised later, in the test that asks for it)."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001
        return exc


@dataclass
class Cases:
    """A test module's cases in the session's shared launches (module doc). ``case_of(test function name, its
    parameters)`` names the case or cases a selected test asks for (None: none); without it every case of a
    world size is made when one is asked for."""

    ranks_of: dict[str, int]
    prepare: Callable[[list[str], int, Path], dict[str, Any]]
    finish: Callable[[str, Any, list[str]], Any]
    case_of: Callable[[str, dict], str | list[str] | None] | None = None


class SharedLaunches:
    """One launch per world size for the cases of every selected test module that has ``LAUNCHES``, made the
    first time a test asks for a case of that size (module doc)."""

    made_here: list[SharedLaunches] = []  # every instance, for ``timing_lines``

    def __init__(self, items: list, folder: Path):
        self.folder, self.made = folder, {}
        self.seconds: dict[tuple[int, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        SharedLaunches.made_here.append(self)
        self.modules: dict[str, Cases] = {}
        self.selected: dict[str, set[str] | None] = {}
        for item in items:
            module = getattr(item, "module", None)
            cases = getattr(module, "LAUNCHES", None)
            if not isinstance(cases, Cases):
                continue
            name = module.__name__.rsplit(".", 1)[-1]
            self.modules[name] = cases
            if cases.case_of is None:
                self.selected[name] = None  # every case
                continue
            asked = cases.case_of(item.originalname, getattr(getattr(item, "callspec", None), "params", {}))
            self.selected.setdefault(name, set()).update([asked] if isinstance(asked, str) else asked or [])

    def result(self, cases: Cases, name: str) -> Any:
        """The result of case ``name`` of the module whose ``LAUNCHES`` is ``cases``; an exception is raised."""
        module = next(m for m, c in self.modules.items() if c is cases)
        ranks = cases.ranks_of[name]
        if ranks not in self.made:
            self.made[ranks] = self._launch(ranks, (module, name))
        if (module, name) not in self.made[ranks]:  # a case no selected test named: made on its own
            self.made[ranks] |= self._launch(ranks, (module, name), only=True)
        result = self.made[ranks][module, name]
        if isinstance(result, BaseException):
            raise result
        return result

    def _launch(self, ranks: int, asked: tuple[str, str], only: bool = False) -> dict[tuple[str, str], Any]:
        folder = self.folder / f"ranks{ranks}{'-' + '-'.join(asked) if only else ''}"
        made, prepared, jobs = {}, {}, {}
        with _in_repo():
            for module, cases in self.modules.items():
                chosen = self.selected[module]
                names = [
                    n
                    for n, r in cases.ranks_of.items()
                    if r == ranks
                    and ((module, n) == asked if only else chosen is None or n in chosen or (module, n) == asked)
                ]
                if not names:
                    continue
                start = time.monotonic()
                out = attempt(lambda: cases.prepare(names, ranks, folder / module))
                self.seconds[ranks, module]["prepare"] += time.monotonic() - start
                for name in names:
                    case = out if isinstance(out, Exception) else out[name]
                    if isinstance(case, Exception):
                        made[module, name] = case
                        continue
                    prepared[module, name] = case
                    jobs |= {f"{module}/{name}/{i}": j for i, j in enumerate(case[0])}
            order = sorted(jobs, key=lambda key: not jobs[key]["draws"])  # stable: drawing jobs first
            start = time.monotonic()
            failures = run_jobs({key: jobs[key] for key in order}, ranks, folder)
            self.seconds[ranks, "(the launch, wall)"]["jobs"] += time.monotonic() - start
            for (module, name), (case_jobs, state) in prepared.items():
                runs = [failures[f"{module}/{name}/{i}"] for i in range(len(case_jobs))]
                self.seconds[ranks, module]["jobs"] += sum(
                    JOB_SECONDS.get(f"{module}/{name}/{i}", 0.0) for i in range(len(case_jobs))
                )
                start = time.monotonic()
                made[module, name] = attempt(lambda: self.modules[module].finish(name, state, runs))
                self.seconds[ranks, module]["finish"] += time.monotonic() - start
        return made


def timing_lines() -> list[str]:
    """Where the shared launches' time went, per world size and test module: preparing the cases (planning,
    writing programs), their jobs (rank 0's seconds inside the launch), finishing them (one-process references,
    judging); then the slowest jobs; for the session's summary (tests/e2e/conftest.py)."""
    rows = [
        (ranks, module, parts)
        for launches in SharedLaunches.made_here
        for (ranks, module), parts in sorted(launches.seconds.items())
    ]
    if not rows:
        return []
    lines = [
        "shared torchrun launches (tests/e2e/one_launch.py), seconds:",
        f"{'ranks':>5}  {'module':<34}{'prepare':>9}{'jobs':>9}{'finish':>9}",
    ]
    lines += [
        f"{ranks:>5}  {module:<34}{parts.get('prepare', 0):>9.1f}{parts.get('jobs', 0):>9.1f}"
        f"{parts.get('finish', 0):>9.1f}"
        for ranks, module, parts in rows
    ]
    slowest = sorted(JOB_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_JOBS]
    lines += [f"the {len(slowest)} slowest jobs (module/case/job, rank 0's seconds):"]
    lines += [f"{seconds:>9.1f}  {name}" for name, seconds in slowest]
    return lines


def once_per_arguments(train_reference: Callable) -> Callable:
    """``verify.train_reference`` that computes a run with every random op fixed once per distinct arguments (the
    model file's path, contents, factory and sequence length, batch size, steps, seed, lr, dtype, micro-batches,
    data, recipe: each argument's repr, a Recipe's every field) and hands each caller its own copy: such a run is a function of those (weights and data drawn from the seed,
    no random op left, one thread). Runs that draw random numbers are computed each time."""
    signature, made = inspect.signature(train_reference), {}

    @functools.wraps(train_reference)
    def once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if not arguments["fixed_randomness"]:
            return train_reference(*args, **kwargs)
        model_file = arguments.pop("model_file")
        key = (
            str(model_file.path.resolve()),
            hashlib.sha256(model_file.path.read_bytes()).hexdigest(),
            model_file.factory_name,
            model_file.seq_len,
            *(repr(v) for v in arguments.values()),
        )
        if key not in made:
            made[key] = train_reference(*args, **kwargs)
        run = made[key]
        return replace(run, losses=list(run.losses), params={k: v.clone() for k, v in run.params.items()})

    return once


@contextlib.contextmanager
def _in_repo():
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


# --------------------------------------------------------------------------- verify


def verify_cases(
    make_plan: Callable[[str], Any],
    steps_of: Callable[[str], int],
    seed: int = 0,
    lr: float = DEFAULT_LR,
    data_of: Callable[[str, Path], DataSource] | None = None,
    recipe_of: Callable[[str], Recipe | None] | None = None,
) -> tuple[Callable, Callable]:
    """``Cases``' prepare and finish for ``autoshard.verify.verify(plan, steps, seed, recipe, data)`` of each case's
    plan (``make_plan(name)``, ``steps_of(name)``, ``data_of(name, its folder)``, by default the model file's dataset
    or example_batch draws; ``recipe_of(name)``, by default or None ``Recipe(lr=lr)``): the result is (plan, its
    ``VerifyReport``), or the exception planning or verify raised before launching. The verify run is the case's
    first job; a 16-bit plan's fp32 twin (``verify.fp32_twin``), which verify runs too, its second."""

    def prepare_all(names: list[str], ranks: int, folder: Path) -> dict[str, Any]:
        def one(name):
            data = data_of(name, folder / name) if data_of else DataSource()
            recipe = (recipe_of(name) if recipe_of else None) or Recipe(lr=lr)
            return _prepare_verify(make_plan(name), steps_of(name), folder / name, seed, recipe, data)

        return {name: attempt(lambda: one(name)) for name in names}

    def finish(name: str, state: tuple, failures: list[str]) -> tuple:
        plan, steps, model_file, notes, outs, data, recipe = state
        parallel, *twin = (program_run(out, failure) for out, failure in zip(outs, failures))
        return plan, judge(plan, model_file, parallel, steps, seed, recipe, notes, data, *twin)

    return prepare_all, finish


def program_run(out: Path, failure: str) -> Run | str:
    """What a program job wrote with ``--metrics-out out`` (``verify.read_run``), or why it did not finish."""
    return f"the emitted program failed:\n{failure}" if failure else read_run(out)


def verify_jobs(
    plan, steps: int, folder: Path, seed: int, recipe: Recipe, data: DataSource, wrap: Callable = lambda job: job
) -> tuple[list[dict], list[Path]]:
    """The program runs ``verify`` makes of ``plan``: its program, and a 16-bit plan's fp32 twin's
    (``verify.fp32_twin``), each written under ``folder`` with verify's command line (``program_args``); the jobs
    (each passed through ``wrap``) and their metrics folders."""
    plans = [(plan, folder), *[(twin, folder / "fp32-twin") for twin in [fp32_twin(plan)] if twin]]
    jobs, outs = [], []
    for each, where in plans:
        program = write_program(each, where / "train.py", recipe=recipe)
        out = where / "metrics"
        jobs.append(wrap(job(program, program_args(steps, seed, recipe.lr, out, data), out)))
        outs.append(out)
    return jobs, outs


def _prepare_verify(
    plan, steps: int, folder: Path, seed: int, recipe: Recipe, data: DataSource
) -> tuple[list[dict], tuple]:
    model_file, notes = prepare(plan, steps, seed, data)  # raises AutoshardError as verify would
    jobs, outs = verify_jobs(plan, steps, folder, seed, recipe, data)
    return jobs, (plan, steps, model_file, notes, outs, data, recipe)


def assert_trains_like_one_process(name: str, spec: str, plan, out: Path, failure: str) -> None:
    """``zoo.run_and_judge``'s checks of one program run (``zoo.program_case``'s command line, metrics in ``out``):
    it did not crash, it ran, and it trains like one process (``zoo._verdict``: fp32 and float64 one-process
    runs)."""
    from e2e.zoo import _last_lines, _verdict

    errors = sorted(out.glob("error-rank*.txt"))
    assert not errors, f"{name} crashed: {_last_lines(errors[0].read_text())}"
    assert (out / "metrics.json").exists(), f"{name} did not run: {failure[-3000:]}"
    status, detail = _verdict(spec, plan, out)
    assert status == "verified", f"{name}: {detail}"


def program_cases(make_plan: Callable[[str], Any]) -> tuple[Callable, Callable]:
    """``Cases``' prepare and finish for emitted programs run as the zoo runs them (``program_job``): each case's
    plan (``make_plan(name)``) written to ``folder/name/train.py``, its metrics in ``folder/name/out``; the result is
    (plan, ``folder/name``, failure: "" when it ran to its end), or the exception planning raised."""

    def prepare_all(names: list[str], ranks: int, folder: Path) -> dict[str, Any]:
        def one(name):
            plan = make_plan(name)
            program = write_program(plan, folder / name / "train.py")
            return [program_job(program, folder / name / "out")], (plan, folder / name)

        return {name: attempt(lambda: one(name)) for name in names}

    return prepare_all, lambda name, state, failures: (*state, failures[0])


def program_job(program: Path, out: Path, **how) -> dict:
    """``zoo.program_case`` (the zoo's steps, seed, lr and ``--fixed-randomness``) as a job."""
    from e2e.zoo import program_case

    case = program_case(str(program), program, out, **how)
    return job(case["program"], case["args"], case["metrics_out"], draws="--fixed-randomness" not in case["args"])
