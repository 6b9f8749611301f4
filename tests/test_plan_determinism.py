"""Same inputs, same plan: Llama-3.1-70B on 32 dgx-h100 nodes at 8,192 tokens planned twice, in two processes with
different string hash orders, the second (its capture from the first's cache) pinned to one core and starved there
(stopped and continued in turn, half of its wall time stopped), gives the same bytes.

The search picked dp 64 x tp 4 or dp 128 x tp 2 by run: a block's input (the residual stream) was told from its
other inputs by element count, and Llama's causal mask, (b, 1, s, s) booleans, has as many as a (b, s, d) stream at
s = d = 8,192; which of the two a set of names gave first was the process's hash order (``cost.memory._input_split``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


LLAMA_3_1_70B = "hf:examples/configs/llama-3.1-70b"  # its config.json, as transformers writes it
STARVE_SLICE_S = 0.02  # stopped, then running, this long each: about a scheduler's slice


def _one_core() -> set[int]:
    """The one core the loaded plan runs on."""
    return {max(os.sched_getaffinity(0))}


def _plan(out: Path, hash_seed: str, *extra: str, cores: set[int] | None = None, starved: bool = False) -> None:
    command = [sys.executable, "-m", "autoshard", "plan", LLAMA_3_1_70B, "--cluster", "dgx-h100", "--nodes", "32"]
    command += ["--global-batch", "512", "--seq-len", "8192", "-o", str(out), *extra]
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=os.environ | {"PYTHONHASHSEED": hash_seed},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    ) as proc:
        stop = threading.Event()
        starver = threading.Thread(target=_starve, args=(proc.pid, stop), daemon=True) if starved else None
        if starver:
            starver.start()
        try:
            _, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # a hang: the planner and whatever it started, stopped or not
            raise
        finally:
            stop.set()
            if starver:
                starver.join()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
    assert proc.returncode == 0, stderr[-3000:]


def _starve(pid: int, stop: threading.Event) -> None:
    """Stop and continue the planner's process group in turn until ``stop``: it runs for about half of its wall
    time, as beside a busy loop on its core, at no CPU (a busy loop cost the suite about 17 CPU-s)."""
    while not stop.is_set():
        for sig in (signal.SIGSTOP, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            stop.wait(STARVE_SLICE_S)


def test_the_70b_plan_is_the_same_bytes_in_another_hash_order_and_under_load(tmp_path):
    _plan(tmp_path / "quiet.json", "1")
    # the capture cached by the first: the search pinned to one core and starved on it (stopped half the time)
    _plan(tmp_path / "loaded.json", "2", cores=_one_core(), starved=True)
    assert (tmp_path / "quiet.json").read_bytes() == (tmp_path / "loaded.json").read_bytes()
