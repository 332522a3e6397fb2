# The two set-up commands of the README. Both create .venv on first use (Python 3.11, pip only).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers: the suite's runs wait on processes, servers and SLURM as much as they compute.
# Each test module stays on one worker, so that its module fixtures are made once (--dist loadfile;
# xdist's loadgroup does not group under pytest 9).
JOBS ?= 2
# A machine without a GPU (CI): TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU build
# from that index (its +cpu versions rank above PyPI's CUDA build of the same release): docs/install.md.
TORCH_INDEX ?=

.PHONY: train test test-quick lint install docs clean

train: $(VENV)/.installed
	$(BIN)/python train.py $(ARGS)

# Where the CPU goes, per test file (CPU seconds and fresh interpreters, not wall time, which a shared
# machine makes meaningless): TEST_CPU_LOG=cpu.log make test, then python -m tests.cpu_accounting cpu.log.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: the unit tests and a few fast real runs (the `quick` marker, tests/conftest.py).
test-quick: $(VENV)/.installed
	$(BIN)/python -m pytest -n $(JOBS) -m quick $(PYTEST_ARGS)

# ruff and the other pre-commit hooks (.pre-commit-config.yaml) over every file; CI runs it first.
lint: $(VENV)/.installed
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pre-commit run --all-files --show-diff-on-failure

install: $(VENV)/.installed

# Each key's doc, from its schema, into conf/'s comments and docs/keys.md (a unit test checks them).
docs: $(VENV)/.installed
	$(BIN)/python -m trainer.configuration.reference --write

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[all,test]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
