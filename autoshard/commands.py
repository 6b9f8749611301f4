"""What each ``autoshard`` command does with its parsed arguments (``cli`` parses and dispatches): plan and
estimate (their outputs checked before anything is written), inspect, diff, compile, run (elastic included),
verify, dryrun and calibrate. A handler returns the exit status; bad input is an ``AutoshardError``, which
``cli.main`` prints as one line with exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.pins import PIN_OF, PINS, Pins
from autoshard.ir.plan import model_source
from autoshard.ir.recipe import RECIPE_FLAGS, recipe_of

EXIT_DOES_NOT_FIT = 1  # estimate: priced, printed and written, but over the device's memory


EXIT_VERIFY_FAILED = 1


MAX = 2**63 - 1  # --seed: torch.manual_seed takes 0 .. 2**64-1; beyond it every rank would fail


def pins_of(args) -> dict[str, object]:
    """The pin flags of a ``plan`` / ``estimate`` command line, by ``Pins`` field (None: not given)."""
    return {row.name: getattr(args, row.name) for row in PINS}


def recipe_of_args(args):
    """The recipe of a ``compile`` / ``run`` / ``verify`` command line: ``--recipe FILE``, its flags over it."""
    return recipe_of(args.recipe, **{row.name: getattr(args, row.name) for row in RECIPE_FLAGS})


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
    if plan.cluster.get("groups"):
        raise AutoshardError(
            f"--elastic {args.elastic} on a cluster of node groups: re-planning node groups for fewer ranks is "
            f"not built (which group lost them decides the new cluster); run without --elastic"
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
