"""Write emitted programs and launch them with torchrun on this machine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, model_source, write_text_atomic
from autoshard.ir.recipe import Recipe
from autoshard.passes.lowering.codegen import emit_program, emit_sbatch

MAX_LOCAL_CPU_RANKS = 16  # more CPU processes than this on one machine is a mistake, not a test


def write_program(
    plan: Plan, path: str | Path, sbatch: bool = False, plan_file: str = "plan.json", recipe: Recipe | None = None
) -> Path:
    """Emit the plan's program to ``path`` atomically (no half-written file on failure); with
    ``sbatch``, also its SLURM batch script beside it (``train.py`` -> ``train.sbatch``). The header's run
    commands name ``path`` and ``plan_file``; ``recipe`` is its ``RECIPE`` (None: the defaults)."""
    path = Path(path)
    if path.suffix != ".py":
        raise AutoshardError(f"output '{path}' must end in .py; e.g. -o train.py")
    model_path = model_source(plan.model["spec"])[0]
    if path.exists() and model_path.exists() and path.resolve() == model_path.resolve():
        raise AutoshardError(
            f"output '{path}' is this plan's model file; writing the program there would replace "
            f"your model; fix: choose another name, e.g. -o train.py"
        )
    write_text_atomic(path, emit_program(plan, str(path), plan_file, recipe))
    if sbatch:
        write_text_atomic(path.with_suffix(".sbatch"), emit_sbatch(plan, path.name))
    return path


def check_runs_here(plan: Plan) -> None:
    """A plan runs here when it needs one node of at most MAX_LOCAL_CPU_RANKS ranks, or CPU node groups (gloo) of
    as many ranks in all: their nodes' ranks run as this machine's processes, which trains the same numbers (where
    a rank sits changes its speed, never what it computes), so a plan for groups of different speeds is checked
    here."""
    nodes = plan.cluster.get("nodes", 1)
    cpu_groups = bool(plan.cluster.get("groups")) and plan.cluster["backend"] == "gloo"
    if (nodes > 1 and not cpu_groups) or plan.world_size > MAX_LOCAL_CPU_RANKS:
        raise AutoshardError(
            f"this plan needs {plan.world_size} ranks on {nodes} node(s); run its program on the cluster with "
            f"the torchrun command in its header, or re-plan with --cluster local-cpu --devices-per-node 4 to try it here"
        )


class TorchrunResult(subprocess.CompletedProcess):
    """A finished torchrun job; ``crash`` is the block that names the failed rank ("" when none); ``failures``
    each failed or stopped rank's exit status (negative: the signal that ended it; {} when none failed)."""

    crash: str = ""
    failures: dict[int, int] = {}


# torchrun's own entry point, run so that a failed rank ends in ``crash_block`` instead of
# torchrun's ChildFailedError traceback and banner.
_AGENT = "import sys; from autoshard.launch import torchrun_main; sys.exit(torchrun_main(sys.argv[1:]))"
CRASH_FILE_ENV = "AUTOSHARD_CRASH_FILE"
FAILURES_FILE_ENV = "AUTOSHARD_FAILURES_FILE"  # torchrun_main writes each failed rank's exit status here (JSON)
USER_ERROR_EXIT = 2  # a rank's exit status for bad input (AutoshardError)


JOB_ENV = "AUTOSHARD_JOB"  # every process of one job carries this token (torchrun, its ranks): ``_job_pids``
LAUNCHER_PID_ENV = "AUTOSHARD_LAUNCHER_PID"
STOP_GRACE_S = 20.0  # after SIGTERM, how long torchrun may take to stop its ranks before everything is killed


class _Stop(Exception):
    """The launcher got SIGTERM or SIGINT (Ctrl-C) while the job ran."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_torchrun(
    program: Path,
    nproc: int,
    args: list[str],
    quiet: bool = False,
    max_restarts: int = 0,
    extra_env: dict[str, str] | None = None,
) -> TorchrunResult:
    """``python -m torch.distributed.run --standalone`` with ``nproc`` ranks on this machine.

    ``max_restarts``: torchrun starts every rank again this many times when one fails (the
    program resumes from its newest checkpoint; see ``runtime.faults``). When the job fails,
    the first rank to fail is named in one block (``crash_block``), printed on stderr and kept
    in the result's ``crash``.

    The job is owned here: torchrun runs in its own session, and SIGTERM or SIGINT (Ctrl-C) to
    this process stops all of it (``_stop_job``: SIGTERM to torchrun, which stops its ranks; after
    STOP_GRACE_S, SIGKILL to every process of the job) and ends with one line and the conventional
    exit status 128 + the signal. torchrun and its ranks also die with their parent
    (``runtime.distributed.die_with_parent``), should this process be killed outright. With
    ``--checkpoint-dir`` in ``args``, the folder is locked for the job (``checkpoint.lock``): a second
    job on it is refused, naming this one's pid, and ``.partial`` folders of dead writers are removed.
    """
    torchrun_args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", str(program), *args]
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if quiet else {}
    lock = _lock_checkpoint_dir(args)
    try:
        with tempfile.TemporaryDirectory(prefix="autoshard-torchrun-") as tmp:
            crash_file, failures_file = Path(tmp) / "crash.txt", Path(tmp) / "failures.json"
            token = uuid.uuid4().hex
            env = {
                **os.environ,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": _pythonpath_with_autoshard(),
                CRASH_FILE_ENV: str(crash_file),
                FAILURES_FILE_ENV: str(failures_file),
                JOB_ENV: token,
                LAUNCHER_PID_ENV: str(os.getpid()),
                **(extra_env or {}),
            }
            if lock is not None:
                env[_checkpoint().LOCK_HELD_ENV] = lock.folder
            result = _run_owned([sys.executable, "-c", _AGENT, *torchrun_args], env, token, lock, kwargs)
            result.crash = crash_file.read_text() if crash_file.exists() else ""
            result.failures = read_failures(failures_file)
    finally:
        if lock is not None:
            lock.release()
    return result


def _checkpoint():
    from autoshard.runtime import checkpoint  # imports torch: only for a job with a checkpoint folder

    return checkpoint


def _lock_checkpoint_dir(args: list[str]):
    """The lock of the ``--checkpoint-dir`` in ``args`` (None without one), its dead writers' ``.partial``
    folders removed."""
    folder = _flag_value(args, "--checkpoint-dir")
    if not folder:
        return None
    checkpoint = _checkpoint()
    lock = checkpoint.lock(folder, holder=f"autoshard run pid {os.getpid()}")
    checkpoint.remove_partials(folder)  # we hold the lock: whoever wrote them is gone
    return lock


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _run_owned(cmd: list[str], env: dict, token: str, lock, kwargs: dict) -> TorchrunResult:
    """Run torchrun in its own session; SIGTERM / SIGINT here stop the whole job (``run_torchrun``)."""
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {}

    def on_signal(signum, frame):
        raise _Stop(signum)

    if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
        for sig in handled:
            previous[sig] = signal.signal(sig, on_signal)
    proc = None
    try:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, pass_fds=(lock.fd,) if lock is not None else (), **kwargs
        )
        if lock is not None:
            lock.note(f"autoshard run pid {os.getpid()}, torchrun pid {proc.pid}")
        stdout, stderr = proc.communicate()
        return TorchrunResult(proc.args, proc.returncode, stdout, stderr)
    except _Stop as stop:
        for sig in handled:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        if proc is not None:
            _stop_job(proc, token)
        name = signal.Signals(stop.signum).name
        print(
            f"error: stopped by {name}: torchrun and every rank of the job were stopped; the newest complete "
            f"checkpoint (if any) is kept and a new run resumes from it",
            file=sys.stderr,
            flush=True,
        )
        output = proc.stdout.read() if proc is not None and proc.stdout else None
        return TorchrunResult(cmd, 128 + stop.signum, output, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_job(proc: subprocess.Popen, token: str) -> None:
    """SIGTERM to torchrun's session (torchrun stops its ranks, each in its own session), then, after
    STOP_GRACE_S or at once for what is left, SIGKILL to every process of the job."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _job_pids(token)
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGKILL)
    for pid in left:
        _kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    # A killed process is gone once it is reaped; while it exits its environment already reads empty, so
    # the ones we killed are watched by pid, and the token finds any the scan missed.
    while (any(_pid_alive(pid) for pid in left) or _job_pids(token)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _job_pids(token: str) -> list[int]:
    """Live processes (not zombies) whose environment carries this job's token (Linux ``/proc``; else [])."""
    needle = f"{JOB_ENV}={token}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and _alive(entry):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return pids


def _pid_alive(pid: int) -> bool:
    try:
        return _alive(Path(f"/proc/{pid}"))
    except OSError:
        return False


def _alive(entry: Path) -> bool:
    stat = (entry / "stat").read_text()
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def torchrun_main(argv: list[str]) -> int:
    """torchrun (``torch.distributed.run.main``); a failed job prints ``crash_block`` and exits 1.

    Each rank runs under ``runtime.faults.guard``, which records its exception with torch's
    ``@record`` in the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``); torchrun hands
    those back in ``ChildFailedError.failures``.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    from autoshard.runtime.distributed import die_with_parent

    die_with_parent(signal.SIGTERM, os.environ.get(LAUNCHER_PID_ENV))  # a killed launcher stops the job

    if not os.environ.get("AUTOSHARD_DEBUG"):  # the agent's per-rank log lines say what the block says
        for name in list(logging.root.manager.loggerDict):  # each elastic module sets its logger's own level
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        main(argv)
    except ChildFailedError as exc:
        if os.environ.get(FAILURES_FILE_ENV):
            write_failures(Path(os.environ[FAILURES_FILE_ENV]), exc.failures)
        if refused_bad_input(exc.failures):
            return USER_ERROR_EXIT  # the ranks refused bad input and said why in one line (runtime.faults.guard)
        block = crash_block(exc.failures)
        print(block, file=sys.stderr, flush=True)
        if os.environ.get(CRASH_FILE_ENV):
            Path(os.environ[CRASH_FILE_ENV]).write_text(block)
        return 1
    except SignalException as exc:  # stopped (its ranks too) by a signal: the launcher says so in one line
        return 128 + int(exc.sigval)
    return 0


def write_failures(path: Path, failures: dict) -> None:
    """Each failed rank's exit status (torchrun's ``ProcessFailure.exitcode``: negative, the signal that ended
    it), as JSON ``{"rank": status}``, for the launcher (``read_failures``)."""
    path.write_text(json.dumps({str(rank): int(failure.exitcode) for rank, failure in sorted(failures.items())}))


def read_failures(path: Path) -> dict[int, int]:
    """``write_failures``' file as {rank: exit status}; {} when there is none (the job did not fail)."""
    if not path.exists():
        return {}
    return {int(rank): int(status) for rank, status in json.loads(path.read_text()).items()}


def refused_bad_input(failures: dict) -> bool:
    """Every rank that failed refused bad input (exit 2), or was stopped by torchrun (a signal) after one did."""
    refused = [f for f in failures.values() if f.exitcode == USER_ERROR_EXIT]
    return bool(refused) and all(f.exitcode == USER_ERROR_EXIT or f.exitcode < 0 for f in failures.values())


_PEER_GONE = re.compile(r"connection (closed|reset)|broken pipe|timed out|timeout|peer", re.IGNORECASE)


def crash_block(failures: dict) -> str:
    """The first rank to fail: its exception, its last frame and the model file's line (``summarize_crash``).

    A rank torchrun stopped (SIGTERM, sent to the others once one fails) before it recorded an error
    comes after every rank that failed on its own, and a rank whose error is a lost connection to
    another rank after every rank that failed otherwise (they follow the rank that really failed);
    then by the error file's time.
    The times alone mislead: a rank without an error file (one that printed its error and exited) is
    timed when torchrun saw it, later than its peers' error files, and a stopped rank can be seen
    before the failed rank's error file is read.
    """

    def order(item):
        rank, failure = item
        stopped = failure.exitcode == -signal.SIGTERM and not _recorded(failure)  # stopped before it failed
        return stopped, bool(_PEER_GONE.search(str(failure.message))), failure.timestamp, rank

    rank, failure = min(failures.items(), key=order)
    others = len(failures) - 1
    callstack = _callstack(failure)
    if _recorded(failure):
        first, *where = summarize_crash(callstack, _recorded_message(failure), _model_files(failure))
    else:
        first, where = _failure_message(failure), []
    lines = [f"rank {rank} failed: {first}", *(f"  {line}" for line in where)]
    if others:
        lines.append(f"  ({others} other rank(s) stopped after it)")
    if os.environ.get("AUTOSHARD_DEBUG") and callstack:  # --debug: the rank's whole traceback
        lines.append(callstack.rstrip())
    return "\n".join(lines)


def _recorded(failure) -> bool:
    """Whether the rank recorded a Python exception (``runtime.faults.record_for_torchrun``)."""
    message = _recorded_message(failure)
    return failure.error_file_data != {} and bool(message) and not message.startswith("To enable traceback")


def _recorded_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


def _failure_message(failure) -> str:
    """What a rank that recorded no exception died of."""
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()} (no Python exception)"
    return f"exited with status {failure.exitcode} (its own message is in the output above)"


def _callstack(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack", ""))
    return ""


def _model_files(failure) -> list[str] | None:
    """The model files the rank had loaded (``runtime.faults`` records them), or None if it did not say."""
    message = failure.message
    files = message.get("extraInfo", {}).get("model_files") if isinstance(message, dict) else None
    return [str(f) for f in files] if isinstance(files, list) else None


@dataclass(frozen=True)
class Frame:
    """One frame of a Python traceback."""

    path: str
    line: int
    function: str
    source: str = ""

    def __str__(self) -> str:
        return f"{_short(self.path)}:{self.line} in {self.function}" + (f": {self.source[:200]}" if self.source else "")


_TRACEBACK_START = "Traceback (most recent call last):"
_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+?)\s*$')
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::(.*))?$")
_CARETS = re.compile(r"^[\s~^]+$")  # Python 3.11's markers under a frame's source line


def parse_traceback(text: str) -> tuple[list[Frame], str]:
    """The frames of the last traceback in ``text`` (``traceback.format_exc()``), innermost last, and the
    exception text after them (its type, message and any lines the message spans)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK_START)]
    i = starts[-1] + 1 if starts else 0
    frames: list[Frame] = []
    while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        match = _FRAME_LINE.match(lines[i])
        if match:
            frames.append(Frame(match.group(1), int(match.group(2)), match.group(3)))
        elif frames and not frames[-1].source and _is_source(lines[i]):
            frames[-1] = Frame(frames[-1].path, frames[-1].line, frames[-1].function, lines[i].strip())
        i += 1
    return frames, "\n".join(lines[i:])


def summarize_crash(callstack: str, message: str = "", model_files: list[str] | None = None) -> list[str]:
    """A crashed rank's summary, from its traceback text (and torch's one-line ``message``, "Type: text").

    1. the exception type, and its message's first line or "(empty message)";
    2. ``at`` the last frame (file:line in function: source);
    3. ``model file:`` the innermost frame in the model file, when there is one and it is not the last
       frame; or else, when the last frame is in a library, ``from`` the innermost one outside libraries.

    The model file is one of ``model_files`` (the files the rank loaded); when none are known, code outside
    Python's library, installed packages, autoshard and the scripts run (their ``<module>`` frames). When the
    stack holds no model frame, the model line is the last one the text quotes elsewhere: in an exception
    chained before it, or in the traceback torch.fx puts in a message ("Original traceback:"; a pipeline
    stage's graph runs the model's code, not its file).
    """
    frames, exception = parse_traceback(callstack)
    lines = [_exception_line(exception, message) if frames else _exception_line(message, exception)]
    if not frames:  # no traceback (torch's ``format_exc`` outside an except block reads "NoneType: None")
        return lines
    last = frames[-1]
    lines.append(f"at {last}")
    quoted = _frames_in(callstack)  # every frame the text names: chained exceptions', torch.fx's quotes
    programs = {frame.path for frame in quoted if frame.function == "<module>"}
    model = _model_frame(frames, model_files, programs) or _model_frame(quoted, model_files, programs)
    if model is not None and model != last:
        lines.append(f"model file: {model}")
    elif model is None and _is_library(last.path):
        own = [frame for frame in frames if not _is_library(frame.path)]
        if own:
            lines.append(f"from {own[-1]}")
    return lines


def _exception_line(*texts: str) -> str:
    """ "Type: first line of the message", or "Type (empty message)", from the first of ``texts`` naming a type."""
    for text in texts:
        stripped = [line for line in text.splitlines() if line.strip()]
        match = _EXCEPTION_LINE.match(stripped[0].strip()) if stripped else None
        if match:
            first = (match.group(2) or "").strip() or next((line.strip() for line in stripped[1:]), "")
            return f"{match.group(1)}: {first[:400]}" if first else f"{match.group(1)} (empty message)"
    named = [text.strip() for text in texts if text.strip()]
    return named[0].splitlines()[0][:400] if named else "an exception (no type recorded)"


def _frames_in(text: str) -> list[Frame]:
    """Every frame ``text`` names, in order: the tracebacks' and those quoted in messages (torch.fx's)."""
    frames = []
    for line in text.splitlines():
        match = _FRAME_LINE.match(line)
        if match:
            frames.append(Frame(match.group(1), int(match.group(2)), match.group(3)))
        elif frames and not frames[-1].source and _is_source(line):
            frames[-1] = Frame(frames[-1].path, frames[-1].line, frames[-1].function, line.strip())
    return frames


def _is_source(line: str) -> bool:
    """An indented line of code under a frame (not Python 3.11's ~^ markers, nor a repetition note)."""
    return (
        line.startswith(" ")
        and bool(line.strip())
        and not _CARETS.match(line)
        and not line.strip().startswith("[Previous line repeated")
    )


def _model_frame(frames: list[Frame], model_files: list[str] | None, programs: set[str]) -> Frame | None:
    """The innermost (last) of ``frames`` in the model file (``summarize_crash``)."""
    if model_files:
        wanted = {_resolved(path) for path in model_files}
        found = [frame for frame in frames if _resolved(frame.path) in wanted]
    else:
        found = [
            frame
            for frame in frames
            if not _is_library(frame.path) and not _in_autoshard(frame.path) and frame.path not in programs
        ]
    return found[-1] if found else None


def _resolved(path: str) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):
        return path


def _in_autoshard(path: str) -> bool:
    return _resolved(path).startswith(str(Path(__file__).resolve().parent) + os.sep)


def last_own_frame(callstack: str) -> str:
    """``path:line in function: source`` of the innermost frame outside torch and Python's own
    library (the model file, or autoshard), or ""."""
    own = [frame for frame in parse_traceback(callstack)[0] if not _is_library(frame.path)]
    return str(own[-1]) if own else ""


def _is_library(path: str) -> bool:
    parts = Path(path).parts
    stdlib = str(Path(os.__file__).parent)
    return (
        path.startswith("<")
        or path.startswith(stdlib)
        or "torch" in parts
        or ("site-packages" in parts and "autoshard" not in parts)
    )


def _short(path: str) -> str:
    """Relative to the working directory; an installed package's file from its package (``torch/...``)."""
    parts = Path(path).parts
    if "site-packages" in parts:
        return str(Path(*parts[len(parts) - parts[::-1].index("site-packages") :]))
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except (ValueError, OSError, RuntimeError):
        return path


def _pythonpath_with_autoshard() -> str:
    """Make ``import autoshard`` work in the ranks even when it is not installed (a source checkout)."""
    root = str(Path(__file__).resolve().parent.parent)
    current = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (root, current) if p)
