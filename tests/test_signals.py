"""The checkpoint folder's lock and the launcher's signal handling, without torchrun (fast)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from autoshard.errors import AutoshardError
from autoshard.launch import _flag_value, _run_owned
from autoshard.runtime import checkpoint
from autoshard.runtime.checkpoint import latest, lock, remove_partials

HOLD = (
    "import sys, time; from autoshard.runtime.checkpoint import lock; lock(sys.argv[1], 'test pid 4242'); "
    "print('held', flush=True); time.sleep(60)"
)


def test_a_second_job_on_a_locked_folder_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AutoshardError, match=r"in use by another job \(test pid 4242\)") as exc:
            lock(tmp_path, "second")
        assert "\n" not in str(exc.value) and "--checkpoint-dir" in str(exc.value)
    finally:
        holder.kill()
        holder.wait()
    held = lock(tmp_path, "third")  # the kernel released the dead holder's lock
    assert (tmp_path / checkpoint.LOCK_FILE).read_text().strip() == "third"
    held.release()


def test_the_lock_holder_removes_dead_writers_partials_only(tmp_path):
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"x")
    (tmp_path / ".step-00000004.partial").mkdir()
    (tmp_path / ".step-00000004.partial" / "__0_0.distcp").write_bytes(b"x")
    assert [p.name for p in remove_partials(tmp_path)] == [".step-00000004.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert latest(tmp_path).name == "step-00000002"


def test_an_unusable_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AutoshardError, match="cannot use checkpoint folder"):
        lock(tmp_path / "file" / "ckpt", "me")


def test_flag_value():
    assert _flag_value(["--steps", "3", "--checkpoint-dir", "ck"], "--checkpoint-dir") == "ck"
    assert _flag_value(["--checkpoint-dir=ck2"], "--checkpoint-dir") == "ck2"
    assert _flag_value(["--steps", "3"], "--checkpoint-dir") is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_whole_job_and_exits_128_plus_it(tmp_path, capfd, sig):
    """A stand-in job (a parent and a child in its own session, as torchrun starts ranks) that ignores
    SIGTERM: the launcher escalates to SIGKILL after the grace period, and nothing of it survives."""
    pids = tmp_path / "pids"
    job = (
        "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'], start_new_session=True); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(60)"
    )
    token = "t" + str(os.getpid())
    env = {**os.environ, "AUTOSHARD_JOB": token}

    def send():
        while not pids.exists() or not pids.read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    import threading

    threading.Thread(target=send, daemon=True).start()
    import autoshard.launch as launch

    old, before = launch.STOP_GRACE_S, signal.getsignal(sig)
    launch.STOP_GRACE_S = 1.0
    try:
        result = _run_owned([sys.executable, "-c", job], env, token, None, {})
    finally:
        launch.STOP_GRACE_S = old
    assert result.returncode == 128 + sig
    err = capfd.readouterr().err
    assert f"error: stopped by {signal.Signals(sig).name}" in err and err.count("\n") == 1
    for pid in map(int, pids.read_text().split()):
        assert not _alive(pid), pid
    assert signal.getsignal(sig) is before  # the launcher's own handlers are back


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False
