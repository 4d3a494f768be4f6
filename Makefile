# What a developer runs, by name (`make help` lists them). Every target uses the tools of
# the virtualenv VENV (default .venv, made by `make install`); point it elsewhere with
# `make test VENV=/path/to/venv`.

VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
# The CPU build: an unpinned torch, pulled by any package, is a multi-GB CUDA build.
TORCH := torch==2.13.0
# Arguments for pytest (e.g. `make test-fast PYTEST_ARGS="-k report -x"`).
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install test test-slow test-fast lint format pre-commit gallery fixtures bench ci

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

$(PYTHON):
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip

install: $(PYTHON)  ## the virtualenv with lorascope editable, the test bed and the dev tools; the git hooks
	$(PYTHON) -m pip install -q $(TORCH)
	$(PYTHON) -m pip install -q -e ".[test,analysis,dev]"
	$(BIN)/pre-commit install

test:  ## every test but those marked slow, the end-to-end ones included (~15-27 min on 2 cores): what CI runs
	$(PYTHON) -m pytest -q -ra $(PYTEST_ARGS)

test-slow:  ## only the tests marked slow: second plantings and variants of e2e scenarios (~7 min)
	$(PYTHON) -m pytest -q -ra -m slow $(PYTEST_ARGS)

test-fast:  ## unit and browser tests, no end-to-end job (~3 min)
	$(PYTHON) -m pytest -q -ra -m "not e2e" $(PYTEST_ARGS)

lint:  ## ruff (lint and format check) and mypy on the package
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy lorascope

format:  ## ruff format, then ruff's safe lint fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

pre-commit:  ## every pre-commit hook on every file
	$(BIN)/pre-commit run --all-files

gallery:  ## re-render the example reports (reports/*.html) from fixtures/
	$(PYTHON) -m lorascope.report.gallery

fixtures:  ## re-record the run-directory fixtures with the real 2-rank job (minutes); then `make gallery`
	$(PYTHON) fixtures/record_runs.py

bench:  ## the benchmarks, each printing its figures (tens of minutes; see benchmarks/)
	$(PYTHON) benchmarks/probe_overhead.py --reps 5 --steps 30
	$(PYTHON) benchmarks/hang_latency.py --reps 5
	$(PYTHON) benchmarks/report_scale.py
	$(PYTHON) benchmarks/snapshot_speed.py

ci:  ## CI from nothing, as it runs: a fresh .venv, then the README's test command
	bash .ci/run
