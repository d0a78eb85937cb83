# Two commands on a fresh machine:
#   make train   set up .venv if missing, install, train the tiny GPT with 2 pipeline stages on CPU
#   make test    set up .venv if missing, install, lint (ruff, mypy), run the test suite
#   make test-torch TORCH=2.14.1   the unit tests + the compact multi-rank set on another torch, in .venv-torch<X>
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

# The dev environment's torch. The package itself accepts a range (pyproject.toml); pinning here, not there, keeps a
# user's installed (CUDA) torch while the CPU install path takes the CPU build that lies on disk.
DEV_TORCH ?= 2.13.0
TORCH     ?= 2.14.1
TVENV     := .venv-torch$(TORCH)

.PHONY: setup train lint test test-fast test-torch setup-torch bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77,<82" wheel
	# torch first, from the dev pin: the range in pyproject.toml then keeps it (no multi-GB CUDA wheel on CPU).
	$(BIN)/python -m pip install -q "torch==$(DEV_TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

train: setup
	OMP_NUM_THREADS=1 $(BIN)/python recipes/gpt/train.py experiment=tiny_cpu_1f1b $(ARGS)

lint: setup
	$(BIN)/python -m ruff check lightning_pipe recipes bench tests examples tools
	$(BIN)/python -m mypy

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

# Another torch in its own venv. Releases above this machine's pip cap (2.14.1) need the cap skipped for the one
# command, e.g. PIP_CONFIG_FILE=/dev/null make test-torch TORCH=2.15.0 (docs/versions.md, "Running another torch").
$(TVENV)/.installed-stamp: pyproject.toml
	@test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/python -m pip install -q --upgrade pip "setuptools>=77,<82" wheel
	$(TVENV)/bin/python -m pip install -q "torch==$(TORCH)"
	$(TVENV)/bin/python -m pip install -q -e ".[dev]"
	@$(TVENV)/bin/python -c "import torch, sys; v = torch.__version__.split('+')[0]; \
		sys.exit(0 if v == '$(TORCH)' else f'installing the project replaced torch $(TORCH) by {v}')"
	@touch $@

setup-torch: $(TVENV)/.installed-stamp

test-torch: setup-torch
	OMP_NUM_THREADS=1 $(TVENV)/bin/python -m pytest -q -m "not distributed or compact" tests/unit tests/distributed $(ARGS)

# every benchmark's quick form, one JSON (python -m bench lists them; docs/development.md, "Benchmarks")
bench: setup
	@mkdir -p bench/out
	OMP_NUM_THREADS=1 $(BIN)/python -m bench all --quick --json bench/out/quick.json

clean:
	rm -rf $(VENV) .venv-torch* outputs multirun lightning_logs .pytest_cache
