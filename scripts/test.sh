#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests and multi-process gloo runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One pytest-xdist worker per core (AUTOSHARD_TEST_WORKERS overrides; 0 runs in this process); the tests of one
# shared torchrun launch stay on one worker (tests/conftest.py). A test that makes a launch holds its whole time,
# up to ~10 minutes on a loaded 2-core machine: hence the long per-test timeout.
exec .venv/bin/python -m pytest -q --durations=25 --timeout 1800 -n "${AUTOSHARD_TEST_WORKERS:-auto}" --dist loadgroup "$@"
