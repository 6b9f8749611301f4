"""runtime/report: each step's figures (MFU against the plan's model FLOPs, memory, lr, gradient norm, ETA) on
stdout, as JSON lines and in TensorBoard, and the run against the plan's prediction at the end."""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from autoshard.errors import AutoshardError
from autoshard.runtime import report
from autoshard.runtime.report import Prediction, StepLog

PREDICTED = dict(
    step_time_s=2.0,
    mfu=0.5,
    peak_flops_per_s=1e12,
    devices=4,
    allocated_bytes=3 * 2**30,
    memory_peak_bytes=int(3.15 * 2**30),
)


@pytest.fixture
def clock(monkeypatch):
    """time.perf_counter as the test sets it: each step takes ``clock.step_s``."""

    class Clock:
        now, step_s = 0.0, 4.0

        def __call__(self):
            self.now += self.step_s  # from one call to the next: start() to end() is one step
            return self.now

    fake = Clock()
    monkeypatch.setattr(report.time, "perf_counter", fake)
    return fake


def run_steps(log: StepLog, losses, lr=1e-3, grad_norm=None):
    for step, loss in enumerate(losses):
        log.start()
        log.end(step, loss, lr=lr, grad_norm=grad_norm)


def test_the_eta_is_the_pace_of_the_recent_steps(tmp_path, clock, capsys):
    """Each step's ETA: the median of the last ETA_WINDOW_STEPS steps, not of the whole run (which sorted every step
    so far, each step); the end's figures still take every step."""
    stream = tmp_path / "steps.jsonl"
    log = StepLog(tokens_per_step=1, is_main=True, log_every=1 << 30, last_step=1000, jsonl=str(stream))
    clock.step_s = 10.0
    run_steps(log, [1.0] * (1 + report.ETA_WINDOW_STEPS * 3 // 2))
    clock.step_s = 1.0
    for step in range(len(log.losses), len(log.losses) + report.ETA_WINDOW_STEPS):
        log.start()
        log.end(step, 1.0)
    assert log.recent_median_step_s == 1.0 and log.median_step_s == 10.0  # the run's: 150 steps of 10 s, 100 of 1 s
    assert capsys.readouterr().out.count("ETA") == 1  # step 0's line only
    last = json.loads(stream.read_text().splitlines()[-1])
    assert last["eta_s"] == (1000 - last["step"]) * 1.0


def test_mfu_is_the_plans_model_flops_over_the_measured_step(clock):
    """F_step = mfu · t · N · P = 0.5 · 2 s · 4 · 1e12; a 4 s step: F / (4 s · 4 · 1e12) = 25 %."""
    prediction = Prediction(**PREDICTED)
    assert prediction.model_flops_per_step == pytest.approx(4e12)
    assert prediction.mfu_of(4.0) == pytest.approx(0.25)
    assert prediction.mfu_of(1.0) == pytest.approx(1.0)


def test_each_step_goes_to_stdout_and_json_lines_on_rank_0_only(tmp_path, clock, capsys):
    stream = tmp_path / "logs" / "steps.jsonl"
    log = StepLog(tokens_per_step=1000, is_main=True, prediction=dict(PREDICTED), jsonl=str(stream), last_step=2)
    run_steps(log, [3.0, 2.5, 2.0], grad_norm=0.75)
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and [r["loss"] for r in records] == [3.0, 2.5, 2.0]
    first = records[0]
    assert first["step_s"] == pytest.approx(4.0) and first["tokens_per_s"] == pytest.approx(250.0)
    assert first["mfu"] == pytest.approx(0.25) and first["lr"] == 1e-3 and first["grad_norm"] == 0.75
    assert first["memory_bytes"] > 2**20  # a CPU rank: the process's peak resident set
    assert first["eta_s"] == pytest.approx(8.0) and records[-1]["eta_s"] == 0  # two steps of 4 s left, then none
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step    0 | loss 3.0000 |") and "| MFU 25.0% |" in out[0] and "| ETA 8s" in out[0]
    assert "grad norm 0.7500" in out[0] and " GiB" in out[0]
    other = tmp_path / "other.jsonl"
    run_steps(StepLog(tokens_per_step=1000, is_main=False, prediction=dict(PREDICTED), jsonl=str(other)), [1.0])
    assert not other.exists() and capsys.readouterr().out == ""  # only rank 0 reports


def test_the_end_compares_the_run_with_the_plan(clock):
    log = StepLog(tokens_per_step=1000, is_main=True, prediction=dict(PREDICTED))
    run_steps(log, [3.0, 2.5, 2.0])
    table = log.against_prediction()
    step_row = next(line for line in table.splitlines() if line.startswith("median step"))
    assert "4000.0 ms" in step_row and "2000.0 ms" in step_row and step_row.endswith("2.000")
    mfu_row = next(line for line in table.splitlines() if line.startswith("MFU"))
    assert "25.0%" in mfu_row and "50.0%" in mfu_row
    assert StepLog(tokens_per_step=1000, is_main=True).against_prediction() == ""  # no plan, no comparison


def test_tensorboard_writes_scalars_or_names_the_missing_package(tmp_path, clock):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(AutoshardError, match="pip install tensorboard"):
            StepLog(tokens_per_step=1000, is_main=True, tensorboard=str(tmp_path / "tb"))
        return
    log = StepLog(tokens_per_step=1000, is_main=True, prediction=dict(PREDICTED), tensorboard=str(tmp_path / "tb"))
    run_steps(log, [3.0, 2.0])
    log.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_eta_reads_as_a_clock():
    assert [report._clock(s) for s in (7, 125, 3723)] == ["7s", "2m05s", "1h02m03s"]


def test_run_refuses_tensorboard_without_its_package_before_anything_starts(in_repo, tmp_path, capsys, monkeypatch):
    import importlib.util as util

    from autoshard.cli import main

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    plan = tmp_path / "plan.json"
    assert (
        main(["plan", "examples/gpt.py:build", "--cluster", "local-cpu", "--global-batch", "4", "-o", str(plan)]) == 0
    )
    capsys.readouterr()
    code = main(["run", str(plan), "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install tensorboard" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no program written, nothing launched


def write_ranks(out, ranks):
    """rank-r.json as ``report._write_rank_record`` writes it: each rank's (step times, step ends)."""
    out.mkdir(exist_ok=True)
    for r, (times, ends) in enumerate(ranks):
        record = {"median_step_s": statistics.median(times[report.WARMUP_STEPS :]), "step_times_s": times}
        if ends is not None:
            record["step_ends_s"] = ends
        (out / f"rank-{r}.json").write_text(json.dumps(record))


def ends_of(start_s, times):
    """Each step's end on the wall clock, steps back to back from ``start_s``."""
    out, now = [], start_s
    for t in times:
        now += t
        out.append(now)
    return out


def test_the_jobs_step_is_read_where_every_rank_runs(tmp_path):
    """Two ranks that share one core and no collective: a step takes 1 s alone, 2 s shared. Rank 1 starts 3 s late
    and rank 0 ends first, so each has steps alone at the edges of a short run, which pull their medians under the
    pace they keep together; the window where both run holds only the shared steps."""
    rank0 = [1.0] + [1.0] * 4 + [2.0] * 3  # warm-up, alone until rank 1's warm-up ends at 5 s, shared until 11 s
    rank1 = [2.0] + [2.0] * 3 + [1.0] * 4  # from 3 s: warm-up and steps shared until 11 s, then alone
    write_ranks(tmp_path / "free", [(rank0, ends_of(0.0, rank0)), (rank1, ends_of(3.0, rank1))])
    assert report.slowest_rank_median_step_s(tmp_path / "free") == 1.0
    assert report.steady_step_s(tmp_path / "free") == 2.0

    together = [1.0, 2.0, 2.0, 3.0, 2.0]  # ranks that meet every step: ends a few ms apart, the same steps
    write_ranks(tmp_path / "met", [(together, ends_of(0.0, together)), (together, ends_of(0.004, together))])
    assert report.steady_step_s(tmp_path / "met") == report.slowest_rank_median_step_s(tmp_path / "met") == 2.0

    write_ranks(tmp_path / "old", [(rank0, None), (rank1, None)])  # records written before the step ends
    assert report.steady_step_s(tmp_path / "old") == report.slowest_rank_median_step_s(tmp_path / "old")


def test_each_rank_records_its_steps_ends_on_the_wall_clock(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(report.time, "time", lambda: 1000.0 + clock.now)
    log = StepLog(tokens_per_step=8, is_main=False)
    for step in range(3):
        log.start()
        log.end(step, 1.0)
    assert log.step_ends_s == [1008.0, 1016.0, 1024.0]  # each end() after its start(), 4 s apart
