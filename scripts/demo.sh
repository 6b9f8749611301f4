#!/usr/bin/env bash
# The main job: measure this machine's CPU ranks (calibrate --quick: matmul and memory speed, gloo's collectives,
# the runtime's host time per op, per FSDP2 unit, per optimizer tensor; with --model, the example's own forward,
# backward and optimizer step timed on these ranks, which the generic probes alone price ~1.5x fast), plan the example GPT on that measured
# cluster, show the plan, emit the program, and train with it on real text (Jane Austen's Northanger Abbey as
# bytes, the model file's dataset: examples/gpt_austen.py, examples/data/): loss falling, tokens/s, and the step
# measured against the plan's prediction. The local-cpu preset's figures are rough defaults with no host time: a
# model this small spends most of its step in the host, so only a measured cluster predicts its step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p runs
set -x
autoshard calibrate --quick --devices-per-node 2 --model examples/gpt_austen.py:build -o runs/cluster.yaml
autoshard plan examples/gpt_austen.py:build --cluster runs/cluster.yaml --global-batch 16 -o runs/plan.json
autoshard compile runs/plan.json -o runs/train.py
autoshard run runs/plan.json --steps 60 --program runs/train.py
