"""``autoshard`` command line: parse, call the API, print. Errors: one line, exit 2."""

from __future__ import annotations

import argparse
import math
import os
import sys

from autoshard.commands import (
    MAX,
    cmd_calibrate,
    cmd_compile,
    cmd_diff,
    cmd_dryrun,
    cmd_estimate,
    cmd_inspect,
    cmd_plan,
    cmd_run,
    cmd_verify,
)
from autoshard.errors import AutoshardError
from autoshard.ir.pins import PINS
from autoshard.ir.plan_format import PLAN_RUNTIMES
from autoshard.ir.recipe import RECIPE_FILE_HELP, RECIPE_FLAGS

EXIT_USER_ERROR = 2


# Commands that only read and write files, run in this process. ``entry`` ends them without Python's
# own teardown: once torch and torch.export are imported, finalizing their ~10^4 modules and objects
# takes 0.4-0.8 s on a 2-core machine, a fifth of a cold ``plan``. Nothing of ours runs at exit (every
# file is written and renamed into place before the command returns). Commands that start processes
# (run, verify, calibrate) exit normally, so multiprocessing and torchrun clean up after their children.
QUICK_EXIT_COMMANDS = frozenset({"plan", "estimate", "inspect", "diff", "compile"})


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (and exit 2) like every other user error."""

    def error(self, message: str):
        raise AutoshardError(f"{self.prog}: {message} (see {self.prog} --help)")


def _int_flag(flag: str, low: int, high: int, example: int):
    """argparse ``type=`` for an integer flag in [low, high]: anything else is one line before anything starts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; e.g. {flag} {example}") from None
        if not low <= value <= high:
            bound = f">= {low}" if high >= 10**15 else f"from {low} to {high:,}"
            raise argparse.ArgumentTypeError(f"{flag} {text} must be an integer {bound}; e.g. {flag} {example}")
        return value

    return parse


def _positive_float(flag: str):
    """argparse ``type=`` for a finite number > 0 (a learning rate): anything else is one line."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; e.g. {flag} 3e-4") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{flag} {text} must be a finite number > 0; e.g. {flag} 3e-4")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if debug:
            os.environ["AUTOSHARD_DEBUG"] = "1"  # a failed rank's whole traceback (autoshard.launch.crash_block)
        return args.func(args)
    except AutoshardError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``autoshard`` console script: ``main``, then exit with its code (see QUICK_EXIT_COMMANDS)."""
    import_cp_model_without_pandas()
    code = main()
    if sys.argv[1:2] and sys.argv[1] in QUICK_EXIT_COMMANDS:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:  # the reader went away (`| head`): nothing more can be said
            pass
        os._exit(code)
    sys.exit(code)


def import_cp_model_without_pandas() -> None:
    """Import OR-Tools' ``cp_model`` with a stand-in for pandas, in autoshard's own process (the console script,
    and the capture child it forks, which inherits the module). ``cp_model`` imports pandas (0.3-0.45 s on a
    2-core machine, the largest part of importing it) only for its ``pd.Series``/``pd.Index`` variable-array
    helpers, which autoshard never calls; the capture child imports it before its TP proof, on the cold
    ``plan``'s critical path. The stand-in is gone from ``sys.modules`` once ``cp_model`` is imported: a later
    ``import pandas`` (a model file's) gets the real one, and only ``cp_model.pd`` is the stand-in. Where
    pandas is already imported, or OR-Tools' import ever needs more of it, the real import is left to run."""
    if "pandas" in sys.modules or "ortools.sat.python.cp_model" in sys.modules:
        return
    import types

    stand_in = types.ModuleType("pandas", "autoshard: a stand-in while OR-Tools' cp_model is imported")
    stand_in.Index = type("Index", (), {})
    stand_in.Series = type("Series", (), {})
    sys.modules["pandas"] = stand_in
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except Exception:  # a newer OR-Tools reads more of pandas at import: its own import, with the real one
        for name in [n for n in sys.modules if n.startswith("ortools")]:
            del sys.modules[name]
    finally:
        if sys.modules.get("pandas") is stand_in:
            del sys.modules["pandas"]


PLAN_HELP = "a plan JSON written by `autoshard plan` or `estimate`"


SEED_HELP = "seed of the initial weights, the data and dropout (default: 0)"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = _Parser(prog="autoshard", description="Plan, emit and verify distributed training programs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_plan(sub, common)
    _add_estimate(sub, common)
    _add_inspect(sub, common)
    _add_diff(sub, common)
    _add_compile(sub, common)
    _add_run(sub, common)
    _add_verify(sub, common)
    _add_dryrun(sub, common)
    _add_calibrate(sub, common)
    return parser


def _add_plan(sub, common) -> None:
    p = sub.add_parser("plan", parents=[common], help="choose how to parallelize a model on a cluster")
    _add_plan_arguments(p)
    p.add_argument(
        "--dryrun",
        action="store_true",
        help="then run the chosen plan's ranks of each role on fake "
        "tensors, as `autoshard dryrun` does, and print their peak memory by part beside the "
        "prediction (on stderr with --json)",
    )
    p.set_defaults(func=cmd_plan)


def _add_estimate(sub, common) -> None:
    p = sub.add_parser(
        "estimate",
        parents=[common],
        help="price a configuration fixed by hand (--dp --tp --pp --zero --microbatch-size "
        "--recompute --schedule all pinned; --virtual-stages follows the schedule)",
    )
    _add_plan_arguments(p)
    p.set_defaults(func=cmd_estimate)


def _add_plan_arguments(p) -> None:
    p.add_argument("model", help="path/to/model.py:factory")
    p.add_argument("--cluster", required=True, help="preset (local-cpu, dgx-a100-80gb, dgx-h100) or cluster YAML")
    p.add_argument("--nodes", type=int, help="nodes to plan for (default: the cluster file's or preset's)")
    p.add_argument(
        "--devices-per-node",
        type=int,
        help="GPUs (or CPU ranks) per node to plan for (default: the cluster file's or preset's)",
    )
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sample, handed to the model file's "
        "example_batch(batch_size, seq_len=...) (default: the file's own)",
    )
    p.add_argument("-o", "--output", help="write plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON to stdout")
    _add_pin_arguments(p)
    p.add_argument(
        "--runtime",
        choices=PLAN_RUNTIMES,
        default="autoshard",
        type=str.lower,
        help="price the configuration as this runtime runs it: autoshard (the emitted program, default) "
        "or megatron-lm (to compare with Megatron-LM's published runs; the plan still compiles "
        "to autoshard's program)",
    )
    p.add_argument(
        "--no-fold",
        action="store_true",
        help="export every repeated layer instead of three and copies "
        "(slower on deep models; for a model whose layers differ by their index)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="capture the model even if the capture cache has it "
        "(AUTOSHARD_CACHE=0 turns the cache off; AUTOSHARD_CACHE_DIR moves it)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="stop searching after this long and report the optimality gap (default: search to the optimum)",
    )


def _add_pin_arguments(p) -> None:
    """One flag per row of ``ir.pins.PINS``, stored under its ``Pins`` field (``args.zero_stage`` for
    --zero): ``pins_of`` hands them to ``Pins`` as they are, which checks them."""
    for row in PINS:
        p.add_argument(
            row.flag,
            dest=row.name,
            type=row.parse,
            choices=row.choices,
            help=row.help,
            metavar=row.metavar or (None if row.choices else row.keyword.upper()),
        )


def _add_inspect(sub, common) -> None:
    p = sub.add_parser("inspect", parents=[common], help="show a plan as tables")
    p.add_argument("plan", help=PLAN_HELP)
    p.add_argument(
        "--all",
        action="store_true",
        dest="every_module",
        help="one tensor-parallel row per module (default: one per module of the repeated layers, with their count)",
    )
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="re-evaluate the plan's cost with NAME (global_batch, seq_len, microbatch_size, dp, tp, pp, "
        "cp: cost.symbolic.WHAT_IF_NAMES) changed, without re-planning; repeat for several",
    )
    p.set_defaults(func=cmd_inspect)


def _add_diff(sub, common) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two plans: decisions and predicted parts")
    p.add_argument("a", help="plan JSON")
    p.add_argument("b", help="plan JSON")
    p.set_defaults(func=cmd_diff)


def _add_compile(sub, common) -> None:
    p = sub.add_parser("compile", parents=[common], help="emit the training program of a plan")
    p.add_argument("plan", help=PLAN_HELP)
    p.add_argument("-o", "--output", default="train.py", help="the program to write (default: train.py)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing SLURM script beside the program (NAME.sbatch) that autoshard did not write",
    )
    _add_recipe_arguments(p)
    p.set_defaults(func=cmd_compile)


def _add_run(sub, common) -> None:
    p = sub.add_parser("run", parents=[common], help="emit a plan's program and run it here with torchrun")
    p.add_argument("plan", help=PLAN_HELP)
    p.add_argument(
        "--steps", type=_int_flag("--steps", 1, 10**9, 20), default=20, help="optimizer steps to train (default: 20)"
    )
    p.add_argument("--seed", type=_int_flag("--seed", 0, MAX, 0), default=0, help=SEED_HELP)
    p.add_argument("--program", help="keep the emitted program here (default: next to the plan)")
    p.add_argument("--checkpoint-dir", help="save DCP checkpoints here and resume from the newest one")
    p.add_argument(
        "--checkpoint-every",
        type=_int_flag("--checkpoint-every", 1, 10**9, 100),
        default=100,
        help="steps between checkpoints",
    )
    p.add_argument(
        "--max-restarts",
        type=_int_flag("--max-restarts", 0, 100, 1),
        default=None,
        help="restart every rank this many times when one fails (resumes from --checkpoint-dir; "
        "default: 0, and 3 relaunches with --elastic)",
    )
    p.add_argument(
        "--elastic",
        metavar="MIN:MAX",
        help="when ranks are lost (killed outright), re-plan for the ranks left (at least MIN, at most MAX), "
        "keeping the global batch, and resume from the newest checkpoint in --checkpoint-dir",
    )
    p.add_argument(
        "--timeout-s",
        type=_int_flag("--timeout-s", 1, 10**7, 300),
        default=300,
        help="a collective waiting longer ends the job, naming the ranks that never joined it",
    )
    p.add_argument("--metrics-out", help="folder for losses, step times and final weights")
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from these weights: a Hugging Face folder of *.safetensors (save_pretrained's) or a DCP "
        "checkpoint; each rank reads only its shards",
    )
    p.add_argument(
        "--export-hf",
        metavar="DIR",
        help="at the end, write the weights here as Hugging Face safetensors, with a transformers model's config "
        "(from_pretrained loads the folder)",
    )
    p.add_argument(
        "--log-jsonl",
        metavar="FILE",
        help="append each step's figures (loss, step time, tokens/s, lr, grad norm, MFU, memory) here as JSON lines",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write each step's figures as TensorBoard scalars here (needs the tensorboard package)",
    )
    _add_data_arguments(p)
    p.add_argument(
        "--data-workers",
        type=_int_flag("--data-workers", 0, 64, 1),
        default=1,
        help="DataLoader processes per rank reading the dataset ahead (default: 1; 0: in the training process)",
    )
    _add_recipe_arguments(p)
    p.set_defaults(func=cmd_run)


def _add_data_arguments(p) -> None:
    p.add_argument(
        "--data",
        help="train on this flat token file (nanoGPT's .bin: tokens back to back, no header), "
        "in windows of the plan's tokens per sample (default: the model file's dataset(seq_len), else "
        "example_batch draws)",
    )
    p.add_argument(
        "--data-dtype",
        choices=["uint16", "int32"],
        default="uint16",
        help="the token type of --data's file (default: uint16)",
    )


def _add_recipe_arguments(p, what: str = "the program's RECIPE constants") -> None:
    """``--recipe FILE`` and one flag per row of ``ir.recipe.RECIPE_FLAGS`` (stored under the Recipe field's name;
    ``recipe_of_args`` reads them)."""
    group = p.add_argument_group("training recipe", f"optimizer, schedule and clipping ({what})")
    group.add_argument("--recipe", metavar="FILE", help=RECIPE_FILE_HELP)
    for row in RECIPE_FLAGS:
        group.add_argument(
            row.flag, dest=row.name, type=row.parse, choices=row.choices, help=row.help, metavar=row.metavar
        )


def _add_verify(sub, common) -> None:
    p = sub.add_parser("verify", parents=[common], help="check the emitted program trains like one process")
    p.add_argument("plan", help=PLAN_HELP)
    p.add_argument(
        "--steps",
        type=_int_flag("--steps", 1, 10**6, 5),
        default=5,
        help="steps to train both ways and compare (default: 5)",
    )
    p.add_argument("--seed", type=_int_flag("--seed", 0, MAX, 0), default=0, help=SEED_HELP)
    _add_data_arguments(p)
    _add_recipe_arguments(p, "both train with it")
    p.set_defaults(func=cmd_verify)


def _add_dryrun(sub, common) -> None:
    p = sub.add_parser(
        "dryrun",
        parents=[common],
        help="run one rank's setup and two steps on fake tensors and "
        "compare its peak memory by part with the plan's prediction",
    )
    p.add_argument("plan", help=PLAN_HELP)
    p.add_argument(
        "--rank",
        type=_int_flag("--rank", 0, MAX, 0),
        action="append",
        dest="ranks",
        help="a rank of the plan's world to run (repeatable; default: one of each distinct role, rank 0 "
        "and a pipeline's last stage)",
    )
    p.add_argument(
        "--steps",
        type=_int_flag("--steps", 1, 100, 2),
        default=2,
        help="training steps to run after setup (default: 2; the peak is the largest over them)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"ranks": [{"rank", "peak_bytes", '
        '"predicted_peak_bytes", "parts": {part: [measured, predicted]}}], "notes": [what it assumed]}',
    )
    p.set_defaults(func=cmd_dryrun)


def _add_calibrate(sub, common) -> None:
    p = sub.add_parser("calibrate", parents=[common], help="measure this machine and write a cluster file")
    p.add_argument("-o", "--output", required=True, help="the cluster YAML to write, e.g. cluster.yaml")
    p.add_argument("--devices-per-node", type=int, help="ranks to measure with (default: 2 on CPU, every GPU)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and repeats (about 30 s on 2 idle CPU cores; each --model adds its profile, 20 s for the "
        "example GPT)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="MODEL",
        help="also measure this model (file.py:factory): its forward and backward per micro-batch size "
        "and recompute mode, kept in the cluster file for plans of it (repeatable)",
    )
    p.add_argument("--microbatch-sizes", default="1,2,4,8", help="micro-batch sizes to measure --model at")
    p.add_argument(
        "--repeats",
        default="1",
        help="calibrate this many times in a row and write every time's median over them: steadier on a shared "
        "machine whose speed moves for minutes at a time (default 1)",
    )
    p.add_argument(
        "--across-nodes",
        metavar="NODE_FILE",
        help="under torchrun on every node: measure the links between nodes and write NODE_FILE's "
        "cluster (from calibrate on one node) with them",
    )
    p.set_defaults(func=cmd_calibrate)


if __name__ == "__main__":
    entry()
