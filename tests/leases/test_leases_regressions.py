"""Regression tests for races and hangs found in review, one section per finding.

Each test forces its interleaving deterministically: events and monkeypatched hooks hold a
window open where the bug lived, and real servers are frozen with ``SIGSTOP`` where the bug was
about a server that stops answering. The only bounded waits (``join``, ``wait``, ``wait_until``
with a timeout) tell "it happened" from "it hung": none measures speed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reactivex import operators as ops

from rxcoord.leases import (
    DistributedLease,
    LeaseLost,
    LeaseProviderClosed,
    LeaseStoreUnavailable,
    MemoryLeases,
    MemoryLeaseStore,
    PostgresLeases,
    RedisLeases,
)
from rxcoord.leases._notify import Listener, WaitHub, Watch

from .conftest import (
    Backend,
    ThrowawayPostgres,
    ThrowawayRedis,
    drop_table,
    start_redis,
    wait_until,
)

LISTENING_BACKENDS = [
    pytest.param("postgres", id="postgres", marks=pytest.mark.backend),
    pytest.param("redis", id="redis", marks=pytest.mark.backend),
]


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` on a daemon thread; the list receives its result or exception."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- 1. lock(): a loss found by keep-alive is raised on exit ----------------------------------


def test_lock_raises_lease_lost_on_exit_when_keep_alive_found_the_loss(
    backend: Backend, name: str
) -> None:
    holder, other = backend.new(), backend.new()
    told = threading.Event()
    thieves: list[DistributedLease] = []

    def block() -> None:
        with holder.lock(name, at_most_for=0.3, keep_alive=True) as lease:
            lease.on_lost(lambda _error: told.set())
            lease.stop_keep_alive()  # a pause: the lease expires on the store
            thieves.append(other.acquire(name, 5.0, timeout=10.0))
            lease.start_keep_alive()  # its next renewal finds the lease gone
            assert told.wait(10)
            assert lease.lost

    with pytest.raises(LeaseLost):
        block()
    assert thieves[0].held  # the exit did not touch the new holder's lease
    thieves[0].release()


# -- 2. extend() to a shorter duration reschedules keep-alive ---------------------------------


def test_extend_to_a_shorter_duration_reschedules_keep_alive(backend: Backend, name: str) -> None:
    holder, other = backend.new(), backend.new()
    lease = holder.acquire(name, at_most_for=60.0, keep_alive=True)  # next renewal in 20 s
    lease.extend(0.3)  # from now on renewed every 0.1 s
    # One explicit extension, then renewals for longer than the new at_most_for: the lease
    # would have expired by now without them.
    wait_until(lambda: lease.stats().extensions >= 4, what="renewals at the new period")
    assert other.try_acquire(name, 5.0) is None
    assert lease.held
    lease.release()


# -- 3. a server that stops answering: no hang, loss reported by the lease's expiry -----------


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


# -- 4. acquire_rx: a disposal overlapping the emission leaks nothing --------------------------


# The disposal overlapping the emission (the lease taken from its Waiter, the observer stopped
# before on_next): see test_leases_waiting.py, which pins the new rule (the subscriber's callback
# receives it; a disposal before the taking releases it).


def test_acquire_rx_leaves_the_lease_to_a_subscriber_that_disposes_on_receipt(
    name: str,
) -> None:
    """``first()`` disposes upstream on the emitting thread: the lease was received."""
    with MemoryLeases() as leases:
        got: list[DistributedLease] = []
        received = threading.Event()

        def on_next(lease: DistributedLease) -> None:
            got.append(lease)
            received.set()

        leases.acquire_rx(name, 30.0).pipe(ops.first()).subscribe(on_next)
        assert received.wait(10)
        assert got[0].held
        got[0].release()


# -- 5. PostgreSQL: one table, however spelled, one set of channels ----------------------------


@pytest.mark.backend
def test_postgres_providers_spelling_the_table_differently_wake_each_other(
    monkeypatch: pytest.MonkeyPatch, postgres_url: str, name: str
) -> None:
    table = f"alias_{uuid.uuid4().hex[:10]}"
    holder = PostgresLeases(postgres_url, table=table, timeout=2.0)
    waiter = PostgresLeases(postgres_url, table=f"public.{table}", timeout=2.0)
    subscribed = threading.Event()
    acked = Listener._acked

    def watch_acks(self: Listener, lease_name: str) -> None:
        acked(self, lease_name)
        if self is waiter._listener:
            subscribed.set()

    monkeypatch.setattr(Listener, "_acked", watch_acks)
    try:
        lease = holder.acquire(name, at_most_for=60.0)
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        assert subscribed.wait(10)  # the waiter listens: from now on it sleeps until notified
        lease.release()
        wait.join(15)
        assert not wait.is_alive(), "the waiter was not woken by the release"
        assert isinstance(outcome[0], DistributedLease), outcome
        assert waiter.stats().notifications >= 1
        outcome[0].release()
    finally:
        holder.close()
        waiter.close()
        drop_table(postgres_url, table)


# -- 6. keep-alive restarted after a failed release survives the renewal in flight ------------


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


# -- 7. close() racing release() leaves nothing held ------------------------------------------


def test_close_releases_a_lease_whose_release_it_interrupted(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    store = MemoryLeaseStore()
    leases, other = MemoryLeases(store), MemoryLeases(store)
    lease = leases.acquire(name, at_most_for=30.0)
    entered, proceed = threading.Event(), threading.Event()
    release = leases._release_lease

    def held_release(held: DistributedLease) -> bool:
        entered.set()
        proceed.wait(10)  # release() is under way ("releasing") while close() starts
        return release(held)  # finds the provider closing: LeaseProviderClosed

    monkeypatch.setattr(leases, "_release_lease", held_release)
    releasing, outcome = in_thread(lease.release)
    assert entered.wait(10)
    closer, _ = in_thread(leases.close)
    wait_until(lambda: leases.closed)
    closer.join(0.5)  # give close() time to reach the lease (it now waits for the release)
    proceed.set()
    releasing.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert isinstance(outcome[0], LeaseProviderClosed), outcome
    assert lease.released  # close() released it, as LeaseProviderClosed promises
    again = other.try_acquire(name, 5.0)
    assert again is not None
    again.release()
    other.close()


# -- 8. a waiter arriving as the last one leaves keeps a confirmed subscription ----------------


@pytest.mark.parametrize("backend", LISTENING_BACKENDS, indirect=True)
def test_a_subscription_kept_for_a_new_waiter_stays_confirmed(
    monkeypatch: pytest.MonkeyPatch, backend: Backend, name: str
) -> None:
    leases = backend.new()
    hold, held, go = threading.Event(), threading.Event(), threading.Event()
    take_changes = Listener._take_changes

    def held_take_changes(self: Listener) -> tuple[list[str], list[str]]:
        if hold.is_set():
            held.set()
            go.wait(10)  # the listener thread acts only after the new waiter arrived
        return take_changes(self)

    monkeypatch.setattr(Listener, "_take_changes", held_take_changes)
    hub: WaitHub = leases._hub
    first = hub.watch(name)
    try:
        wait_until(lambda: first.confirmed, what="the first subscription")
        hold.set()
        first.close()  # the last waiter leaves...
        assert held.wait(10)
        second = hub.watch(name)  # ...and a new one arrives before the listener acts
        hold.clear()
        go.set()
        try:
            # Otherwise it would never be confirmed, and its waiter would poll forever.
            wait_until(lambda: second.confirmed, 5.0, "the kept subscription to stay confirmed")
        finally:
            second.close()
    finally:
        go.set()
        first.close()


# -- 9. RedisLeases(client=...) with decode_responses=True still wakes waiters ----------------


@pytest.mark.backend
def test_redis_client_with_decode_responses_still_wakes_waiters(redis_url: str, name: str) -> None:
    import redis

    prefix = f"decode:{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    holder = RedisLeases(client=client, prefix=prefix, timeout=2.0)
    waiter = RedisLeases(client=client, prefix=prefix, timeout=2.0)
    try:
        lease = holder.acquire(name, at_most_for=60.0)
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        channel = f"{prefix}{{{name}}}:released"  # the key scheme in RedisLeases' docstring
        wait_until(
            lambda: dict(client.pubsub_numsub(channel)).get(channel) == 1,
            what="the waiter's subscription",
        )
        lease.release()
        wait.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
        # The release's message reaches the listener and is understood (with str replies it
        # never matched). Waited for, not asserted at once: under load the waiter's last
        # poll before its subscription was confirmed can take the lease first.
        wait_until(lambda: waiter.stats().notifications >= 1, what="the release notification")
        outcome[0].release()
    finally:
        holder.close()
        waiter.close()
        client.close()


# -- also: a release between a waiter's failed try and its registration wakes it ---------------


def test_a_release_between_the_failed_try_and_the_registration_is_not_missed(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    store = MemoryLeaseStore()
    holder, waiter = MemoryLeases(store), MemoryLeases(store)
    lease = holder.acquire(name, at_most_for=60.0)
    watch = WaitHub.watch

    def late_watch(
        self: WaitHub, watched: str, callback: Callable[[], object] | None = None
    ) -> Watch:
        if self is waiter._hub and lease.held:
            lease.release()  # notifies before the waiter is registered: nobody hears it
        return watch(self, watched, callback)

    monkeypatch.setattr(WaitHub, "watch", late_watch)
    try:
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        wait.join(10)
        assert not wait.is_alive(), "the waiter sleeps until the old holder's expiry"
        assert isinstance(outcome[0], DistributedLease), outcome
        outcome[0].release()
    finally:
        holder.close()
        waiter.close()
