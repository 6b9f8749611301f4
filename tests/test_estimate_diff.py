"""`autoshard estimate` (a configuration fixed by hand) and `autoshard diff` (two plans part by part)."""

import json
from pathlib import Path

import pytest

from autoshard.cli import main

GPT = "examples/gpt.py:build"
GOLDEN = Path(__file__).resolve().parent / "golden"
CLUSTER = ["--cluster", "local-cpu", "--devices-per-node", "4", "--global-batch", "16"]
PINS = ["--dp", "4", "--tp", "1", "--pp", "1", "--zero", "1", "--microbatch-size", "2", "--recompute", "selective"]
PIPELINE = [
    "--dp",
    "2",
    "--tp",
    "1",
    "--pp",
    "2",
    "--zero",
    "1",
    "--microbatch-size",
    "2",
    "--recompute",
    "none",
    "--schedule",
    "1f1b",
]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory):
    """The planner's choice and a pipeline estimate, as files."""
    folder = tmp_path_factory.mktemp("diff")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(Path(__file__).resolve().parent.parent)
        assert main(["plan", GPT, *CLUSTER, "--json", "-o", str(folder / "a.json")]) == 0
        assert main(["estimate", GPT, *CLUSTER, *PIPELINE, "--json", "-o", str(folder / "b.json")]) == 0
    return str(folder / "a.json"), str(folder / "b.json")


def test_estimate_is_plan_with_everything_pinned(in_repo, capsys):
    """--schedule none is implied for --pp 1; the JSON is byte for byte `plan`'s with the same pins."""
    code, estimated, err = run_cli(capsys, "estimate", GPT, *CLUSTER, *PINS, "--json")
    assert code == 0 and err == ""
    code, planned, _ = run_cli(capsys, "plan", GPT, *CLUSTER, *PINS, "--schedule", "none", "--json")
    assert code == 0 and estimated == planned
    plan = json.loads(estimated)
    decisions = plan["decisions"]
    assert (decisions["mesh"], decisions["zero_stage"], decisions["recompute"], decisions["schedule"]) == (
        {"dp": 4, "tp": 1, "pp": 1},
        1,
        "selective",
        "none",
    )
    assert plan["review"]["alternatives"] == [] and len(plan["provenance"]["pinned"]) == 7


def test_estimate_prints_tables_and_writes(in_repo, capsys, two_plans, tmp_path):
    code, out, _ = run_cli(capsys, "estimate", GPT, *CLUSTER, *PINS, "-o", str(tmp_path / "e.json"))
    assert code == 0 and "Time per step" in out and f"plan written to {tmp_path / 'e.json'}" in out
    assert json.loads((tmp_path / "e.json").read_text())["review"]["symbolic"]["symbols"]["dp"] == 4


@pytest.mark.parametrize(
    "drop, named",
    [
        (["--zero"], "--zero"),
        (["--microbatch-size", "--recompute"], "--microbatch-size, --recompute"),
    ],
)
def test_estimate_needs_every_pin(in_repo, capsys, tmp_path, drop, named):
    argv = [a for i, a in enumerate(PINS) if a not in drop and (i == 0 or PINS[i - 1] not in drop)]
    code, _, err = run_cli(capsys, "estimate", GPT, *CLUSTER, *argv, "-o", str(tmp_path / "e.json"))
    assert code == 2 and f"pin {named} too" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "e.json").exists()


def test_estimate_of_a_pipeline_needs_its_schedule(in_repo, capsys):
    argv = PIPELINE[:-2]
    code, _, err = run_cli(capsys, "estimate", GPT, *CLUSTER, *argv)
    assert code == 2 and "--schedule" in err


def test_estimate_that_does_not_fit_still_reports(in_repo, capsys, tmp_path):
    """A user pricing a configuration gets its price even when it does not fit: the tables (which say "does not
    fit", never "% used" past 100 % or "chosen"), the JSON (whose notes say so), one line on stderr, and exit 1, so
    that a script cannot take it for a configuration that runs."""
    out_file = tmp_path / "huge.json"
    code, out, err = run_cli(
        capsys,
        "estimate",
        "tests/bad_models/huge.py:build",
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--dp",
        "2",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "3",
        "--microbatch-size",
        "1",
        "--recompute",
        "full",
        "-o",
        str(out_file),
    )
    assert code == 1 and "Memory per rank" in out
    assert "does not fit:" in out.split("Time per step")[0] and "used)" not in out
    rows = [line for line in out.split("Alternatives considered")[1].splitlines() if line.startswith("│ 2x1x1")]
    assert rows and "does not fit" in rows[0] and "chosen" not in rows[0]
    assert err.startswith("does not fit:") and "GiB over the" in err and err.count("\n") == 1
    plan = json.loads(out_file.read_text())
    assert any(n.startswith("does not fit:") for n in plan["review"]["notes"])
    assert plan["predicted"]["memory_peak_bytes_per_rank"] > plan["cluster"]["device"]["memory_bytes"]


def test_diff_shows_differing_decisions_and_parts(in_repo, capsys, two_plans):
    a, b = two_plans
    code, out, err = run_cli(capsys, "diff", a, b)
    assert code == 0 and err == ""
    for text in (
        "Decisions that differ",
        "mesh",
        "dp=4 tp=1 pp=1",
        "dp=2 tp=1 pp=2",
        "schedule",
        "1f1b",
        "split points",
        "Predicted",
        "step (ms)",
        "pipeline bubble",
        "peak memory per rank",
        "MFU",
        "tokens/s",
        "delta %",
        "forward (ms)",
        "new",
    ):
        assert text in out, text
    assert "recompute" not in out.split("Predicted")[0]  # the same in both: not listed


def test_diff_of_a_plan_with_itself(in_repo, capsys, two_plans):
    code, out, _ = run_cli(capsys, "diff", two_plans[0], two_plans[0])
    assert code == 0 and "none: the same decisions" in out and "+0.0%" in out


@pytest.mark.parametrize("which, message", [("missing", "not found"), ("broken", "not valid JSON")])
def test_diff_bad_files_are_one_line(in_repo, capsys, two_plans, tmp_path, which, message):
    path = tmp_path / "x.json"
    if which == "broken":
        path.write_text("{not json")
    code, out, err = run_cli(capsys, "diff", two_plans[0], str(path))
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: ") and out == ""


def test_estimate_that_fits_is_pinned_not_chosen(in_repo, capsys):
    code, out, _ = run_cli(
        capsys,
        "estimate",
        GPT,
        *CLUSTER,
        "--dp",
        "4",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "0",
        "--microbatch-size",
        "4",
        "--recompute",
        "none",
    )
    assert code == 0 and "% used)" in out
    rows = [line for line in out.split("Alternatives considered")[1].splitlines() if line.startswith("│ 4x1x1")]
    assert rows and "pinned: nothing else priced" in rows[0] and "chosen" not in rows[0]


def test_a_plan_with_less_room_than_the_memory_models_error_says_to_dry_run_it():
    """inspect's memory table: a plan that fits with less room than the memory model's measured error (8 % of the
    device) says so and names `autoshard dryrun`; one with more room, or one that does not fit, says nothing of it."""
    from dataclasses import replace

    from rich.console import Console

    from autoshard.cost.rank_memory import MEASURED_MEMORY_ERROR
    from autoshard.ir.plan import load_plan
    from autoshard.show import memory_table

    plan = load_plan(GOLDEN / "bf16_dp_zero3.plan.json")
    device = plan.cluster["device"]["memory_bytes"]

    def shown(peak_fraction: float) -> str:
        memory = replace(plan.predicted.memory, peak_bytes=int(device * peak_fraction))
        predicted = replace(plan.predicted, memory=memory, memory_peak_bytes_per_rank=memory.peak_bytes)
        console = Console(width=200, record=True)
        console.print(memory_table(replace(plan, predicted=predicted)))
        return console.export_text()

    thin = shown(1 - MEASURED_MEMORY_ERROR / 2)
    assert "thin margin" in thin and "autoshard dryrun" in thin and "(4.0%) left" in thin
    assert "thin margin" not in shown(1 - 2 * MEASURED_MEMORY_ERROR)
    assert "thin margin" not in shown(1.1)
