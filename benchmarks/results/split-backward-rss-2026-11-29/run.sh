#!/usr/bin/env bash
# The largest resident set of a rank in a real 2-rank run (GNU time's %M over `autoshard run`'s torchrun
# workers): ZBV against interleaved 1F1B on the same model, cuts and micro-batches (`wide_llama.py`: transformers'
# Llama, 8 layers, hidden 512, seq 256; micro-batch 4, m 4 and 8, 3 steps). Run from this folder.
set -euo pipefail
A=${AUTOSHARD:-autoshard}
for s in interleaved-1f1b zbv; do
  for m in 4 8; do
    $A estimate wide_llama.py:build --cluster local-cpu --devices-per-node 2 --global-batch $((4*m)) --dp 1 --tp 1 \
      --pp 2 --zero 0 --microbatch-size 4 --schedule $s --recompute none -o plan_${s}_$m.json > /dev/null
    /usr/bin/time -f "$s m=$m max RSS of a rank %M KiB, wall %e s" $A run plan_${s}_$m.json --steps 3 \
      > /dev/null 2> time_${s}_$m.txt
    tail -1 time_${s}_$m.txt
  done
done
