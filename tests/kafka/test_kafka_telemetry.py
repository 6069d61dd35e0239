"""The keyed consumer seen through OpenTelemetry, and the consumer's context in its handlers
(issue 24, Kafka): a real broker, the real SDK (``support.otel``), real threads and loops.

Each consumer's group id is its ``rxcoord.name`` and each test has topics of its own, so what a
test reads back is its own even while earlier tests' threads still record.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from loguru import logger
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, StatusCode
from support.otel import Telemetry

from rxcoord import Retry, TenantTaskCoordinator
from rxcoord._core.telemetry import inject_headers
from rxcoord.kafka import KeyedConsumer, Record, commit_records, kafka_records

from .support import Cluster, Running, keyed_items, wait_for

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Where a handler runs: on the poll thread, on a worker thread, as ``async def`` on the loop,
# as a job of a coordinator (its worker threads).
SHAPES = ("inline", "worker", "async", "scheduler")

WAIT = 60.0


class Seen:
    """What handlers saw, by record (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: list[Any] = []

    def add(self, value: Any) -> None:
        with self.lock:
            self.values.append(value)

    def __len__(self) -> int:
        with self.lock:
            return len(self.values)


def consumer_of(
    shape: str,
    cluster: Cluster,
    group: str,
    topic: str,
    body: Callable[[Record], None],
    **options: Any,
) -> KeyedConsumer:
    """A consumer whose handler of the given shape calls ``body(record)``."""
    config = cluster.config(group)
    if shape == "async":

        async def handle_async(record: Record) -> None:
            await asyncio.sleep(0)
            body(record)

        return KeyedConsumer(config, [topic], handle_async, **options)
    if shape == "scheduler":
        coordinator = TenantTaskCoordinator(name=f"{group}-jobs", max_concurrency=4)
        return KeyedConsumer(config, [topic], body, scheduler=coordinator, **options)
    return KeyedConsumer(config, [topic], body, inline=shape == "inline", **options)


class AsyncRunning:
    """``run_async()`` on a loop thread of its own, started in a context with ``rid`` set."""

    def __init__(self, consumer: KeyedConsumer, rid: str | None = None) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(rid,), daemon=True)
        self.thread.start()

    def _run(self, rid: str | None) -> None:
        async def main() -> None:
            request_id.set(rid)
            with logger.contextualize(request_id=rid):
                await self.consumer.run_async()

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc

    def stop(self) -> BaseException | None:
        self.consumer.close()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "run_async() did not return after close()"
        return self.error


class RunningIn(Running):
    """``run()`` on a thread of its own whose context has ``request_id = rid``."""

    def __init__(self, consumer: Any, rid: str) -> None:
        self.rid = rid
        super().__init__(consumer)

    def _run(self) -> None:
        request_id.set(self.rid)
        with logger.contextualize(request_id=self.rid):
            super()._run()


@pytest.fixture
def extras() -> Iterator[list[dict[str, Any]]]:
    """The ``extra`` of every loguru record logged with message ``"handled"``."""
    seen: list[dict[str, Any]] = []

    def sink(message: Any) -> None:
        if message.record["message"] == "handled":
            seen.append(dict(message.record["extra"]))

    sink_id = logger.add(sink, level="INFO")
    yield seen
    logger.remove(sink_id)


def produce_traced(cluster: Cluster, topic: str, count: int) -> list[SpanContext]:
    """``count`` records of key ``k{i}`` to partition 0, each under a producer-side span whose
    ``traceparent`` travels in its headers; returns those spans' contexts."""
    tracer = trace.get_tracer("tests.producer")
    contexts: list[SpanContext] = []
    for i in range(count):
        with tracer.start_as_current_span(f"{topic} send", kind=SpanKind.PRODUCER) as span:
            headers: list[tuple[str, str | bytes | None]] = [*inject_headers()]
            cluster.producer.produce(
                topic, key=f"k{i}".encode(), value=b"v", partition=0, headers=headers
            )
            contexts.append(span.get_span_context())
    assert cluster.producer.flush(30) == 0
    return contexts


def offset_of(span: ReadableSpan) -> int:
    offset = (span.attributes or {})["messaging.kafka.offset"]
    assert isinstance(offset, int)
    return offset


def by_offset(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    return sorted(spans, key=offset_of)


# -- metrics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_records_counted_by_outcome_and_commits_timed(
    otel: Telemetry, cluster: Cluster, shape: str
) -> None:
    # 20 records, every fifth fails: 16 completed, 4 failed (skipped by on_error).
    topic = cluster.topic(2)
    cluster.produce(topic, keyed_items(20, 20))
    group = cluster.group(f"records-{shape}")
    handled = Seen()

    def body(record: Record) -> None:
        handled.add(record.offset)
        key, _, seq = (record.value or b"").decode().rpartition(":")
        if int(key[1:]) % 5 == 0:
            raise ValueError(f"bad {key}:{seq}")

    consumer = consumer_of(shape, cluster, group, topic, body, on_error="skip", commit_interval=0.1)
    running = Running(consumer)
    wait_for(lambda: len(handled) == 20, WAIT, "every record handled")
    wait_for(lambda: consumer.stats().in_flight == 0, WAIT, "every record passed the prefix")
    wait_for(
        lambda: otel.collect().count("rxcoord.kafka.commit.wait", {"rxcoord.name": group}) > 0,
        WAIT,
        "a commit answered",
    )
    assert running.stop() is None
    metrics = otel.collect()
    mine = {"rxcoord.name": group, "messaging.destination.name": topic}
    assert metrics.value("rxcoord.kafka.records", {**mine, "rxcoord.outcome": "completed"}) == 16
    assert metrics.value("rxcoord.kafka.records", {**mine, "rxcoord.outcome": "failed"}) == 4
    assert {a["rxcoord.outcome"] for a in metrics.attribute_sets("rxcoord.kafka.records")
            if a["rxcoord.name"] == group} == {"completed", "failed"}  # fmt: skip
    waits = {"rxcoord.name": group, "messaging.consumer.group.name": group}
    assert metrics.count("rxcoord.kafka.commit.wait", waits) >= 1  # the final commit, at least
    assert 0 < metrics.max("rxcoord.kafka.commit.wait", waits) < 30
    assert metrics.units["rxcoord.kafka.commit.wait"] == "s"


def test_lag_in_flight_and_paused_gauges_follow_the_consumer_and_go_with_it(
    otel: Telemetry, cluster: Cluster
) -> None:
    # One partition, its first record blocks: records pile up behind the commit point and the
    # partition pauses (max_in_flight=5); released, everything is committed; closed, gone.
    topic = cluster.topic(1)
    produced = cluster.produce(topic, keyed_items(30, 30))
    group = cluster.group("gauges")
    release = threading.Event()
    handled = Seen()

    def handle(record: Record) -> None:
        if record.offset == 0:
            release.wait(WAIT)
        handled.add(record.offset)

    consumer = KeyedConsumer(
        cluster.config(group),
        [topic],
        handle,
        inline=False,
        max_in_flight=5,
        commit_interval=0.1,
    )
    running = Running(consumer)
    mine = {"rxcoord.name": group, "messaging.destination.name": topic}
    part = {**mine, "messaging.destination.partition.id": "0"}

    def paused() -> bool:
        return otel.collect().value("rxcoord.kafka.paused", mine) == 1

    try:
        wait_for(paused, WAIT, "the partition paused behind its blocked first record")
        metrics = otel.collect()
        stats = consumer.stats()
        assert metrics.value("rxcoord.kafka.in_flight", part) >= 5
        assert metrics.value("rxcoord.kafka.in_flight", part) <= stats.fetched
        # Nothing committed or committable yet: no lag is known, so none is reported.
        assert metrics.select("rxcoord.kafka.lag", part) == []
        assert metrics.units["rxcoord.kafka.in_flight"] == "{record}"
        assert metrics.units["rxcoord.kafka.paused"] == "{partition}"
    finally:
        release.set()
    wait_for(lambda: len(handled) == 30, WAIT, "every record handled")
    wait_for(lambda: cluster.committed(topic, group, 1) == produced.end, WAIT, "commits at the end")

    def settled() -> bool:
        metrics = otel.collect()
        return (
            metrics.value("rxcoord.kafka.in_flight", part) == 0
            and metrics.value("rxcoord.kafka.paused", mine) == 0
            and len(metrics.select("rxcoord.kafka.lag", part)) == 1
        )

    wait_for(settled, WAIT, "in_flight and paused back to 0, a lag known")
    lag = otel.collect().value("rxcoord.kafka.lag", part)
    assert 0 <= lag <= 30
    assert running.stop() is None
    metrics = otel.collect()
    for name in ("rxcoord.kafka.lag", "rxcoord.kafka.in_flight", "rxcoord.kafka.paused"):
        assert metrics.select(name, {"rxcoord.name": group}) == [], name


# -- traces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_record_span_continues_the_producers_trace_and_holds_the_users_spans(
    otel: Telemetry, cluster: Cluster, shape: str
) -> None:
    topic = cluster.topic(1)
    sent = produce_traced(cluster, topic, 3)
    group = cluster.group(f"spans-{shape}")
    tracer = trace.get_tracer("tests.handler")
    handled = Seen()

    def body(record: Record) -> None:
        with tracer.start_as_current_span(f"user {record.offset}"):
            pass
        handled.add(record.offset)

    consumer = consumer_of(shape, cluster, group, topic, body)
    running = Running(consumer)
    wait_for(lambda: len(otel.spans(f"{topic} process")) == 3, WAIT, "three record spans")
    assert running.stop() is None
    records = by_offset(otel.spans(f"{topic} process"))
    assert [offset_of(span) for span in records] == [0, 1, 2]
    for offset, (span, producer) in enumerate(zip(records, sent, strict=True)):
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None
        assert span.parent.span_id == producer.span_id
        assert span.context.trace_id == producer.trace_id
        assert dict(span.attributes or {}) == {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": topic,
            "messaging.destination.partition.id": "0",
            "messaging.kafka.offset": offset,
            "messaging.consumer.group.name": group,
            "rxcoord.outcome": "completed",
        }  # no key: keys are opt-in
        (user,) = otel.spans(f"user {offset}")
        assert user.parent is not None
        if shape == "scheduler":  # the coordinator's job span sits between them
            (job,) = [s for s in otel.spans() if s.context.span_id == user.parent.span_id]
            assert job.name == f"rxcoord.job {group}-jobs"
            assert job.parent is not None
            assert job.parent.span_id == span.context.span_id
        else:
            assert user.parent.span_id == span.context.span_id


def test_a_failed_record_has_an_error_status_and_its_exception(
    otel: Telemetry, cluster: Cluster
) -> None:
    topic = cluster.topic(1)
    produce_traced(cluster, topic, 2)
    group = cluster.group("failed-span")

    def handle(record: Record) -> None:
        if record.offset == 1:
            raise ValueError("bad record")

    consumer = KeyedConsumer(cluster.config(group), [topic], handle, on_error="skip")
    running = Running(consumer)
    wait_for(lambda: len(otel.spans(f"{topic} process")) == 2, WAIT, "two record spans")
    assert running.stop() is None
    spans = by_offset(otel.spans(f"{topic} process"))
    ok, failed = spans
    assert ok.status.status_code is StatusCode.UNSET
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["rxcoord.outcome"] == "failed"
    assert failed.attributes["error.type"] == "ValueError"
    (event,) = [e for e in failed.events if e.name == "exception"]
    assert event.attributes is not None
    assert event.attributes["exception.message"] == "bad record"


@pytest.mark.parametrize("shape", ["worker", "async"])
def test_a_retried_record_is_one_span_and_one_count_a_dead_letter_a_failure(
    otel: Telemetry, cluster: Cluster, shape: str
) -> None:
    # Offset 0 fails twice, then succeeds on its third attempt; offset 1 fails every attempt
    # and is dead-lettered. One span and one count per record, whatever its attempts.
    topic = cluster.topic(1)
    produce_traced(cluster, topic, 2)
    group = cluster.group(f"retried-{shape}")
    attempts: dict[int, int] = {}
    lock = threading.Lock()

    def body(record: Record) -> None:
        with lock:
            attempts[record.offset] = attempts.get(record.offset, 0) + 1
            attempt = attempts[record.offset]
        if record.offset == 1 or attempt < 3:
            raise ConnectionError(f"attempt {attempt} of {record.offset}")

    consumer = consumer_of(
        shape,
        cluster,
        group,
        topic,
        body,
        retry=Retry(attempts=3, backoff=0.01, jitter=0),
        dead_letter=f"{topic}.DLT",
    )
    running = Running(consumer)
    wait_for(lambda: consumer.stats().dead_lettered == 1, WAIT, "a dead letter delivered")
    wait_for(lambda: len(otel.spans(f"{topic} process")) == 2, WAIT, "two record spans")
    assert running.stop() is None
    assert attempts == {0: 3, 1: 3}
    ok, failed = by_offset(otel.spans(f"{topic} process"))
    assert ok.status.status_code is StatusCode.UNSET
    assert [e.name for e in ok.events] == ["rxcoord.record.retry"] * 2
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events if e.name == "rxcoord.record.retry"] == [
        "rxcoord.record.retry"
    ] * 2
    metrics = otel.collect()
    mine = {"rxcoord.name": group, "messaging.destination.name": topic}
    assert metrics.value("rxcoord.kafka.records", {**mine, "rxcoord.outcome": "completed"}) == 1
    assert metrics.value("rxcoord.kafka.records", {**mine, "rxcoord.outcome": "failed"}) == 1


def test_record_keys_are_on_spans_only_when_asked_for(otel: Telemetry, cluster: Cluster) -> None:
    topic = cluster.topic(1)
    produce_traced(cluster, topic, 1)
    group = cluster.group("keys")
    consumer = KeyedConsumer(
        cluster.config(group), [topic], lambda record: None, trace_record_keys=True
    )
    running = Running(consumer)
    wait_for(lambda: len(otel.spans(f"{topic} process")) == 1, WAIT, "a record span")
    assert running.stop() is None
    (span,) = otel.spans(f"{topic} process")
    assert span.attributes is not None
    assert span.attributes["messaging.kafka.message.key"] == "k0"
    with pytest.raises(TypeError, match="trace_record_keys"):
        KeyedConsumer(cluster.config(group), [topic], print, trace_record_keys="yes")  # type: ignore[arg-type]


def test_rx_records_are_emitted_under_their_span_in_the_subscribers_context(
    otel: Telemetry, cluster: Cluster
) -> None:
    topic = cluster.topic(1)
    sent = produce_traced(cluster, topic, 2)
    group = cluster.group("rx")
    tracer = trace.get_tracer("tests.handler")
    seen = Seen()

    def work(record: Record) -> Record:
        with tracer.start_as_current_span(f"user {record.offset}"):
            seen.add(request_id.get())
        return record

    subscribed: list[Any] = []

    def subscriber() -> None:
        request_id.set("rx-1")
        source = kafka_records(cluster.config(group), [topic], commit_interval=0.1)
        subscribed.append(source.pipe(_map(work), commit_records()).subscribe())

    thread = threading.Thread(target=subscriber)
    thread.start()
    thread.join()
    try:
        wait_for(lambda: len(otel.spans(f"{topic} process")) == 2, WAIT, "two record spans")
    finally:
        subscribed[0].dispose()
    assert seen.values == ["rx-1", "rx-1"]
    for span in otel.spans(f"{topic} process"):
        offset = offset_of(span)
        assert span.parent is not None
        assert span.parent.span_id == sent[offset].span_id
        (user,) = otel.spans(f"user {offset}")
        assert user.parent is not None
        assert user.parent.span_id == span.context.span_id


def _map(fn: Callable[[Record], Record]) -> Any:
    from reactivex import operators as ops

    return ops.map(fn)


# -- context ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_handlers_see_the_context_of_run_async(
    otel: Telemetry, cluster: Cluster, shape: str, extras: list[dict[str, Any]]
) -> None:
    # run_async() polls on a thread of its own: without the consumer's context carried, even a
    # handler called on the poll thread would see nothing.
    topic = cluster.topic(2)
    cluster.produce(topic, keyed_items(6, 6))
    group = cluster.group(f"context-{shape}")
    seen = Seen()

    def body(record: Record) -> None:
        seen.add(request_id.get())
        logger.info("handled")

    consumer = consumer_of(shape, cluster, group, topic, body)
    running = AsyncRunning(consumer, f"run-{shape}")
    wait_for(lambda: len(seen) == 6, WAIT, "every record handled")
    assert running.stop() is None
    assert seen.values == [f"run-{shape}"] * 6
    assert [e.get("request_id") for e in extras] == [f"run-{shape}"] * 6


def test_worker_handlers_see_the_context_of_run(
    otel: Telemetry, cluster: Cluster, extras: list[dict[str, Any]]
) -> None:
    topic = cluster.topic(2)
    cluster.produce(topic, keyed_items(6, 6))
    group = cluster.group("context-run")
    seen = Seen()

    def body(record: Record) -> None:
        seen.add((request_id.get(), threading.current_thread().name))
        logger.info("handled")
        request_id.set("changed")  # in this record's own copy: later records see run-1

    consumer = KeyedConsumer(cluster.config(group), [topic], body, inline=False)
    running = RunningIn(consumer, "run-1")
    wait_for(lambda: len(seen) == 6, WAIT, "every record handled")
    assert running.stop() is None
    assert {rid for rid, _ in seen.values} == {"run-1"}
    assert all(name.startswith("rxcoord-kafka") for _, name in seen.values)
    assert [e.get("request_id") for e in extras] == ["run-1"] * 6
