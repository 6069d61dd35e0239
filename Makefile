# rxcoord: `make demo` and `make test` bootstrap a local .venv themselves (idempotent).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-slow test-all lint format bench docs clean

venv: $(STAMP)

# Re-install only when the project's metadata changed; a second run costs nothing.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: venv
	$(BIN)/rxcoord demo

LINTED := rxcoord tests examples benchmarks docs/hooks

lint: venv
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy --strict $(LINTED)

# Everything but the stress tests marked slow, on two pytest workers (each starts its own
# throwaway servers); a few minutes on 2 cores. CI runs the slow ones after it. The strict
# build of the docs and the run of every documented program are tests among the others
# (tests/documentation/), so they share the two workers instead of adding a serial step.
test: lint
	$(BIN)/python -m pytest -m "not slow" -n 2

# The stress tests (real processes, kill -9, SIGSTOP, brokers): one at a time, they time things.
test-slow: venv
	$(BIN)/python -m pytest -m slow

test-all: test test-slow

format: venv
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

bench: venv
	$(BIN)/rxcoord bench

# The documentation site, into site/ (make test builds it with --strict).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
