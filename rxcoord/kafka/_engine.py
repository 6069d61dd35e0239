"""The poll loop under both consumer forms: fetch, track, pause, commit, rebalance.

What Kafka (librdkafka) already does is left to it: group membership and heartbeats (on its own
thread, so a busy handler never costs the membership), fetching, assignment, pause/resume and
the commit protocol. What it lacks, and the engine adds, is an ordering-aware commit point: with
``enable.auto.commit`` Kafka commits whatever was *returned* by ``consume()``, which is at-most-
once for records still running. The engine instead commits, per partition, the end of the
contiguous prefix of *completed* offsets (``PartitionState``), periodically, on revoke and on
close, never per record.

The engine is driven by a *processor* (the keyed dispatcher of ``KeyedConsumer``, or the Rx
source's emitter) that receives each batch and reports completions by adding offsets to their
partition state's ``done`` set under ``lock``. Everything else runs on the one poll thread:
rebalance callbacks, too, are called by librdkafka inside ``consume()`` on that thread. (The
poll thread is one thread at a time, not always the same one: ``KeyedConsumer`` moves the loop
to a new thread when an inline handler blocks, handing over under ``lock``.)

With an offsets store (``PostgresOffsets``, see ``_offsets.py``) each assignment first *claims*
its partitions in the database (a new epoch each, the stored prefix and the offsets done beyond
it) and starts fetching at the stored prefix, the store's position winning over Kafka's; the
engine folds the completed prefixes into the store (before committing them to Kafka, which so
stays behind the database) periodically, on revoke and on close.

The end of a run is bounded: the final commit and the group leave run on a helper thread that
the engine waits for until a deadline (``KeyedConsumer``'s ``drain_timeout``), then abandons with
a warning; a broker that stopped answering made them wait for librdkafka's request timeouts
(over 60 s seen on the test broker during a rebalance).

librdkafka's log goes to loguru through the consumer's ``logger`` setting (``_logs.py``).

Backpressure keeps the consumer in its group: beyond ``max_in_flight`` uncommitted records the
partitions holding more than their share are paused (``Consumer.pause``) while polling goes on,
and resumed once the total fell to three quarters of the limit or the partition below half its
share. A slow key therefore pauses only its own partition, whose commit point it holds back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from loguru import logger

from rxcoord._core import telemetry

from . import _logs
from ._errors import BrokerUnavailable, OffsetStoreError, OffsetStoreUnavailable, UnknownTopic
from ._partitions import REVOKED, REVOKING, PartitionState

if TYPE_CHECKING:
    from ._offsets import Claim, PostgresOffsets

__all__ = ["Engine", "Processor", "complete", "make_consumer"]

_POLL_TIMEOUT = 0.05  # seconds consume() waits for a batch: bounds the latency of close and commit
_CLAIM_BACKOFF: Final = (0.1, 5.0)  # seconds between claims while the database is away


class Processor(Protocol):
    """What the engine asks of the code that runs the records."""

    def dispatch(self, messages: list[Message]) -> None:
        """Run or queue a batch (poll thread). Skips messages of partitions not ``ACTIVE``.

        May raise to leave the loop without housekeeping: ``KeyedConsumer`` does when another
        thread took the poll role over (the engine then runs on that thread)."""

    def outstanding(self, states: Sequence[PartitionState]) -> int:
        """Records of these states whose handling started and has not ended (under the lock).

        A revoke waits (``revoke_timeout``) for these; the processor must never start a record
        of a state whose phase is no longer ``ACTIVE``."""

    def pending(self) -> int:
        """Records fetched and neither ended nor dropped, all partitions (under the lock)."""

    def revoking(self, states: Sequence[PartitionState]) -> None:
        """These states are being revoked: start none of their records (poll thread)."""

    def stopping(self, drain: bool) -> None:
        """The engine stops: start nothing new unless ``drain`` (poll thread)."""


def make_consumer(config: Mapping[str, Any], on_commit: Callable[..., None]) -> Consumer:
    """Create the confluent-kafka consumer with the engine's settings over the user's.

    Raises:
        ValueError: the configuration is refused by librdkafka (unknown or invalid property).
    """
    conf = dict(config)
    user_on_commit = conf.pop("on_commit", None)

    def commit_cb(error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        on_commit(error, partitions)
        if user_on_commit is not None:
            user_on_commit(error, partitions)

    # The engine commits explicit offsets itself; librdkafka's automatic commit would commit
    # records that are still running.
    conf["enable.auto.commit"] = False
    conf["enable.auto.offset.store"] = False
    conf["on_commit"] = commit_cb
    # librdkafka's log through loguru (folded), not printed to stderr; the application's own
    # logger, if it passes one, wins.
    conf.setdefault("logger", _logs.librdkafka_logger())
    try:
        return Consumer(conf)
    except KafkaException as exc:
        raise ValueError(f"confluent-kafka refused the configuration: {exc.args[0]}") from exc


class Engine:
    """Owns the confluent-kafka consumer and its partition states; runs on the poll thread."""

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        max_in_flight: int,
        commit_interval: float,
        revoke_timeout: float,
        startup_timeout: float,
        batch_size: int,
        name: str,
        offsets: PostgresOffsets | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when records end (waiters only)
        self.waiters = 0
        self.topics = list(topics)
        self.max_in_flight = max_in_flight
        self.commit_interval = commit_interval
        self.revoke_timeout = revoke_timeout
        self.startup_timeout = startup_timeout
        self.batch_size = batch_size
        self.bootstrap = str(config.get("bootstrap.servers", ""))
        self.store = offsets
        # Set when the run should end: a claim waiting for the database gives up then.
        self.interrupt = threading.Event()
        # With the cooperative protocols an assignment is incremental: it must be added to,
        # not replaced (librdkafka refuses the other call).
        strategy = str(config.get("partition.assignment.strategy", ""))
        self._incremental = "cooperative" in strategy or (
            str(config.get("group.protocol", "classic")).lower() == "consumer"
        )
        self.log = logger.bind(consumer=name)
        # rxcoord.name and the group are both the group id: a consumer has no other name.
        self.telemetry = telemetry.kafka(name, name)
        # When each asynchronous commit still unanswered was sent (rxcoord.kafka.commit.wait):
        # librdkafka answers a consumer's commits in the order they were sent.
        self._commits_sent: deque[float] = deque()
        self.consumer = make_consumer(config, self._commit_answered)
        self.states: dict[tuple[str, int], PartitionState] = {}
        self.processor: Processor | None = None
        self.failure: BaseException | None = None  # a fatal Kafka error ends the loop with it
        self.rebalances = 0
        self.commits = 0
        self.fetched = 0
        self._epochs = 0
        self._next_commit = 0.0
        self._closing = False

    # -- the loop --------------------------------------------------------------------------

    def check_startup(self) -> None:
        """Fail fast on an unreachable cluster or a missing topic instead of polling forever.

        Raises:
            BrokerUnavailable: no broker answered within ``startup_timeout``.
            UnknownTopic: a subscribed topic does not exist.
        """
        try:
            metadata = self.consumer.list_topics(timeout=self.startup_timeout)
        except KafkaException as exc:
            # The log lines librdkafka queued say why (refused, unresolved...): deliver them.
            self.consumer.poll(0)
            raise BrokerUnavailable(
                f"no Kafka broker of bootstrap.servers={self.bootstrap!r} answered within "
                f"{self.startup_timeout:g}s ({exc.args[0]}): check the address and that the "
                "cluster is up, or raise startup_timeout"
            ) from exc
        missing = [
            topic
            for topic in self.topics
            if not topic.startswith("^")  # a pattern subscription matches whatever exists
            and (topic not in metadata.topics or metadata.topics[topic].error is not None)
        ]
        if missing:
            raise UnknownTopic(
                f"topic(s) {', '.join(map(repr, missing))} do not exist on {self.bootstrap!r}: "
                "create them first (for example with confluent_kafka.admin.AdminClient."
                "create_topics), or fix the name"
            )

    def subscribe(self) -> None:
        self.consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        # Lag, in-flight and paused gauges while the run lasts (close() withdraws them).
        self.telemetry.observe(self, _partition_rows)
        self._next_commit = time.monotonic() + self.commit_interval

    def poll_once(self, accept: bool, timeout: float = _POLL_TIMEOUT) -> None:
        """One turn: fetch a batch (dispatched if ``accept``), move commit points, pause, commit.

        ``timeout``: seconds ``consume()`` may wait for a batch (shorter while the processor
        has timed work for the poll thread, such as records whose retry wait ended)."""
        messages = self.consumer.consume(self.batch_size, timeout)
        if messages and accept:
            assert self.processor is not None
            self.processor.dispatch(messages)
        # Records consumed while not accepting are neither run nor tracked: every later one of
        # their partition is dropped too, so the commit point never passes them.
        self.housekeeping()

    def housekeeping(self) -> None:
        with self.lock:
            for state in self.states.values():
                if state.order:
                    state.advance()
        self._backpressure()
        now = time.monotonic()
        if now >= self._next_commit:
            self._next_commit = now + self.commit_interval
            states = list(self.states.values())
            if self.store is not None:
                self.store.fold(states)  # the database first: Kafka's commit stays behind it
            self.commit(states, asynchronous=True)
            self._refresh_watermarks()

    def _refresh_watermarks(self) -> None:
        # Read here, on the poll thread: called from another thread (stats()) it can deadlock,
        # the caller holding the GIL inside librdkafka while consume() waits for the GIL to run
        # a callback. ``cached`` reads the last fetch response; no request is sent.
        for s in self.states.values():
            try:
                _, high = self.consumer.get_watermark_offsets(
                    TopicPartition(s.topic, s.partition), cached=True
                )
            except KafkaException:
                continue
            if high is not None and high >= 0:
                s.high = high

    def commit(self, states: Sequence[PartitionState], *, asynchronous: bool) -> None:
        """Commit each state's completed prefix that moved since its last commit."""
        offsets = [
            TopicPartition(s.topic, s.partition, s.committable)
            for s in states
            if s.committable > s.requested
        ]
        if not offsets:
            return
        for s in states:
            if s.committable > s.requested:
                s.requested = s.committable
        self.commits += 1
        sent = time.perf_counter()
        try:
            if asynchronous:
                self.consumer.commit(offsets=offsets, asynchronous=True)
                self._commits_sent.append(sent)
            else:
                answer = self.consumer.commit(offsets=offsets, asynchronous=False)
                self.telemetry.commit_waited(time.perf_counter() - sent)
                self._on_commit(None, answer)
        except KafkaException as exc:
            # A commit refused during a rebalance (the generation moved on) is not fatal: the
            # new owner starts from the last commit that did succeed, so records repeat, none
            # is lost.
            self.log.warning("commit of {} failed: {}", offsets, exc)
            for s in states:
                s.requested = s.committed
            return

    def _commit_answered(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's answer to an asynchronous commit (synchronous ones return theirs)."""
        try:
            sent = self._commits_sent.popleft()
        except IndexError:  # not one of ours: nothing to time
            pass
        else:
            self.telemetry.commit_waited(time.perf_counter() - sent)
        self._on_commit(error, partitions)

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is not None:
            # The whole request failed (for example a rebalance moved the generation on):
            # nothing of it is committed; the next periodic commit asks again.
            self.log.warning("commit failed: {}", error)
            for tp in partitions:
                state = self.states.get((tp.topic, tp.partition))
                if state is not None:
                    state.requested = state.committed
            return
        for tp in partitions:
            state = self.states.get((tp.topic, tp.partition))
            if state is None:
                continue
            if tp.error is None and tp.offset >= 0:
                state.committed = max(state.committed, tp.offset)
            elif tp.error is not None:
                state.requested = state.committed  # retried by the next periodic commit

    def _backpressure(self) -> None:
        states = self.states
        if not states:
            return
        total = 0
        for s in states.values():
            total += len(s.order)
        limit = self.max_in_flight
        share = max(1, limit // len(states))
        pause: list[PartitionState] = []
        resume: list[PartitionState] = []
        for s in states.values():
            held = len(s.order)
            if not s.paused:
                if total >= limit and held >= share:
                    pause.append(s)
            elif total < limit * 3 // 4 or held < share // 2:
                resume.append(s)
        if pause:
            self.consumer.pause([TopicPartition(s.topic, s.partition) for s in pause])
            for s in pause:
                s.paused = True
            self.log.debug("paused {} partition(s): {} records in flight", len(pause), total)
        if resume:
            self.consumer.resume([TopicPartition(s.topic, s.partition) for s in resume])
            for s in resume:
                s.paused = False

    def pause_all(self) -> None:
        """Stop fetching everywhere while polling goes on (shutdown)."""
        assigned = [TopicPartition(s.topic, s.partition) for s in self.states.values()]
        if assigned:
            self.consumer.pause(assigned)
        for s in self.states.values():
            s.paused = True

    def wait_for(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Block (under the lock's condition) until ``predicate`` holds or ``deadline`` passes."""
        with self.changed:
            self.waiters += 1
            try:
                while not predicate():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self.changed.wait(min(left, 0.1))
                return True
            finally:
                self.waiters -= 1

    def close(self, deadline: float | None = None) -> None:
        """Commit what completed and leave the group (the revoke callback commits nothing new).

        With ``deadline`` (``time.monotonic()``), return by then at the latest: the commit and
        the leave run on a helper thread, abandoned (still running, a daemon) if they take
        longer.

        Raises:
            Exception: The commit or the leave failed before the deadline.
        """
        self._closing = True
        self.telemetry.forget(self)  # a closing consumer's partitions are no longer reported
        try:
            if deadline is None:
                self._final_commit_and_leave()
                return
            errors: list[BaseException] = []

            def final() -> None:
                try:
                    self._final_commit_and_leave()
                except BaseException as exc:
                    errors.append(exc)

            helper = threading.Thread(target=final, name="rxcoord-kafka-close", daemon=True)
            helper.start()
            helper.join(max(0.0, deadline - time.monotonic()))
            if helper.is_alive():
                self.log.warning(
                    "the final commit and the group leave did not finish in time (the broker "
                    "does not answer?): abandoned; the group notices after session.timeout.ms"
                )
            elif errors:
                raise errors[0]
        finally:
            _logs.flush()

    def _final_commit_and_leave(self) -> None:
        try:
            with self.lock:
                for state in self.states.values():
                    state.advance()
            states = list(self.states.values())
            if self.store is not None:
                self.store.fold(states, final=True)
            self.commit(states, asynchronous=False)
        finally:
            self.consumer.close()

    # -- rebalance callbacks (poll thread, inside consume()) ------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self.lock:
            self.rebalances += 1
            states = []
            for tp in partitions:
                self._epochs += 1
                state = PartitionState(tp.topic, tp.partition, self._epochs, self)
                self.states[(tp.topic, tp.partition)] = state
                states.append(state)
        if self.store is not None:
            self._claim(consumer, states)
        self.log.info("assigned {}", [(tp.topic, tp.partition) for tp in partitions])

    def _claim(self, consumer: Consumer, states: list[PartitionState]) -> None:
        """Claim the assigned partitions in the offsets store, then fetch from its positions.

        Retried while the database is away (the poll thread waits here, heartbeats go on in
        librdkafka's thread), until the claim succeeds or the run ends; a refusal ends the run.
        A partition left unclaimed is assigned paused and never runs a record.
        """
        assert self.store is not None
        wanted = [(s.topic, s.partition) for s in states]
        delay, most = _CLAIM_BACKOFF
        claims: dict[tuple[str, int], Claim] | None = None
        while claims is None:
            try:
                claims = self.store.claim(wanted)
            except OffsetStoreUnavailable as exc:
                self.log.warning("claiming {} failed (retrying): {}", wanted, exc)
                if self.interrupt.wait(delay):
                    break
                delay = min(delay * 2, most)
            except OffsetStoreError as exc:
                self.failure = exc
                self.interrupt.set()
                break
        parts = []
        with self.lock:
            for s in states:
                claim = None if claims is None else claims.get((s.topic, s.partition))
                s.claim = claim
                if claim is None:
                    s.phase = REVOKED  # no record of it runs; the run is ending
                parts.append(
                    TopicPartition(s.topic, s.partition, claim.start)
                    if claim is not None
                    else TopicPartition(s.topic, s.partition)
                )
        if self._incremental:
            consumer.incremental_assign(parts)
        else:
            consumer.assign(parts)
        unclaimed = [tp for tp, s in zip(parts, states, strict=True) if s.claim is None]
        if unclaimed:
            consumer.pause(unclaimed)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        states = self._take(partitions)
        if not states:
            return
        with self.lock:
            for s in states:
                s.phase = REVOKING
        assert self.processor is not None
        self.processor.revoking(states)
        if not self._closing:
            # Records of these partitions that already run get a bounded time to finish, so
            # their completions make it into the final commit; the group's rebalance waits
            # for this callback meanwhile.
            deadline = time.monotonic() + self.revoke_timeout
            finished = self.wait_for(lambda: self.processor.outstanding(states) == 0, deadline)  # type: ignore[union-attr]
            if not finished:
                self.log.warning(
                    "revoke: records of {} still running after {}s; their results are dropped",
                    [(s.topic, s.partition) for s in states],
                    self.revoke_timeout,
                )
        with self.lock:
            for s in states:
                s.advance()
        if self.store is not None:
            self.store.fold(states, final=True)
        self.commit(states, asynchronous=False)
        with self.lock:
            for s in states:
                s.phase = REVOKED  # from now on, late completions are dropped
        self.log.info("revoked {}", [(s.topic, s.partition) for s in states])

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost (session expired): another member may own them already, so commit nothing.
        states = self._take(partitions)
        with self.lock:
            for s in states:
                s.phase = REVOKED
        if states:
            assert self.processor is not None
            self.processor.revoking(states)
        self.log.warning("lost {}", [(s.topic, s.partition) for s in states])

    def _take(self, partitions: list[TopicPartition]) -> list[PartitionState]:
        with self.lock:
            self.rebalances += 1
            taken = []
            for tp in partitions:
                state = self.states.pop((tp.topic, tp.partition), None)
                if state is not None:
                    taken.append(state)
            return taken

    # -- helpers for processors -----------------------------------------------------------

    def message_error(self, error: KafkaError) -> None:
        """A message carrying an error instead of a record: fatal ones end the loop."""
        code = error.code()
        if code == KafkaError._PARTITION_EOF:
            return
        if error.fatal():
            self.failure = KafkaException(error)
            return
        self.log.warning("consumer error: {}", error)


def complete(state: PartitionState, offset: int) -> None:
    """Report a record of ``state`` as completed (any thread); dropped once it was revoked."""
    engine = state.owner
    assert isinstance(engine, Engine)
    with engine.lock:
        # Offsets below the prefix were completed already (a record reported twice).
        if state.phase != REVOKED and offset >= state.committable:
            state.done.add(offset)
        if engine.waiters:
            engine.changed.notify_all()


def _partition_rows(engine: Engine) -> list[tuple[str, int, int | None, int, bool]]:
    """``(topic, partition, lag, in_flight, paused)`` per assigned partition, for the gauges."""
    with engine.lock:
        return [
            (s.topic, s.partition, s.lag, len(s.order), s.paused) for s in engine.states.values()
        ]
