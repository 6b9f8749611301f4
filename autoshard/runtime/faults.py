"""Faults: restart from checkpoints, a hang deadline that names the stuck rank, and injection for tests.

Rank failure. ``autoshard run --max-restarts R`` launches torchrun with ``--max-restarts R``:
when a rank dies, torchrun's agent stops the others and starts every rank again, and the
program resumes from the newest complete checkpoint (``runtime.checkpoint``; a write that
was cut off is a ``.partial`` folder, never loaded). The data of step t depends only on
(seed, t), so the run ends with the parameters of a run without the fault; the steps after
the last checkpoint are computed again, nothing is lost.

A rank that survives (its collective lost the dead peer: "Connection reset by peer") says so in one
line, and whether torchrun restarts the job, instead of a traceback (``peer_gone_message``): the
dead rank is the one to name, and torchrun's block names it when the job ends. It exits with
``PEER_FAULT_EXIT`` (3), as a rank whose collective timed out does, so that the launcher tells a fault of
another rank from an exception of the rank's own (exit 1; ``autoshard.elastic``: relaunch, or stop).

Hangs. Every collective runs under the process group's timeout T (``init_distributed``,
``--timeout-s`` on the program). A rank whose collective times out marks itself in
torchrun's rendezvous store (``autoshard/timed-out/<rank>``), waits a moment for the others
to do the same, and names the ranks that never did: they are not in the collective at all
(stuck in their own code, or gone). It then exits non-zero and torchrun stops the job, so a
hang costs T plus a few seconds instead of forever.

Injection (tests and drills only): ``AUTOSHARD_INJECT_FAULT=KIND:RANK:STEP`` with KIND one of
``kill`` (SIGKILL after the step), ``hang`` (sleep forever after the step) or
``kill-in-checkpoint`` (SIGKILL after writing the checkpoint of that step, before it is
renamed into place). RANK may name several ranks, ``kill:2,3:4``: they die together, as a node's ranks
do when it goes away (each ignores torchrun's SIGTERM from then on and waits in the store for the others
before it kills itself, so torchrun sees every one of them killed outright). Acted on only in the first
attempt of a job (``TORCHELASTIC_RESTART_COUNT`` = 0, and ``ELASTIC_ATTEMPT_ENV`` = 0 under
``autoshard run --elastic``, whose relaunches are new torchrun jobs), so a restarted job runs clean.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from autoshard.errors import AutoshardError

INJECT_ENV = "AUTOSHARD_INJECT_FAULT"
# A rank's exit status when another rank's fault ended it (its peer went away, or a collective timed out: ``guard``);
# an exception of its own exits 1 (Python's), bad input 2 (``AutoshardError.exit_code``)
PEER_FAULT_EXIT = 3
ELASTIC_ATTEMPT_ENV = "AUTOSHARD_ELASTIC_ATTEMPT"  # the relaunch of an elastic job its ranks run in (0: the first)
ELASTIC_LEFT_ENV = "AUTOSHARD_ELASTIC_RELAUNCHES_LEFT"  # how many more times an elastic job may be launched
KINDS = ("kill", "hang", "kill-in-checkpoint")
STRAGGLER_GRACE_S = 3.0  # how long a timed-out rank waits for the others to time out too
_progress = {"step": None}


def note_step(step: int) -> None:
    """Record the last step this rank finished (for the hang message)."""
    _progress["step"] = step


def inject(kind: str, step: int) -> None:
    """Carry out the injected fault ``kind`` if it is due on this rank at this step (module doc)."""
    spec = os.environ.get(INJECT_ENV, "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not spec or not first_attempt or os.environ.get(ELASTIC_ATTEMPT_ENV, "0") != "0":
        return
    want_kind, ranks, at_step = _parse(spec)
    rank = int(os.environ.get("RANK", "0"))
    if want_kind != kind or at_step != step or rank not in ranks:
        return
    print(f"fault injected: {kind} on rank {rank} at step {step}", file=sys.stderr, flush=True)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if len(ranks) > 1:
        _die_together(ranks, step)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_together(ranks: tuple[int, ...], step: int) -> None:
    """Wait until every rank of ``ranks`` is here, deaf to torchrun's SIGTERM (which it sends the others once the
    first of them is gone), so that each of them ends killed outright (module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store = dist.distributed_c10d._get_default_store()
    key = f"autoshard/inject/{step}"
    store.add(key, 1)
    while store.add(key, 0) < len(ranks):
        time.sleep(0.01)


def _parse(spec: str) -> tuple[str, tuple[int, ...], int]:
    parts = spec.split(":")
    ranks = parts[1].split(",") if len(parts) == 3 else []
    if (
        len(parts) != 3
        or parts[0] not in KINDS
        or not all(r.isdigit() for r in ranks)
        or not parts[2].isdigit()
        or len(ranks) > 1
        and parts[0] != "kill"
    ):
        raise SystemExit(
            f"error: {INJECT_ENV}={spec!r} must be KIND:RANK:STEP with KIND one of {', '.join(KINDS)} "
            f"(kill may name several ranks, kill:2,3:5); e.g. kill:1:5"
        )
    return parts[0], tuple(int(r) for r in ranks), int(parts[2])


def guard(main: Callable[[], None]) -> None:
    """Run the program's ``main``; a collective that times out ends it with one line naming the stuck ranks;
    any other exception is recorded for torchrun (``record_for_torchrun``) and raised."""
    try:
        main()
    except AutoshardError as exc:  # a user mistake (e.g. the model file changed since planning): one line, exit 2
        if not getattr(exc, "same_on_every_rank", False) or not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(AutoshardError.exit_code)
    except Exception as exc:  # torch raises DistBackendError / RuntimeError, by backend
        if dist.is_initialized() and _is_peer_gone(exc):  # another rank died: it is the one to name, not us
            record_for_torchrun(exc)
            print(f"rank {dist.get_rank()}: {peer_gone_message()}", file=sys.stderr, flush=True)
            os._exit(PEER_FAULT_EXIT)  # no traceback, and no destroy_process_group: its peers are gone
        if not _is_timeout(exc) or not dist.is_initialized():
            record_for_torchrun(exc)
            raise
        print(f"error: {hang_message(exc)}", file=sys.stderr, flush=True)
        os._exit(PEER_FAULT_EXIT)  # skip destroy_process_group: it would wait on the stuck ranks


def record_for_torchrun(exc: BaseException) -> None:
    """Write the exception to the error file torchrun gave this rank (``TORCHELASTIC_ERROR_FILE``),
    as torch's ``@record`` does: torchrun hands it to the launcher, which names the failed rank
    (``autoshard.launch.crash_block``). Nothing outside torchrun."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    handler.record_exception(exc)
    _add_crash_context(os.environ["TORCHELASTIC_ERROR_FILE"], exc)


MODEL_FILES_KEY = "model_files"  # read by autoshard.launch.crash_block
MODEL_MODULE_PREFIX = "autoshard_user_model_"  # modelfile's module names for model files


def _add_crash_context(error_file: str, exc: BaseException) -> None:
    """Beside torch's record: the model files this rank loaded (so the launcher can name the model file's
    line among the frames), and the traceback of ``exc`` itself where torch's ``format_exc`` had none."""
    try:
        data = json.loads(Path(error_file).read_text())
        info = data["message"]["extraInfo"]
    except (OSError, ValueError, KeyError, TypeError):  # not torch's format: leave it as torch wrote it
        return
    info[MODEL_FILES_KEY] = loaded_model_files()
    if not str(info.get("py_callstack", "")).startswith("Traceback"):
        info["py_callstack"] = "".join(traceback.format_exception(exc))
    Path(error_file).write_text(json.dumps(data))


def loaded_model_files() -> list[str]:
    """The paths of the model files imported in this process (``modelfile.load_model_file``)."""
    return sorted(
        {
            str(Path(module.__file__).resolve())
            for name, module in list(sys.modules.items())
            if name.startswith(MODEL_MODULE_PREFIX) and getattr(module, "__file__", None)
        }
    )


# What gloo and NCCL say when the other end of a collective went away (its process ended): gloo's socket errors;
# NCCL's ncclRemoteError ("remote process exited or there was a network error", "... a remote process exiting
# prematurely"), its socket's "connection closed by remote peer", and ProcessGroupNCCL's "NCCL communicator was
# aborted on rank N" (a communicator its watchdog aborted after an error on it).
_PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "connection closed by remote peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "remote process exited",
    "remote process exiting",
    "communicator was aborted",
)


def _is_peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer of a collective went away. An aborted NCCL communicator whose reason is a timeout
    (the watchdog's "Watchdog caught collective operation timeout") is a hang, not a peer gone: ``hang_message``."""
    text = str(exc).lower()
    if "communicator was aborted" in text and _is_timeout(exc):
        return False
    return any(phrase in text for phrase in _PEER_GONE)


def peer_gone_message() -> str:
    """One line for a rank whose collective lost a peer: what happens next (a restart, or the end)."""
    step = _progress["step"]
    where = f"after step {step}" if step is not None else "before the first step ended"
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts < allowed:
        then = (
            f"torchrun restarts every rank (restart {restarts + 1} of {allowed}) and the job resumes from "
            f"its newest checkpoint"
        )
    elif int(os.environ.get(ELASTIC_LEFT_ENV, "0")) > 0:
        then = (
            "autoshard run --elastic launches the job again from its newest checkpoint, re-planned for the "
            "ranks left if any were lost"
        )
    else:
        then = "the job stops; the rank that failed first is named below"
    return f"another rank ended during a collective {where}; {then}"


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def hang_message(exc: BaseException) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    stuck = _ranks_not_timed_out(rank, world)
    step = _progress["step"]
    where = f" after step {step}" if step is not None else " before the first step ended"
    who = (
        f"rank(s) {', '.join(map(str, stuck))} never joined it (stuck in their own code, or gone)"
        if stuck
        else "every rank was waiting in it (a lost message or a dead link)"
    )
    return (
        f"rank {rank}: a collective{where} timed out; {who}; look at those ranks' logs, "
        f"or raise --timeout-s if a step can really take that long"
    )


def _ranks_not_timed_out(rank: int, world: int) -> list[int]:
    """Ranks that did not mark a timeout within the grace period (module doc)."""
    # torch has no API that lists the ranks missing from a collective; torchrun's store is
    # the one channel that still works when the process group does not.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"autoshard/timed-out/{rank}", "1")
    deadline = time.monotonic() + STRAGGLER_GRACE_S
    missing = [r for r in range(world) if r != rank]
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not _has_key(store, f"autoshard/timed-out/{r}")]
        time.sleep(0.1)
    return missing


def _has_key(store, key: str) -> bool:
    try:
        store.wait([key], timedelta(milliseconds=10))
        return True
    except Exception:  # the store raises on its wait timeout  # noqa: BLE001
        return False
