"""Fixtures for the whole suite: the shared ones live in ``tests/support/``."""

from support.otel import otel  # noqa: F401  (the fixture, for every test module)
from support.servers import (  # noqa: F401  (the lease, fleet and Kafka suites)
    postgres_server,
    postgres_url,
    redis_server,
    redis_url,
)
