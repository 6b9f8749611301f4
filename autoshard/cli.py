"""``autoshard`` command line: parse, call the API, print. Errors: one line, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.pins import PIN_OF, PINS, Pins
from autoshard.ir.plan import model_source
from autoshard.ir.plan_format import PLAN_RUNTIMES
from autoshard.ir.recipe import RECIPE_FILE_HELP, RECIPE_FLAGS, recipe_of

EXIT_USER_ERROR = 2
EXIT_DOES_NOT_FIT = 1  # estimate: priced, printed and written, but over the device's memory
EXIT_VERIFY_FAILED = 1
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


MAX = 2**63 - 1  # --seed: torch.manual_seed takes 0 .. 2**64-1; beyond it every rank would fail


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


def pins_of(args) -> dict[str, object]:
    """The pin flags of a ``plan`` / ``estimate`` command line, by ``Pins`` field (None: not given)."""
    return {row.name: getattr(args, row.name) for row in PINS}


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


def recipe_of_args(args):
    """The recipe of a ``compile`` / ``run`` / ``verify`` command line: ``--recipe FILE``, its flags over it."""
    return recipe_of(args.recipe, **{row.name: getattr(args, row.name) for row in RECIPE_FLAGS})


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


def _calibrate_across_nodes(args, output) -> int:
    from autoshard.calibrate_nodes import calibrate_across_nodes

    command = f"autoshard calibrate --across-nodes {args.across_nodes} -o {output}"
    cluster = calibrate_across_nodes(args.across_nodes, str(output), command)
    if cluster is not None:
        link = cluster.inter_node
        print(
            f"wrote {output}: {cluster.nodes} nodes x {cluster.devices_per_node}, inter_node "
            f"{link.latency_us:.3g} µs, {link.bandwidth_gbps:.3g} GB/s per device"
        )
    return 0


def cmd_plan(args) -> int:
    _check_plan_output(args)
    with _capture_ahead(args):
        from autoshard import api  # after the capture started: the imports run while it captures

        plan = api.plan(
            args.model,
            cluster=args.cluster,
            global_batch=args.global_batch,
            nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            runtime=args.runtime,
            fold=not args.no_fold,
            time_limit_s=_time_limit(args.time_limit),
            cache=not args.no_cache,
            seq_len=args.seq_len,
            **pins_of(args),
        )
    _write_plan(plan, args)
    if args.dryrun:
        _print_dryrun(plan, file=sys.stderr if args.json else sys.stdout)
    return 0


def _capture_ahead(args):
    """``passes.capturing.front.capture_ahead`` for a plan / estimate command line (the capture starts in a
    forked child while the planner is imported)."""
    from autoshard.passes.capturing.front import capture_ahead

    return capture_ahead(
        args.model,
        fold=not args.no_fold,
        use_cache=not args.no_cache,
        seq_len=args.seq_len,
        tp_degrees=_tp_degrees(args),
    )


def _tp_degrees(args) -> list[int] | None:
    """The tensor-parallel degrees the command's plan may take (``Cluster.tp_degrees``, as ``PlanRequest.tp_degrees``
    gives them), for the forked capture to prove; None (every degree) when the cluster or the pin cannot be read
    here: the plan reports that itself."""
    from autoshard.cost.hardware import load_cluster

    try:
        cluster = load_cluster(args.cluster, nodes=args.nodes, devices_per_node=args.devices_per_node)
    except AutoshardError:
        return None
    return cluster.tp_degrees(args.tp) if args.tp is None or isinstance(args.tp, int) else None


def _print_dryrun(plan, file) -> None:
    """``autoshard dryrun``'s report of ``plan`` (its default ranks)."""
    from autoshard.dryrun import dryrun, summary_lines

    print(
        f"dry run: {plan.mesh}, ZeRO-{plan.zero_stage}, on fake tensors over a fake group of {plan.world_size} ranks",
        file=file,
        flush=True,
    )
    print("\n".join(summary_lines(plan, dryrun(plan))), file=file)


def _time_limit(value: float | None) -> float | None:
    if value is not None and not (value > 0 and value < 1e6):
        raise AutoshardError(f"--time-limit {value} must be a number of seconds > 0; fix: e.g. --time-limit 10")
    return value


def cmd_estimate(args) -> int:
    """Every decision pinned (--schedule none implied for --pp 1; pins with a default, such as
    --virtual-stages, may be left out: ``Pins.with_defaults``). A configuration that does not fit is
    still priced, printed and written (the user asked what it costs, and "it needs 3 GiB more than the device
    has" is part of that answer; the plan's notes carry it too), with one "does not fit" line on stderr, and
    exits 1 (``EXIT_DOES_NOT_FIT``) so that a script cannot take it for a configuration that runs. Exit 2
    stays for bad input, as everywhere."""
    if args.schedule is None and args.pp == 1:
        args.schedule = "none"
    _check_plan_output(args)
    with _capture_ahead(args):
        from autoshard import api  # after the capture started: the imports run while it captures

        pins = pins_of(args)
        missing = [PIN_OF[name].flag for name in Pins(**pins).missing_for_estimate()]
        if missing:
            raise AutoshardError(
                f"estimate prices a configuration fixed by hand: pin {', '.join(missing)} too "
                f"(or let `autoshard plan` choose)"
            )

        plan = api.estimate(
            args.model,
            cluster=args.cluster,
            global_batch=args.global_batch,
            nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            fold=not args.no_fold,
            cache=not args.no_cache,
            runtime=args.runtime,
            seq_len=args.seq_len,
            **pins,
        )
    _write_plan(plan, args)
    peak, device = plan.tightest_memory()
    if peak > device:
        over = peak - device
        print(
            f"does not fit: {peak / 2**30:.2f} GiB per rank, "
            f"{over / 2**30:.2f} GiB over the {device / 2**30:.1f} GiB per device (exit {EXIT_DOES_NOT_FIT})",
            file=sys.stderr,
        )
        return EXIT_DOES_NOT_FIT
    return 0


def _plan_inputs(args) -> dict[str, Path]:
    """The files a plan or estimate command reads, by what they are: -o never names one of them."""
    inputs = {"model file": model_source(args.model)[0]}
    if Path(args.cluster).exists():
        inputs["cluster file"] = Path(args.cluster)
    return inputs


def _check_plan_output(args) -> None:
    """Before any capture: -o is not an input, a folder or a Python module (a plan is JSON)."""
    if not args.output:
        return
    output = Path(args.output)
    check_outputs([output], _plan_inputs(args))
    if output.suffix == ".py" and output.exists():
        raise AutoshardError(
            f"output '{output}' is an existing Python file and a plan is JSON; writing it there "
            f"would replace that code; fix: choose another name, e.g. -o plan.json"
        )


def check_outputs(outputs: list[Path], inputs: dict[str, Path], loaded: dict[Path, str] | None = None) -> None:
    """Every output names a file, not a folder, and none is one of the command's inputs (``inputs``: what it
    is -> path) or a file the model loaded (``loaded``: resolved path -> what it is)."""
    for output in outputs:
        if output.is_dir():
            raise AutoshardError(
                f"output '{output}' is a folder; fix: name a file in it, e.g. "
                f"{output / ('plan.json' if output.suffix != '.py' else 'train.py')}"
            )
        for what, path in inputs.items():
            if _same_file(output, path):
                raise AutoshardError(
                    f"output '{output}' is this command's {what} ('{path}'); writing there would "
                    f"replace it; fix: choose another name for the output"
                )
        what = (loaded or {}).get(_resolved(output))
        if what is not None and output.exists():
            raise AutoshardError(
                f"output '{output}' is {what}; writing there would replace it; fix: choose another name for the output"
            )
    named = [_resolved(o) for o in outputs]
    if len(set(named)) != len(named):
        raise AutoshardError(f"outputs {', '.join(map(str, outputs))} name one file twice; fix: give each its own name")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return _resolved(a) == _resolved(b)


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: compared as written
        return path.absolute()


def _loaded_modules(outputs: list[Path]) -> dict[Path, str]:
    """Resolved output -> what it is, for each of ``outputs`` that is the file of a module imported in this
    process (the model's among them). Compared by the file's identity (device, inode), one ``stat`` per module:
    resolving every module's path took 0.1 s of a plan on 2 cores (about 1,000 modules, a ``lstat`` per part)."""
    wanted: dict[tuple[int, int], Path] = {}
    for output in outputs:
        with contextlib.suppress(OSError):  # not there: nothing it could replace
            stat = os.stat(output)
            wanted[(stat.st_dev, stat.st_ino)] = output
    out: dict[Path, str] = {}
    if not wanted:
        return out
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        try:
            stat = os.stat(file) if isinstance(file, str) else None
        except OSError:
            continue
        output = wanted.get((stat.st_dev, stat.st_ino)) if stat is not None else None
        if output is not None:
            out.setdefault(_resolved(output), f"the module '{name}' that the model imports")
    return out


def _model_reads(args) -> dict[Path, str]:
    """Resolved file -> what it is, for the files the capture recorded as read while the model was built
    (its modules, a config file it opened): the capture cache's entry, when there is one."""
    import json

    try:
        from autoshard.passes.capturing.capture_cache import entry_path
        from autoshard.passes.capturing.front import CAPTURE_BATCH

        entry = entry_path(args.model, CAPTURE_BATCH, not args.no_fold)
        rows = json.loads(entry.read_text())["dependencies"] if entry is not None and entry.is_file() else []
        return {
            _resolved(Path(row[0])): f"a file the model read while it was built ('{row[0]}')"
            for row in rows
            if isinstance(row, list) and row and isinstance(row[0], str)
        }
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        return {}


def _write_plan(plan, args) -> None:
    from autoshard.show import render_plan

    if args.output:
        output = Path(args.output)
        check_outputs([output], _plan_inputs(args), {**_model_reads(args), **_loaded_modules([output])})
        plan.save(args.output)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        render_plan(plan)
        if args.output:
            print(f"plan written to {args.output}")


def cmd_inspect(args) -> int:
    from rich.console import Console

    from autoshard.cost.expressions import what_if_values
    from autoshard.ir.plan import load_plan
    from autoshard.show import render_plan, what_if_view, what_if_warnings

    plan = load_plan(args.plan)
    if not args.what_if:
        render_plan(plan, every_module=args.every_module)
        return 0
    values = what_if_values(args.what_if, plan.model.get("tokens_per_sample", 1))
    view = what_if_view(plan, values)  # checks the plan's symbolic cost before anything is printed
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(view)
    for line in what_if_warnings(plan, values):
        print(f"warning: {line}", file=sys.stderr)
    return 0


def cmd_diff(args) -> int:
    from autoshard.ir.plan import load_plan
    from autoshard.show import render_diff

    a, b = load_plan(args.a), load_plan(args.b)
    render_diff(a, b, (args.a, args.b))
    return 0


AUTOSHARD_MARK = "emitted by autoshard"  # in the first lines of every program and SLURM script autoshard writes


def _program_outputs(plan, program: Path, plan_file: Path, also: tuple[Path, ...] = ()) -> dict[str, Path]:
    """Checks what needs no import: the program's name and that no output is an input."""
    if program.suffix != ".py":
        raise AutoshardError(f"output '{program}' must end in .py; e.g. -o train.py")
    model = model_source(plan.model["spec"])[0]
    if _same_file(program, model):
        raise AutoshardError(
            f"output '{program}' is this plan's model file; writing the program there would "
            f"replace your model; fix: choose another name, e.g. -o train.py"
        )
    inputs = {"plan file": plan_file, "model file": model}
    check_outputs([program, *also], inputs)
    return inputs


def _written_by_autoshard(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return AUTOSHARD_MARK in f.read(4096).decode(errors="replace")
    except OSError:
        return False


def _check_sbatch(sbatch: Path, force: bool) -> bool:
    """Whether ``sbatch`` exists; one that autoshard did not write is replaced only with --force."""
    if not sbatch.exists() or sbatch.is_dir():
        return False
    if not force and not _written_by_autoshard(sbatch):
        raise AutoshardError(
            f"'{sbatch}' exists and autoshard did not write it; compile writes the SLURM script "
            f"beside the program; fix: add --force to replace it, or choose another -o name"
        )
    return True


def cmd_compile(args) -> int:
    from autoshard.ir.plan import check_model_file, load_plan, write_files_atomic
    from autoshard.passes.lowering.codegen import emit_program, emit_sbatch, torchrun_command
    from autoshard.pipeline import check_plan_modules
    from autoshard.runtime.model import load_model_file

    plan = load_plan(args.plan)
    recipe = recipe_of_args(args)  # a bad file or flag before anything is checked or written
    path = Path(args.output)
    sbatch = path.with_suffix(".sbatch")
    inputs = _program_outputs(plan, path, Path(args.plan), also=(sbatch,))
    replaced = _check_sbatch(sbatch, args.force)
    check_model_file(plan)  # its bytes are the planned ones: nothing is imported before this
    model_file = load_model_file(
        plan.model["spec"], expected_hash=plan.model["hash"], seq_len=plan.model.get("seq_len")
    )
    check_plan_modules(plan, model_file)  # every module the plan names is the model's
    check_outputs([path, sbatch], inputs, _loaded_modules([path, sbatch]))  # not a module the model imported
    write_files_atomic(
        {path: emit_program(plan, str(path), args.plan, recipe).encode(), sbatch: emit_sbatch(plan, path.name).encode()}
    )
    print(
        f"wrote {path} and {sbatch}{' (replaced)' if replaced else ''}; run it with: "
        f"{torchrun_command(plan, str(path))} (or on SLURM: sbatch {sbatch})"
    )
    return 0


def tensorboard_available() -> None:
    """--tensorboard's package is importable, or one line naming the fix (before anything starts)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise AutoshardError(
            "--tensorboard needs the tensorboard package; fix: pip install tensorboard, or leave "
            "--tensorboard out (--log-jsonl writes the same figures as JSON lines)"
        )


def _check_output_folder(flag: str, folder: str | None) -> None:
    """A folder the ranks will create or write into: not a file, and under a folder (not a file) that exists."""
    if not folder:
        return
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise AutoshardError(
            f"{flag} '{folder}' is an existing file, not a folder; fix: name a folder (it is created if missing)"
        )
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AutoshardError(
            f"{flag} '{folder}' cannot be created: '{parent}' is a file; fix: name a folder under an existing folder"
        )
    if not os.access(parent if not path.exists() else path, os.W_OK | os.X_OK):
        raise AutoshardError(
            f"{flag} '{folder}': '{parent if not path.exists() else path}' is not writable; "
            f"fix: choose a folder you can write"
        )


def cmd_run(args) -> int:
    from autoshard.elastic import DEFAULT_ELASTIC_RESTARTS, Attempt, run_elastic
    from autoshard.ir.plan import check_model_file, load_plan
    from autoshard.launch import check_runs_here, run_torchrun, write_program
    from autoshard.passes.lowering.lower import layout
    from autoshard.pipeline import check_plan_modules
    from autoshard.runtime.data import DataSource, open_dataset
    from autoshard.runtime.model import load_model_file

    plan = load_plan(args.plan)
    recipe = recipe_of_args(args)
    check_runs_here(plan)
    elastic = _elastic_of(args, plan)
    if args.max_restarts is None:
        args.max_restarts = DEFAULT_ELASTIC_RESTARTS if elastic else 0
    if args.max_restarts and not args.checkpoint_dir:
        raise AutoshardError(
            f"--max-restarts {args.max_restarts} without --checkpoint-dir would restart from "
            f"step 0; add --checkpoint-dir DIR (and --checkpoint-every N)"
        )
    program = Path(args.program) if args.program else Path(args.plan).with_suffix(".train.py")
    inputs = _program_outputs(plan, program, Path(args.plan))
    if not args.program and program.is_file() and not _written_by_autoshard(program):
        raise AutoshardError(
            f"'{program}' exists and autoshard did not write it; run keeps the program next to the "
            f"plan; fix: name another file with --program, or move that one"
        )
    _check_output_folder("--metrics-out", args.metrics_out)  # every output checked before anything starts
    _check_output_folder("--checkpoint-dir", args.checkpoint_dir)
    _check_output_folder("--tensorboard", args.tensorboard)
    _check_output_folder("--export-hf", args.export_hf)
    if args.init_from and not Path(args.init_from).is_dir():
        raise AutoshardError(
            f"--init-from '{args.init_from}' is not a folder; fix: name a Hugging Face folder of *.safetensors "
            f"(save_pretrained's) or a DCP checkpoint"
        )
    if args.tensorboard:
        tensorboard_available()
    if args.log_jsonl and Path(args.log_jsonl).is_dir():
        raise AutoshardError(f"--log-jsonl {args.log_jsonl!r} is a folder; fix: name a file (lines are appended)")
    check_model_file(plan)  # its bytes are the planned ones: nothing is imported before this
    model_file = load_model_file(
        plan.model["spec"], expected_hash=plan.model["hash"], seq_len=plan.model.get("seq_len")
    )
    check_plan_modules(plan, model_file)  # every module the plan names is the model's
    data = DataSource(args.data, args.data_dtype)
    open_dataset(model_file, data, layout(plan).tokens_per_sample)  # its samples match example_batch's rows
    check_outputs([program], inputs, _loaded_modules([program]))
    write_program(plan, program, plan_file=args.plan, recipe=recipe)
    print(f"running {program} on {plan.world_size} local ranks", flush=True)
    extra = ["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else []
    extra += ["--metrics-out", args.metrics_out] if args.metrics_out else []
    extra += ["--log-jsonl", args.log_jsonl] if args.log_jsonl else []
    extra += ["--tensorboard", args.tensorboard] if args.tensorboard else []
    extra += ["--init-from", args.init_from] if args.init_from else []
    extra += ["--export-hf", args.export_hf] if args.export_hf else []
    extra += [*data.program_args(), "--data-workers", str(args.data_workers)]
    program_args = [
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--timeout-s",
        str(args.timeout_s),
        "--checkpoint-every",
        str(args.checkpoint_every),
        *extra,
    ]
    if elastic:
        first = Attempt(plan, program)
        return run_elastic(first, elastic, program_args, args.checkpoint_dir, args.max_restarts, recipe)
    proc = run_torchrun(program, plan.world_size, program_args, max_restarts=args.max_restarts)
    _note_preset(plan)
    return proc.returncode


def _elastic_of(args, plan):
    """``--elastic MIN:MAX`` read and checked against the plan (None without it): it needs a checkpoint folder."""
    from autoshard.elastic import ElasticRange

    if not args.elastic:
        return None
    elastic = ElasticRange.parse(args.elastic)
    if not args.checkpoint_dir:
        raise AutoshardError(
            f"--elastic {args.elastic} without --checkpoint-dir would re-plan and start again from step 0; "
            f"add --checkpoint-dir DIR (and --checkpoint-every N)"
        )
    elastic.check_plan(plan.world_size)
    return elastic


def _note_preset(plan) -> None:
    """Under the run's measured-against-predicted table: a plan priced on a preset's figures says so, and how to
    get a prediction to hold the run to (``show.preset_caveat``)."""
    from autoshard.show import preset_caveat

    caveat = preset_caveat(plan.cluster)
    if caveat:
        print(f"note: the prediction is the preset's: {caveat}", flush=True)


def cmd_verify(args) -> int:
    from autoshard.ir.plan import check_model_file, load_plan
    from autoshard.runtime.data import DataSource
    from autoshard.verify import fp32_twin, summary_lines, verify

    plan = load_plan(args.plan)
    recipe = recipe_of_args(args)
    check_model_file(plan)  # its bytes are the planned ones: nothing is imported before this
    twin = f" (float8 {plan.decisions.float8} through its twin with float8 off)" if plan.float8_linears else ""
    twin += f" ({plan.precision}: its layout first in fp32, then in {plan.precision})" if fp32_twin(plan) else ""
    print(
        f"verifying {args.plan}{twin}: {plan.mesh}, ZeRO-{plan.zero_stage}, recompute {plan.recompute}, "
        f"{plan.world_size} CPU ranks vs one process, {args.steps} steps",
        flush=True,
    )
    report = verify(plan, steps=args.steps, seed=args.seed, recipe=recipe, data=DataSource(args.data, args.data_dtype))
    print("\n".join(summary_lines(report)))
    if not report.ok:
        print(f"FAILED: {report.failure}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    print("OK: the parallel program trains like one process")
    return 0


def cmd_dryrun(args) -> int:
    from autoshard.dryrun import dryrun, notes, summary_lines
    from autoshard.ir.plan import check_model_file, load_plan

    plan = load_plan(args.plan)
    check_model_file(plan)  # its bytes are the planned ones: nothing is imported before this
    results = dryrun(plan, ranks=args.ranks, steps=args.steps)
    if args.json:
        print(json.dumps({"ranks": [result.as_json() for result in results], "notes": notes(plan)}, indent=1))
    else:
        print("\n".join(summary_lines(plan, results)))
    return 0


def cmd_calibrate(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from autoshard.calibrate import (
        calibrate,
        check_output,
        microbatch_sizes_flag,
        render,
        repeats_flag,
        resolve_ranks,
        write_cluster_file,
    )
    from autoshard.model_probes import profile_request

    output = check_output(args.output)
    inputs = {"--across-nodes file": Path(args.across_nodes)} if args.across_nodes else {}
    check_outputs([output], {**inputs, **{f"--model file {m}": model_source(m)[0] for m in args.model}})
    if args.across_nodes:
        return _calibrate_across_nodes(args, output)
    ranks, _ = resolve_ranks(args.devices_per_node)
    repeats = repeats_flag(args.repeats)
    sizes = microbatch_sizes_flag(args.microbatch_sizes)
    models = [profile_request(spec, sizes) for spec in args.model]  # captured before minutes of measuring
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("calibrating", total=None)
        result = calibrate(
            ranks,
            quick=args.quick,
            models=models,
            repeats=repeats,
            on_step=lambda done, total, name: progress.update(
                task, completed=done, total=total, description=f"calibrating: {name}"
            ),
        )
    command = (
        "autoshard calibrate"
        + (" --quick" if args.quick else "")
        + f" --devices-per-node {ranks}"
        + "".join(f" --model {m}" for m in args.model)
        + (f" --microbatch-sizes {args.microbatch_sizes}" if args.model else "")
        + (f" --repeats {repeats}" if repeats > 1 else "")
        + f" -o {output}"
    )
    write_cluster_file(output, result, command)
    render(result)
    print(f"wrote {output}; use it with: autoshard plan MODEL --cluster {output} --global-batch N")
    return 0


if __name__ == "__main__":
    entry()
