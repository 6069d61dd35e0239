"""A consumer process for the multi-process tests.

``python -m tests.kafka.worker BOOTSTRAP TOPIC GROUP LOG NAME SLEEP_MS CONCURRENCY [MAX_IN_FLIGHT]``
runs ``KeyedConsumer.run()`` on the main thread, so SIGTERM drains.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rxcoord.kafka import KeyedConsumer

from .support import SESSION_TIMEOUT_MS, RunLog, logging_handler


def main() -> None:
    bootstrap, topic, group, log_path, name, sleep_ms, concurrency = sys.argv[1:8]
    max_in_flight = int(sys.argv[8]) if len(sys.argv) > 8 else 10_000
    log = RunLog(Path(log_path), name)
    consumer = KeyedConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 500,
            "log_level": 3,
        },
        [topic],
        logging_handler(log, sleep=int(sleep_ms) / 1000),
        max_concurrency=int(concurrency),
        max_in_flight=max_in_flight,
        batch_size=50,
        commit_interval=0.2,
        revoke_timeout=5,
    )
    consumer.run()
    print("drained", consumer.stats().completed, flush=True)


if __name__ == "__main__":
    main()
