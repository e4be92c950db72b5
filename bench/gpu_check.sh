#!/usr/bin/env bash
# One H200 check (about 4 minutes, no downloads). On a GPU machine with torch and transformers
# (a fresh one: `TORCH_SPEC=torch make setup` first; an offline image: its own python3):
#   bash bench/gpu_check.sh            (results: bench/out/gpu_check.json, and $OUT when set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout ${GPU_CHECK_TIMEOUT_S:-480} "$PY" bench/gpu_check.py "$@"
