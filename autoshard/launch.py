"""Write emitted programs and launch them with torchrun on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
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


def run_torchrun(program: Path, nproc: int, args: list[str], quiet: bool = False, max_restarts: int = 0,
                 extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` with ``nproc`` ranks on this machine.

    ``max_restarts``: torchrun starts every rank again this many times when one fails (the
    program resumes from its newest checkpoint; see ``runtime.faults``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", str(program), *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": _pythonpath_with_autoshard(), **(extra_env or {})}
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if quiet else {}
    return subprocess.run(cmd, env=env, check=False, **kwargs)


def _pythonpath_with_autoshard() -> str:
    """Make ``import autoshard`` work in the ranks even when it is not installed (a source checkout)."""
    root = str(Path(__file__).resolve().parent.parent)
    current = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (root, current) if p)
