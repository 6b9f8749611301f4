"""The held-out benchmark's figures, per model and per round as run (README.md beside this file).

    python benchmarks/heldout/summarise.py benchmarks/heldout/out/hf_llama.json benchmarks/heldout/out/hf_mixtral.json

For each model and each round r (every plan run once in it): MAPE of the predictions against that round's times,
Spearman's ρ, the pick's regret (its round-r time over the round's best) and the largest error; then the machine's
own noise beside them: the pick's reference runs (``--reference-every``), their spread (max/min − 1), their
coefficient of variation and the short-range noise (the median relative change between consecutive reference
runs); the same round with the drift those runs trace removed (``bench_plans.drift_removed``); and the signed
errors by plan kind (how many over- and under-priced, the median signed error). No round is averaged with another
and no signed error is pooled across kinds or models.

A confirmation run beside a model's JSON (``X.confirm.json``, the third declaration): the pick and the round's
fastest other plans run again in interleaved rounds; the regret of record is the pick's median over the best median
of them, each plan's spread beside it. ``--confirm-regex X.json`` prints the ``--only`` pattern of those plans.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_plans import drift_removed  # noqa: E402  (the benchmark's own drift removal)


def ranks(xs: list[float]) -> list[float]:
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


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: Pearson's r of the ranks."""
    return statistics.correlation(ranks(xs), ranks(ys))


def round_figures(rows: list[dict], pick: str, rnd: int) -> dict:
    """MAPE, ρ, regret and the largest error of round ``rnd`` (its times only; the plans it ran, where a run was
    stopped inside a round)."""
    rows = [r for r in rows if len(r["measured_rounds_s"]) > rnd]
    measured = [r["measured_rounds_s"][rnd] for r in rows]
    predicted = [r["predicted_s"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    best = min(measured)
    picked = next((m for r, m in zip(rows, measured) if r["key"] == pick), None)
    worst = max(range(len(rows)), key=lambda i: errors[i])
    return {
        "round": rnd + 1,
        "plans": len(rows),
        "mape": statistics.fmean(errors),
        "median_ape": statistics.median(errors),
        "spearman": spearman(predicted, measured),
        "regret": picked / best if picked else None,
        "max_error": errors[worst],
        "max_error_plan": rows[worst]["key"],
        "under_predicted": sum(p < m for p, m in zip(predicted, measured)),
    }


def noise(reference: list[dict]) -> dict:
    """The pick run again through the benchmark: spread (max/min − 1) and coefficient of variation."""
    times = [r["measured_s"] for r in sorted(reference, key=lambda r: r.get("position", r.get("at", 0)))]
    steps = [abs(b / a - 1) for a, b in zip(times, times[1:])]
    return {
        "runs": len(times),
        "spread": max(times) / min(times) - 1,
        "cv": statistics.pstdev(times) / statistics.fmean(times),
        "short_range": statistics.median(steps) if steps else None,
        "min_s": min(times),
        "max_s": max(times),
    }


def kind(key: str) -> str:
    """A plan's kind: its mesh and what it adds (``dp1 tp2 pp2 z0 b4 none gpipe sp`` -> ``tp2 x pp2 sp``)."""
    degrees = [f"{d}{n}" for d, n in re.findall(r"\b(dp|tp|pp|ep)(\d+)", key) if int(n) > 1]
    extras = [w for w in ("selective", "full", "alternate", "sp") if re.search(rf"\b{w}\b", key)]
    return " x ".join(degrees or ["one rank"]) + "".join(f" {w}" for w in extras)


def by_kind(rows: list[dict], rnd: int = 0) -> list[dict]:
    """Signed errors (predicted / measured − 1) of round ``rnd`` per plan kind: count, over- and under-priced,
    median."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        if len(r["measured_rounds_s"]) > rnd:
            groups.setdefault(kind(r["key"]), []).append(r["predicted_s"] / r["measured_rounds_s"][rnd] - 1)
    return [
        {"kind": k, "plans": len(e), "over": sum(x > 0 for x in e), "median_error": statistics.median(e)}
        for k, e in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]


def model_figures(path: Path) -> dict:
    """A model's figures from ``bench_plans.py``'s JSON (or the same rows recovered from a stopped run's log)."""
    doc = json.loads(path.read_text())
    pick = _pick(doc, path)
    confirm = path.with_suffix(".confirm.json")
    rounds = max(len(r["measured_rounds_s"]) for r in doc["rows"])
    placed = len(doc["reference"]) > 1 and all("position" in r for r in doc["reference"])  # the first run's
    steady = drift_removed(doc["rows"], doc["reference"]) if placed else []  # recovered records have no places
    return {
        "model": doc["model"],
        "pick": pick,
        "rounds": [round_figures(doc["rows"], pick, r) for r in range(rounds)],
        "drift_removed": [round_figures(steady, pick, r) for r in range(rounds)] if steady else [],
        "kinds": by_kind(doc["rows"]),
        "noise": noise(doc["reference"]),
        "confirmation": confirmation(confirm, pick) if confirm.exists() else None,
    }


def confirmation_keys(path: Path, others: int = 2) -> list[str]:
    """The pick and the ``others`` fastest other plans of a model's round as run, the pick first."""
    doc = json.loads(path.read_text())
    pick = _pick(doc, path)
    fastest = sorted((r for r in doc["rows"] if r["key"] != pick), key=lambda r: r["measured_rounds_s"][0])
    return [pick] + [r["key"] for r in fastest[:others]]


def confirmation_regex(keys: list[str]) -> str:
    """An anchored ``bench_plans.py --only`` pattern matching exactly these keys."""
    return "^(" + "|".join(re.escape(k) for k in keys) + ")$"


def confirmation(path: Path, pick: str) -> dict:
    """The regret of record from a confirmation run: the pick's median over the best plan's median, every plan's
    runs and spread (max/min − 1) beside it."""
    doc = json.loads(path.read_text())
    medians = {r["key"]: statistics.median(r["measured_rounds_s"]) for r in doc["rows"]}
    best = min(medians, key=medians.get)
    return {
        "rounds": max(len(r["measured_rounds_s"]) for r in doc["rows"]),
        "regret": medians[pick] / medians[best],
        "best": best,
        "plans": [
            {
                "key": r["key"],
                "median_s": medians[r["key"]],
                "runs_s": r["measured_rounds_s"],
                "spread": max(r["measured_rounds_s"]) / min(r["measured_rounds_s"]) - 1,
            }
            for r in doc["rows"]
        ],
    }


def _pick(doc: dict, path: Path) -> str:
    return doc["summary"]["pick"] if "summary" in doc else doc.get("pick") or _logged_pick(path.with_suffix(".log"))


def _logged_pick(log: Path) -> str:
    """The planner's pick as ``bench_plans.py`` logs it ("N plans; the planner picks KEY"), for a JSON written before
    its summary (the runs are written first; a summary that fails after them leaves no pick in the file)."""
    found = re.search(r"the planner picks (.+)", log.read_text())
    if not found:
        raise SystemExit(f"{log}: no pick logged; the JSON has none either")
    return found.group(1).strip()


def table(figures: list[dict]) -> str:
    lines = [
        "| model | round | plans run | MAPE | median APE | max error (plan) | Spearman ρ | regret | under-predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        for label, rounds in (("", f["rounds"]), (" (drift removed)", f.get("drift_removed", []))):
            for r in rounds:
                regret = f"{r['regret']:.3f}" if r["regret"] else "-"
                lines.append(
                    f"| {f['model']} | {r['round']}{label} | {r['plans']} | {r['mape']:.1%} | {r['median_ape']:.1%} | "
                    f"{r['max_error']:.1%} ({r['max_error_plan']}) | {r['spearman']:.3f} | {regret} | "
                    f"{r['under_predicted']}/{r['plans']} |"
                )
    lines += [
        "",
        "| model | pick | reference runs | spread (max/min − 1) | CV | short-range (median consecutive change) |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        n = f["noise"]
        short = f"{n['short_range']:.1%}" if n.get("short_range") is not None else "-"
        lines.append(f"| {f['model']} | {f['pick']} | {n['runs']} | {n['spread']:.1%} | {n['cv']:.1%} | {short} |")
    confirmed = [f for f in figures if f.get("confirmation")]
    if confirmed:
        lines += [
            "",
            "| model | confirmation: plan | rounds | median | runs (ms) | spread | regret of record |",
            "|---|---|---|---|---|---|---|",
        ]
    for f in confirmed:
        c = f["confirmation"]
        for p in c["plans"]:
            runs = ", ".join(f"{t * 1e3:.1f}" for t in p["runs_s"])
            mark = " (pick)" if p["key"] == f["pick"] else ""
            regret = f"**{c['regret']:.3f}**" if p["key"] == f["pick"] else ""
            lines.append(
                f"| {f['model']} | {p['key']}{mark} | {c['rounds']} | {p['median_s'] * 1e3:.1f} ms | {runs} | "
                f"{p['spread']:.1%} | {regret} |"
            )
    lines += ["", "| model | plan kind | plans | over-priced | median signed error |", "|---|---|---|---|---|"]
    for f in figures:
        for k in f.get("kinds", []):
            lines.append(f"| {f['model']} | {k['kind']} | {k['plans']} | {k['over']} | {k['median_error']:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_plans.py outputs of the held-out models")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--confirm-regex", action="store_true", help="print the confirmation run's --only pattern of the one run given"
    )
    args = parser.parse_args()
    if args.confirm_regex:
        if len(args.runs) != 1:
            parser.error("--confirm-regex takes one model's run; pass its JSON alone")
        print(confirmation_regex(confirmation_keys(args.runs[0])))
        return
    figures = [model_figures(p) for p in args.runs]
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
