"""KeyedLocks' waiting side: a granted lease reaches its waiter, or is released - never lost.

Every waiter (a blocked thread, an asyncio task, an ``acquire*``/``run*`` subscription) is the
core ``Waiter``: whichever way it leaves (disposed, timed out, task cancelled, loop closed,
delivery refused or dropped by its scheduler) and whichever thread wins a race with the grant,
the lease is taken by the waiter's side or released. These tests open each window with events,
gates and a controllable timer, never by letting time pass.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

import pytest
from locks_support import ManualTimer, Notifications, daemon, is_free
from reactivex import abc
from reactivex import operators as ops
from reactivex.scheduler import EventLoopScheduler, ThreadPoolScheduler
from support.waiting import WAIT, until, wait_until

from rxcoord import KeyedLocks, Lease
from rxcoord._core import waiter as core_waiter
from rxcoord._errors import LockTimeout
from rxcoord._locks import _waiting
from rxcoord._locks._table import PENDING

# -- a grant to a waiter that is gone is released: a delivery the scheduler never runs --------


def test_disposing_releases_a_granted_lease_whose_delivery_the_scheduler_dropped() -> None:
    locks = KeyedLocks()
    scheduler = EventLoopScheduler()
    busy, go = threading.Event(), threading.Event()

    def occupy(_scheduler: abc.SchedulerBase, _state: Any) -> None:
        busy.set()
        go.wait(WAIT)

    scheduler.schedule(occupy)  # keep its thread occupied
    assert busy.wait(WAIT)
    try:
        holder = locks.hold("a").__enter__()
        got: list[Lease] = []
        subscription = locks.acquire("a", scheduler=scheduler).subscribe(got.append)
        holder.release()  # grants it: the delivery is queued on the scheduler ...
        scheduler.dispose()  # ... which is shut down and drops its queue
        subscription.dispose()  # the subscriber gives up too
        assert got == []
        assert is_free(locks, "a")  # not leaked
        assert len(locks) == 0
    finally:
        go.set()


def test_disposing_releases_a_grant_whose_loop_delivery_never_ran() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    loop = asyncio.new_event_loop()
    try:
        got: list[Lease] = []

        async def subscribe() -> abc.DisposableBase:
            return locks.acquire("a").subscribe(got.append)

        subscription = loop.run_until_complete(subscribe())
        holder.release()  # grants it: delivery posted to the loop, which is not running
        subscription.dispose()
        assert is_free(locks, "a")
        loop.run_until_complete(asyncio.sleep(0))  # the late delivery finds nothing to do
        assert got == []
        assert len(locks) == 0
    finally:
        loop.close()


# -- a BaseException from one notification ----------------------------------------------------


def test_a_base_exception_from_one_grant_does_not_lose_the_others() -> None:
    locks = KeyedLocks()
    bulk = locks.hold_many(["a", "b", "c"]).__enter__()

    def interrupted(lease: Lease) -> None:
        raise SystemExit("the subscriber's thread is told to stop")

    locks.acquire("a").subscribe(interrupted)
    other = Notifications()
    locks.acquire("c").subscribe(other)
    waiter_done = threading.Event()

    def blocking() -> None:
        with locks.hold("b", timeout=WAIT):
            pass
        waiter_done.set()

    daemon(blocking)
    wait_until(lambda: locks.stats().waiting == 3)
    with pytest.raises(SystemExit):
        bulk.release()  # grants a, c and b in one step
    assert other.done.wait(WAIT)  # still told
    assert waiter_done.wait(WAIT)  # still woken
    other.items[0].release()
    assert is_free(locks, "a")  # the interrupted subscriber's lease was released
    assert len(locks) == 0


# -- asyncio waiters are woken on their loop; a cancelled task keeps nothing ------------------


async def test_acquire_delivers_to_an_asyncio_subscriber_on_its_loop() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    recorder = Notifications()
    locks.acquire("a").subscribe(recorder)
    await asyncio.to_thread(holder.release)
    assert await asyncio.to_thread(recorder.done.wait, WAIT)
    assert set(recorder.threads) == {threading.get_ident()}
    recorder.items[0].release()


@pytest.mark.parametrize("form", ["run", "acquire"])
def test_await_granted_by_another_thread_completes(form: str) -> None:
    # The awaiting loop has nothing else to do: only a proper wake-up (call_soon_threadsafe)
    # resumes it. Before the fix, the grant resolved the future from the releasing thread and
    # the loop slept on forever. The loop runs on a daemon thread, so a hang fails the join
    # below instead of the whole session.
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    results: list[str] = []

    def take(lease: Lease) -> str:
        lease.release()
        return "value"

    async def main() -> None:
        if form == "run":
            results.append(await locks.run("a", lambda: "value"))
        else:
            results.append(await locks.acquire("a").pipe(ops.map(take)))

    thread = daemon(lambda: asyncio.run(main()))
    wait_until(lambda: locks.stats().waiting == 1)
    holder.release()  # grants it on this thread
    thread.join(WAIT)
    assert not thread.is_alive()
    assert results == ["value"]
    assert len(locks) == 0


def test_awaiting_acquire_with_a_scheduler_wakes_the_loop() -> None:
    # With scheduler=, reactivex's await resolved its future from a pool thread: the idle loop
    # was never woken. acquire*() now await like hold_async().
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    pool = ThreadPoolScheduler(1)
    results: list[Lease] = []

    async def main() -> None:
        results.append(await locks.acquire("a", scheduler=pool))

    thread = daemon(lambda: asyncio.run(main()))
    wait_until(lambda: locks.stats().waiting == 1)
    holder.release()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert len(results) == 1
    assert not results[0].released
    results[0].release()
    assert len(locks) == 0


async def test_a_task_cancelled_after_its_awaited_grant_does_not_keep_the_lease() -> None:
    # The grant lands in the awaiting task's future, then the task is cancelled before it
    # resumes: before the fix the lease was dropped with the task, held forever.
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()

    async def waiter() -> Lease:
        return await locks.acquire("a")

    task = asyncio.create_task(waiter())
    await until(lambda: locks.stats().waiting == 1)
    holder.release()  # on the loop's thread: granted to the waiting task at once
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert locks.stats().held == 0
    assert len(locks) == 0
    with locks.hold("a", timeout=0):
        pass


# -- grants unblocked by timeouts run their work off the shared delivery pool -----------------


def test_work_under_grants_unblocked_by_timeouts_does_not_starve_other_timeouts() -> None:
    locks = KeyedLocks()
    holder = locks.hold("blocker").__enter__()
    started = threading.Semaphore(0)
    finish = threading.Event()
    workers = 4  # rxcoord's shared delivery pool has four threads

    def long_work() -> None:
        started.release()
        finish.wait()  # unbounded: must outlast the wait below; the finally-block ends it

    try:
        for i in range(workers):
            # R_i waits for "blocker" and heads ("b", i); its timeout withdraws it, which
            # grants the run() behind it: fn runs on whatever thread delivers that grant.
            locks.acquire_many(["blocker", ("b", i)], timeout=0.001).subscribe(
                on_error=lambda e: None
            )
            locks.run(("b", i), long_work).subscribe(on_error=lambda e: None)
        for _ in range(workers):
            assert started.acquire(timeout=WAIT)
        # Four works now occupy their threads. Another timeout must still be delivered.
        timed_out = Notifications()
        locks.acquire("blocker", timeout=0.001).subscribe(timed_out)
        assert timed_out.done.wait(WAIT)
        assert isinstance(timed_out.errors[0], LockTimeout)
    finally:
        finish.set()
    wait_until(lambda: locks.stats().held == 1)
    holder.release()
    assert len(locks) == 0


# -- a scheduler that refuses the delivery ----------------------------------------------------


def test_a_scheduler_refusing_the_delivery_errors_the_subscriber() -> None:
    locks = KeyedLocks()
    scheduler = EventLoopScheduler()
    scheduler.dispose()  # schedule() now raises
    holder = locks.hold("a").__enter__()
    recorder = Notifications()
    locks.acquire("a", scheduler=scheduler).subscribe(recorder)
    holder.release()
    assert recorder.done.is_set()  # told, on the releasing thread
    assert len(recorder.errors) == 1
    assert recorder.items == []
    assert is_free(locks, "a")

    outcome: list[BaseException] = []

    def blocking() -> None:
        try:
            locks.run("b", lambda: 1, scheduler=scheduler).run()
        except Exception as exc:
            outcome.append(exc)

    thread = daemon(blocking)
    thread.join(WAIT)
    assert not thread.is_alive()  # run(...).run() returned ...
    assert len(outcome) == 1  # ... with the error

    with locks.hold("a"):  # a timeout's LockTimeout cannot be scheduled either
        timed_out = Notifications()
        locks.acquire("a", timeout=0.001, scheduler=scheduler).subscribe(timed_out)
        assert timed_out.done.wait(WAIT)
        assert isinstance(timed_out.errors[0], LockTimeout)
    assert len(locks) == 0


def test_a_refused_delivery_of_a_free_lease_errors_inside_subscribe() -> None:
    locks = KeyedLocks()
    scheduler = EventLoopScheduler()
    scheduler.dispose()
    recorder = Notifications()
    locks.acquire("a", scheduler=scheduler).subscribe(recorder)
    assert len(recorder.errors) == 1
    assert len(locks) == 0


# -- the one ownership rule: a waiter leaving while its grant is in flight ------------------------
#
# The window: the table has granted the request (under the mutex) and the releasing thread is
# on its way to ``waiter.grant(lease)``. The gate below holds the releasing thread exactly
# there, so each way of leaving meets the grant in the middle, deterministically.


class InFlight:
    """Holds ``Waiter.grant`` on the thread named ``releaser`` until :meth:`open`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.gate = threading.Event(), threading.Event()
        original = core_waiter.Waiter.grant

        def grant(waiter: core_waiter.Waiter[Any], value: Any) -> bool:
            if threading.current_thread().name == "releaser":
                self.reached.set()
                assert self.gate.wait(WAIT)
            return original(waiter, value)

        monkeypatch.setattr(core_waiter.Waiter, "grant", grant)

    def watch_deadlines(self, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
        """An event set once a blocking or async wait has reached its deadline."""
        expired = threading.Event()
        original = _waiting.expire

        def expire(lease: Lease, waiter: core_waiter.Waiter[Lease]) -> bool:
            try:
                return original(lease, waiter)
            finally:
                expired.set()

        monkeypatch.setattr(_waiting, "expire", expire)
        return expired

    def release(self, lease: Lease) -> threading.Thread:
        """Release ``lease`` on the releaser thread; return once its grant is in flight."""
        thread = threading.Thread(target=lease.release, name="releaser", daemon=True)
        thread.start()
        assert self.reached.wait(WAIT)
        return thread

    def open(self, thread: threading.Thread) -> None:
        self.gate.set()
        thread.join(WAIT)
        assert not thread.is_alive()


def test_disposing_while_the_grant_is_in_flight_releases_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight = InFlight(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    got = Notifications()
    subscription = locks.acquire("a").subscribe(got)
    releaser = in_flight.release(holder)
    subscription.dispose()  # the table granted it already: nothing to withdraw
    assert locks.stats().held == 1
    in_flight.open(releaser)  # the grant reaches a cancelled waiter: released
    assert got.items == []
    assert got.errors == []
    assert is_free(locks, "a")
    assert locks.stats().cancelled_total == 0  # not withdrawn: granted, then released
    assert len(locks) == 0


def test_a_timeout_after_the_grant_was_decided_delivers_the_grant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = ManualTimer.install(monkeypatch)
    in_flight = InFlight(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    got = Notifications()
    locks.acquire("a", timeout=5).subscribe(got)
    releaser = in_flight.release(holder)
    assert timer.fire() == 1  # the deadline passes while the grant is on its way
    in_flight.open(releaser)
    assert got.done.wait(WAIT)
    assert got.errors == []  # only a pending request times out
    assert len(got.items) == 1
    assert locks.stats().timeouts_total == 0
    got.items[0].release()
    assert len(locks) == 0


def test_a_timeout_then_a_late_dispose_counts_one_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    got = Notifications()
    subscription = locks.acquire("a", timeout=5).subscribe(got)
    assert timer.fire() == 1
    assert got.done.wait(WAIT)
    assert isinstance(got.errors[0], LockTimeout)
    subscription.dispose()  # after the timeout: nothing left to withdraw
    stats = locks.stats()
    assert (stats.timeouts_total, stats.cancelled_total, stats.waiting) == (1, 0, 0)
    holder.release()
    assert len(locks) == 0


def test_disposing_before_the_timer_fires_leaves_nothing_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    got = Notifications()
    subscription = locks.acquire("a", timeout=5).subscribe(got)
    subscription.dispose()
    assert timer.pending == 0  # the timer was cancelled with the request
    timer.fire()
    assert got.errors == []
    stats = locks.stats()
    assert (stats.timeouts_total, stats.cancelled_total) == (0, 1)
    holder.release()
    assert len(locks) == 0


async def test_a_task_cancelled_while_its_grant_is_in_flight_keeps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight = InFlight(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()

    async def waiter() -> None:
        async with locks.hold_async("a"):
            raise AssertionError("a cancelled task entered its block")

    task = asyncio.create_task(waiter())
    await until(lambda: locks.stats().waiting == 1)
    releaser = await asyncio.to_thread(in_flight.release, holder)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(in_flight.open, releaser)
    assert is_free(locks, "a")
    assert locks.stats().held == 0
    assert len(locks) == 0


def test_a_blocking_wait_that_expires_while_its_grant_is_in_flight_gets_the_grant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight = InFlight(monkeypatch)
    expired = in_flight.watch_deadlines(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    outcome: list[object] = []

    def blocked() -> None:
        try:
            # The grant is held back until well after this deadline (the gate fixes the order,
            # not the duration): the wait expires with the grant decided but not handed over.
            with locks.hold("a", timeout=0.01) as lease:
                outcome.append(lease.keys)
        except LockTimeout as exc:
            outcome.append(exc)

    thread = daemon(blocked)
    wait_until(lambda: locks.stats().waiting == 1)
    releaser = in_flight.release(holder)
    assert expired.wait(WAIT)  # the deadline has passed with the grant decided, not handed over
    assert thread.is_alive()  # still waiting: for the hand-over now, not the deadline
    in_flight.open(releaser)
    thread.join(WAIT)
    assert outcome == [frozenset({"a"})]  # only a pending request times out
    assert locks.stats().timeouts_total == 0
    assert len(locks) == 0


async def test_an_async_wait_that_expires_while_its_grant_is_in_flight_gets_the_grant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight = InFlight(monkeypatch)
    expired = in_flight.watch_deadlines(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()

    async def waiter() -> frozenset[object]:
        async with locks.hold_async("a", timeout=0.01) as lease:
            return lease.keys

    task = asyncio.create_task(waiter())
    await until(lambda: locks.stats().waiting == 1)
    releaser = await asyncio.to_thread(in_flight.release, holder)
    await until(expired.is_set)  # its deadline passes while the gate holds the grant
    assert not task.done()
    await asyncio.to_thread(in_flight.open, releaser)
    assert await asyncio.wait_for(task, WAIT) == frozenset({"a"})
    assert locks.stats().timeouts_total == 0
    assert len(locks) == 0


def test_every_waiter_is_the_core_waiter() -> None:
    # One primitive: a pending request of each kind carries a core Waiter, dropped with it.
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    subscription = locks.acquire("a").subscribe()
    pending = _pending_leases(locks)
    assert len(pending) == 1
    assert isinstance(pending[0]._waiter, core_waiter.Waiter)
    subscription.dispose()
    assert pending[0]._waiter is None
    holder.release()
    assert len(locks) == 0


def _pending_leases(locks: KeyedLocks) -> list[Lease]:
    entry = locks._queues["a"]
    assert isinstance(entry, collections.deque)
    return [lease for lease in entry if isinstance(lease, Lease) and lease._state == PENDING]
