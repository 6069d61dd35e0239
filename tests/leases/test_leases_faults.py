"""Store outages and restarts, against servers these tests may stop and start.

PostgreSQL and Redis: throwaway servers are stopped (and crashed) for real. SQLite has no server;
its outage is another process holding the database's exclusive lock past the provider's timeout,
and its restart is closing every connection and reopening the file. MemoryLeases has no store
apart from the process, so it has nothing to lose or restart (explicit skips below).

A server that stops answering without closing its sockets is a real server frozen with
``SIGSTOP``; a single failed call (a blip) is forced on MemoryLeases by a monkeypatched store
step. The only bounded waits there tell "it happened" from "it hung": none measures speed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.servers import ThrowawayPostgres, ThrowawayRedis, start_redis
from support.waiting import wait_until

from rxcoord.leases import (
    DistributedLease,
    LeaseLost,
    LeaseProvider,
    LeaseStoreUnavailable,
    MemoryLeases,
    MemoryLeaseStore,
    PostgresLeases,
    RedisLeases,
    SqliteLeases,
)

from .conftest import drop_table, in_thread


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


# -- a server that stops answering: no hang, loss reported by the lease's expiry ------------


def _cluster_pids(server: ThrowawayPostgres) -> list[int]:
    """The postmaster and its children (read from /proc: no ps needed)."""
    master = int((server.data / "postmaster.pid").read_text().split()[0])
    pids = [master]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == master:
            pids.append(int(entry.name))
    return pids


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@pytest.mark.backend
def test_a_frozen_postgres_fails_calls_reports_loss_and_lets_close_return(
    postgres_server: ThrowawayPostgres, name: str
) -> None:
    table = f"frozen_{uuid.uuid4().hex[:10]}"
    url = postgres_server.url
    # The keeper's own timeout is long: only capping renewals at the lease's remaining time
    # can report its loss in time.
    keeper = PostgresLeases(url, table=table, timeout=30.0)
    caller = PostgresLeases(url, table=table, timeout=0.5)
    pids: list[int] = []
    try:
        kept = keeper.acquire(name + "-kept", at_most_for=0.9, keep_alive=True)
        held = caller.acquire(name + "-held", at_most_for=30.0)
        told = threading.Event()
        kept.on_lost(lambda _error: told.set())
        pids = _cluster_pids(postgres_server)
        _signal_all(pids, signal.SIGSTOP)

        call, outcome = in_thread(lambda: caller.try_acquire(name, 5.0))
        call.join(15)
        assert not call.is_alive(), "a call to a frozen server hung"
        assert isinstance(outcome[0], LeaseStoreUnavailable), outcome

        assert told.wait(15), "keep-alive did not report the loss"
        assert kept.lost

        closer, _ = in_thread(caller.close)
        closer.join(15)
        assert not closer.is_alive(), "close() hung on a frozen server"
        assert held.lost  # not released: it expires on its own
    finally:
        _signal_all(pids, signal.SIGCONT)
        keeper.close()
        caller.close()
        drop_table(url, table)


@pytest.fixture
def own_redis() -> Iterator[ThrowawayRedis]:
    """A Redis server of this test's own, to freeze."""
    server = start_redis()
    try:
        yield server
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.remove()


@pytest.mark.backend
def test_a_frozen_redis_keep_alive_reports_the_loss_by_the_expiry(
    own_redis: ThrowawayRedis, name: str
) -> None:
    assert own_redis.proc is not None
    with RedisLeases(own_redis.url, timeout=30.0) as leases:
        kept = leases.acquire(name, at_most_for=0.6, keep_alive=True)
        told = threading.Event()
        kept.on_lost(lambda _error: told.set())
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            # Without the cap the renewal would wait for the 30 s socket timeout.
            assert told.wait(15), "keep-alive did not report the loss"
            assert kept.lost
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)


# -- a release that fails on a blip: keep-alive restarted, the renewal in flight survives ---


def test_keep_alive_restarted_by_a_failed_release_survives_a_renewal_in_flight(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    store = MemoryLeaseStore()
    leases, other = MemoryLeases(store), MemoryLeases(store)
    in_extend, finish_extend = threading.Event(), threading.Event()
    tick_decided, finish_tick = threading.Event(), threading.Event()
    in_release, fail_release = threading.Event(), threading.Event()
    extend, release, tick = (
        leases._extend_lease,
        leases._release_lease,
        DistributedLease._keep_alive_tick,
    )
    first_extend, first_release = [True], [True]

    def slow_extend(lease: DistributedLease, most: float, **kwargs: object) -> bool:
        if first_extend[0]:
            first_extend[0] = False
            in_extend.set()
            finish_extend.wait(10)  # the first renewal stays in flight
        return extend(lease, most, **kwargs)  # type: ignore[arg-type]

    def failing_release(lease: DistributedLease) -> bool:
        if first_release[0]:
            first_release[0] = False
            in_release.set()
            fail_release.wait(10)
            raise LeaseStoreUnavailable("a blip")
        return release(lease)

    def held_tick(self: DistributedLease) -> float | None:
        delay = tick(self)
        if delay is None and not tick_decided.is_set():
            tick_decided.set()  # decided to stop (the lease was being released)...
            finish_tick.wait(10)  # ...and finishes only after keep-alive was restarted
        return delay

    monkeypatch.setattr(leases, "_extend_lease", slow_extend)
    monkeypatch.setattr(leases, "_release_lease", failing_release)
    monkeypatch.setattr(DistributedLease, "_keep_alive_tick", held_tick)
    try:
        lease = leases.acquire(name, at_most_for=0.6, keep_alive=True)  # renewed every 0.2 s
        assert in_extend.wait(10)
        releasing, outcome = in_thread(lease.release)
        assert in_release.wait(10)
        finish_extend.set()
        assert tick_decided.wait(10)
        fail_release.set()
        releasing.join(10)
        assert isinstance(outcome[0], LeaseStoreUnavailable), outcome
        assert lease.held
        assert lease.keep_alive  # restarted
        finish_tick.set()
        # The restarted renewals go on: more of them than fit in one at_most_for.
        wait_until(lambda: lease.stats().extensions >= 4, 10.0, "the restarted renewals")
        assert leases.stats().keep_alive == 1
        assert other.try_acquire(name, 5.0) is None
        lease.release()
    finally:
        finish_extend.set()
        fail_release.set()
        finish_tick.set()
        leases.close()
        other.close()


@pytest.mark.slow
def test_a_fleet_fails_new_jobs_while_its_store_is_down_and_recovers(store: Store) -> None:
    from rxcoord import TenantTaskCoordinator

    coordinator = TenantTaskCoordinator(
        name=f"fleet-{uuid.uuid4().hex[:8]}",
        max_concurrency=2,
        fleet=store.make(),
        permit_at_most_for=60.0,
    )
    try:
        assert coordinator.execute(lambda: "up").run() == "up"
        store.down()
        try:
            # Refused within the provider's timeout, with the store's error: not a hang.
            with pytest.raises(LeaseStoreUnavailable):
                coordinator.execute(lambda: "never").run()
            stats = coordinator.stats()
            assert stats.running == 0
            assert stats.fleet is not None
            assert stats.fleet.store_errors >= 1
        finally:
            store.up()
        # Back: the next job is admitted (no error left to retry, no permit leaked).
        assert coordinator.execute(lambda: "up again").run() == "up again"
    finally:
        coordinator.close()
