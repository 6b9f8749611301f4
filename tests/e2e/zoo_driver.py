"""Run several emitted programs, one after another, in one torchrun launch (the zoo's driver).

    torchrun --nproc-per-node 2 zoo_driver.py CASES_JSON

CASES_JSON lists ``{"name", "program", "args"}``: each program is a file ``autoshard compile`` wrote,
run as it is (its ``main()``) with ``args`` as its command line. One launch saves a process start,
imports and a process group per case. The process group is made once: the programs' own
``runtime.init_distributed`` returns it, and their ``runtime.shutdown`` (which ends the process)
does nothing until the last case. A case that raises writes ``error-rank{r}.txt`` into its metrics
folder and ends the launch (a rank left inside a collective could not go on).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

from autoshard import runtime


def run_case(case: dict, index: int) -> None:
    spec = importlib.util.spec_from_file_location(f"zoo_case_{index}", case["program"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [case["program"], *case["args"]]
    module.main()


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    ctx = runtime.init_distributed(expected_world_size=int(os.environ["WORLD_SIZE"]))
    shutdown = runtime.shutdown
    runtime.init_distributed = lambda *args, **kwargs: ctx
    runtime.shutdown = lambda: None
    for index, case in enumerate(cases):
        try:
            run_case(case, index)
        except BaseException:  # noqa: BLE001  (recorded for the test, then the launch ends)
            out = Path(case["metrics_out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"error-rank{ctx.rank}.txt").write_text(traceback.format_exc())
            os._exit(1)
    shutdown()


if __name__ == "__main__":
    main()
