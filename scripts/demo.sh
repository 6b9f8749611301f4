#!/usr/bin/env bash
# The main job: plan the example GPT for this machine's CPU ranks, show the plan, emit the
# program, and train with it on real text (Jane Austen's Northanger Abbey as bytes, the model
# file's dataset: examples/gpt_austen.py, examples/data/): loss falling, tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p runs
set -x
autoshard plan examples/gpt_austen.py:build --cluster local-cpu --devices-per-node 2 --global-batch 16 -o runs/plan.json
autoshard compile runs/plan.json -o runs/train.py
autoshard run runs/plan.json --steps 60 --program runs/train.py
