#!/usr/bin/env bash
# The split backward's memory on the dry run against the plan's, transformers Llama with 8 layers, pp 2 on
# 2 local CPU ranks, micro-batch 2: y_<schedule>_<global batch>_<recompute>.json the plans (`autoshard
# estimate`), dy_*.json the dry runs (`autoshard dryrun --json`), the table in benchmarks/RESULTS.md ("Dry run",
# "The split backward"). Run from the repository root.
set -euo pipefail
D=${D:-benchmarks/results/dryrun-zero-bubble-2026-11-29}  # the folder written (the mended rows: ../dryrun-zero-bubble-mended-2026-11-29)
row() {  # schedule, global batch, recompute
  autoshard estimate tests/models/hf_llama.py:build_8_layers --cluster local-cpu --devices-per-node 2 \
    --global-batch "$2" --dp 1 --tp 1 --pp 2 --zero 0 --microbatch-size 2 --schedule "$1" --recompute "$3" \
    -o "$D/y_$1_$2_$3.json" > /dev/null
  autoshard dryrun "$D/y_$1_$2_$3.json" --json > "$D/dy_$1_$2_$3.json"
}
row zbv 8 none; row zbv 16 none; row zbv 8 full; row interleaved-zb 8 none
row interleaved-1f1b 8 none; row interleaved-1f1b 8 full
