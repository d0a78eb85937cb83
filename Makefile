# Two commands on a fresh machine:
#   make train   set up .venv if missing, install, train the tiny GPT with 2 pipeline stages on CPU
#   make test    set up .venv if missing, install, lint (ruff, mypy), run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup train lint test test-fast bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 in pyproject.toml: on CPU machines pip takes the CPU build, not a CUDA wheel.
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

train: setup
	OMP_NUM_THREADS=1 $(BIN)/python recipes/gpt/train.py experiment=tiny_cpu_1f1b $(ARGS)

lint: setup
	$(BIN)/python -m ruff check lightning_pipe recipes bench tests examples
	$(BIN)/python -m mypy

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

bench: setup
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/schedules.py

clean:
	rm -rf $(VENV) outputs multirun lightning_logs .pytest_cache
