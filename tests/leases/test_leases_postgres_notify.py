"""PostgreSQL: a release notifies only when a waiter marked its row, and no waiter is missed.

The release's ``pg_notify`` is skipped unless a waiter's failed attempt set ``waited`` on the
row (see "Notifications only when someone waits" in ``rxcoord/leases/_backends/_postgres.py``).
These tests check both halves: nothing is sent when nobody waits, and a waiter that sleeps
until notified (its lease would take a minute to expire) is woken by every release, however the
release races with its attempts.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rxcoord import LeaseReleasedError, LockTimeout
from rxcoord.leases import DistributedLease, PostgresLeases
from rxcoord.leases._backends._postgres import channel_for

from .conftest import drop_table, in_thread, pg_row_waited, wait_until

pytestmark = pytest.mark.backend


@pytest.fixture
def table(postgres_url: str) -> Iterator[str]:
    name = f"notify_{uuid.uuid4().hex[:10]}"
    yield name
    drop_table(postgres_url, name)


def _listen(url: str, table: str, name: str) -> Any:
    """A raw connection LISTENing on the lease's channel."""
    import psycopg
    from psycopg import sql

    conn = psycopg.connect(url, autocommit=True)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_for(("public", table), name))))
    return conn


def _received(conn: Any, timeout: float) -> int:
    return sum(1 for _ in conn.notifies(timeout=timeout, stop_after=1))


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "non-durable"])
@pytest.mark.parametrize("at_least_for", [0.0, 0.05], ids=["deleted", "kept"])
def test_a_release_notifies_only_when_someone_waits(
    postgres_url: str, table: str, name: str, durable: bool, at_least_for: float
) -> None:
    holder = PostgresLeases(postgres_url, table=table, durable=durable, timeout=5.0)
    waiter = PostgresLeases(postgres_url, table=table, durable=durable, timeout=5.0)
    try:
        holder.try_acquire("setup", 5.0).release()  # type: ignore[union-attr]  # creates it
        listener = _listen(postgres_url, table, name)
        try:
            lease = holder.try_acquire(name, 60.0, at_least_for)
            assert lease is not None
            assert waiter.try_acquire(name, 60.0) is None  # tried once: not a waiter
            assert not pg_row_waited(postgres_url, table, name)
            lease.release()
            assert _received(listener, 0.3) == 0, "a release nobody waited for notified"
            time.sleep(at_least_for)

            lease = holder.try_acquire(name, 60.0, at_least_for)
            assert lease is not None
            wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
            wait_until(lambda: pg_row_waited(postgres_url, table, name), what="the mark")
            lease.release()
            assert _received(listener, 10.0) == 1, "a release a waiter waited for was silent"
            wait.join(15)
            assert isinstance(outcome[0], DistributedLease), outcome
            outcome[0].release()
        finally:
            listener.close()
    finally:
        holder.close()
        waiter.close()


def test_a_grant_clears_the_mark_a_waiter_left_and_a_waiters_grant_is_marked(
    postgres_url: str, table: str, name: str
) -> None:
    holder = PostgresLeases(postgres_url, table=table)
    waiter = PostgresLeases(postgres_url, table=table)
    try:
        lease = holder.try_acquire(name, 2.0)
        assert lease is not None
        # A waiter marks the row, then gives up.
        wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=1.5))
        wait_until(lambda: pg_row_waited(postgres_url, table, name), what="the mark")
        wait.join(15)
        assert isinstance(outcome[0], LockTimeout), outcome
        # Expired by the store's clock (the local view may run ahead of the server's grant
        # time under load): holder() reads the row with clock_timestamp().
        wait_until(lambda: holder.holder(name) is None, what="the lease's expiry")
        again = holder.try_acquire(name, 60.0)  # takes the expired row over: nobody waits
        assert again is not None
        assert not pg_row_waited(postgres_url, table, name)
        again.release()

        # The grant a waiter wins is marked: the rest of its queue sleeps until its release.
        lease = holder.acquire(name, 60.0)
        waits = [in_thread(lambda: waiter.acquire(name, 60.0, timeout=30.0)) for _ in range(2)]
        wait_until(lambda: waiter.stats().waiting == 2, what="two waiters")
        wait_until(lambda: pg_row_waited(postgres_url, table, name), what="the mark")
        lease.release()
        wait_until(lambda: any(outcome for _, outcome in waits), what="the first waiter's lease")
        assert pg_row_waited(postgres_url, table, name)
        for _, outcome in waits:
            if outcome:
                assert isinstance(outcome[0], DistributedLease), outcome
                outcome[0].release()  # notifies: the other waiter is woken, not left a minute
        for thread, outcome in waits:
            thread.join(15)
            assert isinstance(outcome[0], DistributedLease), outcome
        for _, outcome in waits:
            got = outcome[0]
            assert isinstance(got, DistributedLease)
            with contextlib.suppress(LeaseReleasedError):
                got.release()
    finally:
        holder.close()
        waiter.close()


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "non-durable"])
def test_every_release_wakes_a_waiter_however_it_races_the_waiters_attempts(
    postgres_url: str, table: str, name: str, durable: bool
) -> None:
    """Releases at random moments around the waiter's attempts (its first one, the one after
    its LISTEN is confirmed, or later), from another provider. The holder's leases last a
    minute and a confirmed waiter does not poll: a lost wake-up fails the round's timeout.
    A second holder takes the name over now and then, so the waiter also fails on grants it
    has not marked yet."""
    rng = random.Random(1234)
    holder = PostgresLeases(postgres_url, table=table, durable=durable, timeout=5.0)
    rival = PostgresLeases(postgres_url, table=table, durable=durable, timeout=5.0)
    waiter = PostgresLeases(postgres_url, table=table, durable=durable, timeout=5.0)
    try:
        holder.try_acquire(name, 1.0).release()  # type: ignore[union-attr]  # creates it
        for round_ in range(60):
            lease = holder.acquire(name, 60.0, timeout=10.0)
            wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=10.0))
            time.sleep(rng.choice([0.0, 0.0005, 0.002, 0.005, 0.02]))
            if round_ % 4 == 3:
                # Hand the name to a rival (release, then take at once) before releasing it,
                # unless the waiter was quicker.
                lease.release()
                taken = rival.try_acquire(name, 60.0)
                if taken is not None:
                    time.sleep(rng.choice([0.0, 0.002, 0.02]))
                    taken.release()
            else:
                lease.release()
            wait.join(15)
            assert not wait.is_alive(), f"round {round_}: the waiter was never woken"
            got = outcome[0]
            assert isinstance(got, DistributedLease), (round_, got)
            got.release()
        assert waiter.stats().notifications >= 1
    finally:
        holder.close()
        rival.close()
        waiter.close()


def test_waiters_of_several_providers_are_all_served(
    postgres_url: str, table: str, name: str
) -> None:
    """Several providers wait for one name held a minute at a time: each release wakes them,
    the losers mark the winner's grant, and its release wakes them again, down to the last."""
    providers = [PostgresLeases(postgres_url, table=table, timeout=5.0) for _ in range(4)]
    try:
        first = providers[0].acquire(name, 60.0, timeout=10.0)
        served: list[int] = []
        lock = threading.Lock()

        def wait_then_hold(i: int) -> None:
            lease = providers[i].acquire(name, 60.0, timeout=20.0)
            with lock:
                served.append(i)
            time.sleep(0.01)
            lease.release()

        threads = [in_thread(functools.partial(wait_then_hold, i))[0] for i in range(1, 4)]
        wait_until(lambda: pg_row_waited(postgres_url, table, name), what="a waiter's mark")
        first.release()
        for thread in threads:
            thread.join(30)
        assert sorted(served) == [1, 2, 3]
    finally:
        for provider in providers:
            provider.close()
