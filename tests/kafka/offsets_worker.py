"""A consumer process for the exactly-once process tests (``PostgresOffsets``).

``python -m tests.kafka.offsets_worker BOOTSTRAP TOPIC GROUP PG_URL OFFSETS EFFECTS NAME
[--sleep-ms N] [--concurrency N] [--idle S] [--outage S]`` runs ``KeyedConsumer.run()`` on the
main thread (so SIGTERM drains). Each record's handler inserts its row into the effects table
(see ``effects.py``), then sleeps ``--sleep-ms`` inside its open transaction, so a ``kill -9``
or a ``SIGSTOP`` finds transactions in flight. At the end it prints one JSON line with the
store's statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import signal
import sys
import time
from typing import Any

from loguru import logger

from rxcoord.kafka import KeyedConsumer, PostgresOffsets, Record

from .effects import parse
from .support import SESSION_TIMEOUT_MS


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "url", "offsets", "effects", "name"):
        parser.add_argument(name)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--outage", type=float, default=60.0)
    args = parser.parse_args()
    # rxcoord's warnings to this process's output (shown when a test fails).
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{time:HH:mm:ss.SSS} {level} {name}: {message}")
    logger.enable("rxcoord")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (a hang)
    sql = (
        f"INSERT INTO {args.effects} (key, seq, worker, part, kafka_offset) "
        "VALUES (%s, %s, %s, %s, %s)"
    )
    pause = args.sleep_ms / 1000

    def handle(record: Record, tx: Any) -> None:
        key, seq = parse(record)
        tx.execute(sql, (key, seq, args.name, record.partition, record.offset), prepare=True)
        if pause:
            time.sleep(pause)

    offsets = PostgresOffsets(
        args.url, table=args.offsets, idle_in_transaction_timeout=args.idle,
        outage_timeout=args.outage,
    )  # fmt: skip
    consumer = KeyedConsumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 500,
        },
        [args.topic],
        handle,
        offsets=offsets,
        max_concurrency=args.concurrency,
        batch_size=50,
        commit_interval=0.2,
        revoke_timeout=5,
        drain_timeout=10,
    )
    consumer.run()
    print(json.dumps(dataclasses.asdict(offsets.stats())), flush=True)


if __name__ == "__main__":
    main()
