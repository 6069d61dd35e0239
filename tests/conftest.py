"""Fixtures for the whole suite: the shared ones live in ``tests/support/``."""

from support.otel import otel  # noqa: F401  (the fixture, for every test module)
from support.servers import postgres_server, postgres_url  # noqa: F401  (the lease and Kafka suites)
