#!/bin/bash
# Snapshot every run's per-rank metrics files of the running bench_plans (its work dir is reused per run).
last=""
n=0
while true; do
  d=/tmp/tmps67raw4t/out
  if [ -n "$d" ] && [ "$(ls $d/rank-*.json 2>/dev/null | wc -l)" = 4 ]; then
    sig=$(stat -c %Y.%s $d/rank-*.json | tr '\n' ' ')
    if [ "$sig" != "$last" ]; then
      sleep 1
      n=$((n+1)); lines=$(grep -c "^round" /tmp/heldout.log)
      dst=/tmp/heldout-runs/$(printf %04d $n)-after-$lines
      mkdir -p $dst && cp $d/rank-*.json $dst/ && date +%s > $dst/at
      last=$(stat -c %Y.%s $d/rank-*.json | tr '\n' ' ')
    fi
  fi
  sleep 1
done
