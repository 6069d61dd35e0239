"""Retries that keep per-key order, dead letters and stalled records, on the real broker."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer
from support.waiting import until, wait_until

from rxcoord import Retry, TenantTaskCoordinator
from rxcoord.kafka import DeadLetterFailed, KeyedConsumer, Record

from .support import (
    AttemptLog,
    Child,
    Cluster,
    Running,
    check_invariants,
    check_retry_order,
    completed_pairs,
    keyed_items,
    read_topic,
)

WAIT = 30.0  # bounds a wait on the broker (a group join takes seconds on Tansu)


class Flaky(Exception):
    pass


def flaky(
    log: AttemptLog,
    fails: Callable[[Record, int], bool],
    hold: Callable[[Record, int], None] | None = None,
) -> Callable[[Record], None]:
    """A handler that logs each attempt and fails while ``fails(record, attempt)`` says so."""
    attempts: dict[tuple[int, int], int] = defaultdict(int)
    lock = threading.Lock()

    def handle(record: Record) -> None:
        with lock:
            attempts[(record.partition, record.offset)] += 1
            attempt = attempts[(record.partition, record.offset)]
        log.add("start", record)
        if hold is not None:
            hold(record, attempt)
        if fails(record, attempt):
            log.add("fail", record)
            raise Flaky(f"{record.value!r} failed attempt {attempt}")
        log.add("ok", record)

    return handle


def value_is(*values: bytes) -> Callable[[Record], bool]:
    return lambda record: record.value in values


def test_a_record_between_attempts_keeps_its_key_and_its_partition_s_commit(
    cluster: Cluster,
) -> None:
    topic = cluster.topic(1)
    items = [(k, seq) for seq in range(5) for k in ("a", "b", "c")]
    produced = cluster.produce(topic, items)
    _, a1 = produced.where[("a", 1)]
    release = threading.Event()
    log = AttemptLog()

    def fails(record: Record, attempt: int) -> bool:
        return (record.value == b"a:1" and attempt < 3) or (record.value == b"b:3" and attempt < 2)

    def hold(record: Record, attempt: int) -> None:
        if record.value == b"a:1" and attempt == 3:
            release.wait(WAIT)  # its last attempt: in progress until the test has looked

    consumer = KeyedConsumer(
        cluster.config(cluster.group()), [topic], flaky(log, fails, hold),
        max_concurrency=4, commit_interval=0.05,
        retry=Retry(attempts=3, backoff=0.1, jitter=0),
    )  # fmt: skip
    running = Running(consumer)
    try:
        # Every record of b and c is done, a:1 is in its third attempt.
        wait_until(lambda: log.count("ok", "b") == 5 and log.count("ok", "c") == 5, WAIT, "b, c")
        wait_until(lambda: log.count("start", "a") == 4, WAIT, "a:1's third attempt")
        stats = consumer.stats()
        assert stats.partitions[0].committable is not None
        assert stats.partitions[0].committable <= a1  # never past the record in progress
        assert log.count("start", "a") == 4  # a:0 once, a:1 three times; a:2.. still wait
        assert stats.retries == 3  # a:1 twice, b:3 once
        release.set()
        wait_until(lambda: log.count("ok") == len(items), WAIT, "all records")
    finally:
        release.set()
        assert running.stop() is None
    check_retry_order(log.snapshot(), attempts=3)
    assert cluster.committed(topic, cluster.group(), 1)[0] == len(items)
    final = consumer.stats()
    assert (final.retries, final.retrying, final.failed, final.dead_lettered) == (3, 0, 0, 0)


@pytest.mark.parametrize("inline", [None, False])
def test_a_retry_wait_gives_the_slot_and_the_thread_back(
    cluster: Cluster, inline: bool | None
) -> None:
    topic = cluster.topic(1)
    cluster.produce(topic, [("a", 0), ("b", 0)])  # a first: it takes the only slot
    log = AttemptLog()
    consumer = KeyedConsumer(
        cluster.config(cluster.group()), [topic],
        flaky(log, lambda record, attempt: record.value == b"a:0" and attempt == 1),
        max_concurrency=1, inline=inline,  # one slot; with inline=False one worker thread
        retry=Retry(attempts=2, backoff=0.5, jitter=0),
    )  # fmt: skip
    running = Running(consumer)
    try:
        wait_until(lambda: log.count("ok") == 2, WAIT, "both records")
    finally:
        assert running.stop() is None
    events = log.snapshot()
    a_starts = [e.at for e in events if e.key == "a" and e.kind == "start"]
    b_ok = next(e.at for e in events if e.key == "b" and e.kind == "ok")
    assert len(a_starts) == 2
    assert a_starts[0] < b_ok < a_starts[1]  # b ran during a's backoff
    check_retry_order(events, attempts=2)


def test_a_retry_wait_keeps_the_poll_thread_at_its_usual_pace(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a record waits for its next attempt, the poll thread polls as it does with
    nothing to do (a poll ends when the wait does), not every few milliseconds."""
    topic = cluster.topic(1)
    cluster.produce(topic, [("a", 0)])
    log = AttemptLog()
    consumer = KeyedConsumer(
        cluster.config(cluster.group()), [topic],
        flaky(log, lambda record, attempt: attempt == 1),
        retry=Retry(attempts=2, backoff=1.5, jitter=0),
    )  # fmt: skip
    # A spy on the poll thread's turns: no statistic counts them.
    turns: list[float] = []
    poll_once = consumer._engine.poll_once

    def counted(accept: bool, timeout: float) -> None:
        turns.append(time.monotonic())
        poll_once(accept, timeout)

    monkeypatch.setattr(consumer._engine, "poll_once", counted)
    running = Running(consumer)
    try:
        wait_until(lambda: log.count("ok") == 1, WAIT, "the second attempt")
    finally:
        assert running.stop() is None
    events = log.snapshot()
    failed_at = next(e.at for e in events if e.kind == "fail")
    again_at = [e.at for e in events if e.kind == "start"][1]
    assert again_at - failed_at >= 1.5  # it waited its backoff
    during = [t for t in turns if failed_at < t < again_at]
    # Polls of 50 ms: about 30 in the wait (at 2 ms, as before, about 750).
    assert len(during) <= 60, len(during)


async def test_async_handlers_are_retried_in_key_order(
    cluster: Cluster,
) -> None:
    topic = cluster.topic(1)
    items = [(k, seq) for seq in range(4) for k in ("a", "b")]
    cluster.produce(topic, items)
    log = AttemptLog()
    group = cluster.group()
    attempts: dict[int, int] = defaultdict(int)

    async def handle(record: Record) -> None:  # on run_async's loop
        attempts[record.offset] += 1
        log.add("start", record)
        await asyncio.sleep(0.001)
        if record.offset % 3 == 0 and attempts[record.offset] < 3:
            log.add("fail", record)
            raise Flaky(f"{record.value!r} failed")
        log.add("ok", record)

    consumer = KeyedConsumer(
        cluster.config(group), [topic], handle, commit_interval=0.05,
        retry=Retry(attempts=3, backoff=0.02),
    )  # fmt: skip
    task = asyncio.create_task(consumer.run_async())
    await until(lambda: log.count("ok") == len(items), "all records", WAIT)
    await consumer.aclose()
    await task
    check_retry_order(log.snapshot(), attempts=3)
    assert consumer.stats().retries == 2 * len([o for o in range(len(items)) if o % 3 == 0])


def test_records_run_by_a_coordinator_are_retried_in_key_order(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    items = [(k, seq) for seq in range(4) for k in ("a", "b")]
    cluster.produce(topic, items)
    log = AttemptLog()
    with TenantTaskCoordinator(max_concurrency=2) as coordinator:
        consumer = KeyedConsumer(
            cluster.config(cluster.group()), [topic],
            flaky(log, lambda record, attempt: record.offset % 3 == 0 and attempt < 3),
            scheduler=coordinator, retry=Retry(attempts=3, backoff=0.02),
        )  # fmt: skip
        running = Running(consumer)
        try:
            wait_until(lambda: log.count("ok") == len(items), WAIT, "all records")
        finally:
            assert running.stop() is None
    check_retry_order(log.snapshot(), attempts=3)
    assert consumer.stats().retries == 2 * len([o for o in range(len(items)) if o % 3 == 0])


def test_a_dead_letter_carries_the_record_and_where_and_why_it_failed(
    cluster: Cluster,
) -> None:
    topic = cluster.topic(1)
    dead = cluster.topic(1)
    cluster.producer.produce(topic, key=b"k", value=b"ok:0")
    cluster.producer.produce(
        topic, key=b"poison", value=b"poison:0", headers=[("trace", b"t-1"), ("trace", b"t-2")]
    )
    cluster.producer.produce(topic, key=b"k", value=b"ok:1")
    assert cluster.producer.flush(30) == 0
    log = AttemptLog()
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(log, lambda record, attempt: record.key == b"poison"),
        retry=Retry(attempts=2, backoff=0.05), dead_letter=dead, commit_interval=0.05,
    )  # fmt: skip
    running = Running(consumer)
    try:
        wait_until(lambda: consumer.stats().dead_lettered == 1, WAIT, "the dead letter")
        wait_until(lambda: cluster.committed(topic, group, 1)[0] == 3, WAIT, "the commit")
    finally:
        assert running.stop() is None
    assert log.count("fail") == 2
    (letter,) = read_topic(cluster.bootstrap, dead, 1)
    assert (letter.key(), letter.value()) == (b"poison", b"poison:0")
    headers = letter.headers()
    assert headers[:2] == [("trace", b"t-1"), ("trace", b"t-2")]  # the original ones, in order
    extra = dict(headers[2:])
    assert extra["rxcoord.error"] == (f"{__name__}.Flaky: b'poison:0' failed attempt 2".encode())
    assert extra["rxcoord.attempts"] == b"2"
    assert extra["rxcoord.topic"] == topic.encode()
    assert extra["rxcoord.partition"] == b"0"
    assert extra["rxcoord.offset"] == b"1"
    assert extra["rxcoord.group"] == group.encode()
    assert int(extra["rxcoord.timestamp"]) > 0
    stats = consumer.stats()
    assert (stats.retries, stats.dead_lettered, stats.failed, stats.completed) == (1, 1, 1, 3)


def test_a_dead_letter_callable_decides_after_the_last_attempt(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    cluster.produce(topic, [("a", 0), ("a", 1)])
    letters: list[tuple[bytes | None, str]] = []
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(AttemptLog(), lambda record, attempt: record.value == b"a:0"),
        retry=Retry(attempts=3, backoff=0.01),
        dead_letter=lambda record, exc: letters.append((record.value, str(exc))),
        on_error="stop",  # not consulted: dead_letter decides
        commit_interval=0.05,
    )  # fmt: skip
    running = Running(consumer)
    try:
        wait_until(lambda: cluster.committed(topic, group, 1)[0] == 2, WAIT, "the commit")
    finally:
        assert running.stop() is None
    assert letters == [(b"a:0", "b'a:0' failed attempt 3")]
    assert consumer.stats().dead_lettered == 1


def _stops_before(
    cluster: Cluster, error: type[Exception], match: str, **options: Any
) -> tuple[AttemptLog, KeyedConsumer]:
    """Run ``options`` over ok, poison, ok: ``run()`` raises ``error``, and the commit stays at
    the poison record (offset 1)."""
    topic = cluster.topic(1)
    cluster.produce(topic, [("a", 0), ("p", 0), ("b", 0)])
    log = AttemptLog()
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(log, lambda record, attempt: record.value == b"p:0"),
        commit_interval=0.05, **options,
    )  # fmt: skip
    stopped = Running(consumer).join(WAIT)  # run() returns by itself, raising
    assert isinstance(stopped, error), stopped
    assert re.search(match, str(stopped)), stopped
    if error is DeadLetterFailed:
        assert isinstance(stopped.__cause__, Flaky)  # the handler's own exception
    assert cluster.committed(topic, group, 1)[0] <= 1  # never past the poison record
    return log, consumer


def test_a_dead_letter_topic_that_cannot_be_written_stops_without_committing(
    cluster: Cluster,
) -> None:
    log, consumer = _stops_before(
        cluster, DeadLetterFailed, r"dead-letter topic 'orders\.DLT'",
        retry=Retry(attempts=2, backoff=0.01), dead_letter="orders.DLT",
        # Its producer reaches no broker: the delivery times out and is reported failed.
        dead_letter_config={"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000},
    )  # fmt: skip
    assert log.count("fail") == 2
    stats = consumer.stats()
    assert (stats.dead_lettered, stats.retrying) == (0, 0)


def test_a_dead_letter_callable_that_raises_stops_without_committing(cluster: Cluster) -> None:
    def refuse(record: Record, exc: Exception) -> None:
        raise RuntimeError("the dead-letter store is down")

    log, consumer = _stops_before(
        cluster, RuntimeError, "dead-letter store is down",
        retry=Retry(attempts=2, backoff=0.01), dead_letter=refuse,
    )  # fmt: skip
    assert log.count("fail") == 2
    assert consumer.stats().dead_lettered == 0


def test_a_stop_during_a_retry_wait_drops_the_record_uncommitted(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    cluster.produce(topic, [("a", 0), ("p", 0), ("p", 1), ("b", 0)])
    log = AttemptLog()
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(log, lambda record, attempt: record.value == b"p:0"),
        retry=Retry(attempts=5, backoff=60, jitter=0),  # a wait no test waits out
        commit_interval=0.05,
    )  # fmt: skip
    running = Running(consumer)
    wait_until(lambda: consumer.stats().retrying == 1 and log.count("ok") == 2, WAIT, "p:0 waiting")
    started = time.monotonic()
    assert running.stop(drain=False) is None
    assert time.monotonic() - started < 10  # the 60 s wait was not waited for
    assert cluster.committed(topic, group, 1)[0] == 1  # a:0 done; p:0 not: consumed again
    assert log.count("start", "p") == 1  # no further attempt, and p:1 never started
    stats = consumer.stats()
    assert stats.retrying == 0
    assert stats.dropped >= 2  # p:0 (waiting) and p:1 (queued behind it)


def test_a_revoke_during_a_retry_wait_drops_the_record_for_the_next_owner(
    cluster: Cluster,
) -> None:
    topic = cluster.topic(1)
    other_topic = cluster.topic(1)
    cluster.produce(topic, [("p", 0), ("p", 1), ("a", 0)])
    log = AttemptLog()
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(log, lambda record, attempt: record.value == b"p:0" and attempt == 1),
        retry=Retry(attempts=2, backoff=600, jitter=0),  # a wait no test waits out
        commit_interval=0.05,
    )  # fmt: skip
    running = Running(consumer)
    wait_until(lambda: consumer.stats().retrying == 1, WAIT, "p:0 waiting")
    # A second member on another topic of the group: the partition is revoked and given back
    # under a new epoch (see test_kafka_rebalance.py).
    other = Consumer(cluster.config(group))
    other.subscribe([other_topic])
    stop = threading.Event()
    poller = threading.Thread(target=lambda: [other.poll(0.1) for _ in iter(stop.is_set, True)])
    poller.start()
    try:
        # The waiting record was dropped (its key free, nothing committed past it): p:0 is
        # fetched again and handled by the new assignment, long before its 600 s wait.
        wait_until(lambda: log.count("ok", "p") == 2, WAIT * 2, "p:0 handled again")
        wait_until(lambda: cluster.committed(topic, group, 1)[0] == 3, WAIT, "the commit")
        assert [p.epoch for p in consumer.stats().partitions] not in ([], [1])  # a new one
    finally:
        stop.set()
        poller.join()
        other.close()
    assert running.stop() is None
    stats = consumer.stats()
    assert stats.retrying == 0
    assert stats.dropped >= 1
    assert log.count("start", "p") == 3  # p:0 twice (once per epoch), p:1 once
    # (a:0 ran under both epochs: nothing was committed past p:0; the checker is per epoch.)
    check_retry_order([e for e in log.snapshot() if e.key == "p"], attempts=2)


def test_a_drain_lets_a_waiting_record_finish_its_attempts(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    cluster.produce(topic, [("p", 0), ("p", 1)])
    log = AttemptLog()
    group = cluster.group()
    consumer = KeyedConsumer(
        cluster.config(group), [topic],
        flaky(log, lambda record, attempt: record.value == b"p:0" and attempt == 1),
        retry=Retry(attempts=2, backoff=0.5, jitter=0),
    )  # fmt: skip
    running = Running(consumer)
    wait_until(lambda: consumer.stats().retrying == 1, WAIT, "p:0 waiting")
    assert running.stop(drain=True) is None
    assert log.count("ok") == 2
    assert cluster.committed(topic, group, 1)[0] == 2
    check_retry_order(log.snapshot(), attempts=2)


def test_a_stalled_record_is_reported_once_and_shows_in_stats(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    cluster.produce(topic, [("s", 0), ("f", 0)])
    release = threading.Event()
    stalls: list[tuple[bytes | None, float]] = []
    log = AttemptLog()

    def hold(record: Record, attempt: int) -> None:
        if record.value == b"s:0":
            release.wait(WAIT)

    consumer = KeyedConsumer(
        cluster.config(cluster.group()), [topic],
        # f:0 fails and waits 0.5 s: attempts and waits count together, so it stalls too.
        flaky(log, lambda record, attempt: record.value == b"f:0" and attempt == 1, hold),
        retry=Retry(attempts=2, backoff=0.5, jitter=0),
        stall_after=0.2,
        on_stall=lambda record, elapsed: stalls.append((record.value, elapsed)),
    )  # fmt: skip
    running = Running(consumer)
    try:
        wait_until(lambda: len(stalls) == 2, WAIT, "two stalls")
        assert {value for value, _ in stalls} == {b"s:0", b"f:0"}
        assert all(elapsed >= 0.2 for _, elapsed in stalls)
        wait_until(lambda: log.count("ok", "f") == 1, WAIT, "f:0's second attempt")
        # s:0 is still held: still stalled, reported once, the oldest of its partition.
        wait_until(
            lambda: (consumer.stats().partitions[0].oldest_in_progress or 0) > 0.6, WAIT, "age"
        )
        stats = consumer.stats()
        assert stats.stalled_keys == 1
        assert len(stalls) == 2  # once per record, however long it stays stalled
    finally:
        release.set()
    wait_until(
        lambda: (
            consumer.stats().stalled_keys == 0
            and consumer.stats().partitions[0].oldest_in_progress is None
        ),
        WAIT,
        "s:0 ended",
    )
    assert running.stop() is None
    assert len(stalls) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"retry": 3}, TypeError, r"retry must be a rxcoord\.Retry"),
        ({"dead_letter": 3}, TypeError, "dead_letter must be a topic name"),
        ({"dead_letter": "orders DLT"}, ValueError, "is not a Kafka topic name"),
        ({"dead_letter": ""}, ValueError, "is not a Kafka topic name"),
        ({"dead_letter": "x" * 250}, ValueError, "1 to 249"),
        ({"dead_letter_config": {"linger.ms": 5}}, ValueError, 'pass dead_letter="topic"'),
        ({"dead_letter": "d", "dead_letter_config": 5}, TypeError, "producer settings"),
        ({"dead_letter": "d", "dead_letter_config": {"no.such": 1}}, ValueError, "no.such"),
        ({"stall_after": 0}, ValueError, "stall_after must be a positive"),
        ({"stall_after": float("nan")}, ValueError, "stall_after must be a positive"),
        ({"stall_after": "60"}, TypeError, "stall_after must be a number"),
        ({"stall_after": 1, "on_stall": "log"}, TypeError, "on_stall must be a callable"),
        ({"on_stall": print}, ValueError, "on_stall needs stall_after="),
    ],
)  # fmt: skip
def test_bad_options_are_refused_at_the_call_with_the_fix(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        KeyedConsumer(
            {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}, ["orders"], print, **kwargs
        )


def _commits(path: Path) -> list[tuple[int, int, float]]:
    """The commits a retry worker logged: (partition, offset, when)."""
    if not path.exists():
        return []
    *lines, _partial = path.read_text().split("\n")
    return [(int(p), int(o), float(at)) for _, p, o, at in (line.split() for line in lines if line)]


def _retry_worker(
    cluster: Cluster, topic: str, dead: str, group: str, name: str, interval: float, linger: int
) -> Child:
    return Child(
        cluster, name, "tests.kafka.retry_worker", cluster.bootstrap, topic, dead, group,
        str(cluster.log_for(name)), name, str(interval), str(linger),
        str(cluster.tmp / f"commits-{name}.txt"),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["before the delivery", "after the delivery"])
def test_kill_9_around_a_dead_letter_never_loses_the_record(cluster: Cluster, kill: str) -> None:
    topic = cluster.topic(2)
    dead = cluster.topic(1)
    seqs: dict[str, int] = {}
    items = [*keyed_items(20, 4, seqs), ("poison", 0), *keyed_items(20, 4, seqs)]
    produced = cluster.produce(topic, items)
    partition, poison = produced.where[("poison", 0)]
    ends = {p: produced.end.get(p, 0) for p in (0, 1)}
    group = cluster.group()
    if kill == "before the delivery":
        # Commits every 0.1 s while the dead letter lingers in its producer for a minute.
        first = _retry_worker(cluster, topic, dead, group, "w1", 0.1, 60_000)
        others = set(produced.where) - {("poison", 0)}
        wait_until(lambda: others <= completed_pairs(cluster.runs()), 60, "the other records")
        wait_until(
            lambda: len([r for r in cluster.runs() if r.key == "poison" and r.end]) == 2,
            30,
            "both attempts of the poison record",
        )
        done_at = max(r.end or 0.0 for r in cluster.runs())
        # A record on the other partition, and its commit: a commit cycle after every record
        # but the dead-lettered one ended. The poison's partition is committed no further.
        other = 1 - partition
        cluster.producer.produce(topic, key=b"tick", value=b"tick:0", partition=other)
        assert cluster.producer.flush(30) == 0
        ends[other] += 1
        commits = cluster.tmp / "commits-w1.txt"
        wait_until(
            lambda: any(p == other and at > done_at for p, _, at in _commits(commits)),
            30,
            "a commit after the other records",
        )
        assert max(o for p, o, _ in _commits(commits) if p == partition) <= poison
    else:
        # Delivered at once, but no commit for a minute.
        first = _retry_worker(cluster, topic, dead, group, "w1", 60.0, 5)
        assert len(read_topic(cluster.bootstrap, dead, 1, timeout=60)) == 1
    first.kill()
    second = _retry_worker(cluster, topic, dead, group, "w2", 0.1, 5)
    try:
        wait_until(
            lambda: all(  # (a partition without records has no commit)
                cluster.committed(topic, group, 2)[p] == end for p, end in ends.items() if end
            ),
            90,
            "the second run",
        )
    finally:
        assert second.terminate() == 0
    letters = read_topic(cluster.bootstrap, dead, 2, timeout=15)
    assert [(m.key(), m.value()) for m in letters] == [(b"poison", b"poison:0")] * len(letters)
    if kill == "before the delivery":
        assert len(letters) == 1  # the killed run's letter was never sent; the second run's was
    else:
        assert len(letters) == 2  # at least once: delivered, not committed, so again
    # The second run handled the record again (the first had not committed it).
    assert [r for r in cluster.runs() if r.worker == "w2" and r.key == "poison"]
    check_invariants(produced, cluster.runs(), duplicates=True, dead=["w1"])
