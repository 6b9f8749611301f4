"""Plan a fixed corpus and write every plan's JSON (or its one-line refusal) to a folder.

    .venv/bin/python scripts/plan_corpus.py OUT_DIR [--only SUBSTRING]
    diff -r before/ after/

A change that should leave plans as they are (a refactoring of the plan record, the pins or the
flags) is checked by running this before and after it and diffing the two folders. The corpus:

- every ``tests/golden/*.plan.json``: its model and cluster, re-planned through the command line
  (``autoshard plan``) with the pins it records (``provenance.pinned``, valued from the plan);
- every model file of ``tests/models/`` and ``examples/`` (its ``build`` factory, or its first
  ``build_*``) through the Python API at a few pin sets: nothing pinned, dp, tp, pp (and an
  interleaved schedule with even cuts), ZeRO-3, cp, ep, HSDP, sequence parallel, a bf16 GPU cluster,
  and ``estimate`` with every decision pinned (API and command line);
- ``autoshard plan --help`` and ``autoshard estimate --help``.

A refusal is written as ``NAME.err`` (its message), so the refusals are compared too. Each model is
captured once per run (a private capture cache under OUT_DIR, removed at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Pin sets for the model files: name -> (API keywords besides the pins, pins). local-cpu with 4 ranks
# unless the set names another cluster.
PIN_SETS: dict[str, tuple[dict, dict]] = {
    "auto": ({}, {}),
    "dp": ({}, dict(dp=4)),
    "tp": ({}, dict(tp=2)),
    "pp": ({}, dict(pp=2)),
    "pp-interleaved": ({"global_batch": 16}, dict(pp=2, schedule="interleaved-1f1b", stage_cuts="even")),
    "zero3": ({}, dict(dp=4, zero=3)),
    "cp": ({}, dict(cp=2)),
    "ep": ({}, dict(ep=2)),
    "hsdp": ({"nodes": 2, "devices_per_node": 2}, dict(dp=4, zero=3, dp_replicate=2)),
    "sp": ({}, dict(tp=2, sequence_parallel=True)),
    "bf16": ({"cluster": "dgx-h100", "devices_per_node": 8, "global_batch": 16}, {}),
}
ESTIMATE = dict(dp=2, tp=2, pp=1, zero=1, microbatch_size=2, recompute="none")
ESTIMATE_FLAGS = ["--dp", "2", "--tp", "2", "--pp", "1", "--zero", "1", "--microbatch-size", "2", "--recompute", "none"]


def model_specs() -> list[str]:
    specs = []
    for path in sorted((ROOT / "tests" / "models").glob("*.py")) + sorted((ROOT / "examples").glob("*.py")):
        names = re.findall(r"^def (build\w*)\(", path.read_text(), re.M)
        if names:
            factory = "build" if "build" in names else names[0]
            specs.append(f"{path.relative_to(ROOT)}:{factory}")
    return specs


def golden_commands() -> list[tuple[str, list[str]]]:
    """(name, argv) of ``autoshard plan`` for each golden plan, its pins valued from the plan."""
    from autoshard.ir.plan import load_plan

    out = []
    for path in sorted((ROOT / "tests" / "golden").glob("*.plan.json")):
        plan = load_plan(path)
        values = {
            "dp": plan.mesh.dp,
            "tp": plan.mesh.tp,
            "pp": plan.mesh.pp,
            "cp": plan.mesh.cp,
            "zero": plan.zero_stage,
            "microbatch_size": plan.microbatch_size,
            "recompute": plan.recompute,
            "schedule": plan.schedule,
            "virtual_stages": plan.virtual_stages,
            "dp_replicate": plan.dp_replicate,
            "ep": plan.ep,
            "sequence_parallel": "on" if plan.sequence_parallel else "off",
        }
        argv = [
            "plan",
            plan.model["spec"],
            "--cluster",
            plan.cluster["name"],
            "--nodes",
            str(plan.cluster["nodes"]),
            "--devices-per-node",
            str(plan.cluster["devices_per_node"]),
            "--global-batch",
            str(plan.global_batch),
        ]
        if plan.model.get("seq_len"):
            argv += ["--seq-len", str(plan.model["seq_len"])]
        for name in plan.pinned:
            argv += [f"--{name.replace('_', '-')}", str(values[name])]
        out.append((path.name.removesuffix(".plan.json"), argv))
    return out


def run_cli(argv: list[str], out: Path, name: str) -> None:
    from autoshard.cli import main

    stderr = io.StringIO()
    target = out / f"{name}.plan.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            code = main([*argv, "-o", str(target)])
        except Exception as exc:  # a bug of the planner, as in run_api
            code, stderr = 1, io.StringIO(f"BUG {type(exc).__name__}: {exc}\n")
    if code != 0:
        (out / f"{name}.err").write_text(stderr.getvalue())
    elif not target.exists():
        (out / f"{name}.err").write_text(f"exit {code} and no plan\n")


def run_api(call, out: Path, name: str) -> None:
    from autoshard.errors import AutoshardError

    try:
        plan = call()
    except AutoshardError as exc:
        (out / f"{name}.err").write_text(f"{exc}\n")
        return
    except Exception as exc:  # a bug of the planner: compared like a refusal, and listed at the end
        (out / f"{name}.err").write_text(f"BUG {type(exc).__name__}: {exc}\n")
        return
    (out / f"{name}.plan.json").write_text(plan.to_json())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write the plans into (created; emptied first)")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cache = out / ".cache"
    os.environ["AUTOSHARD_CACHE_DIR"] = str(cache)
    os.environ["AUTOSHARD_CAPTURE_AHEAD"] = "0"  # one process: the cache makes later pin sets quick
    os.chdir(ROOT)  # model specs are relative to the checkout

    from autoshard import api
    from autoshard.cli import build_parser

    for command in ("plan", "estimate"):
        with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
            os.environ["COLUMNS"] = "120"
            build_parser().parse_args([command, "--help"])
        (out / f"help-{command}.txt").write_text(text.getvalue())

    start = time.time()
    for name, argv in golden_commands():
        if args.only in f"golden-{name}":
            run_cli(argv, out, f"golden-{name}")
    for spec in model_specs():
        stem = spec.split("/")[-1].replace(".py:", "-")
        for set_name, (extra, pins) in PIN_SETS.items():
            name = f"{stem}--{set_name}"
            if args.only not in name:
                continue
            kw = {"cluster": "local-cpu", "devices_per_node": 4, "global_batch": 8, **extra}
            run_api(lambda: api.plan(spec, **kw, **pins), out, name)
        if args.only in f"{stem}--estimate":
            run_api(
                lambda: api.estimate(spec, cluster="local-cpu", devices_per_node=4, global_batch=8, **ESTIMATE),
                out,
                f"{stem}--estimate",
            )
            run_cli(
                [
                    "estimate",
                    spec,
                    "--cluster",
                    "local-cpu",
                    "--devices-per-node",
                    "4",
                    "--global-batch",
                    "8",
                    *ESTIMATE_FLAGS,
                ],
                out,
                f"{stem}--estimate-cli",
            )
        print(f"{time.time() - start:7.1f}s {spec}", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    plans, errors = len(list(out.glob("*.plan.json"))), len(list(out.glob("*.err")))
    print(f"wrote {plans} plans and {errors} refusals to {out}")
    for err in sorted(out.glob("*.err")):
        if err.read_text().startswith("BUG"):
            print(f"{err.name}: {err.read_text().strip()[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
