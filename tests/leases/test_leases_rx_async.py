"""The reactive (``run``, ``acquire_rx``) and asyncio forms, over every provider."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import reactivex
from reactivex import operators as ops
from reactivex.internal.exceptions import SequenceContainsNoElementsError
from reactivex.scheduler import ImmediateScheduler
from support.waiting import until, wait_until

from rxcoord.leases import (
    DistributedLease,
    LeaseLost,
    LeaseProvider,
    LockTimeout,
    MemoryLeases,
)

from .conftest import Backend


def collect(source: reactivex.Observable[object]) -> tuple[list[object], BaseException | None]:
    """Subscribe, wait for the end, return (items, error)."""
    items: list[object] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def on_error(error: Exception) -> None:
        errors.append(error)
        done.set()

    source.subscribe(items.append, on_error, done.set)
    assert done.wait(20)
    return items, errors[0] if errors else None


# -- run: ShedLock's executor ---------------------------------------------------------------


def test_run_executes_the_job_under_the_lease(backend: Backend, name: str) -> None:
    leases, other = backend.new(), backend.new()
    seen: list[tuple[int, bool, bool]] = []

    def job(lease: DistributedLease) -> str:
        # Under the lease: nobody else can take the name while the job runs.
        seen.append((lease.token, lease.held, other.try_acquire(name, 5.0) is None))
        return "done"

    items, error = collect(leases.run(name, job, at_most_for=5.0))
    assert (items, error) == (["done"], None)
    assert seen[0][1:] == (True, True)
    lease = other.try_acquire(name, 5.0)  # released after the job
    assert lease is not None
    assert lease.token > seen[0][0]
    lease.release()


def test_run_skips_the_job_when_the_lease_is_taken(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    calls: list[DistributedLease] = []
    items, error = collect(backend.new().run(name, calls.append))
    assert (items, error, calls) == ([], None, [])
    holder.release()


def test_run_with_wait_runs_once_the_holder_releases(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    leases = backend.new()
    result: list[object] = []
    finished = threading.Event()
    leases.run(name, lambda lease: lease.token, wait=True, timeout=10.0).subscribe(
        result.append, on_completed=finished.set
    )
    wait_until(lambda: leases.stats().waiting == 1)
    holder.release()
    assert finished.wait(10)
    (token,) = result
    assert isinstance(token, int)
    assert token > holder.token


def test_run_with_wait_times_out(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    items, error = collect(backend.new().run(name, lambda _: 1, wait=True, timeout=0.2))
    assert items == []
    assert isinstance(error, LockTimeout)
    holder.release()


def test_run_releases_the_lease_when_the_job_fails(backend: Backend, name: str) -> None:
    leases = backend.new()

    def job(_: DistributedLease) -> None:
        raise ValueError("job failed")

    items, error = collect(leases.run(name, job))
    assert items == []
    assert isinstance(error, ValueError)
    assert leases.stats().held == 0
    lease = backend.new().try_acquire(name, 5.0)
    assert lease is not None
    lease.release()


def test_run_reports_a_lease_lost_while_the_job_ran(backend: Backend, name: str) -> None:
    other = backend.new()

    def job(_: DistributedLease) -> int:
        time.sleep(0.45)  # outlives at_most_for
        assert other.try_acquire(name, 5.0) is not None  # and someone took over
        return 1

    items, error = collect(backend.new().run(name, job, at_most_for=0.3))
    assert items == []  # the result of overlapping work is not presented as a success
    assert isinstance(error, LeaseLost)


def test_run_with_keep_alive_outlives_at_most_for(backend: Backend, name: str) -> None:
    other = backend.new()

    def job(lease: DistributedLease) -> int:
        deadline = time.monotonic() + 1.5  # 2.5 x at_most_for; renewals every 0.2 s
        while time.monotonic() < deadline:
            assert other.try_acquire(name, 5.0) is None
            time.sleep(0.05)
        return lease.stats().extensions

    items, error = collect(backend.new().run(name, job, at_most_for=0.6, keep_alive=True))
    assert error is None
    assert isinstance(items[0], int)
    assert items[0] >= 2


def test_disposing_run_cancels_the_wait(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    leases = backend.new()
    calls: list[DistributedLease] = []
    subscription = leases.run(name, calls.append, wait=True).subscribe()
    wait_until(lambda: leases.stats().waiting == 1)
    subscription.dispose()
    wait_until(lambda: leases.stats().waiting == 0, what="the wait to end")
    holder.release()
    time.sleep(0.1)  # a job that was still scheduled would run now
    assert calls == []
    assert leases.stats().granted == 0


def test_run_on_a_given_scheduler(leases: LeaseProvider, name: str) -> None:
    items, error = collect(leases.run(name, lambda _: 7, scheduler=ImmediateScheduler()))
    assert (items, error) == ([7], None)


# -- acquire_rx -----------------------------------------------------------------------------


def test_acquire_rx_emits_the_lease(backend: Backend, name: str) -> None:
    items, error = collect(backend.new().acquire_rx(name, 5.0))
    assert error is None
    (lease,) = items
    assert isinstance(lease, DistributedLease)
    assert lease.held
    lease.release()


def test_acquire_rx_without_wait_completes_empty_when_taken(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    items, error = collect(backend.new().acquire_rx(name, 5.0, wait=False))
    assert (items, error) == ([], None)
    items, error = collect(backend.new().acquire_rx(name, 5.0, timeout=0.1))
    assert isinstance(error, LockTimeout)
    holder.release()


def test_acquire_rx_composes_with_operators(leases: LeaseProvider, name: str) -> None:
    def use(lease: DistributedLease) -> int:
        token = lease.token
        lease.release()
        return token

    pipeline: reactivex.Observable[object] = leases.acquire_rx(name, 5.0).pipe(ops.map(use))
    items, error = collect(pipeline)
    assert error is None
    assert items == [1]


def test_disposing_acquire_rx_cancels_the_wait(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    leases = backend.new()
    got: list[object] = []
    subscription = leases.acquire_rx(name, 5.0).subscribe(got.append)
    wait_until(lambda: leases.stats().waiting == 1)
    subscription.dispose()
    wait_until(lambda: leases.stats().waiting == 0)
    holder.release()
    assert got == []
    lease = backend.new().try_acquire(name, 5.0)  # nothing leaked
    assert lease is not None
    lease.release()


# -- asyncio --------------------------------------------------------------------------------


async def test_acquire_async_waits_for_the_release(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    leases = backend.new()
    task = asyncio.create_task(leases.acquire_async(name, 5.0, timeout=10.0))
    await until(lambda: leases.stats().waiting > 0, "a waiter")
    await holder.release_async()
    lease = await asyncio.wait_for(task, 10)
    assert lease.token > holder.token
    await lease.release_async()


async def test_acquire_async_times_out(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 5.0)
    with pytest.raises(LockTimeout):
        await backend.new().acquire_async(name, 5.0, timeout=0.2)
    assert await backend.new().try_acquire_async(name, 5.0) is None
    holder.release()


async def test_lock_async_holds_and_releases(backend: Backend, name: str) -> None:
    leases = backend.new()
    async with leases.lock_async(name, 0.6, keep_alive=True) as lease:
        await asyncio.sleep(1.0)  # longer than at_most_for: keep-alive holds it
        assert await backend.new().try_acquire_async(name, 5.0) is None
        await lease.extend_async()
    assert lease.released
    with pytest.raises(RuntimeError):
        async with leases.lock_async(name, 5.0):
            raise RuntimeError("body failed")
    assert leases.stats().held == 0


async def test_two_tasks_cannot_release_each_others_lease(leases: LeaseProvider, name: str) -> None:
    first = await leases.acquire_async(name, 0.3)
    await asyncio.sleep(0.45)
    second = await asyncio.create_task(leases.acquire_async(name, 5.0, timeout=5.0))
    with pytest.raises(LeaseLost):
        await asyncio.create_task(first.release_async())
    assert second.held
    await second.release_async()


async def test_cancelling_a_waiter_leaks_nothing(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, 60.0)
    leases = backend.new()
    task = asyncio.create_task(leases.acquire_async(name, 5.0))
    await until(lambda: leases.stats().waiting > 0, "a waiter")
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert leases.stats().waiting == 0
    holder.release()
    lease = await backend.new().try_acquire_async(name, 5.0)
    assert lease is not None
    await lease.release_async()


# -- awaiting the reactive forms ---------------------------------------------------------------


async def test_awaiting_acquire_rx_waits_without_blocking_the_loop(
    backend: Backend, name: str
) -> None:
    # Awaited through reactivex, the blocking wait ran on the loop's own thread: the release
    # below (a coroutine on the same loop) could never run, and the wait timed out.
    holder = backend.new().acquire(name, 30.0)

    async def release_from_the_loop() -> None:
        await until(lambda: leases.stats().waiting > 0, "a waiter")
        await holder.release_async()

    leases = backend.new()
    releasing = asyncio.create_task(release_from_the_loop())
    lease = await leases.acquire_rx(name, 5.0, timeout=5.0)
    await releasing
    assert lease.token > holder.token
    await lease.release_async()


async def test_awaiting_acquire_rx_without_wait_on_a_taken_name_raises(
    backend: Backend, name: str
) -> None:
    holder = backend.new().acquire(name, 30.0)
    with pytest.raises(SequenceContainsNoElementsError):
        await backend.new().acquire_rx(name, 5.0, wait=False)
    holder.release()


async def test_awaiting_run_runs_the_job_off_the_loop(backend: Backend, name: str) -> None:
    # Awaited through reactivex, the job (blocking code, by its signature) ran on the loop.
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def job(lease: DistributedLease) -> int:
        threads.append(threading.get_ident())
        return lease.token

    leases = backend.new()
    token = await leases.run(name, job)
    assert token > 0
    assert threads
    assert threads[0] != loop_thread
    assert leases.stats().held == 0
    holder = backend.new().acquire(name, 30.0)
    with pytest.raises(SequenceContainsNoElementsError):  # taken, wait=False: skipped
        await leases.run(name, job)
    holder.release()


async def test_awaiting_run_reports_a_stop_iteration_instead_of_hanging(
    leases: LeaseProvider, name: str
) -> None:
    def job(lease: DistributedLease) -> int:
        return next(iter(()))

    async with asyncio.timeout(10):
        with pytest.raises(RuntimeError, match="StopIteration") as raised:
            await leases.run(name, job)
    assert isinstance(raised.value.__cause__, StopIteration)
    assert leases.stats().held == 0


# The SystemExit still ends its worker thread, as it would have without rxcoord.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_run_job_dying_of_a_base_exception_releases_the_lease(
    backend: Backend, name: str
) -> None:
    # Before: the lease was neither released nor reported (kept alive forever with keep_alive).
    leases = backend.new()

    def job(lease: DistributedLease) -> None:
        raise SystemExit(3)  # ends only the worker thread

    async with asyncio.timeout(10):
        with pytest.raises(RuntimeError, match="SystemExit") as raised:
            await leases.run(name, job, keep_alive=True)
    assert isinstance(raised.value.__cause__, SystemExit)
    assert leases.stats().held == 0
    other = backend.new().try_acquire(name, 5.0)
    assert other is not None
    other.release()
    # The thread the SystemExit ends must be gone before the test is: its unhandled-exception
    # report (ignored above) would otherwise land on whichever test runs next.
    wait_until(
        lambda: not any(t.name.endswith("-lease-deliver") for t in threading.enumerate()),
        10.0,
        "the job's delivery thread to end",
    )


def test_run_awaited_on_a_loop_closed_before_the_job_ends(name: str) -> None:
    # The outcome has nowhere to go: dropped with a warning, never an exception on the worker
    # thread (which pytest reports as an unhandled thread exception), and the lease released.
    leases = MemoryLeases()
    started, finish = threading.Event(), threading.Event()
    finished: list[int] = []

    def job(lease: DistributedLease) -> int:
        started.set()
        assert finish.wait(10)
        finished.append(lease.token)
        return 42

    async def awaiter() -> int:
        return await leases.run(name, job)

    loop = asyncio.new_event_loop()
    task = loop.create_task(awaiter())
    loop.run_until_complete(asyncio.sleep(0))
    assert started.wait(10)
    loop.close()  # a hand-run loop torn down while its task still waits
    finish.set()
    wait_until(lambda: bool(finished) and leases.stats().held == 0, what="the job's end")
    del task
    leases.close()
