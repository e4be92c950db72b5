#!/usr/bin/env bash
# One H200 check (< 8 min, no downloads). On a fresh GPU machine:
#   TORCH_SPEC=torch make setup && bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 480 "$PY" bench/gpu_check.py "$@"
