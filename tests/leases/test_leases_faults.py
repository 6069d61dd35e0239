"""Store outages and restarts, against servers these tests may stop and start.

PostgreSQL and Redis: throwaway servers are stopped (and crashed) for real. SQLite has no server;
its outage is another process holding the database's exclusive lock past the provider's timeout,
and its restart is closing every connection and reopening the file. MemoryLeases has no store
apart from the process, so it has nothing to lose or restart (explicit skips below).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rxcoord.leases import (
    LeaseLost,
    LeaseProvider,
    LeaseStoreUnavailable,
    PostgresLeases,
    RedisLeases,
    SqliteLeases,
)

from .conftest import (
    ThrowawayPostgres,
    ThrowawayRedis,
    drop_table,
    start_redis,
    wait_until,
)


@dataclass
class Store:
    """A store the test can take down and bring back."""

    id: str
    make: Callable[[], LeaseProvider]
    down: Callable[[], None]
    up: Callable[[], None]
    crash: Callable[[], None]
    keeps_data: bool  # leases and tokens survive down/up


def _store_params() -> list[object]:
    return [
        pytest.param("memory", id="memory"),
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.backend),
        pytest.param("redis", id="redis", marks=pytest.mark.backend),
    ]


@pytest.fixture(params=_store_params())
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind: str = request.param
    providers: list[LeaseProvider] = []

    def tracked(factory: Callable[[], LeaseProvider]) -> Callable[[], LeaseProvider]:
        def make() -> LeaseProvider:
            provider = factory()
            providers.append(provider)
            return provider

        return make

    if kind == "memory":
        pytest.skip("MemoryLeases keeps its store in the process: there is no store to lose")
    if kind == "sqlite":
        path = tmp_path / "leases.db"
        blocker: list[sqlite3.Connection] = []

        def down() -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")  # what a stuck writer in another process does
            blocker.append(conn)

        def up() -> None:
            while blocker:
                conn = blocker.pop()
                conn.execute("COMMIT")
                conn.close()

        def crash() -> None:
            for provider in providers:
                provider.close()  # every connection gone; only the file remains

        result = Store(
            kind, tracked(lambda: SqliteLeases(path, timeout=0.3)), down, up, crash, True
        )
        try:
            yield result
        finally:
            up()
            for provider in providers:
                provider.close()
        return
    if kind == "postgres":
        pg: ThrowawayPostgres = request.getfixturevalue("postgres_server")
        table = f"outage_{uuid.uuid4().hex[:10]}"
        result = Store(
            kind,
            tracked(lambda: PostgresLeases(pg.url, table=table, timeout=1.0)),
            pg.stop,
            pg.start,
            lambda: pg.stop("immediate"),
            True,
        )
        try:
            yield result
        finally:
            if not pg.running:
                pg.start()
            for provider in providers:
                provider.close()
            drop_table(pg.url, table)
        return
    rd: ThrowawayRedis = request.getfixturevalue("redis_server")
    prefix = f"outage:{uuid.uuid4().hex[:10]}:"
    result = Store(
        kind,
        tracked(lambda: RedisLeases(rd.url, prefix=prefix, timeout=2.0)),
        rd.stop,
        rd.start,
        rd.stop,
        False,  # started without persistence
    )
    try:
        yield result
    finally:
        if rd.proc is None:
            rd.start()
        for provider in providers:
            provider.close()


@pytest.mark.slow
def test_an_outage_gives_clear_errors_and_the_provider_recovers(store: Store) -> None:
    name = f"job-{uuid.uuid4().hex[:8]}"
    leases, other = store.make(), store.make()
    held = leases.acquire(name + "-held", at_most_for=60.0)
    busy = leases.acquire(name + "-busy", at_most_for=60.0)
    kept = leases.acquire(name + "-kept", at_most_for=0.6, keep_alive=True)
    told = threading.Event()
    kept.on_lost(lambda _error: told.set())
    waiter_errors: list[BaseException] = []

    def wait() -> None:
        try:
            other.acquire(name + "-busy", 5.0, timeout=30.0)
        except BaseException as exc:
            waiter_errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: other.stats().waiting == 1)

    store.down()
    try:
        with pytest.raises(LeaseStoreUnavailable, match="failed to grant") as caught:
            leases.try_acquire(name, 5.0)
        assert caught.value.__cause__ is not None  # the driver's error, kept for diagnosis
        assert isinstance(caught.value, ConnectionError)
        with pytest.raises(LeaseStoreUnavailable):
            held.release()
        assert held.held  # not released, not lost: the holder may retry
        # A waiter is not left hanging until its timeout: it learns the store is gone.
        waiter.join(15)
        assert not waiter.is_alive()
        assert len(waiter_errors) == 1
        assert isinstance(waiter_errors[0], LeaseStoreUnavailable)
        # Keep-alive could not renew before the lease may have expired: the holder is told.
        assert told.wait(15)
        assert kept.lost
        assert leases.stats().store_errors >= 2
    finally:
        store.up()

    # Back: the very next call works (stale connections are replaced, no error to retry).
    lease = leases.try_acquire(name, 5.0)
    assert lease is not None
    lease.release()
    for survivor in (held, busy):
        if store.keeps_data:
            survivor.release()  # the store kept the lease through the outage
        else:
            with pytest.raises(LeaseLost):
                survivor.release()  # a Redis without persistence restarted empty


@pytest.mark.slow
def test_tokens_survive_a_store_crash(store: Store) -> None:
    if not store.keeps_data:
        pytest.skip(
            "Redis without persistence forgets its counters on restart: tokens after a Redis "
            "restart are promised only with appendonly+appendfsync always (see the test below)"
        )
    name = f"job-{uuid.uuid4().hex[:8]}"
    first = store.make()
    lease = first.try_acquire(name, 5.0)
    assert lease is not None
    lease.release()
    assert first.holder(name) is None  # its row is deleted: the sequence carries the tokens
    unreleased = first.try_acquire(name, 0.3)  # granted and committed, never released
    assert unreleased is not None
    store.crash()
    store.up()
    time.sleep(0.3)  # let the unreleased lease expire
    again = store.make().acquire(name, 5.0, timeout=5.0)
    assert again.token > unreleased.token > lease.token
    again.release()


@pytest.fixture
def persistent_redis() -> Iterator[ThrowawayRedis]:
    server = start_redis(persistent=True)
    try:
        yield server
    finally:
        server.remove()


@pytest.mark.backend
def test_redis_tokens_survive_a_crash_with_fsynced_persistence(
    persistent_redis: ThrowawayRedis,
) -> None:
    import os
    import signal

    import redis

    name = f"job-{uuid.uuid4().hex[:8]}"
    with RedisLeases(persistent_redis.url, timeout=2.0) as leases:
        lease = leases.try_acquire(name, 5.0)
        assert lease is not None
        lease.release()
        with redis.Redis.from_url(persistent_redis.url) as client:
            assert client.keys("rxcoord:lease:*") == [b"rxcoord:lease:seq"]  # nothing per name
        assert persistent_redis.proc is not None
        os.kill(persistent_redis.proc.pid, signal.SIGKILL)  # a crash, no shutdown save
        persistent_redis.proc.wait(10)
        persistent_redis.proc = None
        persistent_redis.start()
        again = leases.try_acquire(name, 5.0)
        assert again is not None
        assert again.token > lease.token
        again.release()


@pytest.mark.slow
def test_the_first_call_after_a_quiet_restart_succeeds(store: Store) -> None:
    """Pooled connections went stale while nobody called: they are replaced, not reported."""
    name = f"job-{uuid.uuid4().hex[:8]}"
    leases = store.make()
    lease = leases.try_acquire(name, 5.0)  # the pool now holds an idle, connected connection
    assert lease is not None
    lease.release()
    store.down()
    store.up()
    again = leases.try_acquire(name, 5.0)
    assert again is not None
    again.release()
    assert leases.stats().store_errors == 0
