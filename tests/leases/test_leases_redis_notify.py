"""Redis: a release publishes only when a waiter marked the lease, and no waiter is missed.

The release's ``PUBLISH`` is skipped unless a waiter's attempt left the mark (a ``!`` at the
end of the lease's value; see "Notifications only when someone waits" in
``rxcoord/leases/_backends/_redis.py``). Both halves, on a server and on a cluster: nothing is
published when nobody waits, and a waiter that sleeps until notified (the leases last a minute)
is woken by every release, however the release races with its attempts.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rxcoord import LeaseReleasedError, LockTimeout
from rxcoord.leases import DistributedLease, RedisLeases

from .conftest import STORES, Backend, in_thread, wait_until

pytestmark = pytest.mark.backend


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    result = STORES[request.param](request, tmp_path, uuid.uuid4().hex[:12])
    try:
        yield result
    finally:
        for provider in result.providers:
            provider.close()


def _new(backend: Backend) -> RedisLeases:
    provider = backend.new(timeout=5.0)
    assert isinstance(provider, RedisLeases)
    return provider


def _client(backend: Backend) -> Any:
    assert backend.url is not None
    if backend.id == "redis-cluster":
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(backend.url)
    import redis

    return redis.Redis.from_url(backend.url)


def _marked(backend: Backend, provider: RedisLeases, name: str) -> bool:
    """Whether a waiter has marked the lease of ``name``."""
    client = _client(backend)
    try:
        value = client.get(provider._key(name))
    finally:
        client.close()
    return bool(value) and value.endswith(b"!")


class Channel:
    """A raw subscriber to a lease's release channel (any node hears a cluster's PUBLISH)."""

    def __init__(self, backend: Backend, provider: RedisLeases, name: str) -> None:
        import redis

        assert backend.url is not None
        self.client = redis.Redis.from_url(backend.url)
        self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        self.pubsub.subscribe(provider._channel(name))
        assert self.pubsub.get_message(timeout=5.0) is not None  # the subscribe confirmation

    def received(self, timeout: float) -> int:
        message = self.pubsub.get_message(timeout=timeout)
        return 0 if message is None else 1

    def close(self) -> None:
        self.pubsub.close()
        self.client.close()


@pytest.mark.parametrize("at_least_for", [0.0, 0.05], ids=["deleted", "kept"])
def test_a_release_publishes_only_when_someone_waits(
    redis_backend: Backend, name: str, at_least_for: float
) -> None:
    holder = _new(redis_backend)
    waiter = _new(redis_backend)
    channel = Channel(redis_backend, holder, name)
    try:
        lease = holder.try_acquire(name, 60.0, at_least_for)
        assert lease is not None
        assert waiter.try_acquire(name, 60.0) is None  # tried once: not a waiter
        assert not _marked(redis_backend, holder, name)
        lease.release()
        assert channel.received(0.3) == 0, "a release nobody waited for published"
        time.sleep(at_least_for)

        lease = holder.try_acquire(name, 60.0, at_least_for)
        assert lease is not None
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        wait_until(lambda: _marked(redis_backend, holder, name), what="the mark")
        lease.release()
        assert channel.received(10.0) == 1, "a release a waiter waited for was silent"
        wait.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
        outcome[0].release()
    finally:
        channel.close()


def test_a_grant_clears_the_mark_and_a_waiters_grant_is_marked(
    redis_backend: Backend, name: str
) -> None:
    holder = _new(redis_backend)
    waiter = _new(redis_backend)
    lease = holder.try_acquire(name, 2.0)
    assert lease is not None
    # A waiter marks the lease, then gives up.
    wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=1.5))
    wait_until(lambda: _marked(redis_backend, holder, name), what="the mark")
    wait.join(15)
    assert isinstance(outcome[0], LockTimeout), outcome
    wait_until(lambda: holder.holder(name) is None, what="the lease's expiry")
    again = holder.try_acquire(name, 60.0)  # a new grant: nobody waits
    assert again is not None
    assert not _marked(redis_backend, holder, name)
    again.release()

    # The grant a waiter wins is marked: the rest of its queue sleeps until its release.
    lease = holder.acquire(name, 60.0)
    waits = [in_thread(lambda: waiter.acquire(name, 60.0, timeout=30.0)) for _ in range(2)]
    wait_until(lambda: waiter.stats().waiting == 2, what="two waiters")
    wait_until(lambda: _marked(redis_backend, holder, name), what="the mark")
    lease.release()
    wait_until(lambda: any(outcome for _, outcome in waits), what="the first waiter's lease")
    assert _marked(redis_backend, holder, name)
    for _, outcome in waits:
        if outcome:
            assert isinstance(outcome[0], DistributedLease), outcome
            outcome[0].release()  # publishes: the other waiter is woken, not left a minute
    for thread, outcome in waits:
        thread.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
    for _, outcome in waits:
        got = outcome[0]
        assert isinstance(got, DistributedLease)
        with contextlib.suppress(LeaseReleasedError):
            got.release()


def test_every_release_wakes_a_waiter_however_it_races_the_waiters_attempts(
    redis_backend: Backend, name: str
) -> None:
    """Releases at random moments around the waiter's attempts (its first one, the one after
    its subscription is confirmed, or later), from another provider. The leases last a minute
    and a confirmed waiter does not poll: a lost wake-up fails the round's timeout. A rival
    takes the name over now and then, so the waiter also fails on grants it has not marked."""
    rng = random.Random(1234)
    holder = _new(redis_backend)
    rival = _new(redis_backend)
    waiter = _new(redis_backend)
    for round_ in range(60):
        lease = holder.acquire(name, 60.0, timeout=10.0)
        wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=10.0))
        time.sleep(rng.choice([0.0, 0.0005, 0.002, 0.005, 0.02]))
        if round_ % 4 == 3:
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


def test_waiters_of_several_providers_are_all_served(redis_backend: Backend, name: str) -> None:
    providers = [_new(redis_backend) for _ in range(4)]
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
    wait_until(lambda: _marked(redis_backend, providers[0], name), what="a waiter's mark")
    first.release()
    for thread in threads:
        thread.join(30)
    assert sorted(served) == [1, 2, 3]


def test_a_marked_lease_extends_and_reads_as_any_other(redis_backend: Backend, name: str) -> None:
    holder = _new(redis_backend)
    waiter = _new(redis_backend)
    lease = holder.try_acquire(name, 1.0, 0.5)
    assert lease is not None
    wait, outcome = in_thread(lambda: waiter.acquire(name, 60.0, timeout=30.0))
    wait_until(lambda: _marked(redis_backend, holder, name), what="the mark")
    read = holder.holder(name)
    assert read is not None
    assert read.token == lease.token
    assert not read.released
    assert holder._store_extend(name, lease.token, 60.0)
    assert _marked(redis_backend, holder, name), "an extension keeps the mark"
    lease.release()  # inside at_least_for: kept as released, and the waiter is told
    wait.join(15)
    assert isinstance(outcome[0], DistributedLease), outcome
    outcome[0].release()
