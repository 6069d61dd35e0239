"""A release signals only when a waiter marked the lease, and no waiter is missed.

The release's signal (Redis: ``PUBLISH``; PostgreSQL: ``pg_notify``) is skipped unless a
waiter's failed attempt left a mark (Redis: a ``!`` at the end of the lease's value;
PostgreSQL: ``waited`` set on the row; see "Notifications only when someone waits" in
``rxcoord/leases/_backends/_redis.py`` and ``_postgres.py``). The same tests check both halves
on every store that notifies (a Redis server, a Redis Cluster, PostgreSQL with durable and
non-durable tables): nothing is signalled when nobody waits, and a waiter that sleeps until
woken (the leases last a minute) is woken by every release, however the release races with
its attempts.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from support.stores import redis_client
from support.waiting import wait_until

from rxcoord import LeaseReleasedError, LockTimeout
from rxcoord.leases import DistributedLease, LeaseProvider, RedisLeases
from rxcoord.leases._backends._postgres import channel_for

from .conftest import Backend, in_thread, pg_row_waited

pytestmark = pytest.mark.backend


@dataclass
class Listener:
    """A raw subscriber to one lease's release signal."""

    received: Callable[[float], int]  # 1 if a signal arrives within the timeout (s), else 0
    close: Callable[[], object]


class Notifying:
    """A notifying store under test, with a raw view of its marks and its release signals."""

    signalled = ""  # the signal's verb, for the messages

    def __init__(self, backend: Backend, **options: object) -> None:
        self.backend = backend
        self.options = options

    def new(self) -> LeaseProvider:
        return self.backend.new(timeout=5.0, **self.options)

    def prepare(self) -> None:
        """Before the test listens or reads marks."""

    def marked(self, name: str) -> bool:
        """Whether a waiter has marked the lease of ``name``."""
        raise NotImplementedError

    def listen(self, name: str) -> Listener:
        raise NotImplementedError


class RedisNotifying(Notifying):
    signalled = "published"

    def __init__(self, backend: Backend, **options: object) -> None:
        super().__init__(backend, **options)
        names = backend.new()  # the store's key and channel names
        assert isinstance(names, RedisLeases)
        self.names = names

    def marked(self, name: str) -> bool:
        assert self.backend.url is not None
        client = redis_client(self.backend.url, cluster=self.backend.id == "redis-cluster")
        try:
            value = client.get(self.names._key(name))
        finally:
            client.close()
        return bool(value) and value.endswith(b"!")

    def listen(self, name: str) -> Listener:
        # A plain client: any node hears a cluster's PUBLISH.
        assert self.backend.url is not None
        client = redis_client(self.backend.url)
        pubsub = client.pubsub()
        pubsub.subscribe(self.names._channel(name))
        assert pubsub.get_message(timeout=5.0) is not None  # the subscribe confirmation

        def close() -> None:
            pubsub.close()
            client.close()

        return Listener(lambda timeout: int(pubsub.get_message(timeout=timeout) is not None), close)


class PostgresNotifying(Notifying):
    signalled = "notified"

    @property
    def table(self) -> str:
        return str(self.backend.options["table"])

    def prepare(self) -> None:
        # The table, made by a provider with the durability under test.
        self.new().try_acquire("setup", 5.0).release()  # type: ignore[union-attr]

    def marked(self, name: str) -> bool:
        assert self.backend.url is not None
        return pg_row_waited(self.backend.url, self.table, name)

    def listen(self, name: str) -> Listener:
        import psycopg
        from psycopg import sql

        assert self.backend.url is not None
        conn = psycopg.connect(self.backend.url, autocommit=True)
        channel = channel_for(("public", self.table), name)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        return Listener(
            lambda timeout: sum(1 for _ in conn.notifies(timeout=timeout, stop_after=1)),
            conn.close,
        )


def stores(*ids: str) -> pytest.MarkDecorator:
    """Run the test on these notifying stores: the suite's ``backend`` fixture (a namespace of
    the test's own, closed and removed after it) with the provider options of each."""
    every = {
        "redis": ("redis", {}),
        "redis-cluster": ("redis-cluster", {}),
        "postgres": ("postgres", {}),
        "postgres-non-durable": ("postgres", {"durable": False}),
    }
    return pytest.mark.parametrize(
        ("backend", "options"), [pytest.param(*every[i], id=i) for i in ids], indirect=["backend"]
    )


EVERY = stores("redis", "redis-cluster", "postgres", "postgres-non-durable")
DURABLE = stores("redis", "redis-cluster", "postgres")
REDIS = stores("redis", "redis-cluster")


@pytest.fixture
def store(backend: Backend, options: dict[str, object]) -> Notifying:
    """The test's notifying store, seen through its marks and release signals."""
    view = RedisNotifying if backend.name == "redis" else PostgresNotifying
    notifying = view(backend, **options)
    notifying.prepare()
    return notifying


@pytest.mark.parametrize("at_least_for", [0.0, 0.05], ids=["deleted", "kept"])
@EVERY
def test_a_release_signals_only_when_someone_waits(
    store: Notifying, name: str, at_least_for: float
) -> None:
    holder = store.new()
    waiter = store.new()
    listener = store.listen(name)
    try:
        lease = holder.try_acquire(name, 60.0, at_least_for)
        assert lease is not None
        assert waiter.try_acquire(name, 60.0) is None  # tried once: not a waiter
        assert not store.marked(name)
        lease.release()
        assert listener.received(0.3) == 0, f"a release nobody waited for {store.signalled}"
        time.sleep(at_least_for)

        lease = holder.try_acquire(name, 60.0, at_least_for)
        assert lease is not None
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        wait_until(lambda: store.marked(name), what="the mark")
        lease.release()
        assert listener.received(10.0) == 1, "a release a waiter waited for was silent"
        wait.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
        outcome[0].release()
    finally:
        listener.close()


@DURABLE
def test_a_grant_clears_the_mark_a_waiter_left_and_a_waiters_grant_is_marked(
    store: Notifying, name: str
) -> None:
    holder = store.new()
    waiter = store.new()
    lease = holder.try_acquire(name, 2.0)
    assert lease is not None
    # A waiter marks the lease, then gives up.
    wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=1.5))
    wait_until(lambda: store.marked(name), what="the mark")
    wait.join(15)
    assert isinstance(outcome[0], LockTimeout), outcome
    # Expired by the store's clock (the local view may run ahead of the server's grant time
    # under load): holder() asks the store.
    wait_until(lambda: holder.holder(name) is None, what="the lease's expiry")
    again = holder.try_acquire(name, 60.0)  # takes the expired lease over: nobody waits
    assert again is not None
    assert not store.marked(name)
    again.release()

    # The grant a waiter wins is marked: the rest of its queue sleeps until its release.
    lease = holder.acquire(name, 60.0)
    waits = [in_thread(lambda: waiter.acquire(name, 60.0, timeout=30.0)) for _ in range(2)]
    wait_until(lambda: waiter.stats().waiting == 2, what="two waiters")
    wait_until(lambda: store.marked(name), what="the mark")
    lease.release()
    wait_until(lambda: any(outcome for _, outcome in waits), what="the first waiter's lease")
    assert store.marked(name)
    for _, outcome in waits:
        if outcome:
            assert isinstance(outcome[0], DistributedLease), outcome
            outcome[0].release()  # signals: the other waiter is woken, not left a minute
    for thread, outcome in waits:
        thread.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
    for _, outcome in waits:
        got = outcome[0]
        assert isinstance(got, DistributedLease)
        with contextlib.suppress(LeaseReleasedError):
            got.release()


@EVERY
def test_every_release_wakes_a_waiter_however_it_races_the_waiters_attempts(
    store: Notifying, name: str
) -> None:
    """Releases at random moments around the waiter's attempts (its first one, the one after
    its subscription is confirmed, or later), from another provider. The leases last a minute
    and a confirmed waiter does not poll: a lost wake-up fails the round's timeout. A rival
    takes the name over now and then, so the waiter also fails on grants it has not marked."""
    rng = random.Random(1234)
    holder = store.new()
    rival = store.new()
    waiter = store.new()
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


@DURABLE
def test_waiters_of_several_providers_are_all_served(store: Notifying, name: str) -> None:
    """Several providers wait for one name held a minute at a time: each release wakes them,
    the losers mark the winner's grant, and its release wakes them again, down to the last."""
    providers = [store.new() for _ in range(4)]
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
    wait_until(lambda: store.marked(name), what="a waiter's mark")
    first.release()
    for thread in threads:
        thread.join(30)
    assert sorted(served) == [1, 2, 3]


@REDIS
def test_a_marked_lease_extends_and_reads_as_any_other(store: Notifying, name: str) -> None:
    holder = store.new()
    waiter = store.new()
    lease = holder.try_acquire(name, 1.0, 0.5)
    assert lease is not None
    wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=30.0))
    wait_until(lambda: store.marked(name), what="the mark")
    read = holder.holder(name)
    assert read is not None
    assert read.token == lease.token
    assert not read.released
    assert holder._store_extend(name, lease.token, 60.0)
    assert store.marked(name), "an extension keeps the mark"
    lease.release()  # inside at_least_for: kept as released, and the waiter is told
    wait.join(15)
    assert isinstance(outcome[0], DistributedLease), outcome
    outcome[0].release()
