# specserve: `make serve` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint bench-cpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
	$(PY) -m specserve.cli fetch-model

serve: setup
	$(PY) -m specserve.cli serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check specserve tests benchmarks

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench-cpu: setup
	$(PY) benchmarks/engine_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
