"""The model zoo (tests/e2e/zoo.py): every case ends as it is expected to, and none trains wrong or crashes.

``zoo_outcomes.json`` pins each (model, case): "verified" (the program trains like one process), or
"refused" with the key words of its one-line reason; for each verified tp2 case, the styles of the
modules that shard (layer numbers written "*"). A case that falls from verified to refused, a refusal
for another reason, a tp layout that loses (or gains) a sharded module: each fails here with the
case named. After a deliberate change, rewrite the file with ``AUTOSHARD_UPDATE_ZOO=1 pytest
tests/e2e/test_zoo.py`` and review its diff.

Every case is a job of the session's shared 2-rank launch (tests/e2e/one_launch.py), beside the other modules'
2-rank cases: one process start, one set of imports and one process group for all of them; a test per model.
"""

import fcntl
import json
import os
import re
from pathlib import Path

import pytest

from autoshard.launch import write_program
from e2e.one_launch import Cases, attempt, program_job
from e2e.zoo import CASES, MODELS, RANKS, Outcome, plan_case, settle, table

pytestmark = pytest.mark.e2e

OUTCOMES = Path(__file__).with_name("zoo_outcomes.json")
REASON_WORDS = 20  # words of a refusal's reason pinned: enough to name it, few enough to survive a number changing


def _prepare(names: list[str], ranks: int, folder: Path) -> dict:
    """Each "model/case" planned: a refusal is its outcome (no job), a plan its program as a job (``zoo.program_case``'s
    command line: the zoo's steps, seed, lr, random ops fixed)."""
    return {name: attempt(lambda: _prepare_one(name, folder / name)) for name in names}


def _prepare_one(name: str, folder: Path) -> tuple[list[dict], tuple[Outcome, Path]]:
    model, case = name.split("/")
    outcome = plan_case(MODELS[model], CASES[case])
    if outcome.plan is None:
        return [], (outcome, folder / "out")
    program = write_program(outcome.plan, folder / "train.py")
    return [program_job(program, folder / "out")], (outcome, folder / "out")


def _finish(name: str, state: tuple[Outcome, Path], failures: list[str]) -> Outcome:
    """A planned case's outcome (``zoo.settle``: crashed, not run with why its launch ended, or its verdict against
    one process)."""
    outcome, out = state
    return outcome if outcome.plan is None else settle(MODELS[name.split("/")[0]], outcome.plan, out, failures[0])


LAUNCHES = Cases(
    {f"{model}/{case}": RANKS for model in MODELS for case in CASES},
    _prepare,
    _finish,
    case_of=lambda test, params: [f"{params['model']}/{case}" for case in CASES] if "model" in params else None,
)


def expected_of(outcomes: dict) -> dict[str, dict]:
    """Each case's outcome as the file pins it."""
    out = {}
    for (model, case), o in sorted(outcomes.items()):
        entry = {"status": o.status}
        if o.status == "refused":
            entry["reason"] = " ".join(re.sub(r"[\d.]+", "N", o.detail).split()[:REASON_WORDS])
        if o.status == "verified" and o.plan.mesh.tp > 1:
            entry["tp"] = sharded_styles(o.plan.tensor_parallel)
        out[f"{model}/{case}"] = entry
    return out


def sharded_styles(styles: dict[str, str]) -> dict[str, str]:
    """Module path (layer numbers as "*") -> style, for every module that does not stay replicated."""
    return {
        re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path): style
        for path, style in sorted(styles.items())
        if style != "replicate"
    }


def test_the_pins_name_every_case_of_every_model():
    pinned = json.loads(OUTCOMES.read_text())
    expected = {f"{model}/{case}" for model in MODELS for case in CASES}
    assert set(pinned) == expected, f"cases added or gone: {sorted(set(pinned) ^ expected)}"


@pytest.mark.parametrize("model", list(MODELS))
def test_every_zoo_case_ends_as_pinned(launches, model):
    outcomes = {(model, case): launches.result(LAUNCHES, f"{model}/{case}") for case in CASES}
    print(table(outcomes, {model: MODELS[model]}, CASES))
    bad = {key: o for key, o in outcomes.items() if o.status not in ("verified", "refused")}
    assert not bad, "\n".join(f"{m}/{c}: {o.status}: {o.detail}" for (m, c), o in bad.items())
    refusals = [o.detail for o in outcomes.values() if o.status == "refused"]
    assert all("\n" not in why and why for why in refusals)  # one line naming the reason
    actual = expected_of(outcomes)
    if os.environ.get("AUTOSHARD_UPDATE_ZOO"):
        _update_pins(actual)
    pinned = json.loads(OUTCOMES.read_text())
    assert set(actual) <= set(pinned), f"cases not pinned: {sorted(set(actual) - set(pinned))}"
    differ = [f"{key}: pinned {pinned[key]}, got {actual[key]}" for key in sorted(actual) if pinned[key] != actual[key]]
    assert not differ, "\n".join(differ)


def _update_pins(actual: dict[str, dict]) -> None:
    """Rewrite this chunk's entries of ``zoo_outcomes.json`` (under a lock: chunks may run at once); entries of
    models no longer in the zoo are dropped."""
    with open(OUTCOMES, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        pins = json.loads(f.read() or "{}") | actual
        pins = {key: entry for key, entry in pins.items() if key.split("/")[0] in MODELS}
        f.seek(0)
        f.truncate()
        f.write(json.dumps(pins, indent=1, sort_keys=True) + "\n")
