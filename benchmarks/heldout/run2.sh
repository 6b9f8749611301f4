#!/usr/bin/env bash
# The held-out CPU benchmark's second declaration (README.md): calibrate on the example GPT only, then price and run
# a transformers Llama decoder and a BERT encoder the calibration never profiled, one round at micro-batch 4.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/heldout/out2
mkdir -p "$out"
autoshard() { python -m autoshard "$@"; }
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.yaml"
for case in "tests/models/hf_llama.py:build_4_layers| z0 b4( |\$)" "tests/models/hf_bert.py:build| z0 b(2|4)( |\$)"; do
  model=${case%%|*}
  only=${case#*|}
  name=$(basename "${model%%.py*}")
  python benchmarks/bench_plans.py --model "$model" --cluster "$out/cluster.yaml" --ranks 4 --global-batch 8 \
    --rounds 1 --steps 16 --only "$only" --reference-every 10 -o "$out/$name.json" | tee "$out/$name.log"
done
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.after.yaml"
