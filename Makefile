# Two commands set everything up on a fresh machine with only Python >= 3.10:
#   make demo   creates .venv, installs carraystore, runs the main job on real photos
#   make test   installs the test extras and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
PYTEST_ARGS ?=
# the suite on every core (pytest-xdist; each worker starts its own session servers)
# two pytest workers per available core (at most 8): many tests wait on servers, subprocesses
# and sleeps, so two per core finish sooner than one
PYTEST_XDIST ?= -n $(shell $(PYTHON) -c 'import os; print(min(8, 2 * len(os.sched_getaffinity(0))))') --dist loadgroup

# The pytest plugins the suite uses, and no others: installed plugins load by default
# (zarr's and anyio's come with those libraries), and pytest rewrites the asserts of every
# module of a plugin's distribution as it is imported, in each pytest process
# (the controller and every worker; more where PYTHONDONTWRITEBYTECODE is set).
# Bytecode written (PYTHONDONTWRITEBYTECODE emptied, where the shell had set it): each worker
# reads the test modules' rewritten asserts from __pycache__, and each of the suite's
# subprocesses reads the package's compiled modules, instead of compiling them again
PYTEST_ENV ?= PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTEST_PLUGINS=xdist.plugin,_hypothesis_pytestplugin PYTHONDONTWRITEBYTECODE=

PEERS_VENV ?= .venv-peers

.PHONY: demo test lint bench faults bench-peers-env venv clean help

help:
	@echo "make demo   - create .venv, install, ingest a small real-photo dataset, print results"
	@echo "make test   - install the test extras and run the test suite"
	@echo "make lint   - ruff (lint and format check) and mypy over the package"
	@echo "make bench  - run the benchmarks (codec suite, loader comparison, store, migration)"
	@echo "make faults - the seeded fault campaign (RUNS=1000 SEED=1 JOBS=cores) into bench/results/faults.md"
	@echo "make bench-peers-env - .venv-peers: PyTorch (CPU), MosaicML Streaming and LitData for bench_remote"

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("carraystore needs Python >= 3.10" if sys.version_info < (3, 10) else 0)'
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras; re-installs when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[$*]'
	@touch $@

venv: $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(BIN)/python -m carraystore.cli.demo --out demo-out

test: $(VENV)/.installed-test
	$(PYTEST_ENV) $(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

lint: $(VENV)/.installed-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The bench files write their results under bench/results/; report.py copies them into
# docs/ even when a goal assertion failed (the exit status is pytest's).
bench: $(VENV)/.installed-bench
	$(BIN)/python -m pytest bench -o python_files='bench_*.py' --benchmark-only -p no:cacheprovider $(PYTEST_ARGS); \
	status=$$?; $(BIN)/python bench/report.py; exit $$status

# The seeded fault campaign (testsupport/faults): kills, full disks, concurrent writers and readers,
# every invariant checked against a ground-truth log; `make test` runs a short one
# (tests/faults/test_campaign.py). One run again: python -m testsupport.faults --seed S --replay R
RUNS ?= 1000
SEED ?= 1
JOBS ?= $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)))')
faults: $(VENV)/.installed-test
	$(BIN)/python bench/fault_campaign.py --runs $(RUNS) --seed $(SEED) --jobs $(JOBS) $(FAULTS_ARGS)

# The remote benchmark's PyTorch peers (MosaicML Streaming, LitData) in their own venv, never
# in $(VENV): see bench/requirements-peers.txt. torchvision comes with both as a dependency,
# but PyPI's is a CUDA build that does not import beside the CPU torch: it is removed (the
# datasets the benchmark uses never import it). The last line proves the peers import.
bench-peers-env: $(PEERS_VENV)/.installed
$(PEERS_VENV)/.installed: bench/requirements-peers.txt pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check install --quiet --only-binary :all: -r bench/requirements-peers.txt -e .
	$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check uninstall --quiet --yes torchvision
	$(PEERS_VENV)/bin/python -c 'import testsupport.torchpeers, litdata, torch; print("peers ready: torch", torch.__version__)'
	@touch $@

clean:
	rm -rf $(VENV) $(PEERS_VENV) demo-out bench/out .pytest_cache *.egg-info
