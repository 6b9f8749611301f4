#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests and multi-process gloo runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One pytest-xdist worker per core (AUTOSHARD_TEST_WORKERS overrides; 0 runs in this process); the tests of one
# shared torchrun launch stay on one worker (tests/conftest.py).
exec .venv/bin/python -m pytest -q --timeout 900 -n "${AUTOSHARD_TEST_WORKERS:-auto}" --dist loadgroup "$@"
