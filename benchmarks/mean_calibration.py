"""The mean of two calibrations of one machine: a cluster file whose every measured figure is the two files' mean.

    python benchmarks/mean_calibration.py BEFORE.yaml AFTER.yaml -o MEAN.yaml

``bench_plans.py --calibrate`` calibrates right before its runs and again right after them. On a shared VM one
calibration is a minute of measuring in a machine whose speed moves by tens of percent within seconds
(RESULTS, "Cost model vs measured runs on this machine's CPU ranks"), while the runs it is compared with span
half an hour; the mean of the calibrations on both sides of the runs is a steadier estimate of the machine
the runs met. Nothing measured in the runs enters it.

Numbers are averaged leaf by leaf (lists element by element); everything else (names, sources, the profile's
signature) is taken from the first file, and the two files must have the same structure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


class CannotMerge(Exception):
    """Two files whose structures differ (written by different versions of calibrate, or of different machines)."""


def mean_of(a, b, where: str = "") -> object:
    """``a`` and ``b`` (parsed YAML) with every number replaced by the mean of the two."""
    if isinstance(a, bool) or isinstance(b, bool) or a == b:  # equal counts stay integers
        return a
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return (a + b) / 2
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise CannotMerge(f"{where or 'the top level'} differs in keys {sorted(set(a) ^ set(b))}")
        return {k: mean_of(a[k], b[k], f"{where}.{k}" if where else str(k)) for k in a}
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise CannotMerge(f"{where} holds lists of {len(a)} and {len(b)} items")
        return [mean_of(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    return a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    try:
        merged = mean_of(yaml.safe_load(args.before.read_text()), yaml.safe_load(args.after.read_text()))
    except CannotMerge as exc:
        print(
            f"error: {exc}; fix: average two calibrations of one machine by one version of calibrate", file=sys.stderr
        )
        sys.exit(2)
    header = f"# The mean of {args.before} and {args.after} (benchmarks/mean_calibration.py).\n"
    args.output.write_text(header + yaml.safe_dump(merged, sort_keys=False))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
