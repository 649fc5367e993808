# Two commands do all the setup: `make demo` (train configs/tiny.yaml on CPU, several processes)
# and `make test` (lint, start the local Slurm cluster, the test suite). Both create/update .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-slurm cluster test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned here; pyproject asks only torch>=2.6 so clusters keep their CUDA build.
	# The fine-tuning extras are pinned beside it to the versions tested with it (torchao follows torch).
	$(BIN)/python -m pip install -q torch==2.13.0 transformers==5.23.0 safetensors==0.8.0 torchao==0.18.0 peft==0.21.2
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/hpc-train train configs/tiny.yaml $(ARGS)

# A real local Slurm cluster (2 emulated nodes, accounting); needs root on Debian/Ubuntu.
cluster:
	bash slurm/local-cluster.sh start

demo-slurm: $(STAMP) cluster
	$(BIN)/hpc-train submit configs/tiny.yaml slurm.nodes=2 slurm.tasks_per_node=1 --wait $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers (pytest-xdist), a test file each at a time (a file's module fixtures are built once, the
# Slurm jobs stay on one worker): while one waits on a Slurm job or a hang timeout, the other computes.
# Files are handed out longest first (tests/conftest.py's SLOWEST_FIRST). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: lint cluster
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

bench: $(STAMP)
	$(BIN)/python tools/bench_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
