#!/usr/bin/env bash
# plans38-4ranks: the 4-rank CPU benchmark as run (a clone at 995202e, 2026-11-29 07:50-09:10 UTC, the machine
# otherwise idle), then the three 4-rank runs pooled.
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p out
python benchmarks/bench_plans.py --ranks 4 --rounds 2 --steps 16 --only ' z0 b(1|4|8)( |$)' \
  --calibrate out/cluster38-4ranks.yaml --calibration-repeats 3 --reference-every 20 -o out/plans38-4ranks.json
python benchmarks/results/cpu-ranks-2026-11-29b/pooled.py
