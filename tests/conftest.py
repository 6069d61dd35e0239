"""Fixtures every suite may use: the throwaway PostgreSQL server (see ``support/servers.py``).

One server per test session (per xdist worker), shared by the lease suite and the Kafka suite;
each test uses tables of its own on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.servers import ThrowawayPostgres, start_postgres


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL server with a persistent data directory this session may stop and start."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_url(request: pytest.FixtureRequest) -> str:
    """RXCOORD_POSTGRES_URL, or the throwaway server's URL."""
    url = os.environ.get("RXCOORD_POSTGRES_URL")
    if url:
        return url
    server: ThrowawayPostgres = request.getfixturevalue("postgres_server")
    return server.url
