# Quick start:  make demo       (install + run the quickstart recipe)
#               make test       (install with dev extras + type check + the whole test suite; what CI runs)
#               make test-fast  (the same without the end-to-end runs marked slow, on two workers: the edit-test loop)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, as the CPU build: a bare `torch` requirement on a machine without torch pulls a
# multi-GB CUDA build. Override for your platform, e.g. TORCH_SPEC="torch==2.13.0 --index-url ...".
TORCH_SPEC ?= torch==2.13.0
PIP    := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test test-fast typecheck install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install -e '.[dev]'
	$(BIN)/python -m qat.nncf_setup   # NNCF's C++ extension, built once into ~/.cache (about 80 s the first time)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/pruneflow optimize recipes/quickstart.yaml

test: $(VENV)/.installed-dev
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Two workers on one thread each (pytest-xdist): the unit tests are single-batch work that one core runs as fast
# as two; a quarter of the fuzz examples (`make test` runs them all).
test-fast: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 PRUNEFLOW_FUZZ_SCALE=0.25 $(BIN)/python -m pytest -m "not slow" -n 2 $(PYTEST_ARGS)

typecheck: $(VENV)/.installed-dev
	$(BIN)/python -m mypy

clean:
	rm -rf runs .pytest_cache
