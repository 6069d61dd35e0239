"""A fleet member for the cross-process tests, logging its runs to a real Redis.

``python -m tests.kafka.fleet BOOTSTRAP TOPIC GROUP REDIS_URL PREFIX NAME [--leases]`` runs
``KeyedConsumer.run()`` on the main thread (so SIGTERM drains). Each handler run appends an
``S`` line when it starts and an ``E`` line when it ends to the Redis list ``PREFIX:log`` (one
``RPUSH`` each, atomic; the times are ``time.monotonic()``, one clock for every process of this
machine), so the invariant checker of ``support.py`` reads one log for the whole fleet.

The *first* run of each record named in the set ``PREFIX:slow`` (``key:seq`` values) blocks
until the test pushes to ``PREFIX:release:key:seq`` (a ``BLPOP``: no polling), long past
``revoke_timeout``. Later runs of it (replays by another member) do not block.

With ``--leases`` the records run under ``TenantTaskCoordinator(leases=RedisLeases(...))``: a
lease per key, kept alive while the record runs, which is what makes a key exclusive across the
fleet past ``revoke_timeout``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import redis

from rxcoord import TenantTaskCoordinator
from rxcoord.kafka import KeyedConsumer, Record
from rxcoord.leases import RedisLeases

from .support import SESSION_TIMEOUT_MS, Run, RunLog, logging_handler, parse_runs

REVOKE_TIMEOUT = 1.0  # seconds: the blocked runs outlive it by far
LEASE_AT_MOST_FOR = 3.0  # seconds a killed member's lease keeps its key


class RedisRunLog(RunLog):
    """``RunLog`` lines appended to a Redis list instead of a file."""

    def __init__(self, client: redis.Redis, prefix: str, worker: str) -> None:
        self.worker = worker
        self.client = client
        self.key = f"{prefix}:log"

    def _write(self, line: str) -> None:
        self.client.rpush(self.key, line.rstrip("\n"))

    def close(self) -> None:
        self.client.close()


def read_fleet_runs(client: redis.Redis, prefix: str) -> list[Run]:
    lines: list[bytes] = client.lrange(f"{prefix}:log", 0, -1)  # type: ignore[assignment]
    return parse_runs(line.decode() for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "redis_url", "prefix", "name"):
        parser.add_argument(name)
    parser.add_argument("--leases", action="store_true")
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis_url)
    log = RedisRunLog(client, args.prefix, args.name)
    slow = {m.decode() for m in client.smembers(f"{args.prefix}:slow")}  # type: ignore[union-attr]

    def hook(record: Record) -> None:
        ident = (record.value or b"").decode()
        if ident in slow and client.set(f"{args.prefix}:first:{ident}", args.name, nx=True):
            # Short BLPOPs: one longer than the client's socket timeout would raise.
            deadline = time.monotonic() + 90
            while not client.blpop([f"{args.prefix}:release:{ident}"], timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{ident} was never released")

    scheduler: TenantTaskCoordinator | None = None
    if args.leases:
        scheduler = TenantTaskCoordinator(
            max_concurrency=16,
            max_queue_size=10_000,
            name=f"{args.prefix}-keys",
            leases=RedisLeases(args.redis_url, prefix=f"{args.prefix}:lease:"),
            lease_at_most_for=LEASE_AT_MOST_FOR,
        )
    config: dict[str, Any] = {
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": SESSION_TIMEOUT_MS,
        "heartbeat.interval.ms": 500,
        "log_level": 3,
    }
    consumer = KeyedConsumer(
        config,
        [args.topic],
        logging_handler(log, hook=hook),
        max_concurrency=16,
        scheduler=scheduler,
        commit_interval=0.2,
        revoke_timeout=REVOKE_TIMEOUT,
        drain_timeout=5,
    )
    started = time.monotonic()
    consumer.run()
    print("drained", consumer.stats().completed, round(time.monotonic() - started, 1), flush=True)
    if scheduler is not None:
        scheduler.close(wait=False)


if __name__ == "__main__":
    main()
