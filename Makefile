# Two commands do all the setup: `make demo` (train configs/tiny.yaml on CPU, several processes)
# and `make test` (lint + the test suite). Both create/update .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned here; pyproject asks only torch>=2.6 so clusters keep their CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/hpc-train train configs/tiny.yaml $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python tools/bench_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
