"""Write emitted programs and launch them with torchrun on this machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, write_text_atomic
from autoshard.passes.codegen import emit_program, emit_sbatch

MAX_LOCAL_CPU_RANKS = 16  # more CPU processes than this on one machine is a mistake, not a test


def write_program(plan: Plan, path: str | Path, sbatch: bool = False) -> Path:
    """Emit the plan's program to ``path`` atomically (no half-written file on failure); with
    ``sbatch``, also its SLURM batch script beside it (``train.py`` -> ``train.sbatch``)."""
    path = Path(path)
    if path.suffix != ".py":
        raise AutoshardError(f"output '{path}' must end in .py; e.g. -o train.py")
    model_path = Path(plan.model["spec"].rsplit(":", 1)[0])
    if path.exists() and model_path.exists() and path.resolve() == model_path.resolve():
        raise AutoshardError(f"output '{path}' is this plan's model file; writing the program there would replace "
                             f"your model; fix: choose another name, e.g. -o train.py")
    write_text_atomic(path, emit_program(plan))
    if sbatch:
        write_text_atomic(path.with_suffix(".sbatch"), emit_sbatch(plan, path.name))
    return path


def check_runs_here(plan: Plan) -> None:
    """A plan runs here when it needs one node of at most MAX_LOCAL_CPU_RANKS ranks."""
    nodes = plan.cluster.get("nodes", 1)
    if nodes > 1 or plan.world_size > MAX_LOCAL_CPU_RANKS:
        raise AutoshardError(
            f"this plan needs {plan.world_size} ranks on {nodes} node(s); run its program on the cluster with "
            f"the torchrun command in its header, or re-plan with --cluster local-cpu --devices-per-node 4 to try it here")


class TorchrunResult(subprocess.CompletedProcess):
    """A finished torchrun job; ``crash`` is the block that names the failed rank ("" when none)."""
    crash: str = ""


# torchrun's own entry point, run so that a failed rank ends in ``crash_block`` instead of
# torchrun's ChildFailedError traceback and banner.
_AGENT = "import sys; from autoshard.launch import torchrun_main; sys.exit(torchrun_main(sys.argv[1:]))"
CRASH_FILE_ENV = "AUTOSHARD_CRASH_FILE"


def run_torchrun(program: Path, nproc: int, args: list[str], quiet: bool = False, max_restarts: int = 0,
                 extra_env: dict[str, str] | None = None) -> TorchrunResult:
    """``python -m torch.distributed.run --standalone`` with ``nproc`` ranks on this machine.

    ``max_restarts``: torchrun starts every rank again this many times when one fails (the
    program resumes from its newest checkpoint; see ``runtime.faults``). When the job fails,
    the first rank to fail is named in one block (``crash_block``), printed on stderr and kept
    in the result's ``crash``.
    """
    torchrun_args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", str(program), *args]
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if quiet else {}
    with tempfile.TemporaryDirectory(prefix="autoshard-torchrun-") as tmp:
        crash_file = Path(tmp) / "crash.txt"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": _pythonpath_with_autoshard(), CRASH_FILE_ENV: str(crash_file), **(extra_env or {})}
        proc = subprocess.run([sys.executable, "-c", _AGENT, *torchrun_args], env=env, check=False, **kwargs)
        result = TorchrunResult(proc.args, proc.returncode, proc.stdout, proc.stderr)
        result.crash = crash_file.read_text() if crash_file.exists() else ""
    return result


def torchrun_main(argv: list[str]) -> int:
    """torchrun (``torch.distributed.run.main``); a failed job prints ``crash_block`` and exits 1.

    Each rank runs under ``runtime.faults.guard``, which records its exception with torch's
    ``@record`` in the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``); torchrun hands
    those back in ``ChildFailedError.failures``.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    if not os.environ.get("AUTOSHARD_DEBUG"):  # the agent's per-rank log lines say what the block says
        for name in list(logging.root.manager.loggerDict):  # each elastic module sets its logger's own level
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        main(argv)
    except ChildFailedError as exc:
        block = crash_block(exc.failures)
        print(block, file=sys.stderr, flush=True)
        if os.environ.get(CRASH_FILE_ENV):
            Path(os.environ[CRASH_FILE_ENV]).write_text(block)
        return 1
    return 0


_PEER_GONE = re.compile(r"connection (closed|reset)|broken pipe|timed out|timeout|peer", re.IGNORECASE)


def crash_block(failures: dict) -> str:
    """The first rank to fail: its exception and the last frame in the model's or autoshard's code.

    First by the error file's time; among ranks that failed in the same second, one whose error
    is not a lost connection to another rank (those follow the rank that really failed).
    """
    def order(item):
        rank, failure = item
        return failure.timestamp, bool(_PEER_GONE.search(str(failure.message))), rank

    rank, failure = min(failures.items(), key=order)
    others = len(failures) - 1
    lines = [f"rank {rank} failed: {_failure_message(failure)}"]
    frame = last_own_frame(_callstack(failure))
    if frame:
        lines.append(f"  at {frame}")
    if others:
        lines.append(f"  ({others} other rank(s) stopped after it)")
    if os.environ.get("AUTOSHARD_DEBUG") and _callstack(failure):  # --debug: the rank's whole traceback
        lines.append(_callstack(failure).rstrip())
    return "\n".join(lines)


def _failure_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.error_file_data == {} or not message or message.startswith("To enable traceback"):
        if failure.exitcode < 0:
            return f"killed by signal {failure.signal_name()} (no Python exception)"
        return f"exited with status {failure.exitcode} (its own message is in the output above)"
    return str(message).strip().splitlines()[0][:400]


def _callstack(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack", ""))
    return ""


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?: +(.*))?')


def last_own_frame(callstack: str) -> str:
    """``path:line in function: source`` of the innermost frame outside torch and Python's own
    library (the model file, or autoshard), or ""."""
    own = [m for m in _FRAME.finditer(callstack) if not _is_library(m.group(1))]
    if not own:
        return ""
    path, line, func, source = own[-1].groups()
    return f"{_short(path)}:{line} in {func}" + (f": {source.strip()}" if source else "")


def _is_library(path: str) -> bool:
    parts = Path(path).parts
    stdlib = str(Path(os.__file__).parent)
    return path.startswith("<") or path.startswith(stdlib) or "torch" in parts \
        or ("site-packages" in parts and "autoshard" not in parts)


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def _pythonpath_with_autoshard() -> str:
    """Make ``import autoshard`` work in the ranks even when it is not installed (a source checkout)."""
    root = str(Path(__file__).resolve().parent.parent)
    current = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (root, current) if p)
