"""Every plan the planner can emit, run on this machine: predicted vs measured step time.

    python benchmarks/bench_plans.py --cluster runs/cpu2.yaml --ranks 2 -o runs/plans2.json
    python benchmarks/bench_plans.py --reprice runs/plans2.json     # the same runs, priced again

For one model, cluster file (from ``autoshard calibrate``) and global batch: every configuration
``passes.planning.strategies`` offers (every mesh, ZeRO stage, micro-batch, recompute mode and schedule
the runtime supports) is planned with all its decisions pinned, emitted, and run with torchrun
on this machine's CPU ranks for ``--steps`` steps; the measured step time is the slowest rank's
median over the steps after the first (``runtime.report.WARMUP_STEPS``) that it ran while every rank ran its
timed steps (``runtime.report.steady_step_s``): ranks that share no collective in a step (a replicated TP
layout) drift apart, the job goes at its slowest one, and a rank that runs before the others start or after
they end has a shared core to itself. The runs are interleaved round by
round (``--rounds``: every plan once, then every plan again) so that a slow phase of the machine
hits all plans alike, and each plan's figure is the median of its rounds.

Reported: MAPE = mean |predicted − measured| / measured; Spearman's ρ between predicted and
measured (do the predictions order the plans as the machine does); the planner's pick (the plan
``autoshard plan`` chooses with nothing pinned) and its regret = measured time of the pick /
the best measured time.

``--calibrate FILE`` runs ``autoshard calibrate --model`` right before the runs and prices with
it (the machine's speed drifts by tens of percent over tens of minutes on a shared VM, so a
calibration from earlier mispredicts every plan alike), and once more after them; the second
summary shows how much the machine moved meanwhile.

``--calibration-repeats N`` makes each of those calibrations N in a row whose every time is the median
(``autoshard calibrate --repeats``): one calibration that lands in a slow minute no longer sets the level.

``--calibrate-every N`` (with ``--calibrate``) calibrates again before every N-th run; each run is then also priced
from the calibrations just before and just after it, interpolated by its place (``rolling_prediction``): on this
VM a calibration can land in a slow period of minutes (twice on 2026-11-27 the profile read 1.6 times the
minutes around it), and the single calibration before the runs then sets every plan's level.

``--reference-every N`` runs the planner's pick again before every N-th run and after the last: the machine's
drift over the runs (on this VM, tens of percent in minutes). The figures of record are the runs as measured; a
second summary divides each run by the drift at its place (``drift_removed``), to tell the cost model's errors
from the machine's moves.

``--reprice`` prices the stored configurations again with the current cost model and the
stored cluster file, without running anything: the measurements stay, the predictions move.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoshard.cost.hardware import load_cluster
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.launch import run_torchrun, write_program
from autoshard.passes.planning.space import candidate_configs
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.runtime.report import steady_step_s

RETRIES = 1  # a run that dies (seen: SIGABRT in gloo's shutdown on the loaded 2-core machine) is run again


def pins_of(config: Decisions) -> Pins:
    m = config.mesh
    return Pins(
        dp=m.dp,
        tp=m.tp,
        pp=m.pp,
        zero_stage=config.zero_stage,
        microbatch_size=config.microbatch_size,
        recompute=config.recompute,
        schedule=config.schedule,
        ep=config.ep,
        # every decision the key names is pinned: unpinned, the planner chooses sequence parallelism itself, and a
        # key's "sp" plan would be the plan without it (both then ran, and were priced, as one)
        sequence_parallel=config.sequence_parallel if config.mesh.tp > 1 else None,
        compile=config.compile or None,
    )


def config_key(config: Decisions) -> str:
    m = config.mesh
    sched = "" if config.schedule == "none" else f" {config.schedule}"
    sched += f" v{config.virtual_stages}" if config.virtual_stages > 2 else ""  # 2 is the interleaved default
    experts = f" ep{config.ep}" if config.ep > 1 else ""
    # sequence parallelism and compiled blocks apart: two plans must never share a key (their runs would merge)
    extra = " sp" * config.sequence_parallel + " compiled" * config.compile
    return (
        f"dp{m.dp} tp{m.tp} pp{m.pp}{experts} z{config.zero_stage} b{config.microbatch_size} {config.recompute}"
        f"{sched}{extra}"
    )


def plan_all(model: str, cluster_path: str, ranks: int, global_batch: int):
    """(key, plan) of every configuration that fits, in the candidate order, and the planner's pick."""
    cluster = load_cluster(cluster_path, devices_per_node=ranks)
    model_file, graph = capture_graph(model)
    plans = []
    for config in candidate_configs(graph, cluster, global_batch, Pins()):
        request = PlanRequest(model, cluster, global_batch, pins_of(config))
        try:
            plans.append((config_key(config), plan_graph(request, model_file, graph)))
        except Exception as exc:  # a pinned configuration that does not fit: not a plan the planner emits
            print(f"skip {config_key(config)}: {exc}", file=sys.stderr)
    pick = plan_graph(PlanRequest(model, cluster, global_batch), model_file, graph)
    return plans, pick


def plan_key(plan) -> str:
    return config_key(
        Decisions(
            Mesh(**{k: plan.mesh.__dict__[k] for k in ("dp", "tp", "pp")}),
            plan.zero_stage,
            plan.microbatch_size,
            plan.num_microbatches,
            recompute=plan.recompute,
            schedule=plan.schedule,
            virtual_stages=plan.virtual_stages,
            ep=plan.ep,
            sequence_parallel=plan.sequence_parallel,
            compile=plan.decisions.compile,
        )
    )


def measure(plan, ranks: int, steps: int, workdir: Path) -> tuple[float, list[list[list[float]]]]:
    """The emitted program's step time (``runtime.report.steady_step_s``), in seconds, and every rank's
    [step times, step ends] (the warm-up one included; ends on the wall clock): kept, so that the runs can be
    read again."""
    program = write_program(plan, workdir / "train.py")
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)  # no rank's figure from the plan before
    for attempt in range(RETRIES + 1):
        proc = run_torchrun(
            program, ranks, ["--steps", str(steps), "--metrics-out", str(out), "--log-every", "1000"], quiet=True
        )
        if proc.returncode == 0:
            records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
            return steady_step_s(out), [[r["step_times_s"], r.get("step_ends_s", [])] for r in records]
        print(f"run failed (attempt {attempt + 1}): {proc.stdout.strip().splitlines()[-1:]}", file=sys.stderr)
    raise RuntimeError(proc.stdout[-2000:])


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: Pearson's r of the ranks (ties share their mean rank); the standard library's, scipy is not
    among the test extras."""
    return statistics.correlation(_ranks(xs), _ranks(ys))


def _ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def summary(rows: list[dict], pick: str) -> dict:
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    best = min(rows, key=lambda r: r["measured_s"])
    picked = next((r for r in rows if r["key"] == pick), None)
    return {
        "plans": len(rows),
        "mape": statistics.fmean(errors),
        "max_error": max(errors),
        "spearman": spearman(pred, meas),
        "pick": pick,
        "pick_measured_s": picked["measured_s"] if picked else None,
        "best_measured": best["key"],
        "best_measured_s": best["measured_s"],
        "regret": picked["measured_s"] / best["measured_s"] if picked else None,
    }


def calibrate(ranks: int, model: str, path: Path, repeats: int = 1) -> str:
    """``autoshard calibrate`` of this machine and ``model`` at ``ranks`` ranks, ``repeats`` calibrations in a row
    (every time their median); the cluster file's path."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard.cli",
            "calibrate",
            "--devices-per-node",
            str(ranks),
            "--model",
            model,
            "--repeats",
            str(repeats),
            "-o",
            str(path),
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:  # its one-line error (or traceback) is the only account of what failed
        sys.exit(f"calibrate failed (exit {done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return str(path)


def run(args) -> dict:
    if args.calibrate:  # right before the runs: the machine's speed drifts over tens of minutes
        args.cluster = calibrate(args.ranks, args.model, Path(args.calibrate), args.calibration_repeats)
    plans, pick = plan_all(args.model, args.cluster, args.ranks, args.global_batch)
    if args.only:  # a subset of the configurations, by their keys ("dp2 tp1 pp1 ep2 z3 b4 none")
        plans = [(key, plan) for key, plan in plans if re.search(args.only, key) or key == plan_key(pick)]
    print(f"{len(plans)} plans; the planner picks {plan_key(pick)}", flush=True)
    calibrations = {0: {key: plan.predicted.step_time_s for key, plan in plans}} if args.calibrate else {}
    times: dict[str, list[float]] = {key: [] for key, _ in plans}
    steps: dict[str, list] = {key: [] for key, _ in plans}  # per round, per rank: [times, ends]
    positions: dict[str, list[int]] = {key: [] for key, _ in plans}  # each run's place in the sequence of runs
    reference: list[dict] = []  # the pick, run again every --reference-every runs: the machine's drift
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for i, (key, plan) in enumerate(plans):
                position = rnd * len(plans) + i
                if args.calibrate and args.calibrate_every and position and position % args.calibrate_every == 0:
                    calibrations[position] = predictions(args, Path(args.calibrate).with_suffix(f".at{position}.yaml"))
                if args.reference_every and position % args.reference_every == 0:
                    ref_s = measure(pick, args.ranks, args.steps, Path(tmp))[0]
                    reference.append({"position": position, "measured_s": ref_s})
                median_s, ranks_steps = measure(plan, args.ranks, args.steps, Path(tmp))
                times[key].append(median_s)
                steps[key].append(ranks_steps)
                positions[key].append(position)
                print(
                    f"round {rnd + 1}/{args.rounds} {i + 1}/{len(plans)} {key}: "
                    f"{times[key][-1] * 1e3:.1f} ms (predicted {plan.predicted.step_time_s * 1e3:.1f})",
                    flush=True,
                )
                if args.output:  # the runs so far, each time: a run stopped early keeps every record it made
                    _save_partial(Path(args.output), args, plans, times, positions, reference)
    rows = [
        {
            "key": key,
            "pins": asdict(pins_of_plan(plan)),
            "predicted_s": plan.predicted.step_time_s,
            "measured_s": statistics.median(times[key]),
            "measured_rounds_s": times[key],
            "positions": positions[key],
            "rank_steps_s": steps[key],  # per round, per rank: [step times, step ends on the wall clock]
        }
        for key, plan in plans
    ]
    if args.reference_every:  # the reference after the last run too: the drift is interpolated between its runs
        with tempfile.TemporaryDirectory() as tmp:
            end = args.rounds * len(plans)
            reference.append({"position": end, "measured_s": measure(pick, args.ranks, args.steps, Path(tmp))[0]})
    if args.output:  # the runs first: nothing after them (a calibration, a summary) may lose them
        Path(args.output).write_text(
            json.dumps({"model": args.model, "ranks": args.ranks, "rows": rows, "reference": reference}, indent=1)
        )
    drift = {}
    rolling = {}
    if args.calibrate:  # again after the runs: how far the machine moved while they ran
        after = calibrate(
            args.ranks, args.model, Path(args.calibrate).with_suffix(".after.yaml"), args.calibration_repeats
        )
        again, again_pick = plan_all(args.model, after, args.ranks, args.global_batch)
        predicted = {key: plan.predicted.step_time_s for key, plan in again}
        drift = summary(
            [dict(r, predicted_s=predicted[r["key"]]) for r in rows if r["key"] in predicted], plan_key(again_pick)
        )
        calibrations[args.rounds * len(plans)] = predicted
        for row in rows:
            row["predicted_rolling_s"] = rolling_prediction(row, calibrations)
        rolling = summary([dict(r, predicted_s=r["predicted_rolling_s"]) for r in rows], plan_key(pick))
    return {
        "model": args.model,
        "cluster": args.cluster,
        "cluster_file": Path(args.cluster).read_text(),
        "summary_calibrated_after": drift,
        "calibrated_at_positions": sorted(calibrations),
        "calibration_repeats": args.calibration_repeats,
        "summary_rolling_calibration": rolling,
        "ranks": args.ranks,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "torch": _torch_version(),
        "wall_s": time.perf_counter() - start,
        "load_1min_at_end": os.getloadavg()[0],
        "rows": rows,
        "reference": reference,
        "summary": summary(rows, plan_key(pick)),
        "summary_drift_removed": summary(drift_removed(rows, reference), plan_key(pick)) if reference else {},
    }


def _save_partial(path: Path, args, plans, times: dict, positions: dict, reference: list) -> None:
    """The runs made so far (``"partial": true``), which the final write replaces: every plan run at least once,
    with its predicted and measured times, its places in the sequence, and the reference runs."""
    rows = [
        {
            "key": key,
            "predicted_s": plan.predicted.step_time_s,
            "measured_rounds_s": times[key],
            "positions": positions[key],
        }
        for key, plan in plans
        if times[key]
    ]
    doc = {"partial": True, "model": args.model, "ranks": args.ranks, "rows": rows, "reference": reference}
    part = path.with_name(path.name + ".writing")
    part.write_text(json.dumps(doc, indent=1))
    os.replace(part, path)  # whole or not at all: a stop mid-write keeps the last complete file


def predictions(args, path: Path) -> dict[str, float]:
    """A calibration now, written to ``path``: every configuration's predicted step time on it."""
    cluster = calibrate(args.ranks, args.model, path, args.calibration_repeats)
    again, _ = plan_all(args.model, cluster, args.ranks, args.global_batch)
    return {key: plan.predicted.step_time_s for key, plan in again}


def rolling_prediction(row: dict, calibrations: dict[int, dict[str, float]]) -> float:
    """The row's prediction from the calibrations made around each of its runs, the mean over its runs::

        pred(run at p) = pred_a + (pred_b − pred_a) · (p − a) / (b − a)

    a ≤ p < b the places of the calibrations just before and just after the run (``--calibrate-every``; the last
    is the one after every run). Every figure is still the cost model's on a calibration: none is taken from the
    runs; what moves is how close in time the calibration is to the run it prices."""
    places = sorted(calibrations)
    key, first = row["key"], calibrations[places[0]][row["key"]]
    out = []
    for p in row["positions"]:
        a = max(q for q in places if q <= p)
        b = min((q for q in places if q > p), default=a)
        pa, pb = calibrations[a].get(key, first), calibrations[b].get(key, first)
        out.append(pa + (pb - pa) * (p - a) / (b - a) if b > a else pa)
    return statistics.fmean(out)


def drift_removed(rows: list[dict], reference: list[dict]) -> list[dict]:
    """The rows with each run divided by the machine's drift at its place in the sequence, for analysis beside the
    figures of record (which are the runs as measured)::

        d(p) = r(p) / median_q r(q)      measured'(run at p) = measured(run at p) / d(p)

    r(p) the reference plan's (the pick's) step time run again every few runs, interpolated linearly between its
    runs at p. d keeps the median machine: it moves no plan's level, only the runs' spread over time."""
    points = sorted((r["position"], r["measured_s"]) for r in reference)
    middle = statistics.median(t for _, t in points)

    def drift(p: int) -> float:
        for (p0, t0), (p1, t1) in zip(points, points[1:]):
            if p0 <= p <= p1:
                return (t0 + (t1 - t0) * (p - p0) / max(p1 - p0, 1)) / middle
        return points[-1][1] / middle

    out = []
    for row in rows:
        rounds = [t / drift(p) for t, p in zip(row["measured_rounds_s"], row["positions"])]
        out.append(dict(row, measured_s=statistics.median(rounds), measured_rounds_s=rounds))
    return out


def pins_of_plan(plan) -> Pins:
    return Pins(
        dp=plan.mesh.dp,
        tp=plan.mesh.tp,
        pp=plan.mesh.pp,
        zero_stage=plan.zero_stage,
        microbatch_size=plan.microbatch_size,
        recompute=plan.recompute,
        schedule=plan.schedule,
        ep=plan.ep,
        sequence_parallel=plan.sequence_parallel if plan.mesh.tp > 1 else None,
        compile=plan.decisions.compile or None,
    )


def reprice(path: Path, cluster: str | None = None) -> dict:
    """The stored runs, priced again with today's cost model (module doc) on their own cluster file,
    or on ``cluster`` (a newer calibration of the same machine)."""
    data = json.loads(path.read_text())
    if cluster is not None:
        data["cluster"], data["cluster_file"] = cluster, Path(cluster).read_text()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(data["cluster_file"])
    plans, pick = plan_all(data["model"], f.name, data["ranks"], data["global_batch"])
    os.unlink(f.name)
    predicted = {key: plan.predicted.step_time_s for key, plan in plans}
    rows = [dict(r, predicted_s=predicted[r["key"]]) for r in data["rows"] if r["key"] in predicted]
    drift = summary(drift_removed(rows, data["reference"]), plan_key(pick)) if data.get("reference") else {}
    return dict(data, rows=rows, summary=summary(rows, plan_key(pick)), summary_drift_removed=drift)


def _regret(summary_: dict) -> str:
    """The summary's regret, or why there is none: stored runs priced again may pick a plan they did not run."""
    return "not measured (the pick was not run)" if summary_["regret"] is None else f"{summary_['regret']:.3f}"


def print_table(result: dict) -> None:
    for r in sorted(result["rows"], key=lambda r: r["measured_s"]):
        err = r["predicted_s"] / r["measured_s"] - 1
        print(
            f"{r['key']:<45} measured {r['measured_s'] * 1e3:8.1f} ms  predicted {r['predicted_s'] * 1e3:8.1f} ms"
            f"  {err:+7.1%}"
        )
    s = result["summary"]
    print(
        f"{s['plans']} plans: MAPE {s['mape']:.1%} (max {s['max_error']:.1%}), Spearman {s['spearman']:.3f}; "
        f"pick {s['pick']} regret {_regret(s)} (best measured {s['best_measured']})"
    )
    if result.get("summary_rolling_calibration"):
        r = result["summary_rolling_calibration"]
        print(
            f"priced from the calibrations around each run (at runs {result['calibrated_at_positions']}): MAPE "
            f"{r['mape']:.1%}, Spearman {r['spearman']:.3f}, regret {_regret(r)}"
        )
    if result.get("summary_drift_removed"):
        d, ref = result["summary_drift_removed"], [r["measured_s"] for r in result["reference"]]
        print(
            f"the reference ({len(ref)} runs of the pick) ranged {min(ref) * 1e3:.1f}-{max(ref) * 1e3:.1f} ms; "
            f"with that drift removed: MAPE {d['mape']:.1%}, Spearman {d['spearman']:.3f}, regret {_regret(d)}"
        )
    if result.get("summary_calibrated_after"):
        a = result["summary_calibrated_after"]
        print(f"priced with the calibration after the runs: MAPE {a['mape']:.1%}, Spearman {a['spearman']:.3f}")


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/gpt.py:build")
    parser.add_argument("--cluster", help="a cluster file from autoshard calibrate (with --reprice: price on it)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-o", "--output", help="write the runs here (JSON)")
    parser.add_argument("--only", metavar="REGEX", help="run only the configurations whose key matches (and the pick)")
    parser.add_argument("--reprice", type=Path, help="price stored runs again instead of running")
    parser.add_argument(
        "--calibration-repeats",
        type=int,
        default=1,
        metavar="N",
        help="each calibration is N in a row, every time their median (autoshard calibrate --repeats N)",
    )
    parser.add_argument(
        "--calibrate-every",
        type=int,
        default=0,
        metavar="N",
        help="with --calibrate, calibrate again before every N-th run: each run is also priced from the calibrations "
        "just before and after it (a third summary; 0: only before and after all the runs)",
    )
    parser.add_argument(
        "--reference-every",
        type=int,
        default=10,
        metavar="N",
        help="run the planner's pick again before every N-th run and after the last: the machine's drift over the "
        "runs, removed in a second summary for analysis (0: no reference runs)",
    )
    parser.add_argument(
        "--calibrate",
        metavar="CLUSTER_YAML",
        help="run autoshard calibrate (with --model) right before the runs, write its file here and "
        "price with it (instead of --cluster)",
    )
    args = parser.parse_args()
    result = reprice(args.reprice, args.cluster) if args.reprice else run(args)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
