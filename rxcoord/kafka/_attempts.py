"""A record's attempts: retries that keep its key, dead letters, and the stall watch.

The coordinator's retry (``rxcoord._coordinator._attempts``), for records. A record whose
handler failed with an exception its ``Retry`` policy retries gives its slot back but keeps its
key (``LaneTable.suspend``): later records of the key stay queued behind it, and its partition's
commit point stays below it (its offset is not done). It holds no thread: a timer on rxcoord's
shared timer thread (``rxcoord._core.timer``) marks it *due*, and the poll thread, whose polls
end when a wait does (:func:`until_next_due`, read by ``KeyedConsumer._poll_timeout``), puts it
back in the lanes (``LaneTable.resume``), where it queues for a slot like any ready record.
Resuming on the poll thread, not on the timer's, keeps the poll thread the only one that takes
a slot without giving one back, which the dispatcher's lock-free inline check relies on
(``_enter_locked``).

After the last attempt, with ``dead_letter="topic"``, the record is produced to that topic and
stays in progress the same way (its key held, no slot) until the broker acknowledged the
delivery: only then is it done (its offset completed, so committed later). A crash before that
consumes it again (it is dead-lettered at least once, never lost); a refused or timed-out
delivery stops the consumer with :class:`DeadLetterFailed`, the record not committed.

A revoke or a stop drops a record that waits (for its next attempt or its delivery): its timer
is cancelled, its offset stays uncommitted, and the next owner (or the next run) processes it
again. A drain (``close(drain=True)``, SIGTERM) lets waiting records finish their attempts
within ``drain_timeout``.

With ``stall_after=s``, a record in progress (attempts and waits together) for longer than ``s``
is reported once: a warning, ``on_stall(record, elapsed)`` on a delivery worker (never on the
timer thread), and ``stats().stalled_keys``.

Each function takes the consumer first, like the coordinator's. State lives in
``KeyedConsumer._progress`` (records tracked beyond the plain path) under the consumer's lock.
"""

from __future__ import annotations

import functools
import heapq
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rxcoord._core.retry import gave_up
from rxcoord._core.timer import TimerHandle, call_later
from rxcoord._core.workers import hand_off

from . import _logs
from ._errors import DeadLetterFailed
from ._partitions import ACTIVE, REVOKED
from ._record import Record

if TYPE_CHECKING:
    from ._consumer import KeyedConsumer

__all__ = ["DeadLetters", "Progress"]

# Where a tracked record is: running an attempt, waiting for its next one (suspended: its key,
# no slot), ready again (a ready head of the lanes), or waiting for its dead letter's delivery.
RUNNING: Final = 0
WAITING: Final = 1
READY: Final = 2
DELIVERING: Final = 3

_HELD: Final = (WAITING, DELIVERING)
# A retry wait that ended this long ago was served (its timer marked the record due and the
# poll thread resumed it) or its record was dropped: its end is forgotten.
_SERVED_AFTER: Final = 0.05


class Progress:
    """A record in progress beyond the plain path: its attempts, timers and stall (private)."""

    __slots__ = ("attempt", "first", "stall", "stalled", "state", "timer")

    def __init__(self, first: float) -> None:
        self.first = first  # when its first attempt started (time.monotonic())
        self.attempt = 1  # the attempt running, or the next one while it waits
        self.state = RUNNING
        self.timer: TimerHandle | None = None  # its retry wait
        self.stall: TimerHandle | None = None  # its stall watch
        self.stalled = False


def track(c: KeyedConsumer, record: Record, now: float) -> Progress:
    """An attempt of ``record`` starts (or failed untracked, inline): its progress (under the
    lock). The first one starts the record's clock and its stall watch."""
    p = c._progress.get(record)
    if p is None:
        p = c._progress[record] = Progress(now)
        if c._stall_after is not None:
            p.stall = call_later(c._stall_after, functools.partial(stalled, c, record))
    else:
        p.state = RUNNING
    return p


def forget(c: KeyedConsumer, record: Record) -> None:
    """``record`` is no longer in progress (done, dropped): cancel its timers (under the lock)."""
    p = c._progress.pop(record, None)
    if p is None:
        return
    if p.stall is not None:
        p.stall.cancel()
    if p.timer is not None:
        p.timer.cancel()
    if p.state == WAITING:
        c._retrying -= 1
    elif p.state == DELIVERING:
        c._delivering -= 1


def failed(
    c: KeyedConsumer, record: Record, error: Exception, attempted: bool
) -> list[Record] | None:
    """An attempt of ``record`` (holding a slot) failed with ``error``.

    Returns the records that take slots now when ``record`` stays in progress (it waits for
    its next attempt or for its dead letter's delivery, or was dropped because its partition
    is going or the consumer stops); ``None`` when ``on_error`` (or a ``dead_letter``
    callable) decides now. ``attempted``: the handler ran (an error of a record that never
    started, a scheduler's refusal say, is not retried).
    """
    now = time.monotonic()
    with c._lock:
        p = track(c, record, now)
        attempt, first = p.attempt, p.first
    policy = c._retry_policy
    if policy is not None and attempted:
        wait = policy.next_wait(error, attempt, now - first)
        if wait is not None:
            return _wait(c, record, p, error, wait)
    gave_up(error, attempt, f"{record!r}")
    letters = c._dead_letters
    if letters is not None and attempted:
        return _dead_letter(c, record, p, error, letters)
    return None


def _hold(c: KeyedConsumer, record: Record, p: Progress, state: int) -> list[Record] | None:
    """The failed attempt of ``record`` ends; it keeps its key but gives its slot back (under
    the lock). Returns who takes the slot, or None if it may not stay (its partition is going,
    or the consumer stops without a drain): the caller drops it then."""
    st = record._state
    if st.phase != ACTIVE or not c._accepting:
        return None
    st.running -= 1
    st.started -= 1  # the attempt ended: a revoke does not wait for a record between attempts
    p.state = state
    successors = c._turns(c._lanes.suspend(c._key_of(record)))
    if c._engine.waiters:
        c._engine.changed.notify_all()
    return successors


def _wait(
    c: KeyedConsumer, record: Record, p: Progress, error: Exception, wait: float
) -> list[Record]:
    with c._lock:
        successors = _hold(c, record, p, WAITING)
        if successors is not None:
            c._retries += 1
            c._retrying += 1
            p.attempt += 1
            # Under the lock, before its next attempt can start: one span and one count per
            # record (telemetry hook).
            c._telemetry.retrying(record, error)
            # Fires on the timer thread, which waits for this lock: p.timer is set by then.
            p.timer = call_later(wait, functools.partial(_due, c, record))
            heapq.heappush(c._wait_ends, time.monotonic() + wait)
    if successors is None:
        return c._ended(record, None, dropped=True, started=True)
    assert c._retry_policy is not None
    c._log.warning(
        "{}: attempt {} of {} failed ({!r}), retrying in {:.3f} s",
        record,
        p.attempt - 1,
        c._retry_policy.attempts,
        error,
        wait,
    )
    return successors


def _due(c: KeyedConsumer, record: Record) -> None:
    """The retry wait of ``record`` is over (timer thread): the poll thread resumes it."""
    with c._lock:
        p = c._progress.get(record)
        if p is None or p.state != WAITING or p.timer is None:
            return  # dropped meanwhile
        p.timer = None
        c._due.append(record)


def until_next_due(c: KeyedConsumer) -> float | None:
    """Seconds until the next retry wait ends, 0 for one that ended just now (its timer may not
    have marked the record due yet); None when no record waits for its next attempt.

    Bounds the poll thread's wait for records, so that it resumes a record when its wait ends
    and polls no more often than usual while records wait.
    """
    with c._lock:
        ends = c._wait_ends
        if not c._retrying:
            ends.clear()
            return None
        now = time.monotonic()
        while ends and ends[0] < now - _SERVED_AFTER:
            heapq.heappop(ends)
        return max(0.0, ends[0] - now) if ends else None


def resume_due(c: KeyedConsumer) -> None:
    """Put records whose wait is over back in the lanes (poll thread): each takes a slot now,
    or queues as a ready head behind those that were ready before it."""
    starts: list[Record] = []
    with c._lock:
        due, c._due = c._due, []
        for record in due:
            p = c._progress.get(record)
            if p is None or p.state != WAITING:
                continue  # dropped meanwhile
            if record._state.phase != ACTIVE or not c._accepting:
                starts += drop_held(c, record)
                continue
            c._retrying -= 1
            p.state = READY
            if c._lanes.resume(c._key_of(record)):
                record._state.running += 1
                starts.append(record)
            else:
                c._queued += 1
    c._after(starts)


def drop_held(c: KeyedConsumer, record: Record) -> list[Record]:
    """Drop a record that waits (for its next attempt or its delivery): it is not done, its
    offset stays uncommitted (under the lock). Returns who starts now that its key moved on."""
    forget(c, record)
    c._dropped += 1
    return c._turns(c._lanes.drop(c._key_of(record)))


def drop_if(c: KeyedConsumer, dead: Callable[[Record], bool]) -> list[Record]:
    """After the lanes were purged by ``dead``: drop the waiting records it matches and forget
    the ready ones the purge removed (under the lock). Returns who starts now."""
    starts: list[Record] = []
    for record, p in list(c._progress.items()):
        if not dead(record):
            continue
        if p.state in _HELD:
            starts += drop_held(c, record)
        elif p.state == READY:
            forget(c, record)  # purged from the lanes (counted there)
    return starts


# -- dead letters --------------------------------------------------------------------------


def _dead_letter(
    c: KeyedConsumer, record: Record, p: Progress, error: Exception, letters: DeadLetters
) -> list[Record]:
    with c._lock:
        successors = _hold(c, record, p, DELIVERING)
        if successors is not None:
            c._delivering += 1
    if successors is None:
        return c._ended(record, None, dropped=True, started=True)
    c._telemetry.ended(record, error, False)  # telemetry hook: it failed (a dead letter now)
    try:
        letters.send(record, error, p.attempt, functools.partial(_delivered, c, record, error))
    except (BufferError, KafkaException) as exc:
        _undelivered(c, record, error, exc)
    return successors


def _delivered(
    c: KeyedConsumer, record: Record, error: Exception, failure: KafkaError | None, _: Message
) -> None:
    """The broker's delivery report of a dead letter (poll thread, in ``producer.poll``)."""
    if failure is not None:
        _undelivered(c, record, error, failure)
        return
    with c._lock:
        p = c._progress.get(record)
        if p is None or p.state != DELIVERING:
            return  # dropped meanwhile (revoked, stopped): the next owner handles it again
        forget(c, record)
        c._dead_lettered += 1
        c._failed += 1
        c._completed += 1
        st = record._state
        if st.phase != REVOKED:
            st.done.add(record.offset)  # done only now: a crash before this consumes it again
        successors = c._turns(c._lanes.drop(c._key_of(record)))
        if c._engine.waiters:
            c._engine.changed.notify_all()
    c._log.warning("{} failed ({!r}); dead-lettered to {!r}", record, error, c._dead_letter)
    c._after(successors)


def _undelivered(c: KeyedConsumer, record: Record, error: Exception, failure: object) -> None:
    """The dead letter was refused: the consumer stops, the record is not done."""
    topic = c._dead_letter
    stop = DeadLetterFailed(
        f"could not write {record!r} to the dead-letter topic {topic!r}: {failure}; the record "
        "is not committed (the next run consumes it again): check that the topic can be "
        "written (its name, the producer's ACLs and settings in dead_letter_config)"
    )
    stop.__cause__ = error
    c._log.error("{}", stop)
    c._fail(stop)  # drops the record (it waits for its delivery): its offset stays open


def stalled(c: KeyedConsumer, record: Record) -> None:
    """``record`` has been in progress for ``stall_after`` seconds (timer thread): once."""
    with c._lock:
        p = c._progress.get(record)
        if p is None or p.stalled:
            return
        p.stalled = True
        elapsed = time.monotonic() - p.first
        attempt = p.attempt
    c._log.warning("{} stalled: in progress for {:.3f} s (attempt {})", record, elapsed, attempt)
    on_stall = c._on_stall
    if on_stall is not None:
        hand_off(lambda: on_stall(record, elapsed), "on_stall")


class DeadLetters:
    """The dead-letter topic's producer and what a dead letter carries (private).

    A dead letter is the record's key, value and headers, plus (after Spring Kafka's
    ``DeadLetterPublishingRecoverer``) where it came from and why it failed, as UTF-8 text:
    ``rxcoord.error`` (``module.Type: message``, as a traceback's last line names it),
    ``rxcoord.attempts``, ``rxcoord.topic``, ``rxcoord.partition``, ``rxcoord.offset``,
    ``rxcoord.group`` and, when the record has one, ``rxcoord.timestamp`` (milliseconds since
    the epoch).
    """

    def __init__(self, topic: str, group: str, config: Mapping[str, Any]) -> None:
        """Raises: ValueError: confluent-kafka refused the producer's configuration."""
        self.topic = topic
        self.group = group.encode()
        try:
            self.producer = Producer(dict(config))
        except KafkaException as exc:
            raise ValueError(
                f"confluent-kafka refused the dead-letter producer's configuration: "
                f"{exc.args[0]} (fix it in dead_letter_config)"
            ) from exc

    def send(
        self,
        record: Record,
        error: BaseException,
        attempts: int,
        on_delivery: Callable[[KafkaError | None, Message], None],
    ) -> None:
        """Produce ``record``'s dead letter (any thread); ``on_delivery`` gets the broker's
        report on the thread that calls :meth:`poll` or :meth:`flush` (the poll thread).

        Raises:
            BufferError: the producer's local queue is full.
            KafkaException: the producer refused the message.
        """
        kind = type(error)
        name = kind.__qualname__
        if kind.__module__ != "builtins":  # as a traceback names it
            name = f"{kind.__module__}.{name}"
        headers: list[tuple[str, str | bytes | None]] = list(record.headers)
        headers += [
            ("rxcoord.error", f"{name}: {error}".encode()),
            ("rxcoord.attempts", str(attempts).encode()),
            ("rxcoord.topic", record.topic.encode()),
            ("rxcoord.partition", str(record.partition).encode()),
            ("rxcoord.offset", str(record.offset).encode()),
            ("rxcoord.group", self.group),
        ]
        timestamp = record.timestamp
        if timestamp is not None:
            headers.append(("rxcoord.timestamp", str(timestamp).encode()))
        self.producer.produce(
            self.topic,
            key=record.key,
            value=record.value,
            headers=headers,
            on_delivery=on_delivery,
        )
        # Reports are served by the poll thread only (poll()): a delivered record's key moves
        # on there, and only the poll thread may take a slot without giving one back.

    def poll(self) -> None:
        """Serve delivery reports (poll thread)."""
        self.producer.poll(0)

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for outstanding deliveries; how many are left."""
        return self.producer.flush(max(0.0, timeout))


# librdkafka's connection settings (shared by consumers and producers) that a dead-letter
# producer takes over from the consumer's configuration; the rest (group.id, offsets, fetch
# sizes) are the consumer's alone and would be warned about by a producer.
_SHARED: Final = (
    "bootstrap.servers",
    "client.id",
    "client.dns.lookup",
    "security.protocol",
    "sasl.",
    "ssl.",
    "ssl_",
    "enable.ssl.",
    "socket.",
    "broker.",
    "api.version",
    "metadata.",
    "topic.metadata.",
    "reconnect.",
    "retry.backoff",
    "connections.max.idle.ms",
    "log_level",
    "logger",
    "debug",
    "error_cb",
    "oauth_cb",
    "oauthbearer",
)


def producer_config(consumer: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The dead-letter producer's settings: the consumer's connection settings, then
    ``extra`` (``dead_letter_config``) over them."""
    conf = {k: v for k, v in consumer.items() if k.startswith(_SHARED)}
    conf.update(extra)
    # librdkafka's log through loguru, as the consumer's (see _engine.make_consumer).
    conf.setdefault("logger", _logs.librdkafka_logger())
    return conf
