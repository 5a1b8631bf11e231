# Quick start:  make demo       (install + run the quickstart recipe)
#               make test       (install with dev extras + type check + the whole test suite; what CI runs)
#               make test-fast  (the same without the end-to-end runs marked slow, on two workers: the edit-test loop)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, as the CPU build: on Linux the default index's torch is the CUDA build (several GB of nvidia wheels).
# tools/torch_source.py decides where from, with no network call: the configured pip locations when they already
# offer torch's +cpu build (a wheelhouse, a mirror), else PyTorch's CPU index (--index-url .../whl/cpu).
# A CUDA build instead: make demo TORCH_INDEX=https://download.pytorch.org/whl/cu126 (pytorch.org/get-started);
# any pip arguments: TORCH_SPEC="torch==2.13.0 ...".
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
TORCH_SPEC ?= $$($(BIN)/python tools/torch_source.py torch==$(TORCH_VERSION) $(TORCH_INDEX))
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
	$(BIN)/python -m pruneflow.qat.nncf_setup   # NNCF's C++ extension, built once into ~/.cache (about 80 s the first time)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Ends by saying what to type next, whatever the run's exit code (which it keeps): pruneflow is in $(VENV), not on PATH.
demo: $(VENV)/.installed
	@$(BIN)/pruneflow optimize recipes/quickstart.yaml; status=$$?; \
	echo ""; \
	echo "Next: pruneflow is installed in $(VENV), not on your PATH. Activate it, then every README command runs as written:"; \
	echo "    . $(VENV)/bin/activate"; \
	echo "    pruneflow bench runs/quickstart      # or, without activating: $(BIN)/pruneflow bench runs/quickstart"; \
	exit $$status

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
