"""Run several files with a ``main()`` one after another in one torchrun launch (``one_launch.run_jobs``).

    torchrun --nproc-per-node N jobs_driver.py JOBS_JSON

JOBS_JSON lists ``{"name", "program", "args", "out", "copy"}``: each program (an emitted program or a
test driver) is run as it is, a fresh module each time, with ``args`` as its command line; a job's
optional ``copy`` ``[src, dst]`` is copied by rank 0 before it starts (a checkpoint folder to resume
from), behind a barrier. The process group is made once: the programs' own
``runtime.init_distributed`` returns it, and their ``runtime.shutdown`` (which ends the process)
does nothing until the last job. Each rank appends the name of every job it finished and its seconds
to ``JOBS_JSON.done-rank{r}``. A job that raises writes its traceback to ``out/error-rank{r}.txt`` and
ends the launch (a rank left inside a collective could not go on); ``run_jobs`` launches the jobs
after it again. ``AUTOSHARD_PROFILE_JOBS=DIR`` profiles each job on rank 0 (``_profiled``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

GC_THRESHOLDS = (10_000, 10, 100)  # gc.set_threshold: young objects, young passes per middle, middle per old


def run_job(job: dict, index: int) -> None:
    if job.get("copy"):
        import torch.distributed as dist

        if dist.get_rank() == 0:
            shutil.copytree(*job["copy"])
        dist.barrier()
    spec = importlib.util.spec_from_file_location(f"launch_job_{index}", job["program"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [job["program"], *job["args"]]
    module.main()


@contextlib.contextmanager
def _profiled(job: dict, index: int, rank: int):
    """With ``AUTOSHARD_PROFILE_JOBS=DIR``, rank 0's cProfile of the job in ``DIR/<index>-<name>.prof`` (where a
    launch's time goes: tests/README.md)."""
    folder = os.environ.get("AUTOSHARD_PROFILE_JOBS")
    if not folder or rank != 0:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(Path(folder) / f"{index:03d}-{job['name'].replace('/', '_')}.prof")


def keep_collector_off_imports() -> None:
    """The cyclic garbage collector's full passes walk every object alive: in a rank, torch's, transformers' and the
    runtime's modules, the same ones each time. Those made so far are frozen out of its walks (``gc.freeze``), and
    the young generation holds 10,000 objects (700 by default) and the oldest is collected a tenth as often: the
    ranks of ``tests/e2e/test_verify_hybrid.py`` spent about 1 CPU-s each in six full passes (of 7-14 CPU-s)."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main() -> None:
    from autoshard import runtime

    keep_collector_off_imports()
    listing = Path(sys.argv[1])
    jobs = json.loads(listing.read_text())
    ctx = runtime.init_distributed(expected_world_size=int(os.environ["WORLD_SIZE"]))
    shutdown = runtime.shutdown
    runtime.init_distributed = lambda *args, **kwargs: ctx
    runtime.shutdown = lambda: None
    done = listing.with_name(f"{listing.name}.done-rank{ctx.rank}")
    for index, job in enumerate(jobs):
        start = time.monotonic()
        try:
            with _profiled(job, index, ctx.rank):
                run_job(job, index)
        except BaseException:  # noqa: BLE001  (recorded for the test, then the launch ends)
            out = Path(job["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"error-rank{ctx.rank}.txt").write_text(traceback.format_exc())
            os._exit(1)
        with done.open("a") as f:
            f.write(f"{job['name']}\t{time.monotonic() - start:.1f}\n")
    shutdown()


if __name__ == "__main__":
    main()
