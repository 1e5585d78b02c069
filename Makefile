# Two commands set up everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# A CPU-only machine gets the local CPU wheel of torch (or PyPI's CPU index as a fallback) instead of several GB of CUDA.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: venv demo test test-gpu test-convergence test-convergence-gpu checkstyle format bench clean

# No pip cache: the wheels would take their size a second time (triton alone is ~1 GB installed) on a small disk.
$(VENV)/.installed: export PIP_NO_CACHE_DIR := 1
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -z "$(HAS_GPU)" ]; then \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)" 2>/dev/null \
	  || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -q -m "not gpu and not npu and not slow" tests

test-gpu: venv
	$(PY) -m pytest -q -m gpu tests

test-convergence: venv
	$(PY) -m pytest -q -m slow tests

test-convergence-gpu: venv
	$(PY) scripts/convergence_gpu.py

checkstyle: venv
	$(VENV)/bin/ruff check hf_flce tests scripts examples
	$(VENV)/bin/ruff format --check hf_flce tests scripts examples

format: venv
	$(VENV)/bin/ruff check --fix hf_flce tests scripts examples
	$(VENV)/bin/ruff format hf_flce tests scripts examples

bench: venv
	$(PY) scripts/benchmark_kernel.py --out outputs/bench
	$(PY) scripts/benchmark_training.py --out outputs/bench
	$(PY) scripts/benchmark_training.py --task dpo --out outputs/bench
	$(PY) scripts/benchmark_training.py --task grpo --out outputs/bench

clean:
	rm -rf $(VENV) outputs .pytest_cache
