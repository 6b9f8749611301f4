"""Run several emitted programs, one after another, in one torchrun launch (test_determinism's driver).

    torchrun --nproc-per-node N ckpt_driver.py JOBS_JSON

JOBS_JSON lists ``{"program", "args", "copy"}``: each program is a file ``write_program`` wrote,
run as it is (its ``main()``, a fresh module each time) with ``args`` as its command line; a
job's optional ``copy`` ``[src, dst]`` is copied by rank 0 before the job starts (a checkpoint
folder the job is to resume from), behind a barrier. The process group is made once: the programs'
own ``runtime.init_distributed`` returns it, and their ``runtime.shutdown`` (which ends the
process) does nothing until the last job. One launch saves a process start, the imports and a
rendezvous per job. A job that raises prints its traceback and ends the launch with status 1 (a
rank left inside a collective could not go on).

``run_jobs`` (the tests' side) writes the list and launches it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

DRIVER = Path(__file__).resolve()
ROOT = DRIVER.parents[2]


def job(program, *args, copy=None) -> dict:
    """One program run: ``program`` with ``args`` (strings or paths); ``copy`` (src, dst) before it."""
    return {"program": str(program), "args": [str(a) for a in args], "copy": [str(p) for p in copy] if copy else None}


def run_jobs(ranks: int, jobs: list[dict], folder: Path) -> None:
    """Run ``jobs`` in order in one torchrun launch of ``ranks`` ranks; fails the test if any fails."""
    from autoshard.launch import run_torchrun

    folder.mkdir(parents=True, exist_ok=True)
    listing = folder / f"jobs-{len(list(folder.glob('jobs-*.json')))}.json"
    listing.write_text(json.dumps(jobs, indent=1))
    proc = run_torchrun(DRIVER, ranks, [str(listing)], quiet=True)
    assert proc.returncode == 0, proc.stdout[-4000:]


def _run_job(job: dict, index: int) -> None:
    if job["copy"]:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            shutil.copytree(*job["copy"])
        dist.barrier()
    spec = importlib.util.spec_from_file_location(f"ckpt_job_{index}", job["program"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [job["program"], *job["args"]]
    module.main()


def main() -> None:
    from autoshard import runtime

    jobs = json.loads(Path(sys.argv[1]).read_text())
    ctx = runtime.init_distributed(expected_world_size=int(os.environ["WORLD_SIZE"]))
    shutdown = runtime.shutdown
    runtime.init_distributed = lambda *args, **kwargs: ctx
    runtime.shutdown = lambda: None
    for index, job in enumerate(jobs):
        try:
            _run_job(job, index)
        except BaseException:  # noqa: BLE001  (reported, then the launch ends)
            print(
                f"rank {ctx.rank}: job {index} ({job['program']} {' '.join(job['args'])}) failed:\n"
                f"{traceback.format_exc()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
    shutdown()


if __name__ == "__main__":
    main()
