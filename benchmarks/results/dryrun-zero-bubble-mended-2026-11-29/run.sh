#!/usr/bin/env bash
# The rows of ../dryrun-zero-bubble-2026-11-29/run.sh again, after the dry run's mend (its tracker's hooks released
# per micro-batch, `dryrun._chunk_hooks_released`), written here. Run from the repository root.
set -euo pipefail
D=benchmarks/results/dryrun-zero-bubble-mended-2026-11-29 bash benchmarks/results/dryrun-zero-bubble-2026-11-29/run.sh
