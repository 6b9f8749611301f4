#!/usr/bin/env bash
# Create .venv with autoshard installed (editable). torch comes first, as the build for this
# machine: `pip install torch==2.13.0` gives the CPU build on CPU machines; GPU users set
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128) to take a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13') else 1)" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install -q torch==2.13.0 --index-url "$TORCH_INDEX_URL"
  else
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
fi
.venv/bin/python -m pip install -q -e ".[test]"
