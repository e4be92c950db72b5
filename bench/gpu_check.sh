#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py's docstring says what it measures), no downloads. Sized for
# one H100 80 GB or one H200 141 GB: about 5-6 minutes expected (202 s on an H200 before the
# slow-stream and 80 GB runs were added), within GPU_CHECK_TIMEOUT_S (480 s; the script skips,
# naming them, the phases that would not fit, so its table is always printed).
# With 2+ GPUs it adds the cross-device hand-off (two target workers on cuda:1), SIGTERM + exact
# resume in subprocesses, and torchrun --nproc-per-node=2 over NCCL with pipeline.split=1:1
# (small models, about a minute); with one GPU those say "needs 2 GPUs". It ends with a
# PASS / FAIL line (exit status 1 on FAIL). On a GPU machine with torch and transformers (a
# fresh one: `TORCH_SPEC=torch make setup` first; an offline image: its own python3):
#   bash bench/gpu_check.sh            (results: bench/out/gpu_check.json, and $OUT when set)
# The script itself on a CPU: bash bench/gpu_check.sh --tiny --device=cpu [--multi-cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export GPU_CHECK_TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-480}
timeout "$GPU_CHECK_TIMEOUT_S" "$PY" bench/gpu_check.py "$@"
