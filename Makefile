# rxcoord: `make demo` and `make test` bootstrap a local .venv themselves (idempotent).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-slow test-all lint format bench clean

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

# Everything but the stress tests marked slow, on two pytest workers (each starts its own
# throwaway servers); a few minutes on 2 cores. CI runs the slow ones after it.
test: lint
	$(BIN)/python -m pytest -m "not slow" -n 2

# The stress tests (real processes, kill -9, SIGSTOP, brokers): one at a time, they time things.
test-slow: venv
	$(BIN)/python -m pytest -m slow

test-all: test test-slow

format: venv
	$(BIN)/ruff check --fix rxcoord tests examples benchmarks
	$(BIN)/ruff format rxcoord tests examples benchmarks

bench: venv
	$(BIN)/rxcoord bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
