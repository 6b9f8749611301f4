#!/usr/bin/env bash
# The held-out CPU benchmark as declared in README.md: calibrate on the example GPT only, then price and run two
# models the calibration never profiled.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/heldout/out
mkdir -p "$out"
autoshard() { python -m autoshard "$@"; }
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.yaml"
for model in tests/models/hf_llama.py:build_4_layers tests/models/hf_mixtral.py:build; do
  name=$(basename "${model%%.py*}")
  python benchmarks/bench_plans.py --model "$model" --cluster "$out/cluster.yaml" --ranks 4 --global-batch 8 \
    --rounds 2 --steps 16 --only ' z0 b(1|4|8)( |$)' --reference-every 20 -o "$out/$name.json" | tee "$out/$name.log"
done
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.after.yaml"
