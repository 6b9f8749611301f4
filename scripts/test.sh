#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests and multi-process gloo runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --timeout 900 "$@"
