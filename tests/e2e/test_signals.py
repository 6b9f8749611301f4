"""Signals to ``autoshard run`` stop the whole job, and one job at a time writes a checkpoint folder."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autoshard
from autoshard.runtime.checkpoint import latest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    plan = autoshard.plan(
        str(ROOT / "tests/models/mlp.py") + ":build",
        cluster="local-cpu",
        devices_per_node=2,
        global_batch=8,
        dp=2,
        zero=0,
    )
    path = tmp_path_factory.mktemp("signals") / "plan.json"
    plan.save(path)
    return path


def autoshard_run(plan_file, ckpt, steps, *extra, **kwargs):
    cmd = [
        sys.executable,
        "-m",
        "autoshard.cli",
        "run",
        str(plan_file),
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--timeout-s",
        "60",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def job_pids(launcher_pid: int) -> set[int]:
    """Live processes started for this launcher's job: torchrun and its ranks carry its pid in their environment."""
    needle = f"AUTOSHARD_LAUNCHER_PID={launcher_pid}".encode()
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            alive = (entry / "stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
            if alive and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_training(plan_file, ckpt):
    """A long run, once it has written its first complete checkpoint and its ranks are training."""
    first = autoshard_run(plan_file, ckpt, 100000)
    try:
        wait_for(lambda: latest(ckpt) is not None, 120, "the first checkpoint")
        wait_for(lambda: len(job_pids(first.pid)) >= 3, 30, "torchrun and 2 ranks")
    except AssertionError:
        os.killpg(first.pid, signal.SIGKILL)
        raise
    return first


def assert_gone(pids):
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() and job_alive(p) for p in pids), 10, f"{pids} to end")


def job_alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sigterm_stops_every_process_and_a_second_run_resumes(plan_file, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start_training(plan_file, ckpt)
    pids = job_pids(first.pid)
    try:
        # a second job on the same folder is refused at once, naming the first one's pid
        second = autoshard_run(plan_file, ckpt, 4)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert err.count("\n") == 1 and "in use by another job" in err and f"pid {first.pid}" in err, err
        assert "Traceback" not in err
        assert first.poll() is None  # and the first job was not disturbed

        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "error: stopped by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    assert_gone(pids)  # torchrun and both ranks: nothing keeps training or writing checkpoints
    done = int(latest(ckpt).name.split("-")[1])
    time.sleep(1)
    assert int(latest(ckpt).name.split("-")[1]) == done  # no orphan wrote another one

    resumed = autoshard_run(plan_file, ckpt, done + 2, "--metrics-out", str(tmp_path / "out"))
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    losses = json.loads((tmp_path / "out" / "metrics.json").read_text())["losses"]
    assert len(losses) == 2  # it resumed from the checkpoint the stopped job left
    assert latest(ckpt).name == f"step-{done + 2:08d}"
    assert not list(ckpt.glob(".*.partial"))


def test_killed_launcher_takes_its_job_with_it(plan_file, tmp_path):
    """SIGKILL cannot be handled: torchrun and the ranks die with their parent (PR_SET_PDEATHSIG), which
    also releases the checkpoint folder's lock."""
    ckpt = tmp_path / "ckpt"
    first = start_training(plan_file, ckpt)
    pids = job_pids(first.pid)
    first.kill()
    first.communicate(timeout=30)
    assert_gone(pids)
    again = autoshard_run(plan_file, ckpt, int(latest(ckpt).name.split("-")[1]) + 2)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert not list(ckpt.glob(".*.partial"))
