"""The Rx form of the consumer: an Observable of records, and the commit step as an operator.

A pipeline written with them has the consumer's guarantees where Rx gives them::

    kafka_records(config, ["orders"]).pipe(
        serialize_by_key(lambda r: r.key, lambda r: work(r).pipe(ops.map(lambda _: r)),
                         max_concurrent=64),
        commit_records(),
    ).subscribe(on_error=log)

``serialize_by_key`` keeps each key in order (one lane per key per subscription, so a partition
revoked and assigned back cannot run a key twice at once), and ``commit_records`` reports every
record that reaches it as completed: the source then commits, per partition, the contiguous
prefix of completed offsets, pauses partitions beyond ``max_in_flight`` and commits on revoke
and on disposal, like :class:`~rxcoord.kafka.KeyedConsumer` (which runs the same engine with a
dispatcher of its own, because an Observable per record costs more than a fast handler).

Context and traces: ``on_next`` runs in the context of the call that subscribed (its
``contextvars``, ``logger.contextualize`` values) and, with an OpenTelemetry SDK configured,
each record's ``<topic> process`` span is current while it is emitted (parent: the
``traceparent`` in its headers); the span ends when the record passes ``commit_records`` (a
record that never reaches it leaves its span unended, so unexported). Work a pipeline moves to
other threads carries the context only where its operators do.

One difference: records that wait inside ``serialize_by_key`` when their partition is revoked
still run later (an operator cannot be told to drop them); their completions are dropped (the
record's ``current`` is then false, for handlers that want to skip such work).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import Message
from reactivex import Observable, abc
from reactivex.disposable import Disposable

from rxcoord._core.checks import check_count, check_interval
from rxcoord._core.telemetry import traces_on

from ._consumer import _check_config, _check_topics
from ._engine import Engine, complete
from ._partitions import ACTIVE, PartitionState
from ._record import Record
from ._telemetry import ConsumerTelemetry, record_done

__all__ = ["commit_records", "kafka_records"]


def kafka_records(
    config: Mapping[str, Any],
    topics: Sequence[str],
    *,
    max_in_flight: int = 10_000,
    commit_interval: float = 1.0,
    revoke_timeout: float = 10.0,
    startup_timeout: float = 10.0,
    batch_size: int = 500,
    trace_record_keys: bool = False,
) -> Observable[Record]:
    """A cold Observable of the records of ``topics``; each subscription is one group member.

    Subscribing starts a consumer on a thread of its own that emits each record (``on_next``
    on that thread). Report records as completed with :func:`commit_records`: the consumer
    commits each partition's contiguous completed prefix every ``commit_interval`` seconds,
    on revoke and on disposal, and pauses partitions beyond ``max_in_flight`` uncompleted
    records. Disposing commits what completed and leaves the group (it does not wait for
    records still being processed). Errors at start (``BrokerUnavailable``, ``UnknownTopic``)
    and fatal Kafka errors arrive as ``on_error``. The stream never completes by itself.

    Args:
        config: confluent-kafka configuration (``bootstrap.servers`` and ``group.id`` required,
            no ``enable.auto.commit``).
        topics: Topic names to subscribe to.
        max_in_flight: Records emitted and not yet committed beyond which partitions pause.
        commit_interval: Seconds between periodic commits.
        revoke_timeout: Seconds a revoke waits for emitted records of the revoked partitions.
        startup_timeout: Seconds to wait for the cluster's metadata before failing.
        batch_size: Most records fetched per ``consume()`` call.
        trace_record_keys: Put each record's key on its span (``messaging.kafka.message.key``).

    Returns:
        An Observable of :class:`Record`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range or the configuration is incomplete.
    """
    conf = _check_config(config)
    names = _check_topics(topics)
    options: dict[str, Any] = {
        "max_in_flight": check_count(max_in_flight, "max_in_flight", 1),
        "commit_interval": check_interval(commit_interval, "commit_interval"),
        "revoke_timeout": check_interval(revoke_timeout, "revoke_timeout"),
        "startup_timeout": check_interval(startup_timeout, "startup_timeout"),
        "batch_size": check_count(batch_size, "batch_size", 1),
    }
    if not isinstance(trace_record_keys, bool):
        raise TypeError(f"trace_record_keys must be True or False, not {trace_record_keys!r}")

    def subscribe(
        observer: abc.ObserverBase[Record], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        engine = Engine(conf, names, name=str(conf["group.id"]), **options)
        source = _Source(engine, observer)
        telemetry = source.telemetry = ConsumerTelemetry(
            engine.telemetry, record_keys=trace_record_keys
        )
        telemetry.begin()  # the subscriber's context is the records'
        thread = threading.Thread(
            target=telemetry.thread_context().run,
            args=(source.run,),
            name="rxcoord-kafka-records",
            daemon=True,
        )
        thread.start()

        def dispose() -> None:
            source.stopped.set()
            if threading.current_thread() is not thread:
                thread.join()

        return Disposable(dispose)

    return Observable(subscribe)


def commit_records() -> Callable[[Observable[Record]], Observable[Record]]:
    """Report each record that passes as completed, then pass it on.

    Place it after the processing step: a record reaching it has been handled. Its partition's
    commit point moves once every earlier record of the partition has passed too. Records of a
    partition revoked meanwhile pass on, but their completion is dropped. Records that never
    reach it (filtered out, or lost to an error) hold the commit point back, so filter before
    processing only with care: map them to themselves instead.

    Returns:
        An operator function for ``Observable.pipe``.
    """

    def operator(source: Observable[Record]) -> Observable[Record]:
        def subscribe(
            observer: abc.ObserverBase[Record], scheduler: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            def on_next(record: Record) -> None:
                if not isinstance(record, Record):
                    observer.on_error(
                        TypeError(f"commit_records() needs Record items, not {record!r}")
                    )
                    return
                complete(record._state, record.offset)
                record_done(record)
                observer.on_next(record)

            return source.subscribe(
                on_next, observer.on_error, observer.on_completed, scheduler=scheduler
            )

        return Observable(subscribe)

    return operator


class _Source:
    """The processor of a ``kafka_records`` subscription: emits, tracks, never runs records."""

    def __init__(self, engine: Engine, observer: abc.ObserverBase[Record]) -> None:
        self.engine = engine
        self.observer = observer
        self.stopped = threading.Event()
        self.telemetry: ConsumerTelemetry | None = None
        engine.processor = self

    def run(self) -> None:
        engine = self.engine
        error: BaseException | None = None
        try:
            engine.check_startup()
            engine.subscribe()
            while not self.stopped.is_set() and engine.failure is None:
                engine.poll_once(True)
        except Exception as exc:
            error = exc
        finally:
            try:
                engine.close()
            except Exception as exc:
                error = error or exc
        error = error or engine.failure
        if error is not None and not self.stopped.is_set():
            self.observer.on_error(error)  # type: ignore[arg-type]

    def dispatch(self, messages: list[Message]) -> None:
        engine = self.engine
        states = engine.states
        on_next = self.observer.on_next
        telemetry = self.telemetry if traces_on() else None
        engine.fetched += len(messages)
        for msg in messages:
            if self.stopped.is_set():
                return  # the rest is neither emitted nor tracked, so never committed
            error = msg.error()
            if error is not None:
                engine.message_error(error)
                continue
            topic: str = msg.topic()  # type: ignore[assignment]
            partition: int = msg.partition()  # type: ignore[assignment]
            st = states.get((topic, partition))
            if st is None or st.phase != ACTIVE:
                continue
            offset: int = msg.offset()  # type: ignore[assignment]
            st.position = offset + 1
            st.fetched += 1
            with engine.lock:
                st.order.append(offset)
            record = Record(msg, offset, msg.key(), st)
            if telemetry is None:
                on_next(record)
            else:
                telemetry.run(record, on_next, record)  # its span current while it is emitted

    def outstanding(self, states: Sequence[PartitionState]) -> int:
        return sum(len(s.order) - len(s.done) for s in states)

    def pending(self) -> int:
        return self.outstanding(list(self.engine.states.values()))

    def revoking(self, states: Sequence[PartitionState]) -> None:
        pass  # records already emitted run on in the user's pipeline; see the module docstring

    def stopping(self, drain: bool) -> None:
        self.stopped.set()
