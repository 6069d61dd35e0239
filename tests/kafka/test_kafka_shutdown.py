"""The end of a run is bounded by ``drain_timeout``; librdkafka's log goes through loguru, folded.

* A broker that stops answering (``SIGSTOP``) while the consumer closes made the final commit
  and the group leave wait for librdkafka's request timeouts (over 60 s seen on the test broker
  during a rebalance): they now get what is left of ``drain_timeout``, at least a second.
* An unreachable broker printed a ``Connect to ... failed`` line per reconnect attempt on
  stderr; the lines now reach loguru (silent until enabled) at their level, repeats folded.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from rxcoord.kafka import BrokerUnavailable, KeyedConsumer
from rxcoord.kafka._broker import NoBroker, tansu_process
from rxcoord.kafka._logs import Folding

from .conftest import broker_unavailable
from .support import Cluster, Running, keyed_items, wait_for


@pytest.fixture
def stoppable_broker() -> Iterator[tuple[str, int]]:
    """A Tansu of this test's own: (bootstrap, pid), resumed if stopped and removed after."""
    try:
        with tansu_process() as (bootstrap, proc):
            try:
                yield bootstrap, proc.pid
            finally:
                os.kill(proc.pid, signal.SIGCONT)
    except NoBroker as exc:
        broker_unavailable(str(exc))


@pytest.fixture
def rxcoord_logs() -> Iterator[list[tuple[str, str]]]:
    """What rxcoord logs through loguru while the test runs: (level, message).

    loguru's default handler writes to stderr (the application chooses where enabled logs
    go): it is taken out meanwhile, so stderr shows only what bypasses loguru.
    """
    seen: list[tuple[str, str]] = []
    try:
        logger.remove(0)
        restore_default = True
    except ValueError:  # removed before (by the application, or another test)
        restore_default = False
    sink = logger.add(
        lambda message: seen.append((message.record["level"].name, message.record["message"])),
        level="DEBUG",
    )
    logger.enable("rxcoord")
    try:
        yield seen
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
        if restore_default:
            logger.add(sys.stderr)


def test_a_broker_that_stops_answering_does_not_hold_the_end_of_run(
    stoppable_broker: tuple[str, int], tmp_path: Path
) -> None:
    bootstrap, pid = stoppable_broker
    cluster = Cluster(bootstrap, tmp_path, "stop")
    topic = cluster.topic(2)
    cluster.produce(topic, keyed_items(100, 10))
    handled: list[int] = []
    drain_timeout = 2.0
    consumer = KeyedConsumer(
        cluster.config(cluster.group()), [topic], lambda r: handled.append(r.offset),
        drain_timeout=drain_timeout, commit_interval=60,
    )  # fmt: skip
    running = Running(consumer)
    wait_for(lambda: len(handled) == 100, 60, "every record handled")
    os.kill(pid, signal.SIGSTOP)  # the broker stops answering, its connections stay open
    started = time.monotonic()
    closer = threading.Thread(target=consumer.close, daemon=True)
    closer.start()
    running.join(60)
    took = time.monotonic() - started
    closer.join(10)
    cluster.close = lambda: None  # type: ignore[method-assign]  # its producer cannot flush now
    # The commit and the leave were abandoned at the deadline: drain_timeout (nothing was left
    # to drain, so all of it) and the poll loop's last turn.
    assert took <= drain_timeout + 2.0, took
    assert running.error is None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: nothing listens there


def test_an_unreachable_broker_logs_through_loguru_folded_not_on_stderr(
    capfd: pytest.CaptureFixture[str], rxcoord_logs: list[tuple[str, str]]
) -> None:
    consumer = KeyedConsumer(
        {"bootstrap.servers": f"127.0.0.1:{_closed_port()}", "group.id": "g"},
        ["orders"], print, startup_timeout=3,
    )  # fmt: skip
    with pytest.raises(BrokerUnavailable):
        consumer.run()
    # Nothing printed by librdkafka itself (its own format: "%3|<time>|FAIL|rdkafka#...").
    stderr = capfd.readouterr().err
    assert not re.findall(r"^%\d\|", stderr, re.MULTILINE), stderr[-2000:]
    connects = [(level, text) for level, text in rxcoord_logs if "Connect to" in text]
    # librdkafka retried the connection many times in 3 s; loguru got the line once, at
    # librdkafka's level (3, error), and once more at the end with the count folded.
    assert connects, rxcoord_logs
    assert {level for level, _ in connects} == {"ERROR"}
    assert len(connects) <= 2, connects
    assert "more like it folded" in connects[-1][1], connects


def test_folding_lets_a_line_through_once_per_window() -> None:
    now = [0.0]
    folding = Folding(window=10.0, clock=lambda: now[0])

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("x", logging.ERROR, __file__, 1, text, None, None)

    lines = [f"Connect to 127.0.0.1:9092 failed (after {i}ms in state CONNECT)" for i in range(50)]
    passed = [r for r in (record(line) for line in lines) if folding.filter(r)]
    assert [r.getMessage() for r in passed] == [lines[0]]
    assert folding.filter(record("another line"))  # a different line is not folded
    now[0] = 11.0
    late = record(lines[0])
    assert folding.filter(late)
    assert late.getMessage().endswith("(49 more like it folded in the last 10 s)")
    assert folding.pending() == []
    assert not folding.filter(record(lines[1]))
    assert folding.pending() == [(logging.ERROR, lines[1], 1)]


def test_an_application_logger_in_the_config_wins(rxcoord_logs: list[tuple[str, str]]) -> None:
    mine = logging.getLogger(f"my.kafka.{id(rxcoord_logs)}")
    mine.propagate = False
    got: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    mine.addHandler(Collect())
    consumer = KeyedConsumer(
        {"bootstrap.servers": f"127.0.0.1:{_closed_port()}", "group.id": "g", "logger": mine},
        ["orders"], print, startup_timeout=2,
    )  # fmt: skip
    with pytest.raises(BrokerUnavailable):
        consumer.run()
    assert any("Connect to" in line for line in got), got
    assert not [text for _, text in rxcoord_logs if "Connect to" in text]
