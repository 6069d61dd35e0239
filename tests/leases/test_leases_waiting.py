"""Waiting for a taken lease: no thread per waiter, and the grant never lost whoever leaves.

The first section is issue 11's requirement 1, over every backend: hundreds of waiters on one
taken name park no threads, and all of them then get the lease one after another. The others
force, one at a time, each race between a release and a waiter's registration or
subscription, between a grant and the waiter leaving (disposed, timed out, cancelled, provider
closed), and between close() and a release under way, deterministically: a monkeypatched step
holds the window open where the race lives, and the only bounded waits tell "it happened" from
"it hung".
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
from reactivex import abc
from reactivex import operators as ops
from support.execution import ManualScheduler
from support.waiting import until, wait_until

import rxcoord.leases._base as base_module
from rxcoord._core.waiter import Waiter
from rxcoord.leases import (
    DistributedLease,
    LeaseProvider,
    LeaseProviderClosed,
    LockTimeout,
    MemoryLeases,
    MemoryLeaseStore,
)
from rxcoord.leases._notify import Listener, WaitHub, Watch

from .conftest import Backend, in_thread

WAITERS = 300
# Threads a provider may add for any number of waiters: its round-trip workers, the listener
# (PostgreSQL, Redis) and rxcoord's shared timer thread, with room to spare.
EXTRA_THREADS = 8
# The backends whose waiters sleep until a release notifies them (a listener thread).
LISTENING_BACKENDS = [
    pytest.param("postgres", id="postgres", marks=pytest.mark.backend),
    pytest.param("redis", id="redis", marks=pytest.mark.backend),
]


class Sequential:
    """Checks that grants come one after another: never two holders at once, tokens rising."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.lock = threading.Lock()
        self.holding = 0
        self.overlaps = 0
        self.tokens: list[int] = []
        self.errors: list[BaseException] = []
        self.done = threading.Event()

    def enter(self, lease: DistributedLease) -> None:
        with self.lock:
            self.holding += 1
            if self.holding > 1:
                self.overlaps += 1
            self.tokens.append(lease.token)

    def leave(self) -> None:
        with self.lock:
            self.holding -= 1

    def failed(self, error: BaseException) -> None:
        with self.lock:
            self.errors.append(error)
        self.done.set()

    def finished_one(self) -> None:
        with self.lock:
            finished = len(self.tokens) == self.expected
        if finished:
            self.done.set()

    def check(self, holder: DistributedLease) -> None:
        assert self.errors == []
        assert self.overlaps == 0
        assert len(self.tokens) == self.expected  # none lost
        assert len(set(self.tokens)) == self.expected
        assert self.tokens == sorted(self.tokens)  # one grant after another
        assert self.tokens[0] > holder.token


def _wait_for_waiters(leases: LeaseProvider, count: int, peak: list[int]) -> None:
    def check() -> bool:
        peak[0] = max(peak[0], threading.active_count())
        return leases.stats().waiting == count

    wait_until(check, 60.0, f"{count} waiters")


def _quiet(leases: LeaseProvider) -> bool:
    stats = leases.stats()
    return stats.held == 0 and stats.waiting == 0


@pytest.mark.parametrize("form", ["acquire_rx", "run"])
def test_waiting_subscriptions_park_no_thread(backend: Backend, name: str, form: str) -> None:
    holder = backend.new().acquire(name, 60.0)
    leases = backend.new()
    seen = Sequential(WAITERS)
    baseline = threading.active_count()
    peak = [baseline]

    def on_lease(lease: DistributedLease) -> None:
        seen.enter(lease)
        seen.leave()
        lease.release()

    def job(lease: DistributedLease) -> int:
        seen.enter(lease)
        seen.leave()
        return lease.token

    subscriptions = []
    for _ in range(WAITERS):
        if form == "acquire_rx":
            source: Any = leases.acquire_rx(name, 30.0, timeout=120.0)
            subscriptions.append(
                source.subscribe(on_lease, seen.failed, on_completed=seen.finished_one)
            )
        else:
            source = leases.run(name, job, at_most_for=30.0, wait=True, timeout=120.0)
            subscriptions.append(source.subscribe(None, seen.failed, seen.finished_one))
        peak[0] = max(peak[0], threading.active_count())
    _wait_for_waiters(leases, WAITERS, peak)
    extra = peak[0] - baseline
    assert extra <= EXTRA_THREADS, f"{WAITERS} waiting subscriptions added {extra} threads"

    holder.release()
    assert seen.done.wait(100), f"{len(seen.tokens)} of {WAITERS} got the lease"
    seen.check(holder)
    wait_until(lambda: _quiet(leases), 10.0, "nothing held, nobody waiting")


async def test_waiting_tasks_park_no_thread(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 60.0)
    leases = backend.new()
    seen = Sequential(WAITERS)
    baseline = threading.active_count()
    peak = baseline

    async def waiter() -> None:
        async with leases.lock_async(name, 30.0, timeout=120.0) as lease:
            seen.enter(lease)
            seen.leave()

    tasks = [asyncio.create_task(waiter()) for _ in range(WAITERS)]
    for _ in range(30_000):  # state, not time: until every task waits
        peak = max(peak, threading.active_count())
        if leases.stats().waiting == WAITERS:
            break
        await asyncio.sleep(0.002)
    assert leases.stats().waiting == WAITERS
    extra = peak - baseline
    assert extra <= EXTRA_THREADS, f"{WAITERS} waiting tasks added {extra} threads"

    await holder.release_async()
    async with asyncio.timeout(100):
        await asyncio.gather(*tasks)
    seen.check(holder)
    assert _quiet(leases)


def test_one_release_costs_one_round_trip_per_provider_not_per_waiter(name: str) -> None:
    # Waiters of a name share one attempt at a time: no thundering herd on every release.
    with MemoryLeases() as leases:
        holder = leases.acquire(name, 60.0)
        attempts = [0]
        attempt = leases._attempt

        def counted(*args: Any) -> DistributedLease | float:
            attempts[0] += 1
            return attempt(*args)

        seen = Sequential(50)

        def on_lease(lease: DistributedLease) -> None:
            seen.enter(lease)
            seen.leave()
            lease.release()

        for _ in range(50):
            leases.acquire_rx(name, 30.0).subscribe(on_lease, seen.failed, seen.finished_one)
        wait_until(lambda: leases.stats().waiting == 50)
        setattr(leases, "_attempt", counted)  # noqa: B010  (an instance attribute, for mypy)
        holder.release()
        assert seen.done.wait(30)
        seen.check(holder)
        # About one attempt per grant (a wake-up racing an attempt costs one more), where a
        # herd would cost 50 + 49 + ... + 1.
        assert attempts[0] <= 3 * 50, attempts[0]


def test_waiters_of_one_provider_are_served_in_arrival_order(name: str) -> None:
    with MemoryLeases() as leases:
        holder = leases.acquire(name, 60.0)
        order: list[int] = []
        done = threading.Event()

        def on_lease(index: int) -> Callable[[DistributedLease], None]:
            def take(lease: DistributedLease) -> None:
                order.append(index)
                lease.release()
                if len(order) == 10:
                    done.set()

            return take

        for index in range(10):
            leases.acquire_rx(name, 30.0).subscribe(on_lease(index))
            wait_until(lambda index=index: leases.stats().waiting == index + 1)  # type: ignore[misc]
        holder.release()
        assert done.wait(10)
        assert order == list(range(10))


# -- release vs registration: no wake-up missed ---------------------------------------------


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


@pytest.mark.parametrize("backend", LISTENING_BACKENDS, indirect=True)
def test_a_subscription_kept_for_a_new_waiter_stays_confirmed(
    monkeypatch: pytest.MonkeyPatch, backend: Backend, name: str
) -> None:
    # A waiter arriving as the last one leaves keeps a confirmed subscription.
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


# -- dispose vs grant -----------------------------------------------------------------------


def test_a_disposal_between_grant_and_delivery_releases_the_lease(name: str) -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as leases, MemoryLeases(store) as other:
        scheduler = ManualScheduler()  # holds a delivery between the grant and its taking
        got: list[DistributedLease] = []
        subscription = leases.acquire_rx(name, 30.0, scheduler=scheduler).subscribe(got.append)
        scheduler.run_next()  # the first attempt: granted, the delivery is scheduled...
        assert leases.stats().held == 1
        subscription.dispose()  # ...and the subscriber leaves before it runs
        wait_until(lambda: leases.stats().held == 0, what="the untaken lease's release")
        scheduler.run_next()  # the delivery finds nothing to deliver
        assert got == []
        lease = other.try_acquire(name, 5.0)
        assert lease is not None
        lease.release()


def test_a_disposal_overlapping_the_delivery_leaves_the_lease_to_the_subscriber(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # The delivery took the lease from its Waiter; a disposal from another thread then stops
    # the observer before the lease reaches on_next. Before, the lease reached nobody (the
    # observer dropped it) or was released under the subscriber's feet; now the subscriber's
    # callback receives it and owns it.
    taken, disposed = threading.Event(), threading.Event()
    wrapped = base_module._wrapped_on_next

    def late_on_next(observer: abc.ObserverBase[Any]) -> Callable[[Any], None]:
        on_next = wrapped(observer)

        def deliver(lease: Any) -> None:
            taken.set()
            assert disposed.wait(10)  # the subscriber disposes in this window
            on_next(lease)

        return deliver

    monkeypatch.setattr(base_module, "_wrapped_on_next", late_on_next)
    with MemoryLeases() as leases:
        got: list[DistributedLease] = []
        received = threading.Event()

        def on_next(lease: DistributedLease) -> None:
            got.append(lease)
            received.set()

        subscription = leases.acquire_rx(name, 30.0, keep_alive=True).subscribe(on_next)
        assert taken.wait(10)
        subscription.dispose()
        disposed.set()
        assert received.wait(10)
        assert got[0].held  # the subscriber's, kept alive, not released behind its back
        assert leases.stats().keep_alive == 1
        got[0].release()
        assert leases.stats().held == 0


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


def test_a_subscriber_whose_on_next_raises_does_not_keep_the_lease(name: str) -> None:
    with MemoryLeases() as leases:
        errors: list[Exception] = []
        failed = threading.Event()

        def on_next(_: DistributedLease) -> None:
            raise ValueError("subscriber failed")

        def on_error(error: Exception) -> None:
            errors.append(error)
            failed.set()

        leases.acquire_rx(name, 30.0).subscribe(on_next, on_error)
        assert failed.wait(10)
        assert isinstance(errors[0], ValueError)
        wait_until(lambda: leases.stats().held == 0)


def test_a_waiter_leaving_while_its_queue_registers_unregisters_it(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder, MemoryLeases(store) as leases:
        lease = holder.acquire(name, 60.0)
        subscriptions: list[abc.DisposableBase] = []
        watch = WaitHub.watch

        def leaving_watch(
            self: WaitHub, watched: str, callback: Callable[[], object] | None = None
        ) -> Watch:
            registered = watch(self, watched, callback)
            if self is leases._hub:
                subscriptions[0].dispose()  # the only waiter leaves before the queue is set up
            return registered

        monkeypatch.setattr(WaitHub, "watch", leaving_watch)
        got: list[DistributedLease] = []
        scheduler = ManualScheduler()  # holds a delivery between the grant and its taking
        subscriptions.append(leases.acquire_rx(name, scheduler=scheduler).subscribe(got.append))
        scheduler.run_next()  # the first attempt: taken, the wait joins a new queue
        assert leases.stats().waiting == 0
        assert leases._hub.waiting() == 0  # the registration was closed, not left behind
        lease.release()
        assert got == []
        assert leases.stats().granted == 0


# -- timeout vs grant -----------------------------------------------------------------------


def _hold_granting_attempts(
    leases: LeaseProvider,
) -> tuple[threading.Event, threading.Event]:
    """From now on, an attempt that grants stops before returning until ``proceed``.

    For one waiter of a MemoryLeases: first its attempts so far are over (the failed first
    try and the retry its registration makes), so that none of them is still under way when
    the name frees.
    """
    wait_until(lambda: leases.stats().busy >= 2, what="the waiter's attempts so far")
    granted, proceed = threading.Event(), threading.Event()
    attempt = leases._attempt

    def held(*args: Any) -> DistributedLease | float:
        result = attempt(*args)
        if isinstance(result, DistributedLease):
            granted.set()
            assert proceed.wait(10)
        return result

    setattr(leases, "_attempt", held)  # noqa: B010  (an instance attribute, for mypy)
    return granted, proceed


@pytest.mark.parametrize("form", ["acquire", "acquire_rx"])
def test_a_grant_arriving_after_the_timeout_is_released(name: str, form: str) -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side, MemoryLeases(store) as leases:
        holder = holder_side.acquire(name, 60.0)
        outcome: list[object] = []
        finished = threading.Event()

        def wait() -> None:
            try:
                outcome.append(leases.acquire(name, 30.0, timeout=0.5))
            except LockTimeout as exc:
                outcome.append(exc)
            finished.set()

        def failed(error: Exception) -> None:
            outcome.append(error)
            finished.set()

        if form == "acquire":
            threading.Thread(target=wait, daemon=True).start()
        else:
            leases.acquire_rx(name, 30.0, timeout=0.5).subscribe(outcome.append, failed)
        wait_until(lambda: leases.stats().waiting == 1)
        granted, proceed = _hold_granting_attempts(leases)
        holder.release()
        assert granted.wait(10)  # the store granted it; the attempt has not returned yet
        # Meanwhile the waiter's deadline passes: its timer settles the wait (LockTimeout).
        wait_until(lambda: leases.stats().waiting == 0, what="the deadline")
        if form == "acquire_rx":  # delivered at once, the round trip still in flight
            assert finished.wait(10)
        proceed.set()
        # The blocking waiter ran the attempt on its own thread: it returns after it.
        assert finished.wait(10)
        assert isinstance(outcome[0], LockTimeout), outcome
        wait_until(lambda: leases.stats().held == 0, what="the late grant's release")
        lease = holder_side.try_acquire(name, 5.0)
        assert lease is not None
        lease.release()


def test_an_interrupted_blocking_waiter_leaves_its_queue_working(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # A KeyboardInterrupt inside the attempt a blocking head runs on its own thread: the wait
    # is left, and the queue's next waiter still gets the lease (its attempt goes elsewhere).
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side, MemoryLeases(store) as leases:
        holder = holder_side.acquire(name, 60.0)
        outcome: list[object] = []

        def first() -> None:
            try:
                outcome.append(leases.acquire(name, 30.0))
            except KeyboardInterrupt as exc:
                outcome.append(exc)

        interrupted = threading.Thread(target=first, daemon=True)
        interrupted.start()
        wait_until(lambda: leases.stats().waiting == 1)
        got: list[DistributedLease] = []
        received = threading.Event()

        def on_next(lease: DistributedLease) -> None:
            got.append(lease)
            received.set()

        leases.acquire_rx(name, 30.0).subscribe(on_next)
        wait_until(lambda: leases.stats().waiting == 2)
        # Every attempt so far is over: two tries and the registration's retry.
        wait_until(lambda: leases.stats().busy >= 3)
        attempt = leases._attempt
        me = interrupted.ident

        def interrupt_once(*args: Any) -> DistributedLease | float:
            if threading.get_ident() == me:
                raise KeyboardInterrupt
            return attempt(*args)

        setattr(leases, "_attempt", interrupt_once)  # noqa: B010  (an instance attribute)
        holder.release()
        interrupted.join(10)
        assert isinstance(outcome[0], KeyboardInterrupt), outcome
        assert received.wait(10), "the queue stalled after the interrupt"
        assert got[0].held
        got[0].release()
        wait_until(lambda: leases.stats().waiting == 0 and leases.stats().held == 0)


# -- cancel vs grant ------------------------------------------------------------------------


async def test_a_task_cancelled_while_its_grant_is_in_flight_leaks_nothing(name: str) -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side, MemoryLeases(store) as leases:
        holder = holder_side.acquire(name, 60.0)
        task = asyncio.create_task(leases.acquire_async(name, 30.0))
        await until(lambda: leases.stats().waiting == 1)
        granted, proceed = _hold_granting_attempts(leases)
        holder.release()
        await until(granted.is_set)
        task.cancel()  # the store granted it, the waiter leaves before it arrives
        with pytest.raises(asyncio.CancelledError):
            await task
        proceed.set()
        await until(lambda: leases.stats().held == 0)
        assert leases.stats().waiting == 0


async def test_a_task_cancelled_after_its_grant_arrived_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # The grant is decided and its wake-up queued on the loop; the task is cancelled before
    # it runs. The Waiter's rule releases the untaken lease.
    loop = asyncio.get_running_loop()
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side, MemoryLeases(store) as leases:
        holder = holder_side.acquire(name, 60.0)
        task = asyncio.create_task(leases.acquire_async(name, 30.0))
        await until(lambda: leases.stats().waiting == 1)
        decided = threading.Event()
        grant = Waiter.grant

        def grant_then_signal(self: Waiter[Any], value: Any) -> bool:
            granted = grant(self, value)  # the task's wake-up is now queued on the loop
            if isinstance(value, DistributedLease):
                decided.set()
            return granted

        monkeypatch.setattr(Waiter, "grant", grant_then_signal)

        def cancel_once_granted() -> None:
            # On the loop, ahead of the queued wake-up: the loop waits for the grant here.
            assert decided.wait(10)
            task.cancel()

        loop.call_soon(cancel_once_granted)
        holder.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: leases.stats().held == 0)
        lease = holder_side.try_acquire(name, 5.0)
        assert lease is not None
        lease.release()


# -- close vs waiting and releasing ---------------------------------------------------------


def test_close_fails_every_kind_of_waiter(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 60.0)
    leases = backend.new()
    errors: list[BaseException] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def failed(error: BaseException) -> None:
        with lock:
            errors.append(error)
        done.release()

    leases.acquire_rx(name, 30.0).subscribe(on_error=failed)
    leases.run(name, lambda _: 1, wait=True).subscribe(on_error=failed)

    def blocking() -> None:
        try:
            leases.acquire(name, 30.0)
        except BaseException as exc:
            failed(exc)

    thread = threading.Thread(target=blocking)
    thread.start()

    async def in_task() -> None:
        try:
            await leases.acquire_async(name, 30.0)
        except BaseException as exc:
            failed(exc)

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_until_complete, args=(in_task(),))
    runner.start()
    wait_until(lambda: leases.stats().waiting == 4, 20.0, "four waiters")
    leases.close()
    for _ in range(4):
        assert done.acquire(timeout=10)
    thread.join(10)
    runner.join(10)
    loop.close()
    assert all(isinstance(error, LeaseProviderClosed) for error in errors), errors
    assert leases.stats().waiting == 0
    holder.release()


def test_close_while_a_grant_is_in_flight_leaks_nothing(name: str) -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side:
        leases = MemoryLeases(store)
        holder = holder_side.acquire(name, 60.0)
        errors: list[Exception] = []
        failed = threading.Event()

        def on_error(error: Exception) -> None:
            errors.append(error)
            failed.set()

        leases.acquire_rx(name, 30.0).subscribe(on_error=on_error)
        wait_until(lambda: leases.stats().waiting == 1)
        granted, proceed = _hold_granting_attempts(leases)
        holder.release()
        assert granted.wait(10)
        leases.close()  # releases what it holds, fails the waiter
        assert failed.wait(10)
        assert isinstance(errors[0], LeaseProviderClosed)
        proceed.set()  # the grant returns to a waiter that is gone
        lease = holder_side.try_acquire(name, 5.0)
        assert lease is not None
        lease.release()


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


def test_waiting_after_close_fails_at_once(name: str) -> None:
    leases = MemoryLeases()
    leases.close()
    with pytest.raises(LeaseProviderClosed):
        leases.acquire(name, 5.0, timeout=1.0)
    errors: list[Exception] = []
    leases.acquire_rx(name, 5.0).subscribe(on_error=errors.append)
    wait_until(lambda: bool(errors))
    assert isinstance(errors[0], LeaseProviderClosed)


def test_zero_timeouts_try_once_and_say_so(name: str) -> None:
    # timeout=0 tries once: LockTimeout when waiting was asked for, empty when it was not.
    store = MemoryLeaseStore()
    with MemoryLeases(store) as holder_side, MemoryLeases(store) as leases:
        holder = holder_side.acquire(name, 60.0)
        outcomes: list[object] = []
        done = threading.Semaphore(0)

        def record(value: object) -> None:
            outcomes.append(value)
            done.release()

        leases.run(name, lambda _: 1, wait=True, timeout=0).subscribe(
            record, record, lambda: record("empty")
        )
        assert done.acquire(timeout=10)
        leases.run(name, lambda _: 1).subscribe(record, record, lambda: record("empty"))
        assert done.acquire(timeout=10)
        leases.acquire_rx(name, timeout=0).subscribe(record, record, lambda: record("empty"))
        assert done.acquire(timeout=10)
        leases.acquire_rx(name, wait=False).subscribe(record, record, lambda: record("empty"))
        assert done.acquire(timeout=10)
        with pytest.raises(LockTimeout):
            leases.acquire(name, timeout=0)
        kinds = [type(o).__name__ if not isinstance(o, str) else o for o in outcomes]
        assert kinds == ["LockTimeout", "empty", "LockTimeout", "empty"]
        assert leases.stats().waiting == 0
        holder.release()


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_waiters_leaving_at_random_keep_every_invariant(backend: Backend, seed: int) -> None:
    # Blocking, Rx and asyncio waiters on a few names, timing out, disposed and cancelled at
    # random moments while grants fly: never two holders of a name, nothing held or waiting at
    # the end, every hub registration gone.
    import random

    rng = random.Random(seed)
    names = [f"mixed-{seed}-{i}" for i in range(3)]
    with backend.new() as leases:
        holders = dict.fromkeys(names, 0)
        overlaps: list[str] = []
        lock = threading.Lock()
        ended = threading.Semaphore(0)

        def use(lease: DistributedLease) -> None:
            with lock:
                holders[lease.name] += 1
                if holders[lease.name] > 1:
                    overlaps.append(lease.name)
            with lock:
                holders[lease.name] -= 1
            lease.release()

        def blocking(name: str, timeout: float) -> None:
            with contextlib.suppress(LockTimeout):
                use(leases.acquire(name, 5.0, timeout=timeout))
            ended.release()

        def rx(name: str, timeout: float, dispose_after: float | None) -> None:
            finished = threading.Event()

            def on_next(lease: DistributedLease) -> None:
                use(lease)

            subscription = leases.acquire_rx(name, 5.0, timeout=timeout).subscribe(
                on_next, lambda _: finished.set(), finished.set
            )
            if dispose_after is not None and not finished.wait(dispose_after):
                subscription.dispose()
            else:
                finished.wait(30)
            ended.release()

        async def task(name: str, wait_for: float, cancel_after: float | None) -> None:
            async def take() -> None:
                async with leases.lock_async(name, 5.0, timeout=wait_for) as lease:
                    with lock:
                        holders[lease.name] += 1
                        if holders[lease.name] > 1:
                            overlaps.append(lease.name)
                    try:
                        await asyncio.sleep(0)  # a cancellation may land here, under the lease
                    finally:
                        with lock:
                            holders[lease.name] -= 1

            running = asyncio.ensure_future(take())
            if cancel_after is not None:
                await asyncio.wait([running], timeout=cancel_after)
                running.cancel()
            with contextlib.suppress(asyncio.CancelledError, LockTimeout):
                await running

        plans = [
            (rng.choice(names), rng.choice([0.0, 0.05, 2.0]), rng.choice([None, 0.0, 0.01]))
            for _ in range(40)
        ]

        def tasks() -> None:
            async def main() -> None:
                await asyncio.gather(*(task(*plan) for plan in plans))

            asyncio.run(main())
            for _ in plans:
                ended.release()

        threads = [threading.Thread(target=tasks)]
        for _ in range(60):
            name, timeout = rng.choice(names), rng.choice([0.0, 0.02, 0.1, 2.0])
            if rng.random() < 0.5:
                threads.append(threading.Thread(target=blocking, args=(name, timeout)))
            else:
                dispose = rng.choice([None, 0.0, 0.005, 0.03])
                threads.append(threading.Thread(target=rx, args=(name, timeout, dispose)))
        for thread in threads:
            thread.start()
        for _ in range(60 + len(plans)):
            assert ended.acquire(timeout=60)
        for thread in threads:
            thread.join(30)
        assert overlaps == []
        wait_until(lambda: _quiet(leases), 10.0, "nothing held, nobody waiting")
        assert leases._hub.waiting() == 0
        for name in names:
            lease = leases.try_acquire(name, 5.0)
            assert lease is not None
            lease.release()
