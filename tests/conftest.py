"""Fixtures for the whole suite: the shared ones live in ``tests/support/``."""

from support.otel import otel  # noqa: F401  (the fixture, for every test module)
