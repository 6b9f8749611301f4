#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests and multi-process gloo runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One pytest-xdist worker per core (AUTOSHARD_TEST_WORKERS overrides; 0 runs in this process); the tests of one
# shared torchrun launch stay on one worker (tests/conftest.py). A test that makes a launch holds its whole time,
# up to ~10 minutes on a loaded 2-core machine: hence the long per-test timeout.
# Inductor compiles in this process alone (no pool of compile workers per process): on 2 cores shared by two
# workers and their ranks a pool only adds its workers' start (torch imported again in each); the 2-rank compiled
# cases read 317 against 351 CPU-s with it (benchmarks/reports/ci-time-2026-12-03).
# Bytecode is cached (`__pycache__/`, git-ignored) even where the machine sets PYTHONDONTWRITEBYTECODE: every rank,
# CLI child and worker would otherwise compile autoshard's sources again, and pytest its rewritten test modules
# (collection read 13.2 CPU-s per worker without the cache, 8.0 with it: benchmarks/reports/ci-time-2026-12-04).
unset PYTHONDONTWRITEBYTECODE
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
exec .venv/bin/python -m pytest -q --durations=25 --timeout 1800 -n "${AUTOSHARD_TEST_WORKERS:-auto}" --dist loadgroup "$@"
