#!/usr/bin/env bash
# One lent GPU's measurements (benchmarks/gpu_session.py says what and in which order), in one command:
#   bash benchmarks/gpu_session.sh OUT_DIR [--cpu]
# On a lent machine that returns a few files only, write OUT_DIR outside the returned folder and bring back one
# archive: bash benchmarks/gpu_session.sh /tmp/gs ...; tar czf "$OUT/gs.tgz" -C /tmp gs
# Runs with .venv's python where it exists (this repository's set-up), else python3. A GPU machine whose
# python3 has torch but not the planner's other packages takes them as wheels in .whl/ (pip download, README's
# GPU section): they are installed into a private folder, never over the machine's own torch.
# The float8 cases (torchao, --float8 tensorwise) and their bf16 twins run where the GPU has float8 matmuls (SM 8.9+).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR [--cpu]}
shift
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! "$PY" -c "import ortools, networkx, sympy, rich, yaml, torchao" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/autoshard-site \
    .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/autoshard-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
exec "$PY" benchmarks/gpu_session.py "$OUT_DIR" "$@"
