# Two commands set everything up on a fresh machine with only Python >= 3.10:
#   make demo   creates .venv, installs carraystore, runs the main job on real photos
#   make test   installs the test extras and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: demo test bench venv clean help

help:
	@echo "make demo   - create .venv, install, ingest a small real-photo dataset, print results"
	@echo "make test   - install the test extras and run the test suite"
	@echo "make bench  - run the benchmarks (codec suite, loader comparison, store, migration)"

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("carraystore needs Python >= 3.10" if sys.version_info < (3, 10) else 0)'
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras; re-installs when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[$*]'
	@touch $@

venv: $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(BIN)/python -m carraystore.demo --out demo-out

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The bench files write their results under bench/results/; report.py copies them into
# docs/ even when a goal assertion failed (the exit status is pytest's).
bench: $(VENV)/.installed-bench
	$(BIN)/python -m pytest bench -o python_files='bench_*.py' --benchmark-only -p no:cacheprovider $(PYTEST_ARGS); \
	status=$$?; $(BIN)/python bench/report.py; exit $$status

clean:
	rm -rf $(VENV) demo-out bench/out .pytest_cache *.egg-info
