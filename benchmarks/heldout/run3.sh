#!/usr/bin/env bash
# The held-out CPU benchmark's third declaration (README.md): the second declaration's runs again, then a
# confirmation of each model's regret: its pick and the round's two fastest other plans, five interleaved rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/heldout/out3
mkdir -p "$out"
autoshard() { python -m autoshard "$@"; }
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.yaml"
for case in "tests/models/hf_llama.py:build_4_layers| z0 b4( |\$)" "tests/models/hf_bert.py:build| z0 b(2|4)( |\$)"; do
  model=${case%%|*}
  only=${case#*|}
  name=$(basename "${model%%.py*}")
  python benchmarks/bench_plans.py --model "$model" --cluster "$out/cluster.yaml" --ranks 4 --global-batch 8 \
    --rounds 1 --steps 16 --only "$only" --reference-every 10 -o "$out/$name.json" | tee "$out/$name.log"
  keys=$(python benchmarks/heldout/summarise.py --confirm-regex "$out/$name.json")
  python benchmarks/bench_plans.py --model "$model" --cluster "$out/cluster.yaml" --ranks 4 --global-batch 8 \
    --rounds 5 --steps 16 --only "$keys" -o "$out/$name.confirm.json" | tee "$out/$name.confirm.log"
done
autoshard calibrate --devices-per-node 4 --model examples/gpt.py:build --repeats 3 -o "$out/cluster.after.yaml"
python benchmarks/heldout/summarise.py "$out/hf_llama.json" "$out/hf_bert.json" --json "$out/figures.json" \
  | tee "$out/figures.md"
