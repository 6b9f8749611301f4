"""The held-out run's records from its log and the per-run rank files a watcher copied (the run was stopped before
bench_plans wrote its JSON): rows in bench_plans' format, each plan's rounds as far as they ran, and the reference
runs (the pick rerun before every 20th position) told apart from the plans' runs by their times."""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, "/work/main")
from autoshard.runtime.report import steady_step_s

log, snaps, model, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
line = re.compile(r"^round (\d+)/(\d+) (\d+)/(\d+) (.+): ([0-9.]+) ms \(predicted ([0-9.]+)\)$")
rows, order, pick = {}, [], None
for text in log.read_text().splitlines():
    if "plans; the planner picks" in text:
        pick = text.split("picks ", 1)[1].strip()
    m = line.match(text)
    if not m:
        continue
    rnd, _, i, n, key, meas, pred = m.groups()
    row = rows.setdefault(key, {"key": key, "predicted_s": float(pred) / 1e3, "measured_rounds_s": [], "positions": []})
    row["measured_rounds_s"].append(float(meas) / 1e3)
    row["positions"].append((int(rnd) - 1) * int(n) + int(i) - 1)
    order.append(key)
runs = []
for d in sorted(p for p in snaps.iterdir() if p.is_dir() and (p / "at").exists()):
    runs.append(
        {
            "snapshot": d.name,
            "at": int((d / "at").read_text()),
            "measured_s": steady_step_s(d),
            "rank_steps_s": [
                [r["step_times_s"], r.get("step_ends_s", [])]
                for r in (json.loads(f.read_text()) for f in sorted(d.glob("rank-*.json")))
            ],
        }
    )
logged = [round(r["measured_rounds_s"][k] * 1e3, 1) for r in rows.values() for k in range(len(r["measured_rounds_s"]))]
by_line = []  # the measured ms of each logged run, in log order
for text in log.read_text().splitlines():
    m = line.match(text)
    if m:
        by_line.append(float(m.group(6)))
seen, reference = set(), []
for r in (
    runs
):  # a snapshot taken after L log lines is run L's (or run L+1's, copied before its line); else the pick's rerun
    sig = json.dumps(r["rank_steps_s"])
    lines = int(r["snapshot"].rsplit("-", 1)[1])
    near = {round(by_line[k], 1) for k in (lines - 1, lines) if 0 <= k < len(by_line)}
    if round(r["measured_s"] * 1e3, 1) not in near and sig not in seen:
        reference.append(r)
    seen.add(sig)
json.dump(
    {
        "model": model,
        "pick": pick,
        "rows": list(rows.values()),
        "reference": reference,
        "snapshots": [{k: v for k, v in r.items() if k != "rank_steps_s"} for r in runs],
    },
    out.open("w"),
    indent=1,
)
print(
    len(rows),
    "plans;",
    sum(len(r["measured_rounds_s"]) for r in rows.values()),
    "runs;",
    len(reference),
    "reference runs",
)
