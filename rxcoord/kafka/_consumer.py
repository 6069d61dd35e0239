"""``KeyedConsumer``: per-key order, key-level parallelism and ordered commits over Kafka.

The path of a record: the engine's poll thread fetches a batch (``consume(num_messages=...)``);
the keyed dispatcher below gives each record its ordering key and either runs it at once or
queues it behind the running record of its key (a *lane*), or, when ``max_concurrency`` records
already run, in a FIFO of ready records; when a record ends, the next of its lane (or the oldest
ready record) takes its slot; its offset is reported to its partition state, whose completed
prefix the engine commits. This is ``serialize_by_key``'s contract (one lane per key that exists
only while the key has work, FIFO over the cap), on the same lane table
(``rxcoord._core.lanes``) but without an Observable per record, because that costs more per
record than the whole budget of a trivial handler (see
``benchmarks/bench_kafka.py``); :func:`rxcoord.kafka.kafka_records` and
:func:`rxcoord.kafka.commit_records` are the composable Rx form of the same path.

Why lanes are per consumer, not per partition assignment: a partition revoked while one of its
records still runs and then assigned back to this consumer is fetched again from its last commit;
the re-fetched record of that key queues behind the still-running one in the same lane instead
of running beside it (Confluent parallel-consumer #843).

The start gate. A record that holds a slot may still wait before its handler is called: for a
worker thread, in a scheduler's queue, for its key's lease. Right before the call, under the
lock, it is admitted only while its partition is still ``ACTIVE`` (and the consumer is not
stopping without a drain), and then counted as *started*; a revoke waits (``revoke_timeout``)
for started records only. So no record of a revoked partition starts, also one that got its
key's lease only after the partition had moved on, and a revoke is never held up by records
that had not started.

Across processes. Past ``revoke_timeout`` the partition belongs to its new owner while a record
of it may still run here. Nothing in Kafka waits for it (a member that does not answer within
the rebalance timeout, ``max.poll.interval.ms``, is expelled and its partitions reassigned all
the same), and a running Python thread cannot be stopped, so within the consumer the promise is:
no two runs of a key overlap while records finish within ``revoke_timeout``. Past it, exclusion
comes from a lease per key, ``scheduler=TenantTaskCoordinator(leases=provider)``: a run holds
its key's lease (kept alive) until it ends, the new owner's run of that key waits for it, then
passes the gate. That holds while each holder keeps its lease alive; a holder that cannot renew
it within ``lease_at_most_for`` (store unreachable, process frozen) loses it and its record ends
with ``LeaseLost`` (through ``on_error``), and a killed holder's key is free again after
``lease_at_most_for``.

Where sync handlers run. A thread hand-off costs tens of microseconds, more than a trivial
handler itself, so by default (``inline=None``) a sync handler whose measured average duration
is under ``_INLINE_BELOW`` runs on the poll thread itself when its key has nothing queued or
running and a slot is free; slower ones run on worker threads. One call in eight is timed
(the first call always), workers time every call, and the average decides per batch.

A fast average does not stop one call from blocking, which would stall every key, not just its
own. So while inline calls are possible a *watchdog* thread looks at the running inline call
every ``_STALL`` seconds; a call it sees twice has run for at least that long, and it takes the
poll role away from it: under the consumer's lock it claims the record (an atomic ``list.pop``
from a one-element slot, against which the poll thread's own ``pop`` after the call races),
counts it as a running record in its key's lane (later records of the key queue behind it, the
partition's commit point waits for it, a revoke waits for it like for a worker's record), and
starts a new poll thread that dispatches the rest of the batch and goes on polling. The old
thread finishes the record like a worker and leaves the poll loop (``_Handover``); ``run()``'s
thread then waits for the run to end. A blocked call therefore holds back the other keys for
about ``2 * _STALL`` seconds, once, and the average it leaves sends the handler to the workers
until they measure it fast again. Only one thread at a time is the poll thread: the claim, done
under the lock while the old thread is still inside the handler, is the hand-off point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import re
import signal
import threading
import time
import types
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from typing import Any, Final, Literal, NoReturn, cast

from confluent_kafka import Message
from reactivex import Observer, from_future

from rxcoord import TenantScheduler, TenantTaskCoordinator, TooManyTasks
from rxcoord._core.checks import check_count, check_interval
from rxcoord._core.jobs import JobRun, is_work
from rxcoord._core.lanes import LaneTable
from rxcoord._core.retry import Retry
from rxcoord._core.workers import WorkerPool

from . import _attempts
from ._attempts import DeadLetters, Progress, producer_config
from ._engine import Engine
from ._errors import ConsumerClosed
from ._offsets import Dropped, PostgresOffsets, Stopped
from ._partitions import ACTIVE, REVOKED, PartitionState, lag
from ._record import Record
from ._stats import ConsumerState, ConsumerStats, PartitionStats
from ._telemetry import ConsumerTelemetry

__all__ = ["KeyedConsumer", "OnError"]

OnError = Literal["stop", "skip"] | Callable[[Record, Exception], object]

_INLINE_BELOW: Final = 50e-6  # seconds: sync handlers faster than this on average run inline
_EWMA: Final = 0.05
_CLAMP: Final = 4 * _INLINE_BELOW  # a timed call counts at most this long in the average
_STALL: Final = 0.01  # seconds between the watchdog's looks at the running inline call
_REOFFER_AFTER: Final = 0.05  # seconds before a record refused with TooManyTasks is offered again
_NOT_RUN: Final = object()  # a job of a revoked partition (or a stopped consumer) that never ran
_LEAVE_GRACE: Final = 1.0  # seconds the final commit and the group leave get past the drain
_POLL_WAIT: Final = 0.05  # seconds a poll waits for records (bounds close and commit latency)
_TICK: Final = 0.002  # ... once a retry wait ended, and while dead letters are being delivered


class _Handover(Exception):
    """Leaves the poll loop on the thread whose inline call the watchdog took over (private)."""


class _RecordWork(JobRun):
    """What a handler returned that is work, run to its real end by the one job-shape runner
    (``rxcoord._core.jobs``): the record ends once, when the work has ended. An Observable's
    items are ignored; a coroutine runs on the consumer's loop (``run_async``'s, or its own)."""

    __slots__ = ("_consumer", "_once", "_record")

    def __init__(self, consumer: KeyedConsumer, record: Record) -> None:
        super().__init__(_IGNORE, consumer._loop)
        self._consumer = consumer
        self._record = record
        self._once = threading.Lock()

    def _start_coroutine(self, coroutine: Coroutine[Any, Any, Any]) -> bool:
        self.loop = self._consumer._ensure_loop()  # started only when a handler needs it
        return super()._start_coroutine(coroutine)

    def _release(self) -> bool:
        return self._once.acquire(blocking=False)  # one end per record, whatever the work does

    def _finish_value(self, value: Any) -> None:
        if self._release():
            self._consumer._ended_later(self._record, None)

    def _completed(self) -> None:
        if self._release():
            self._consumer._ended_later(self._record, None)

    def _terminate(self, error: Exception) -> None:
        if self._release():
            self._consumer._ended_later(self._record, error)


_IGNORE: Final[Observer[Any]] = Observer(lambda _: None)  # an Observable handler's items


class _Inside(threading.local):
    consumer: object = None


_inside = _Inside()  # which consumer's poll, worker or loop thread this is (close() must not wait)


class KeyedConsumer:
    """Consume Kafka topics with per-key order, key-level parallelism and ordered commits.

    Records of one ordering key are handled one at a time in offset order (a record's handler
    starts only after the previous record of its key ended); records of different keys run
    concurrently up to ``max_concurrency``, also within one partition. Each partition's offset
    is committed only up to the contiguous prefix of completed records (periodically, on revoke
    and on close), so after a crash processing resumes at the first record that had not
    completed: at-least-once, duplicates only past the last commit.

    Beyond ``max_in_flight`` fetched-but-uncommitted records the partitions holding most of them
    are paused while polling continues, so the consumer stays in its group. On revoke no record
    of a revoked partition starts (also none that was still waiting in a scheduler or for its
    key's lease), running ones get ``revoke_timeout`` seconds, the completed prefix is
    committed, and later results of that assignment are dropped. A record still running past
    ``revoke_timeout`` may overlap the new owner's run of it in another process, unless the
    records run under per-key leases (``scheduler=TenantTaskCoordinator(leases=...)``).

    ``handle(record)`` may be a plain function (runs on the poll thread while it is measured
    very fast, else on a worker thread; see ``inline``), an ``async def`` (runs on the loop of
    :meth:`run_async`, or on a loop thread the consumer owns under :meth:`run`), or return an
    Observable (the record ends when it terminates) or a future.

    With ``offsets=PostgresOffsets(...)`` the consumer is exactly-once into PostgreSQL: the
    handler takes ``(record, tx)`` and its effects commit in one transaction with the record's
    position, fenced per assignment (see :class:`PostgresOffsets`).

    Handlers run in the context of the call to :meth:`run` (or of the task awaiting
    :meth:`run_async`): its ``contextvars`` and ``logger.contextualize`` values, and with an
    OpenTelemetry SDK configured the record's ``<topic> process`` span (parent: the
    ``traceparent`` in the record's headers), on every thread a handler runs on. Metrics:
    ``rxcoord.kafka.*`` (see the observability guide).

    Args:
        config: confluent-kafka configuration, passed through; ``bootstrap.servers`` and
            ``group.id`` are required, ``enable.auto.commit`` must not be true (the consumer
            commits itself). An ``on_commit`` callback is called after the consumer's own.
        topics: Topic names (or ``^regex`` patterns) to subscribe to.
        handle: Called with each :class:`Record` (with ``offsets=``: with the record and
            ``tx``, the connection of its transaction).
        key: ``key(record)`` returns the ordering key; default: the record's key, and records
            without a key are each their own key.
        max_concurrency: Most handlers running at once.
        max_in_flight: Records fetched but not yet committed beyond which partitions pause.
        scheduler: A :class:`TenantTaskCoordinator` or :class:`TenantScheduler` that runs the
            handlers (its limits, fairness, leases, fleet); ``None``: the consumer's own threads.
        tenant: With a ``TenantScheduler``: ``tenant(record)`` returns the record's tenant.
        on_error: ``"stop"``: commit the safe prefix and make ``run()`` raise the handler's
            exception; ``"skip"``: log and treat the record as done; a callable
            ``on_error(record, exception)``: when it returns, the record is done (when it
            raises, the consumer stops with that exception).
        commit_interval: Seconds between periodic commits.
        revoke_timeout: Seconds a revoke waits for running records of the revoked partitions.
            Past it the partition goes to its new owner while the record may still run here:
            per-key exclusion across processes past this deadline needs
            ``scheduler=TenantTaskCoordinator(leases=...)`` (a lease per key).
        drain_timeout: Seconds ``close(drain=True)`` and signals wait for fetched records;
            the final commit and the group leave then get what is left of it (at least a
            second), so ``run()`` returns within about ``drain_timeout`` + 1 s of the stop,
            also when the broker stopped answering.
        startup_timeout: Seconds ``run()`` waits for the cluster's metadata before failing.
        batch_size: Most records fetched per ``consume()`` call.
        inline: Where sync handlers run when their key has nothing queued or running and a
            slot is free. ``None`` (default): on the poll thread while their measured average
            duration is under 50 µs (a thread hand-off costs more than such a handler, see
            ``benchmarks/bench_kafka.py``), else on worker threads. ``True``: on the poll
            thread whatever they measure (CPU-bound handlers, which threads cannot speed up
            under the GIL). ``False``: always on worker threads. With ``None`` and ``True`` an
            inline call that runs longer than about 10 ms is taken over: the poll loop moves
            to a new thread and the call finishes as a worker's, so one blocking call holds
            the other keys back for about 20 ms, not for its whole duration
            (``stats().handovers`` counts them). With ``offsets=``, ``None`` means ``False``:
            a database transaction always costs more than a thread hand-off.
        offsets: A :class:`PostgresOffsets`: exactly once into PostgreSQL (see above); the
            store serves this consumer only.
        retry: A :class:`rxcoord.Retry`: a record whose handler raised a retried exception
            waits (``backoff``, ...) and runs again, keeping its key (later records of the key
            wait behind it, its partition's commit stays below it) but no slot and no thread.
            After its last attempt ``dead_letter`` (else ``on_error``) decides. A revoke or a
            stop drops a waiting record (not committed: it is processed again); a drain lets
            it finish its attempts. ``None``: no retries. Not with ``offsets=``.
        dead_letter: What happens to a record that failed its last attempt, instead of
            ``on_error``: a topic name (the record is produced there with its key, value and
            headers plus ``rxcoord.error``, ``rxcoord.attempts``, ``rxcoord.topic``,
            ``rxcoord.partition``, ``rxcoord.offset``, ``rxcoord.group`` and
            ``rxcoord.timestamp`` headers, and is done once the broker acknowledged it; a
            refused delivery stops the consumer with :class:`DeadLetterFailed`, the record
            not committed), or a callable ``dead_letter(record, exception)`` (done when it
            returns; when it raises, the consumer stops with that exception). A topic needs
            no ``offsets=``.
        dead_letter_config: confluent-kafka producer settings for the dead-letter topic, over
            the connection settings taken from ``config`` (``bootstrap.servers``,
            ``security.protocol``, ``sasl.*``, ``ssl.*``, ...); e.g.
            ``{"message.timeout.ms": 30000}``.
        stall_after: Seconds after which a record still in progress (attempts and retry waits
            together) counts as stalled: logged, passed to ``on_stall`` once, and counted in
            ``stats().stalled_keys``. ``None``: not watched.
        on_stall: ``on_stall(record, elapsed)``, called once per stalled record on a worker
            thread of rxcoord's (keep it short). Needs ``stall_after``.
        trace_record_keys: Put each record's key on its span (``messaging.kafka.message.key``,
            decoded as UTF-8). Off by default: keys may be personal data.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or the configuration lacks ``group.id`` or
            ``bootstrap.servers``, enables auto-commit, or is refused by confluent-kafka; or
            ``offsets`` serves another consumer already.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        handle: Callable[[Record], Any] | Callable[[Record, Any], Any],
        *,
        key: Callable[[Record], Hashable] | None = None,
        max_concurrency: int = 64,
        max_in_flight: int = 10_000,
        scheduler: TenantTaskCoordinator | TenantScheduler | None = None,
        tenant: Callable[[Record], Hashable] | None = None,
        on_error: OnError = "stop",
        commit_interval: float = 1.0,
        revoke_timeout: float = 10.0,
        drain_timeout: float = 30.0,
        startup_timeout: float = 10.0,
        batch_size: int = 500,
        inline: bool | None = None,
        offsets: PostgresOffsets | None = None,
        retry: Retry | None = None,
        dead_letter: str | Callable[[Record, Exception], object] | None = None,
        dead_letter_config: Mapping[str, Any] | None = None,
        stall_after: float | None = None,
        on_stall: Callable[[Record, float], object] | None = None,
        trace_record_keys: bool = False,
    ) -> None:
        config = _check_config(config)
        topics = _check_topics(topics)
        if not callable(handle):
            raise TypeError(f"handle must be callable (handle(record)), not {handle!r}")
        if key is not None and not callable(key):
            raise TypeError(f"key must be a callable key(record) -> hashable or None, not {key!r}")
        self._max_concurrency = check_count(max_concurrency, "max_concurrency", 1)
        check_count(max_in_flight, "max_in_flight", 1)
        check_count(batch_size, "batch_size", 1)
        if scheduler is not None and not isinstance(
            scheduler, TenantTaskCoordinator | TenantScheduler
        ):
            raise TypeError(
                "scheduler must be a TenantTaskCoordinator, a TenantScheduler or None, "
                f"not {scheduler!r}"
            )
        if isinstance(scheduler, TenantScheduler):
            if tenant is None:
                raise ValueError(
                    "a TenantScheduler needs tenant=: pass tenant=lambda record: ... "
                    "returning the record's tenant"
                )
            if not callable(tenant):
                raise TypeError(f"tenant must be a callable tenant(record), not {tenant!r}")
        elif tenant is not None:
            raise ValueError("tenant= needs scheduler=TenantScheduler(...); remove tenant=")
        if not (on_error in ("stop", "skip") or callable(on_error)):
            raise ValueError(
                'on_error must be "stop", "skip" or a callable(record, exception), '
                f"not {on_error!r}"
            )
        if inline is not None and not isinstance(inline, bool):
            raise TypeError(f"inline must be True, False or None, not {inline!r}")
        if offsets is not None and not isinstance(offsets, PostgresOffsets):
            raise TypeError(f"offsets must be a PostgresOffsets or None, not {offsets!r}")
        _check_failures(retry, dead_letter, dead_letter_config, stall_after, on_stall, offsets)
        self._handle = cast("Callable[[Record], Any]", handle)
        self._key = key
        self._scheduler = scheduler
        self._tenant = tenant
        self._on_error = on_error
        self._drain_timeout = check_interval(drain_timeout, "drain_timeout")
        self._is_async = inspect.iscoroutinefunction(handle)
        self._inline_mode = inline
        # With one topic (not a pattern) every message is of it: dispatch never asks.
        self._single_topic = topics[0] if len(topics) == 1 and topics[0][:1] != "^" else None
        # Only sync handlers run by the consumer itself can run on the poll thread.
        self._can_inline = inline is not False and not self._is_async and scheduler is None
        if offsets is not None and inline is None:
            self._can_inline = False  # a transaction always costs more than a hand-off
        # The measured average duration of a sync handler call (seconds), each sample clamped
        # to _CLAMP: one call preempted for a GIL switch interval (5 ms) must not send a fast
        # handler to the workers, so it takes about six slow samples in a row to cross
        # _INLINE_BELOW. It starts at zero: the first call runs inline and is timed, and so is
        # each call after a slow sample; a blocking call is the watchdog's.
        self._ewma = 0.0
        self._countdown = 1  # inline calls until the next timed one
        self._engine = Engine(
            config,
            topics,
            max_in_flight=max_in_flight,
            commit_interval=check_interval(commit_interval, "commit_interval"),
            revoke_timeout=check_interval(revoke_timeout, "revoke_timeout"),
            startup_timeout=check_interval(startup_timeout, "startup_timeout"),
            batch_size=batch_size,
            name=str(config["group.id"]),
            offsets=offsets,
        )
        self._offsets = offsets
        if offsets is not None:
            # The hook where a record starts: the store runs the handler inside the record's
            # transaction (and applies on_error there, see _ended).
            try:
                self._handle = offsets.bind(
                    handle,
                    group=str(config["group.id"]),
                    max_concurrency=self._max_concurrency,
                    on_error=self._apply_on_error,
                )
            except BaseException:
                self._engine.consumer.close()
                raise
        # After a failure: retries, dead letters, the stall watch (see _attempts.py).
        self._retry_policy = retry
        self._dead_letter = dead_letter
        self._dead_letters: DeadLetters | None = None
        if isinstance(dead_letter, str):
            try:
                self._dead_letters = DeadLetters(
                    dead_letter,
                    str(config["group.id"]),
                    producer_config(config, dead_letter_config or {}),
                )
            except BaseException:
                self._engine.consumer.close()
                raise
        self._stall_after = None if stall_after is None else float(stall_after)
        self._on_stall = on_stall
        # Records in progress get a clock (and a stall watch) when they start on a worker, a
        # loop or a scheduler; the inline path stays untouched (its records end within ~20 ms
        # or are taken over, and are tracked from then on).
        self._tracking = retry is not None or stall_after is not None
        self._progress: dict[Record, Progress] = {}  # records tracked beyond the plain path
        self._due: list[Record] = []  # records whose retry wait ended: the poll thread resumes
        self._retries = 0
        self._retrying = 0  # records waiting for their next attempt
        self._wait_ends: list[float] = []  # a heap: when their waits end (time.monotonic())
        self._delivering = 0  # records waiting for their dead letter's delivery report
        self._dead_lettered = 0
        self._engine.processor = self
        # telemetry hook: the records' context, spans and counts (see _telemetry.py)
        self._telemetry = ConsumerTelemetry(self._engine.telemetry, record_keys=trace_record_keys)
        self._lock = self._engine.lock
        self._log = self._engine.log
        self._state = ConsumerState.NEW
        # Records by ordering key: one at a time per key in offset order, at most
        # max_concurrency holding a slot (``active``), the others ready in FIFO order; written
        # under self._lock, read without it only by the poll thread's inline check.
        self._lanes: LaneTable[Hashable, Record] = LaneTable(self._max_concurrency)
        self._to_offer: list[Record] = []  # refused by the scheduler (TooManyTasks): offer again
        self._offer_at = 0.0
        self._queued = 0  # records in the lanes that have not taken a slot yet
        self._completed = 0
        self._inline_completed = 0  # records that ran and ended on the poll thread
        self._handovers = 0  # inline calls the watchdog took over
        # The running inline call's record, claimed by one pop. One list per poll thread: a
        # hand-over gives the new poll thread a new one, so the old thread's pop after its
        # call can only fail, never take the new thread's record.
        self._slot: list[Record] = []
        self._batch: list[Message] = []  # the batch being dispatched (the watchdog resumes it)
        self._error: BaseException | None = None  # what ended the poll loop, if not a stop
        self._failed = 0
        self._dropped = 0
        self._accepting = True  # new records may start (false once stopping without drain)
        self._stop = self._engine.interrupt  # set to end the run (a waiting claim gives up)
        self._drain_deadline: float | None = None
        self._drain = True
        self._failure: BaseException | None = None
        self._done = threading.Event()  # run() has finished
        self._pool: WorkerPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where async handlers run
        self._own_loop: threading.Thread | None = None

    # -- public API ------------------------------------------------------------------------

    @property
    def state(self) -> ConsumerState:
        """The lifecycle state."""
        return self._state

    def run(self) -> None:
        """Consume, process and commit until :meth:`close`, SIGTERM/SIGINT or a stop on error.

        Blocks. On the main thread, SIGTERM and SIGINT start a drain (a second signal stops
        without draining); the previous handlers are restored on return. Then drains, commits
        and leaves the group.

        Raises:
            ConsumerClosed: the consumer already ran or was closed.
            BrokerUnavailable: no broker answered within ``startup_timeout``.
            UnknownTopic: a subscribed topic does not exist.
            Exception: with ``on_error="stop"``, the handler's exception that stopped it.
        """
        self._begin()
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            self._run_blocking(None)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    async def run_async(self) -> None:
        """Like :meth:`run` for asyncio services: ``async def`` handlers run on this loop.

        The poll loop runs on a thread of its own; cancelling this coroutine drains and closes
        the consumer (then re-raises the cancellation). Installs no signal handlers.

        Raises:
            ConsumerClosed: the consumer already ran or was closed.
            BrokerUnavailable: no broker answered within ``startup_timeout``.
            UnknownTopic: a subscribed topic does not exist.
            Exception: with ``on_error="stop"``, the handler's exception that stopped it.
        """
        self._begin()
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def target() -> None:
            try:
                self._run_blocking(loop)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, finished, exc)
            else:
                loop.call_soon_threadsafe(_settle, finished, None)

        threading.Thread(target=target, name="rxcoord-kafka-poll", daemon=True).start()
        try:
            await asyncio.shield(finished)
        except asyncio.CancelledError:
            self._request_close(drain=True)
            await finished
            raise

    def close(self, drain: bool = True) -> None:
        """Stop consuming; with ``drain``, finish fetched records first (``drain_timeout``).

        Then commits the completed prefix and leaves the group. From another thread this blocks
        until :meth:`run` returned; from a handler (or the poll thread) it only asks. Idempotent;
        on a consumer that never ran it closes the Kafka client.
        """
        if not isinstance(drain, bool):
            raise TypeError(f"drain must be a bool, not {drain!r}")
        with self._lock:
            if self._state is ConsumerState.NEW:
                self._state = ConsumerState.CLOSED
                never_ran = True
            else:
                never_ran = False
        if never_ran:
            self._engine.consumer.close()
            self._done.set()
            return
        self._request_close(drain)
        if _inside.consumer is self:
            return  # a poll, worker or loop thread of ours: the run waits for it, not it for us
        if self._loop is not None and _on_loop(self._loop):
            return  # an async handler on our loop: waiting would block the records it awaits
        self._done.wait()

    async def aclose(self, drain: bool = True) -> None:
        """:meth:`close` for asyncio code: waits without blocking the loop."""
        await asyncio.to_thread(self.close, drain)

    def stats(self) -> ConsumerStats:
        """A snapshot: counters, backlog, and per partition position, commit point and lag."""
        engine = self._engine
        with self._lock:
            states = list(engine.states.values())
            now = time.monotonic()
            oldest: dict[PartitionState, float] = {}
            stalled = 0
            for record, progress in self._progress.items():
                age = now - progress.first
                if age > oldest.get(record._state, -1.0):
                    oldest[record._state] = age
                stalled += progress.stalled
            longest = max(0, self._lanes.longest() - 1)  # behind the key's head
            parts = []
            in_flight = 0
            for s in states:
                in_flight += len(s.order)
                parts.append(
                    (s, s.position, s.committable, s.committed, len(s.order), s.paused, s.epoch)
                )
            snapshot = (
                engine.fetched,
                self._completed + self._inline_completed,
                self._failed,
                self._dropped,
                self._lanes.active,
                self._queued + len(self._to_offer),
                longest,
                len(self._lanes),
                engine.rebalances,
                engine.commits,
                self._inline_completed,
                self._handovers,
                self._retries,
                self._retrying,
                self._dead_lettered,
                stalled,
            )
        partitions = []
        for s, position, committable, committed, held, paused, epoch in parts:
            partitions.append(
                PartitionStats(
                    topic=s.topic,
                    partition=s.partition,
                    epoch=epoch,
                    position=position if position >= 0 else None,
                    committable=committable if committable >= 0 else None,
                    committed=committed if committed >= 0 else None,
                    in_flight=held,
                    lag=lag(s.high, committed if committed >= 0 else committable),
                    paused=paused,
                    oldest_in_progress=oldest.get(s),
                )
            )
        (fetched, completed, failed, dropped, running, queued, longest, keys, reb, commits,
         inline, handovers, retries, retrying, dead_lettered, stalled) = snapshot  # fmt: skip
        return ConsumerStats(
            state=self._state,
            fetched=fetched,
            completed=completed,
            failed=failed,
            dropped=dropped,
            running=running,
            queued=queued,
            in_flight=in_flight,
            longest_key_queue=longest,
            active_keys=keys,
            paused_partitions=sum(1 for p in partitions if p.paused),
            rebalances=reb,
            commits=commits,
            inline=inline,
            handovers=handovers,
            retries=retries,
            retrying=retrying,
            dead_lettered=dead_lettered,
            stalled_keys=stalled,
            partitions=tuple(partitions),
        )

    def __repr__(self) -> str:
        return f"KeyedConsumer(topics={self._engine.topics!r}, state={self._state.value})"

    # -- lifecycle -------------------------------------------------------------------------

    def _begin(self) -> None:
        with self._lock:
            if self._state is not ConsumerState.NEW:
                raise ConsumerClosed(
                    f"this KeyedConsumer is {self._state.value}: a consumer runs once, "
                    "create a new one"
                )
            self._state = ConsumerState.RUNNING
        self._telemetry.begin()  # telemetry hook: the caller's context is the handlers'

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        # First signal: drain; a second one while draining: stop without waiting for records.
        self._request_close(drain=not self._stop.is_set())

    def _request_close(self, drain: bool) -> None:
        with self._lock:
            if not drain:
                self._drain = False
                self._accepting = False
        self._stop.set()

    def _run_blocking(self, loop: asyncio.AbstractEventLoop | None) -> None:
        engine = self._engine
        self._loop = loop
        try:
            try:
                engine.check_startup()
                engine.subscribe()
            except BaseException as exc:
                self._error = exc
                self._end_run()
            else:
                if self._can_inline:
                    threading.Thread(
                        target=self._watch, name="rxcoord-kafka-watch", daemon=True
                    ).start()
                self._telemetry.thread_context().run(self._poll, None)  # telemetry hook
                # After a hand-over another thread polls and ends the run: wait for it.
                self._done.wait()
        finally:
            _inside.consumer = None
        failure = self._error or self._failure or engine.failure
        if failure is not None:
            raise failure

    def _poll(self, resume: tuple[list[Message], int] | None) -> None:
        """Be the poll thread: poll, dispatch and commit until the run stops, then end it.

        ``resume`` is the batch (and the index in it) a hand-over left to this new poll thread.
        Returns early, leaving the run to the next poll thread, when the watchdog took over an
        inline call of this one.
        """
        _inside.consumer = self
        engine = self._engine
        try:
            if resume is not None:
                self._dispatch(*resume)
                engine.housekeeping()
            while not self._stop.is_set() and engine.failure is None:
                engine.poll_once(True, self._poll_timeout())
                if self._to_offer and time.monotonic() >= self._offer_at:
                    self._offer_again()
                self._serve_attempts()
            self._finish_run()
        except _Handover:
            return
        except BaseException as exc:
            self._error = exc
        self._end_run()

    def _end_run(self) -> None:
        """Commit, leave the group, stop the workers; the run is over (on the poll thread).

        The commit and the leave get what is left of ``drain_timeout`` (at least
        ``_LEAVE_GRACE``), then are abandoned.
        """
        now = time.monotonic()
        drained = self._drain_deadline
        deadline = max(
            now + self._drain_timeout if drained is None else drained, now + _LEAVE_GRACE
        )
        try:
            if self._dead_letters is not None and self._delivering:
                # Reports that arrive now still complete their records for the final commit.
                self._dead_letters.flush(min(deadline - time.monotonic(), _LEAVE_GRACE))
            self._engine.close(deadline)
        except BaseException as exc:
            if self._error is None:
                self._error = exc
        finally:
            if self._offsets is not None:
                self._offsets.close()  # before the loop stops: an async pool closes on it
            self._shutdown_workers()
            with self._lock:
                self._state = ConsumerState.CLOSED
            self._done.set()

    def _finish_run(self) -> None:
        """Drain (bounded) or stop: start nothing new once the deadline passed, then return."""
        engine = self._engine
        with self._lock:
            self._state = ConsumerState.CLOSING
            drain = self._drain and self._failure is None
            if not drain:
                self._accepting = False
                self._drop_queued()
        engine.pause_all()
        deadline = self._drain_deadline = time.monotonic() + self._drain_timeout
        # Keep polling (callbacks, membership) with every partition paused until the fetched
        # records ended or the deadline passed. With a stop, only running records are awaited.
        while time.monotonic() < deadline:
            with self._lock:
                if (self._lanes.active if not self._accepting else self.pending()) == 0:
                    break
            engine.poll_once(False, self._poll_timeout())
            if self._to_offer:
                self._offer_again()
            self._serve_attempts()
            if self._failure is not None and self._accepting:
                with self._lock:
                    self._accepting = False
                    self._drop_queued()
        with self._lock:
            self._accepting = False
            self._drop_queued()
        if self._to_offer:
            self._offer_again()
        with self._lock:
            if self._lanes.active:
                self._log.warning(
                    "{} record(s) still running after the drain; not committed",
                    self._lanes.active,
                )

    def _poll_timeout(self) -> float:
        """How long a poll may wait for records: until the next retry wait ends (the poll
        thread resumes its record then), and only briefly while dead letters are being
        delivered (the poll thread serves their reports)."""
        if self._delivering:
            return _TICK
        if not self._retrying:  # (read without the lock: the next poll sees a new wait)
            return _POLL_WAIT
        due_in = _attempts.until_next_due(self)
        return _POLL_WAIT if due_in is None else min(_POLL_WAIT, max(_TICK, due_in))

    def _serve_attempts(self) -> None:
        """Resume records whose retry wait ended; serve dead-letter delivery reports."""
        if self._due:
            _attempts.resume_due(self)
        if self._delivering and self._dead_letters is not None:
            self._dead_letters.poll()

    def _shutdown_workers(self) -> None:
        if self._pool is not None:
            # Handlers still running past the deadline keep their (daemon) threads; don't wait
            # for them. Records handed over but not started yet are dropped by the start gate.
            self._pool.shutdown(wait=False)
        if self._own_loop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._own_loop.join(5)

    # -- Processor protocol (called by the engine) ------------------------------------------

    def dispatch(self, messages: list[Message]) -> None:
        self._engine.fetched += len(messages)
        self._batch = messages  # where the watchdog finds the rest of it after a hand-over
        self._dispatch(messages, 0)

    def _dispatch(self, messages: list[Message], begin: int) -> None:
        """Run or queue ``messages[begin:]`` (poll thread).

        Raises:
            _Handover: the watchdog took over an inline call of this thread; another thread
                dispatches the rest of the batch.
        """
        # The hot path: a few attribute reads per record, nothing allocated but the Record, no
        # lock for a record that runs inline; per-partition counters are written once per run
        # of records of one partition (a batch holds long runs of each).
        states = self._engine.states
        keyfn = self._key
        lanes = self._lanes
        busy = lanes.keys()  # a live view: the inline check reads it without the lock
        inline = self._can_inline
        auto = self._inline_mode is None
        if inline and auto and self._ewma > _INLINE_BELOW:
            inline = False  # measured slow: workers (their measurements may bring it back)
        telemetry = self._telemetry  # telemetry hook: two flags per batch, a branch per record
        handle = telemetry.inline(self._handle)
        watched = telemetry.on()
        cap = self._max_concurrency
        perf = time.perf_counter
        put = self._slot.append
        take = self._slot.pop
        last_topic: str | None = None
        last_partition = -1
        st: PartitionState | None = None
        # One inline call in eight is timed (the first one, and the one after a slow sample,
        # always): enough to notice a handler turning slow within a batch, at an eighth of the
        # clock's cost.
        countdown = self._countdown
        seen = 0  # records of ``st`` in this run
        last_offset = -1
        done_inline = 0
        single = self._single_topic
        new = object.__new__
        for msg in itertools.islice(messages, begin, None) if begin else messages:
            if msg.error() is not None:
                self._engine.message_error(msg.error())  # type: ignore[arg-type]
                continue
            partition: int = msg.partition()  # type: ignore[assignment]
            # msg.topic() decodes the name on each call: with one topic it is not asked.
            if partition != last_partition or (single is None and msg.topic() != last_topic):
                if seen:
                    self._account(st, seen, last_offset, 0)
                topic: str = single or msg.topic()  # type: ignore[assignment]
                st = states.get((topic, partition))
                # A phase changes only in rebalance callbacks, which run inside consume() on
                # this thread: checked once per run of records of one partition.
                if st is not None and st.phase != ACTIVE:
                    st = None
                last_topic = topic
                last_partition = partition
                seen = 0
            if st is None:
                continue  # fetched just before its partition was revoked: the next owner has it
            offset: int = msg.offset()  # type: ignore[assignment]
            last_offset = offset
            seen += 1
            # Record(msg, offset, key, st) without the cost of a Python __init__ call
            # (bench_kafka's "KeyedConsumer (default), trivial handler" row).
            record = new(Record)
            record._msg = msg
            record.offset = offset
            record.key = key = msg.key()
            record._state = st
            k: Hashable = keyfn(record) if keyfn is not None else key
            if k is None:
                record._lane = None
                k = record  # no key: a key of its own (``_lane`` None: no reference cycle)
            else:
                record._lane = k
            if inline and k not in busy and lanes.active < cap and self._accepting:
                countdown -= 1
                started = perf() if auto and countdown <= 0 else 0.0
                put(record)  # the watchdog may claim it while the handler runs
                try:
                    result = handle(record)
                except Exception as exc:
                    try:
                        take()
                    except IndexError:
                        self._taken(record, None, exc, st, seen, last_offset, done_inline)
                    self._enter(record, k)
                    self._after(self._ended(record, exc))
                    continue
                except BaseException as exc:
                    try:
                        take()
                    except IndexError:
                        self._fail(exc)
                        self._taken(record, None, exc, st, seen, last_offset, done_inline)
                    raise
                try:
                    take()
                except IndexError:
                    self._taken(record, result, None, st, seen, last_offset, done_inline)
                if result is None or not is_work(result):
                    if started:
                        d = min(perf() - started, _CLAMP)
                        ewma = self._ewma = self._ewma + (d - self._ewma) * _EWMA
                        if ewma > _INLINE_BELOW:
                            inline = False
                        countdown = 1 if d > _INLINE_BELOW else 8
                    if st.order:
                        st.order.append(offset)
                        st.done.add(offset)
                    else:
                        st.committable = offset + 1  # nothing earlier outstanding: the prefix
                    done_inline += 1
                    if watched:
                        telemetry.completed(record)  # telemetry hook
                else:
                    self._enter(record, k)
                    self._attach(record, result)
                continue
            with self._lock:
                st.order.append(offset)
                # Behind its key's earlier records, or as a ready head if every slot is taken.
                # (Started while the consumer stops without a drain, the start gate drops it.)
                start = lanes.add(k, record)
                if start:
                    st.running += 1
                else:
                    self._queued += 1
            if start:
                self._start(record)
        self._countdown = countdown
        self._account(st, seen, last_offset, done_inline)

    def _account(
        self, st: PartitionState | None, seen: int, last_offset: int, done_inline: int
    ) -> None:
        """Add a dispatcher's counters (locked: after a hand-over two threads may write)."""
        with self._lock:
            if st is not None and seen:
                st.fetched += seen
                st.position = max(st.position, last_offset + 1)
            self._inline_completed += done_inline

    def _taken(
        self,
        record: Record,
        result: Any,
        error: BaseException | None,
        st: PartitionState | None,
        seen: int,
        last_offset: int,
        done_inline: int,
    ) -> NoReturn:
        """The watchdog took this inline call over: end it as a worker would, leave the loop.

        The watchdog counted the record as running in its lane (under the lock, before the
        call returned), so ending it here is what a worker does with its record.
        """
        self._account(st, seen, last_offset, done_inline)
        if error is not None:
            if isinstance(error, Exception):
                self._after(self._ended(record, error))
            else:  # SystemExit and the like: the consumer stops with it (see _fail)
                self._after(self._ended(record, None, dropped=True))
        elif result is None or not is_work(result):
            self._after(self._ended(record, None))
        else:
            self._attach(record, result)
        raise _Handover

    def outstanding(self, states: Sequence[PartitionState]) -> int:
        # Handlers that started and have not ended. Records holding a slot but not started yet
        # (about to start on a worker, queued in a scheduler, waiting for a key's lease) never
        # start once their partition is revoking: the start gate drops them.
        return sum(s.started for s in states)

    def pending(self) -> int:
        # Records offered again hold slots; records between attempts or waiting for their
        # dead letter's delivery hold none but are not done: a drain waits for them too.
        return self._lanes.active + self._queued + self._retrying + self._delivering

    def revoking(self, states: Sequence[PartitionState]) -> None:
        # Their records that have not started leave the lanes now (each lane keeps its order);
        # those already holding a slot are stopped by the start gate. Records to be offered
        # again to a scheduler hold a slot: they give it back now.
        with self._lock:
            purged = self._lanes.purge(_revoked)
            self._queued -= purged
            self._dropped += purged
            # Records of these partitions between attempts (or waiting for a delivery report)
            # are dropped, their timers cancelled: the next owner processes them again.
            starts = _attempts.drop_if(self, _revoked) if self._progress else []
        self._after(starts)
        if self._to_offer:
            with self._lock:
                gone = [r for r in self._to_offer if r._state.phase != ACTIVE]
                self._to_offer = [r for r in self._to_offer if r._state.phase == ACTIVE]
            for record in gone:
                self._after(self._ended(record, None, dropped=True))

    def stopping(self, drain: bool) -> None:
        self._request_close(drain)

    # -- the watchdog of inline calls ------------------------------------------------------

    def _watch(self) -> None:
        """Take over an inline call seen running at two looks ``_STALL`` apart (own thread)."""
        seen: Record | None = None
        while not self._done.wait(_STALL):
            try:
                current = self._slot[-1]
            except IndexError:
                seen = None
                continue
            if current is seen:
                self._take_over()
                seen = None
            else:
                seen = current

    def _take_over(self) -> None:
        with self._lock:
            try:
                record = self._slot.pop()  # the poll thread's own pop now fails: it lost
            except IndexError:
                return  # the call returned meanwhile
            # The poll thread is inside the handler: its partition state is ours to touch.
            self._enter_locked(record, self._key_of(record))
            self._handovers += 1
            # The average now says "slow": the next batches go to the workers until they
            # measure the handler fast again.
            self._ewma = max(self._ewma, 2 * _STALL)
            batch = self._batch
            self._slot = []  # the new poll thread's (the old one keeps popping the old list)
        index = next(i for i, msg in enumerate(batch) if msg is record._msg)
        self._log.warning(
            "the handler of {} ran inline for over {:.0f} ms: the poll loop moves to a new "
            "thread and the call finishes as a worker's (pass inline=False if it often blocks)",
            record,
            _STALL * 1000,
        )
        threading.Thread(
            target=self._telemetry.thread_context().run,  # telemetry hook: the consumer's context
            args=(self._poll, (batch, index + 1)),
            name="rxcoord-kafka-poll",
            daemon=True,
        ).start()

    # -- running records -------------------------------------------------------------------

    def _enter(self, record: Record, k: Hashable) -> None:
        """Count an inline-started record as running in its (new) lane (it has started)."""
        with self._lock:
            self._enter_locked(record, k)

    def _enter_locked(self, record: Record, k: Hashable) -> None:
        st = record._state
        st.order.append(record.offset)
        # Its key was idle and a slot free when the poll thread called the handler, and only
        # the poll thread takes slots without giving one back (a finish passes its slot on):
        # so it takes a slot now, as the head of its lane.
        started = self._lanes.add(k, record)
        assert started, "an inline record found no free slot"
        st.running += 1
        st.started += 1
        if self._tracking:
            _attempts.track(self, record, time.monotonic())

    def _admit(self, record: Record) -> bool:
        """The start gate, right before a handler is called (any thread): False if the record
        must not start (its partition is being revoked, or the consumer stops without a drain);
        True after counting it as started, which a revoke then waits for."""
        st = record._state
        with self._lock:
            if st.phase != ACTIVE or not self._accepting:
                return False
            st.started += 1
            if self._tracking:
                _attempts.track(self, record, time.monotonic())
            return True

    def _start(self, record: Record) -> None:
        """Run a record that holds a slot (an active head of the lanes), outside the lock."""
        # telemetry hook: scheduled jobs and tasks start in the record's context (they copy it)
        if self._scheduler is not None:
            self._telemetry.run(record, self._start_scheduled, record)
        elif self._is_async:
            try:
                loop = self._ensure_loop()
                future = self._telemetry.run(
                    record, asyncio.run_coroutine_threadsafe, self._run_async(record), loop
                )
            except RuntimeError as exc:  # the loop was closed under us
                self._after(self._ended(record, exc, started=False))
                return
            future.add_done_callback(functools.partial(self._async_done, record))
        else:
            pool = self._pool
            if pool is None:
                with self._lock:
                    if self._pool is None:
                        self._pool = WorkerPool(self._max_concurrency, "rxcoord-kafka")
                    pool = self._pool
            try:
                pool.submit(functools.partial(self._work, record))
            except RuntimeError:  # shut down after the drain deadline: the record is dropped
                self._after(self._ended(record, None, dropped=True))

    async def _run_async(self, record: Record) -> Any:
        if not self._admit(record):
            return _NOT_RUN
        return await self._handle(record)

    def _async_done(self, record: Record, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None and future.result() is _NOT_RUN:
            self._after(self._ended(record, None, dropped=True))
        else:
            self._ended_later(record, _future_error(future))

    def _work(self, record: Record | None) -> None:
        """A worker thread: run the record, then the next of its key while it may keep the slot."""
        _inside.consumer = self
        handle = self._telemetry.wrap(self._handle)  # telemetry hook: each record's context
        perf = time.perf_counter
        while record is not None:
            if not self._admit(record):
                record = self._next_here(self._ended(record, None, dropped=True))
                continue
            started = perf()
            try:
                result = handle(record)
            except Exception as exc:
                record = self._next_here(self._ended(record, exc))
                continue
            d = min(perf() - started, _CLAMP)
            self._ewma += (d - self._ewma) * _EWMA  # racy across workers: an estimate
            if not is_work(result):
                record = self._next_here(self._ended(record, None))
            else:
                self._attach(record, result)
                record = None

    def _next_here(self, successors: list[Record]) -> Record | None:
        """Keep the first successor on this worker thread; start the others elsewhere."""
        if not successors:
            return None
        for other in successors[1:]:
            self._start(other)
        return successors[0]

    def _attach(self, record: Record, result: Any) -> None:
        """The handler returned an Observable, awaitable or future: the record ends with it."""
        _RecordWork(self, record).start(result)

    def _ended_later(
        self, record: Record, error: BaseException | None, *, started: bool = True
    ) -> None:
        if error is not None and not isinstance(error, Exception):
            error = RuntimeError(f"handler of {record!r} was cancelled: {error!r}")
        for successor in self._ended(record, error, started=started):
            self._start(successor)

    def _after(self, successors: list[Record]) -> None:
        for successor in successors:
            self._start(successor)

    def _ended(
        self,
        record: Record,
        error: Exception | None,
        *,
        dropped: bool = False,
        started: bool | None = None,
    ) -> list[Record]:
        """A record holding a slot ended: report its offset, free its slot, pick who runs next.

        ``dropped``: it never started (its result is not counted, its offset not completed).
        ``started``: whether its handler was admitted by the start gate (default: not
        ``dropped``); an error of a record that never started (a scheduler refusing it) still
        goes through ``on_error``.

        Returns the records that take slots now (to be started by the caller, outside the lock).
        """
        decide = False  # on_error decides about a failure
        if error is not None and not dropped:
            # The hook where a record ends, for offsets= (see _offsets.py): a fenced record's
            # transaction rolled back, so its result is dropped like a revoked partition's; a
            # Stopped record went through on_error already (or must not: it is not done).
            if isinstance(error, Dropped):
                error, dropped, started = None, True, True if started is None else started
            elif isinstance(error, Stopped):
                error = error.error
                self._fail(error)
            else:
                if self._retry_policy is not None or self._dead_letters is not None:
                    # Another attempt later, or a dead letter: the record stays in progress.
                    later = _attempts.failed(self, record, error, started is not False)
                    if later is not None:
                        return later
                decide = True
        self._telemetry.ended(record, error, dropped)  # telemetry hook: outcome, span end
        if decide:
            assert error is not None
            error = self._apply_on_error(record, error)
        st = record._state
        with self._lock:
            if self._progress:
                _attempts.forget(self, record)
            st.running -= 1
            if (not dropped) if started is None else started:
                st.started -= 1
            if dropped:
                self._dropped += 1
            elif error is None:
                self._completed += 1
                if st.phase != REVOKED:
                    st.done.add(record.offset)
                else:
                    self._dropped += 1  # late result of a revoked assignment: dropped
            successors = self._turns(self._lanes.finish(self._key_of(record)))
            if self._engine.waiters:
                self._engine.changed.notify_all()
        return successors

    def _turns(self, nxt: Record | None) -> list[Record]:
        """The record the lane table gave a slot to, if it may run (under the lock).

        One whose partition is no longer active, or any while the consumer stops without a
        drain, never starts: it is dropped and passes the slot on, in the table's order.
        Returns the record to start (by the caller, outside the lock), or nothing.
        """
        lanes = self._lanes
        while nxt is not None:
            self._queued -= 1
            st = nxt._state
            if st.phase == ACTIVE and self._accepting:
                st.running += 1
                return [nxt]
            self._dropped += 1
            nxt = lanes.finish(self._key_of(nxt))
        return []

    def _drop_queued(self) -> None:
        """Stopping: records that have not taken a slot never start (under the lock). Records
        to be offered again hold slots; the poll loop's next ``_offer_again`` drops them."""
        purged = self._lanes.purge(_always)
        self._dropped += purged
        self._queued -= purged
        if self._progress:
            _attempts.drop_if(self, _always)  # starts nothing: the consumer no longer accepts

    @staticmethod
    def _key_of(record: Record) -> Hashable:
        k: Hashable = record._lane
        return record if k is None else k

    def _apply_on_error(self, record: Record, error: Exception) -> Exception | None:
        """Apply ``on_error`` (or a ``dead_letter`` callable); returns the error if the consumer
        must stop, else ``None``."""
        letter = self._dead_letter
        policy = letter if callable(letter) else self._on_error
        with self._lock:
            self._failed += 1
        if policy == "skip":
            self._log.opt(exception=error).warning("{} failed; skipped", record)
            return None
        if policy == "stop":
            self._fail(error)
            return error
        try:
            policy(record, error)
        except Exception as exc:
            what = "dead_letter" if policy is letter else "on_error"
            self._log.opt(exception=exc).error("{} raised for {}; stopping", what, record)
            self._fail(exc)
            return exc
        if policy is letter:
            with self._lock:
                self._dead_lettered += 1
        return None

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            self._accepting = False
            self._drop_queued()
        self._stop.set()

    # -- schedulers and loops --------------------------------------------------------------

    def _start_scheduled(self, record: Record) -> None:
        scheduler = self._scheduler
        handle = self._handle
        admitted = False
        job: Callable[[], Any]
        # The start gate runs inside the job: after the scheduler's admission and key guard
        # (a key's lease), right before the handler, so a record whose partition was revoked
        # while it waited there never starts.
        if self._is_async:

            async def job_async() -> Any:
                nonlocal admitted
                if not self._admit(record):
                    return _NOT_RUN
                admitted = True
                return await handle(record)

            job = job_async
        else:

            def job_sync() -> Any:
                nonlocal admitted
                if not self._admit(record):
                    return _NOT_RUN
                admitted = True
                result = handle(record)
                if isinstance(result, concurrent.futures.Future):
                    # The record's work is the future's: as an Observable the scheduler runs
                    # it to its end, so its slot and its key's lease last until it is done
                    # (a plain value would free both at once, while the work goes on).
                    return from_future(cast("asyncio.Future[Any]", result))
                return result

            job = job_sync
        k = self._key_of(record)
        # Our lanes already order the key; passing it on lets a coordinator with leases= hold
        # the key's lease across processes while the record runs.
        lane_key = None if k is record else k
        if isinstance(scheduler, TenantScheduler):
            assert self._tenant is not None
            observable = scheduler.execute(self._tenant(record), job, key=lane_key)
        else:
            assert scheduler is not None
            observable = scheduler.execute(job, key=lane_key)
        done = threading.Lock()

        def on_next(value: Any) -> None:
            if value is not _NOT_RUN and is_work(value) and done.acquire(blocking=False):
                self._attach(record, value)

        def on_error(error: Exception) -> None:
            if done.acquire(blocking=False):
                if isinstance(error, TooManyTasks):
                    self._refused(record)
                else:
                    self._ended_later(record, error, started=admitted)

        def on_completed() -> None:
            if done.acquire(blocking=False):
                if admitted:
                    self._ended_later(record, None)
                else:
                    self._after(self._ended(record, None, dropped=True))

        if self._is_async:
            loop = self._ensure_loop()
            loop.call_soon_threadsafe(lambda: observable.subscribe(on_next, on_error, on_completed))
        else:
            observable.subscribe(on_next, on_error, on_completed)

    def _refused(self, record: Record) -> None:
        # The scheduler is full (its queue is shared with others): keep the slot and the lane,
        # and offer the record again shortly from the poll loop.
        with self._lock:
            self._to_offer.append(record)
            self._offer_at = time.monotonic() + _REOFFER_AFTER

    def _offer_again(self) -> None:
        with self._lock:
            again, self._to_offer = self._to_offer, []
        for record in again:
            if record._state.phase != ACTIVE or not self._accepting:
                self._after(self._ended(record, None, dropped=True))
            else:
                self._start(record)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The loop async handlers run on: run_async()'s, or one thread of our own for run()."""
        if self._loop is not None:
            return self._loop
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    _inside.consumer = self
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.close()

                self._own_loop = threading.Thread(
                    target=serve, name="rxcoord-kafka-loop", daemon=True
                )
                self._own_loop.start()
                ready.wait()
                self._loop = loop
            return self._loop


def _revoked(record: Record) -> bool:
    return record._state.phase != ACTIVE


def _always(record: Record) -> bool:
    return True


def _future_error(future: Any) -> BaseException | None:
    if future.cancelled():
        return asyncio.CancelledError()
    error: BaseException | None = future.exception()
    return error


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


# -- argument checks -------------------------------------------------------------------------


def _check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(
            "config must be a dict of confluent-kafka settings, e.g. "
            f'{{"bootstrap.servers": "host:9092", "group.id": "orders"}}, not {config!r}'
        )
    conf = dict(config)
    for name in conf:
        if not isinstance(name, str):
            raise TypeError(f"config keys must be str, not {name!r}")
    if not conf.get("bootstrap.servers"):
        raise ValueError('config needs "bootstrap.servers": the brokers to connect to')
    if not conf.get("group.id"):
        raise ValueError(
            'config needs "group.id": the consumer group that owns the commits, e.g. "orders"'
        )
    auto = conf.get("enable.auto.commit")
    if auto not in (None, False, "false", "False"):
        raise ValueError(
            'remove "enable.auto.commit" from config: KeyedConsumer commits the completed '
            "prefix itself, and auto-commit would commit records still running"
        )
    return conf


_TOPIC_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,249}")


def _check_failures(
    retry: object,
    dead_letter: object,
    dead_letter_config: object,
    stall_after: object,
    on_stall: object,
    offsets: object,
) -> None:
    """The options of what happens after a failure (see ``_attempts.py``)."""
    if retry is not None and not isinstance(retry, Retry):
        raise TypeError(f"retry must be a rxcoord.Retry(...) or None, not {retry!r}")
    if isinstance(dead_letter, str):
        if not _TOPIC_NAME.fullmatch(dead_letter) or dead_letter in (".", ".."):
            raise ValueError(
                f"dead_letter={dead_letter!r} is not a Kafka topic name: use 1 to 249 of "
                'letters, digits, ".", "_" and "-", e.g. dead_letter="orders.DLT"'
            )
    elif dead_letter is not None and not callable(dead_letter):
        raise TypeError(
            'dead_letter must be a topic name (e.g. "orders.DLT"), a callable '
            f"dead_letter(record, exception) or None, not {dead_letter!r}"
        )
    if dead_letter_config is not None:
        if not isinstance(dead_letter, str):
            raise ValueError(
                "dead_letter_config configures the dead-letter topic's producer: pass "
                'dead_letter="topic" with it, or remove it'
            )
        if not isinstance(dead_letter_config, Mapping):
            raise TypeError(
                "dead_letter_config must be a dict of confluent-kafka producer settings, e.g. "
                f'{{"message.timeout.ms": 30000}}, not {dead_letter_config!r}'
            )
    if offsets is not None and (retry is not None or isinstance(dead_letter, str)):
        raise ValueError(
            "retry= and a dead_letter topic do not work with offsets= yet (the record's "
            "transaction decides its end): retry inside the handler, and pass a callable "
            "dead_letter or on_error"
        )
    if stall_after is not None:
        check_interval(stall_after, "stall_after")
    if on_stall is not None:
        if not callable(on_stall):
            raise TypeError(
                f"on_stall must be a callable on_stall(record, elapsed), not {on_stall!r}"
            )
        if stall_after is None:
            raise ValueError(
                "on_stall needs stall_after=: pass stall_after=seconds (e.g. 60.0), after which a "
                "record in progress counts as stalled"
            )


def _check_topics(topics: Sequence[str]) -> list[str]:
    if isinstance(topics, str | bytes):
        raise TypeError(f"topics must be a list of names, e.g. [{topics!r}], not a string")
    try:
        names = list(topics)
    except TypeError:
        raise TypeError(f"topics must be a list of topic names, not {topics!r}") from None
    if not names:
        raise ValueError("topics must name at least one topic")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"each topic must be a non-empty str, not {name!r}")
    return names
