# rxcoord: `make demo` and `make test` bootstrap a local .venv themselves (idempotent).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test lint format bench clean

venv: $(STAMP)

# Re-install only when the project's metadata changed; a second run costs nothing.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: venv
	$(BIN)/rxcoord demo

lint: venv
	$(BIN)/ruff check rxcoord tests examples benchmarks
	$(BIN)/ruff format --check rxcoord tests examples benchmarks
	$(BIN)/mypy --strict rxcoord tests examples benchmarks

test: lint
	$(BIN)/python -m pytest

format: venv
	$(BIN)/ruff check --fix rxcoord tests examples benchmarks
	$(BIN)/ruff format rxcoord tests examples benchmarks

bench: venv
	$(BIN)/rxcoord bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
