"""Helpers of the Kafka suite: topics, a keyed producer, run logs and the invariant checker.

Handlers log to a file per worker (one machine, so one clock: ``time.monotonic()`` is
CLOCK_MONOTONIC, shared by every process): an ``S`` line when a record's handler starts and an
``E`` line when it ends, each written with one ``write`` on an ``O_APPEND`` file, so a line is
never torn and a ``kill -9`` loses at most the run that was in progress. The checker reads all
files of a test and asserts the consumer's guarantees over them.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from rxcoord.kafka import Record

SESSION_TIMEOUT_MS = 6000  # Tansu: a join takes about half of it, so keep it short


@dataclass
class Produced:
    """What the producer wrote: each (key, seq) with its partition and offset."""

    topic: str
    where: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # -> (p, off)
    end: dict[int, int] = field(default_factory=dict)  # partition -> next offset

    @property
    def keys(self) -> dict[str, list[int]]:
        per_key: dict[str, list[int]] = defaultdict(list)
        for k, seq in self.where:
            per_key[k].append(seq)
        return {k: sorted(v) for k, v in per_key.items()}

    def at(self, partition: int, offset: int) -> tuple[str, int]:
        for ks, (p, o) in self.where.items():
            if (p, o) == (partition, offset):
                return ks
        raise KeyError((partition, offset))


@dataclass(frozen=True)
class Run:
    """One handler invocation, from the logs (``end`` is None if it never ended)."""

    key: str
    seq: int
    worker: str
    start: float
    end: float | None
    partition: int
    offset: int


class Cluster:
    """One test's view of the broker."""

    def __init__(self, bootstrap: str, tmp: Path, tag: str) -> None:
        self.bootstrap = bootstrap
        self.tmp = tmp
        self.tag = tag
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self._topics = 0

    def close(self) -> None:
        self.producer.flush(10)

    def topic(self, partitions: int = 8) -> str:
        self._topics += 1
        name = f"t-{self.tag}-{self._topics}"
        futures = self.admin.create_topics([NewTopic(name, partitions, 1)])
        for future in futures.values():
            future.result(15)
        deadline = time.monotonic() + 15
        while True:
            md = self.admin.list_topics(timeout=5)
            if name in md.topics and len(md.topics[name].partitions) == partitions:
                return name
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {name} did not appear")
            time.sleep(0.05)

    def group(self, name: str = "g") -> str:
        return f"{name}-{self.tag}"

    def config(self, group: str, **overrides: Any) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 500,
        }
        conf.update(overrides)
        return conf

    def produce(
        self,
        topic: str,
        items: Iterable[tuple[str | None, int]],
        value: Callable[[str | None, int], bytes] | None = None,
        produced: Produced | None = None,
    ) -> Produced:
        """Write ``(key, seq)`` records (value ``b"key:seq"``); offsets from delivery reports."""
        out = produced or Produced(topic)
        errors: list[Any] = []
        lock = threading.Lock()

        def report(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)
                return
            k, _, seq = msg.value().decode().rpartition(":")
            with lock:
                out.where[(k, int(seq))] = (msg.partition(), msg.offset())
                out.end[msg.partition()] = max(out.end.get(msg.partition(), 0), msg.offset() + 1)

        for k, seq in items:
            payload = value(k, seq) if value else f"{k}:{seq}".encode()
            while True:
                try:
                    self.producer.produce(
                        topic, key=None if k is None else k.encode(), value=payload,
                        on_delivery=report,
                    )  # fmt: skip
                    break
                except BufferError:
                    self.producer.poll(0.05)
            self.producer.poll(0)
        remaining = self.producer.flush(30)
        assert remaining == 0, f"{remaining} records not delivered"
        assert not errors, errors
        return out

    def committed(self, topic: str, group: str, partitions: int = 8) -> dict[int, int]:
        """The group's committed offsets (an OffsetFetch; this consumer never joins)."""
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group})
        try:
            tps = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
            return {tp.partition: tp.offset for tp in tps}
        finally:
            c.close()

    def log_for(self, worker: str) -> Path:
        return self.logs / f"{worker}.log"

    def runs(self) -> list[Run]:
        return read_runs(self.logs)


def keyed_items(
    records: int, keys: int, seqs: dict[str, int] | None = None
) -> list[tuple[str | None, int]]:
    """``records`` (key, seq) pairs round robin over ``keys`` keys; ``seqs`` carries each key's
    next seq across calls."""
    seqs = {} if seqs is None else seqs
    items: list[tuple[str | None, int]] = []
    for i in range(records):
        k = f"k{i % keys}"
        seq = seqs.get(k, 0)
        items.append((k, seq))
        seqs[k] = seq + 1
    return items


def logging_handler(
    log: RunLog, sleep: float = 0.0, hook: Callable[[Record], None] | None = None
) -> Callable[[Record], None]:
    """A handler that logs its run (S at start, E at the end, also when it raises)."""

    def handle(record: Record) -> None:
        started = log.start(record)
        try:
            if hook is not None:
                hook(record)
            if sleep:
                time.sleep(sleep)
        finally:
            log.end(record, started)

    return handle


class Running:
    """``consumer.run()`` on a thread of its own; ``stop()`` closes it and returns its error."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:
            self.error = exc

    def stop(self, drain: bool = True, timeout: float = 60) -> BaseException | None:
        self.consumer.close(drain=drain)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return after close()"
        return self.error

    def join(self, timeout: float = 60) -> BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return"
        return self.error


class RunLog:
    """Appends S/E lines for one worker (thread-safe, one write per line)."""

    def __init__(self, path: Path, worker: str) -> None:
        self.worker = worker
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def start(self, record: Record) -> float:
        now = time.monotonic()
        self._write(f"S {self._id(record)} {now!r}\n")
        return now

    def end(self, record: Record, started: float) -> None:
        self._write(f"E {self._id(record)} {started!r} {time.monotonic()!r}\n")

    def _id(self, record: Record) -> str:
        k, _, seq = (record.value or b"").decode().rpartition(":")
        return f"{k or '-'} {seq} {self.worker} {record.partition} {record.offset}"

    def _write(self, line: str) -> None:
        os.write(self.fd, line.encode())

    def close(self) -> None:
        os.close(self.fd)


def read_runs(logs: Path) -> list[Run]:
    lines: list[str] = []
    for path in sorted(logs.glob("*.log")):
        # A read can overlap a write still being copied in: only the file's tail can be
        # partial (writes append), so a last line without its newline is left for next time.
        *complete, _partial = path.read_text().split("\n")
        lines += complete
    return parse_runs(lines)


def parse_runs(lines: Iterable[str]) -> list[Run]:
    """Runs from S/E lines (of files or of a Redis list, see ``tests/kafka/fleet.py``)."""
    starts: dict[tuple[str, str, int, int, str], float] = {}
    ended: set[tuple[str, str, int, int, str, float]] = set()
    runs: list[Run] = []
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        kind, k, seq, worker = parts[:4]
        partition, offset = int(parts[4]), int(parts[5])
        if kind == "S":
            starts[(k, seq, partition, offset, worker)] = float(parts[6])
        else:
            start, end = float(parts[6]), float(parts[7])
            ended.add((k, seq, partition, offset, worker, start))
            runs.append(Run(k, int(seq), worker, start, end, partition, offset))
    for (k, seq, partition, offset, worker), start in starts.items():
        if (k, seq, partition, offset, worker, start) not in ended:
            runs.append(Run(k, int(seq), worker, start, None, partition, offset))
    return runs


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition (state, not time) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def completed_pairs(runs: Iterable[Run]) -> set[tuple[str, int]]:
    return {(r.key, r.seq) for r in runs if r.end is not None}


def all_done(cluster: Cluster, produced: Produced) -> Callable[[], bool]:
    wanted = set(produced.where)
    return lambda: wanted <= completed_pairs(cluster.runs())


def check_invariants(
    produced: Produced, runs: list[Run], *, duplicates: bool, dead: Iterable[str] = ()
) -> dict[str, int]:
    """Assert the consumer's guarantees over the logged runs; returns a few counts.

    * nothing lost: every produced (key, seq) completed at least once;
    * per-key order: the first completions of a key's records are in seq (offset) order;
    * no overlap: two runs of one key never overlap in time (also across workers; a run that
      never ended counts until the end of time, unless its worker was killed: ``dead``);
    * duplicates only a replayed suffix: in start order, each run of a key is either the next
      seq or a restart at an earlier one (a replay from a commit point, which then goes on
      consecutively); with ``duplicates=False`` no record ran twice.
    """
    runs_by_key: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        runs_by_key[r.key].append(r)
    dead = set(dead)
    missing = set(produced.where) - completed_pairs(runs)
    assert not missing, f"lost records: {sorted(missing)[:10]} ({len(missing)} in all)"
    duplicated = 0
    for k, key_runs in runs_by_key.items():
        key_runs.sort(key=lambda r: r.start)
        first_end: dict[int, float] = {}
        for r in key_runs:
            if r.end is not None and r.seq not in first_end:
                first_end[r.seq] = r.end
        order = sorted(first_end, key=lambda s: first_end[s])
        assert order == sorted(order), f"key {k}: first completions out of order: {order[:20]}"
        for a, b in itertools.pairwise(key_runs):
            a_end = a.end if a.end is not None else (a.start if a.worker in dead else None)
            assert a_end is not None, f"key {k}: {b} started while {a} never ended"
            assert b.start >= a_end, f"key {k}: {a} and {b} overlap"
        expected_next = 0
        seen: set[int] = set()
        for r in key_runs:
            if r.seq in seen:
                duplicated += 1
            assert r.seq == expected_next or r.seq < expected_next, (
                f"key {k}: run of seq {r.seq} after seq {expected_next - 1}: a record was "
                f"skipped, not replayed ({[x.seq for x in key_runs][:30]})"
            )
            seen.add(r.seq)
            expected_next = r.seq + 1
    if not duplicates:
        assert duplicated == 0, f"{duplicated} record(s) ran twice without a rebalance"
    return {"runs": len(runs), "duplicated": duplicated}


def max_parallel_in_partition(runs: Iterable[Run]) -> int:
    """Most runs of one partition that overlapped in time."""
    best = 0
    per_partition: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in runs:
        if r.end is not None:
            per_partition[r.partition] += [(r.start, 1), (r.end, -1)]
    for events in per_partition.values():
        events.sort(key=lambda e: (e[0], e[1]))
        now = 0
        for _, delta in events:
            now += delta
            best = max(best, now)
    return best


# -- retries and dead letters -------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One event of a handler's attempt: ``start``, ``ok`` or ``fail``."""

    kind: str
    key: str
    offset: int
    at: float


class AttemptLog:
    """What a handler did, attempt by attempt (thread-safe, in memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[Attempt] = []

    def add(self, kind: str, record: Record) -> None:
        key = (record.key or b"-").decode()
        with self._lock:
            self.events.append(Attempt(kind, key, record.offset, time.monotonic()))

    def snapshot(self) -> list[Attempt]:
        with self._lock:
            return list(self.events)

    def count(self, kind: str, key: str | None = None) -> int:
        return sum(1 for e in self.snapshot() if e.kind == kind and key in (None, e.key))


def check_retry_order(events: Iterable[Attempt], attempts: int) -> None:
    """Per-key order over a handler's attempts (one consumer, one assignment).

    * among successful handlings of a key, offsets strictly increase;
    * no later offset of a key begins while an earlier one is in progress: between its first
      start and its end (a success, or its ``attempts``-th failure) every event of the key is of
      that record (its failed attempts, and the waits between them, included).
    """
    by_key: dict[str, list[Attempt]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e.at):
        by_key[e.key].append(e)
    for key, key_events in by_key.items():
        succeeded = [e.offset for e in key_events if e.kind == "ok"]
        assert succeeded == sorted(set(succeeded)), f"key {key}: successes out of order {succeeded}"
        current: int | None = None  # the offset in progress (started, not yet ended)
        failures = 0
        for e in key_events:
            if current is None:
                assert e.kind == "start", f"key {key}: {e} outside an attempt"
                current, failures = e.offset, 0
            else:
                assert e.offset == current, (
                    f"key {key}: offset {e.offset} began while {current} was in progress "
                    "(attempting or waiting for its next attempt)"
                )
            failures += e.kind == "fail"
            if e.kind == "ok" or failures == attempts:
                current = None


def read_topic(bootstrap: str, topic: str, count: int, timeout: float = 30) -> list[Any]:
    """The first ``count`` messages of ``topic`` (all partitions), read by a fresh group."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": SESSION_TIMEOUT_MS,
        }
    )
    messages: list[Any] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while len(messages) < count and time.monotonic() < deadline:
            for msg in consumer.consume(count - len(messages), 0.2):
                if msg.error() is None:
                    messages.append(msg)
    finally:
        consumer.close()
    return messages


ROOT = Path(__file__).resolve().parents[2]


class Child:
    """``python -m MODULE ARGS...`` as a real process in the repository's root, its output in
    ``cluster.tmp / NAME.out``: terminated (SIGTERM, a drain), killed (``kill -9``) or
    awaited, its exit code checked."""

    def __init__(self, cluster: Cluster, name: str, module: str, *args: str) -> None:
        self.name = name
        self.output = cluster.tmp / f"{name}.out"
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float = 60) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        rc = self.proc.returncode
        assert rc == 0, f"{self.name} exited {rc}: {self.output.read_text()[-3000:]}"
        return rc
