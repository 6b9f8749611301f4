"""Two 4-rank runs of the same 83 configurations (`plans34-4ranks`, `plans36-4ranks`), each priced on its own
calibration, pooled: a configuration's error is the median over the four rounds of predicted / measured − 1, each
round's prediction its own run's. Also the two runs' errors side by side by class (the sign of a class's error).

    python benchmarks/results/cpu-ranks-2026-11-29/pooled.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
RUNS = ("plans34-4ranks.json", "plans36-4ranks.json")


def rounds(path: Path) -> dict[str, list[float]]:
    """key -> each round's predicted / measured − 1, the prediction of the run's own calibration."""
    rows = json.loads(path.read_text())["rows"]
    return {r["key"]: [r["predicted_s"] / m - 1 for m in r["measured_rounds_s"]] for r in rows}


def measured(path: Path) -> dict[str, list[float]]:
    """key -> each round's measured step time."""
    return {r["key"]: r["measured_rounds_s"] for r in json.loads(path.read_text())["rows"]}


def predicted(path: Path) -> dict[str, float]:
    return {r["key"]: r["predicted_s"] for r in json.loads(path.read_text())["rows"]}


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank
    return out


def pick_and_order(keys: list[str]) -> None:
    """The pick's regret and Spearman's rho on the four rounds' median times, against the two predictions' mean."""
    times = [measured(HERE / name) for name in RUNS]
    prices = [predicted(HERE / name) for name in RUNS]
    pooled_s = {k: statistics.median(times[0][k] + times[1][k]) for k in keys}
    price_s = {k: statistics.mean(p[k] for p in prices) for k in keys}
    pick = "dp4 tp1 pp1 z0 b2 none"  # the planner's pick in both runs
    best = min(pooled_s, key=pooled_s.get)
    m, q = ranks([pooled_s[k] for k in keys]), ranks([price_s[k] for k in keys])
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(m, q)) / (len(keys) * (len(keys) ** 2 - 1))
    print(f"pooled: Spearman {rho:.3f}; pick {pick} regret {pooled_s[pick] / pooled_s[best]:.3f} (best {best})")


def main() -> None:
    a, b = (rounds(HERE / name) for name in RUNS)
    keys = sorted(set(a) & set(b))
    pooled = {k: statistics.median(a[k] + b[k]) for k in keys}
    apart = {k: (statistics.median(a[k]), statistics.median(b[k])) for k in keys}
    print(f"{len(keys)} configurations in both runs")
    print(f"pooled over 4 rounds: MAPE {statistics.mean(abs(e) for e in pooled.values()):.1%}")
    pick_and_order(keys)
    for i, name in enumerate(RUNS):
        print(
            f"{name} alone (median of its rounds' errors): MAPE {statistics.mean(abs(v[i]) for v in apart.values()):.1%}"
        )
    opposite = [k for k, (x, y) in apart.items() if x * y < 0 and min(abs(x), abs(y)) > 0.05]
    print(f"configurations whose error changes sign between the runs, both beyond 5 %: {len(opposite)}")
    for k in opposite:
        print(f"  {k:<45} {apart[k][0]:+7.1%} {apart[k][1]:+7.1%}")


if __name__ == "__main__":
    main()
