"""KeyedLocks regressions from review: each test failed on the code before its fix.

Windows are held open with events and gates, never with sleeps; ``WAIT`` only bounds a wait
that a correct implementation ends at once (a bug fails instead of hanging).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from locks_support import is_free
from reactivex import abc
from reactivex import operators as ops
from reactivex.scheduler import EventLoopScheduler, ThreadPoolScheduler
from reactivex.testing import TestScheduler

from rxcoord import KeyedLocks, Lease
from rxcoord._errors import LockTimeout

WAIT = 10.0


def wait_for(predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until another thread has reached a state."""
    pause = threading.Event()
    for _ in range(int(WAIT / 0.0005)):
        if predicate():
            return
        pause.wait(0.0005)
    raise AssertionError("state not reached")


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():  # noqa: ASYNC110 - states without an event to wait on
            await asyncio.sleep(0)


def daemon(fn: Callable[[], object]) -> threading.Thread:
    """Start ``fn`` on a daemon thread (a hang on the old code must not block the exit)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


class Recorder(abc.ObserverBase[Any]):
    """Thread-safe record of one subscription's notifications and the threads they came on."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.errors: list[Exception] = []
        self.threads: list[int] = []
        self.done = threading.Event()

    def on_next(self, value: Any) -> None:
        self.threads.append(threading.get_ident())
        self.items.append(value)

    def on_error(self, error: Exception) -> None:
        self.threads.append(threading.get_ident())
        self.errors.append(error)
        self.done.set()

    def on_completed(self) -> None:
        self.threads.append(threading.get_ident())
        self.done.set()


# -- 1. run(): the lease is kept until the work has really ended --------------------------------


def test_disposing_run_keeps_the_lease_while_a_running_executor_job_runs() -> None:
    locks = KeyedLocks()
    started, finish = threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        assert finish.wait(WAIT)
        return "done"

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        subscription = locks.run("k", lambda: executor.submit(job)).subscribe(
            on_error=lambda e: None
        )
        assert started.wait(WAIT)
        subscription.dispose()  # cancel() fails: the job is running
        assert not is_free(locks, "k")  # so it keeps its exclusion
        finish.set()
        wait_for(lambda: is_free(locks, "k"))  # released when the job returned
    assert len(locks) == 0


def test_disposing_run_cancels_a_queued_executor_job_and_releases() -> None:
    locks = KeyedLocks()
    blocker_started, unblock = threading.Event(), threading.Event()
    ran: list[bool] = []

    def blocker() -> None:
        blocker_started.set()
        assert unblock.wait(WAIT)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        executor.submit(blocker)
        assert blocker_started.wait(WAIT)
        subscription = locks.run("k", lambda: executor.submit(ran.append, True)).subscribe(
            on_error=lambda e: None
        )
        subscription.dispose()  # not started yet: cancel() succeeds, it will never run
        assert is_free(locks, "k")
        unblock.set()
    assert ran == []


def test_run_disposed_while_fn_runs_keeps_the_lease_for_the_job_fn_started() -> None:
    locks = KeyedLocks()
    scheduler = TestScheduler()  # fn runs inside advance_by(), on this thread
    job_started, finish = threading.Event(), threading.Event()
    subscriptions: list[abc.DisposableBase] = []

    def job() -> None:
        job_started.set()
        assert finish.wait(WAIT)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:

        def fn() -> concurrent.futures.Future[None]:
            future = executor.submit(job)
            assert job_started.wait(WAIT)
            subscriptions[0].dispose()  # disposed while fn runs ...
            return future  # ... and fn returns a job that cannot be stopped any more

        subscriptions.append(
            locks.run("k", fn, scheduler=scheduler).subscribe(on_error=lambda e: None)
        )
        scheduler.advance_by(1)  # fn ran and returned
        assert not is_free(locks, "k")  # the lease stays with the running job
        finish.set()
        wait_for(lambda: is_free(locks, "k"))
    assert len(locks) == 0


async def test_disposing_run_keeps_the_lease_through_the_coroutines_cleanup() -> None:
    locks = KeyedLocks()
    started, cleaning, cleaned = asyncio.Event(), asyncio.Event(), asyncio.Event()
    finish_cleanup = asyncio.Event()

    async def job() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await finish_cleanup.wait()  # e.g. rolling the entity back
            cleaned.set()

    subscription = locks.run("k", job).subscribe(on_error=lambda e: None)
    await asyncio.wait_for(started.wait(), WAIT)
    subscription.dispose()
    await asyncio.wait_for(cleaning.wait(), WAIT)
    assert not is_free(locks, "k")  # the cancelled coroutine still runs under the lease
    finish_cleanup.set()
    await asyncio.wait_for(cleaned.wait(), WAIT)
    await until(lambda: is_free(locks, "k"))
    assert len(locks) == 0


async def test_disposing_run_from_another_thread_keeps_the_lease_through_the_cleanup() -> None:
    locks = KeyedLocks()
    started, cleaning = asyncio.Event(), asyncio.Event()
    finish_cleanup = asyncio.Event()

    async def job() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await finish_cleanup.wait()

    subscription = locks.run("k", job).subscribe(on_error=lambda e: None)
    await asyncio.wait_for(started.wait(), WAIT)
    await asyncio.to_thread(subscription.dispose)
    await asyncio.wait_for(cleaning.wait(), WAIT)
    assert not is_free(locks, "k")
    finish_cleanup.set()
    await until(lambda: is_free(locks, "k"))


# -- 2. a delivery the scheduler never runs ----------------------------------------------------


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


# -- 3. a BaseException from one notification ---------------------------------------------------


def test_a_base_exception_from_one_grant_does_not_lose_the_others() -> None:
    locks = KeyedLocks()
    bulk = locks.hold_many(["a", "b", "c"]).__enter__()

    def interrupted(lease: Lease) -> None:
        raise SystemExit("the subscriber's thread is told to stop")

    locks.acquire("a").subscribe(interrupted)
    other = Recorder()
    locks.acquire("c").subscribe(other)
    waiter_done = threading.Event()

    def blocking() -> None:
        with locks.hold("b", timeout=WAIT):
            pass
        waiter_done.set()

    daemon(blocking)
    wait_for(lambda: locks.stats().waiting == 3)
    with pytest.raises(SystemExit):
        bulk.release()  # grants a, c and b in one step
    assert other.done.wait(WAIT)  # still told
    assert waiter_done.wait(WAIT)  # still woken
    other.items[0].release()
    assert is_free(locks, "a")  # the interrupted subscriber's lease was released
    assert len(locks) == 0


# -- 4. withdrawn requests parked behind a global request ---------------------------------------


class Payload:
    """Something a subscriber's callback closes over."""


def subscriber(payload: Payload) -> Callable[[Lease], None]:
    return lambda lease: print(payload, lease)


def test_disposed_requests_parked_behind_a_global_request_are_not_retained() -> None:
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()  # a long operation ...
    global_request = Recorder()
    locks.acquire_all().subscribe(global_request)  # ... with a global request behind it
    refs: list[weakref.ref[Payload]] = []
    for i in range(200):
        payload = Payload()
        refs.append(weakref.ref(payload))
        locks.acquire(("k", i)).subscribe(subscriber(payload)).dispose()
    del payload
    gc.collect()
    assert [i for i, ref in enumerate(refs) if ref() is not None] == []  # nothing kept alive
    assert len(locks) == 1
    stuck.release()
    assert global_request.done.is_set()
    global_request.items[0].release()
    assert len(locks) == 0


def test_timed_out_requests_parked_behind_a_global_request_are_not_retained() -> None:
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()
    global_request = Recorder()
    locks.acquire_all().subscribe(global_request)
    refs: list[weakref.ref[Payload]] = []
    count = 50
    timed_out = threading.Semaphore(0)
    for i in range(count):
        payload = Payload()
        refs.append(weakref.ref(payload))
        locks.acquire(("t", i), timeout=0.001).subscribe(
            subscriber(payload), lambda e: timed_out.release()
        )
    del payload
    for _ in range(count):
        assert timed_out.acquire(timeout=WAIT)
    gc.collect()
    # A worker thread may still hold the closure of the last job it ran (one per delivery
    # worker, plus the timer thread's last callback): bounded, not growing with the requests.
    assert len([ref for ref in refs if ref() is not None]) < 10
    stuck.release()
    global_request.items[0].release()
    assert len(locks) == 0


def test_withdrawing_parked_requests_keeps_the_others_in_order() -> None:
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()
    first_global = Recorder()
    locks.acquire_all().subscribe(first_global)
    order: list[int] = []

    def take(i: int) -> Callable[[Lease], None]:
        def on_next(lease: Lease) -> None:
            order.append(i)
            lease.release()

        return on_next

    subscriptions = [locks.acquire(("k", i)).subscribe(take(i)) for i in range(6)]
    for i in (1, 4):
        subscriptions[i].dispose()
    second_global = Recorder()
    second = locks.acquire_all().subscribe(second_global)
    more = [locks.acquire(("m", i)).subscribe(lambda lease: lease.release()) for i in range(3)]
    more[1].dispose()
    second.dispose()  # merges the segment behind it into the parked one
    stuck.release()
    first_global.items[0].release()
    assert order == [0, 2, 3, 5]
    assert len(locks) == 0


# -- 5. asyncio subscribers get their notifications on their loop ------------------------------


async def test_run_notifications_reach_an_asyncio_subscriber_on_its_loop() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    recorder = Recorder()
    locks.run("a", lambda: "value").subscribe(recorder)  # subscribed on the loop
    await until(lambda: locks.stats().waiting == 1)
    await asyncio.to_thread(holder.release)  # granted, and fn run, on that thread
    assert await asyncio.to_thread(recorder.done.wait, WAIT)
    assert recorder.items == ["value"]
    assert set(recorder.threads) == {threading.get_ident()}  # on_next/on_completed on the loop


async def test_acquire_delivers_to_an_asyncio_subscriber_on_its_loop() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    recorder = Recorder()
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
    wait_for(lambda: locks.stats().waiting == 1)
    holder.release()  # grants it on this thread
    thread.join(WAIT)
    assert not thread.is_alive()
    assert results == ["value"]
    assert len(locks) == 0


# -- also: awaiting acquire*() directly ---------------------------------------------------------


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
    wait_for(lambda: locks.stats().waiting == 1)
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


# -- 6. grants unblocked by timeouts run their work off the shared delivery pool ---------------


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
        timed_out = Recorder()
        locks.acquire("blocker", timeout=0.001).subscribe(timed_out)
        assert timed_out.done.wait(WAIT)
        assert isinstance(timed_out.errors[0], LockTimeout)
    finally:
        finish.set()
    wait_for(lambda: locks.stats().held == 1)
    holder.release()
    assert len(locks) == 0


# -- 7. a scheduler that refuses the delivery --------------------------------------------------


def test_a_scheduler_refusing_the_delivery_errors_the_subscriber() -> None:
    locks = KeyedLocks()
    scheduler = EventLoopScheduler()
    scheduler.dispose()  # schedule() now raises
    holder = locks.hold("a").__enter__()
    recorder = Recorder()
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
        timed_out = Recorder()
        locks.acquire("a", timeout=0.001, scheduler=scheduler).subscribe(timed_out)
        assert timed_out.done.wait(WAIT)
        assert isinstance(timed_out.errors[0], LockTimeout)
    assert len(locks) == 0


def test_a_refused_delivery_of_a_free_lease_errors_inside_subscribe() -> None:
    locks = KeyedLocks()
    scheduler = EventLoopScheduler()
    scheduler.dispose()
    recorder = Recorder()
    locks.acquire("a", scheduler=scheduler).subscribe(recorder)
    assert len(recorder.errors) == 1
    assert len(locks) == 0


# -- 8. misuse is loud: a lease is one use ------------------------------------------------------


def test_a_hold_lease_shared_as_a_lock_refuses_a_second_entry() -> None:
    locks = KeyedLocks()
    shared = locks.hold("k")
    inside, leave = threading.Event(), threading.Event()

    def first_user() -> None:
        with shared:
            inside.set()
            assert leave.wait(WAIT)

    thread = daemon(first_user)
    assert inside.wait(WAIT)
    with pytest.raises(RuntimeError, match=r"call hold\(\) per use"):
        shared.__enter__()  # the threading.Lock idiom: must not let a second thread in
    assert not shared.released
    leave.set()
    thread.join(WAIT)
    assert len(locks) == 0


def test_a_hold_lease_entered_while_its_first_entry_waits_is_refused() -> None:
    locks = KeyedLocks()
    holder = locks.hold("k").__enter__()
    shared = locks.hold("k")
    entered = threading.Event()

    def first_user() -> None:
        with shared:
            entered.set()

    thread = daemon(first_user)
    wait_for(lambda: locks.stats().waiting == 1)
    with pytest.raises(RuntimeError, match=r"call hold\(\) per use"):
        shared.__enter__()
    assert locks.stats().waiting == 1  # the first entry's request is untouched
    holder.release()
    assert entered.wait(WAIT)
    thread.join(WAIT)
    assert len(locks) == 0


def test_a_granted_lease_is_entered_once() -> None:
    locks = KeyedLocks()
    recorder = Recorder()
    locks.acquire("a").subscribe(recorder)
    lease: Lease = recorder.items[0]
    with lease:
        with pytest.raises(RuntimeError, match=r"per use"):
            lease.__enter__()
        assert not lease.released
    assert lease.released
    assert len(locks) == 0


async def test_a_hold_async_context_manager_shared_by_two_tasks_refuses_the_second() -> None:
    locks = KeyedLocks()
    shared = locks.hold_async("k")
    inside, leave = asyncio.Event(), asyncio.Event()

    async def first_user() -> None:
        async with shared:
            inside.set()
            await leave.wait()

    async def second_user() -> None:
        async with shared:
            raise AssertionError("entered a context manager another task is inside")

    first = asyncio.ensure_future(first_user())
    await asyncio.wait_for(inside.wait(), WAIT)
    with pytest.raises(RuntimeError, match=r"call hold_async\(\) per use"):
        await asyncio.wait_for(second_user(), WAIT)
    leave.set()
    await asyncio.wait_for(first, WAIT)
    assert len(locks) == 0
    async with shared:  # one use at a time, as before: reusable once left
        assert not is_free(locks, "k")
    assert len(locks) == 0


async def test_a_hold_async_context_manager_is_reusable_after_a_failed_entry() -> None:
    locks = KeyedLocks()
    holder = locks.hold("k").__enter__()
    cm = locks.hold_async("k", timeout=0)
    with pytest.raises(LockTimeout):
        async with cm:
            pass
    holder.release()
    async with cm as lease:
        assert not lease.released
    assert len(locks) == 0


def test_reentering_a_hold_lease_after_release_still_says_released() -> None:
    # Unchanged contract: a released lease is not entered again (LeaseReleasedError).
    locks = KeyedLocks()
    lease = locks.hold("a")
    with lease:
        pass
    with pytest.raises(RuntimeError, match="already released"):
        lease.__enter__()


async def test_awaiting_run_whose_fn_raises_stop_iteration_raises_a_runtime_error() -> None:
    # reactivex's await turned it into a TypeError from asyncio ("StopIteration interacts
    # badly with generators"), hiding the job's own error.
    locks = KeyedLocks()

    def fn() -> int:
        return next(iter(()))

    async with asyncio.timeout(WAIT):
        with pytest.raises(RuntimeError, match="StopIteration") as raised:
            await locks.run("a", fn)
    assert isinstance(raised.value.__cause__, StopIteration)
    assert len(locks) == 0
