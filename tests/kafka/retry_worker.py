"""A consumer process with retries and a dead-letter topic, for the ``kill -9`` tests.

``python -m tests.kafka.retry_worker BOOTSTRAP TOPIC DEAD GROUP LOG NAME COMMIT_INTERVAL LINGER_MS
COMMITS`` runs ``KeyedConsumer.run()`` on the main thread. Records of key ``poison`` always fail
(two attempts, then the dead-letter topic ``DEAD``, whose producer holds each message
``LINGER_MS`` before sending it); the others are logged like ``worker.py``'s. Each commit the
broker confirmed is appended to ``COMMITS`` as ``C partition offset monotonic``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from rxcoord import Retry
from rxcoord.kafka import KeyedConsumer, Record

from .support import SESSION_TIMEOUT_MS, RunLog, logging_handler


class Poison(Exception):
    pass


def main() -> None:
    bootstrap, topic, dead, group, log_path, name, interval, linger, commits = sys.argv[1:10]
    log = RunLog(Path(log_path), name)
    commits_fd = os.open(commits, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def on_commit(error: Any, partitions: Any) -> None:
        if error is None:
            for tp in partitions:
                if tp.error is None:
                    line = f"C {tp.partition} {tp.offset} {time.monotonic()!r}\n"
                    os.write(commits_fd, line.encode())

    def poison(record: Record) -> None:
        if record.key == b"poison":
            raise Poison(f"poison at {record.offset}")

    consumer = KeyedConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 500,
            "log_level": 3,
            "on_commit": on_commit,
        },
        [topic],
        logging_handler(log, hook=poison),
        commit_interval=float(interval),
        retry=Retry(attempts=2, backoff=0.05),
        dead_letter=dead,
        dead_letter_config={"linger.ms": int(linger)},
    )
    consumer.run()
    print("drained", consumer.stats().completed, flush=True)


if __name__ == "__main__":
    main()
