"""``LeaseProvider.run`` follows the one job-runner contract (issue 11, requirement 4).

A job is ``job()`` or ``job(lease)``; what it returns - a value, a coroutine or other awaitable,
a ``concurrent.futures.Future``, an Observable - is run to its real end under the lease, and
the lease is released only after. Before, the lease was always passed (a job without a
parameter failed with a ``TypeError`` on subscription), and whatever the job returned was
emitted as an object: a coroutine was never run (and the lease released at once), an
Observable was emitted instead of its items.

Where the store matters (a second provider must see the name taken while the work is in
flight, a lost lease) the tests run over every backend; the rest on memory.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import reactivex
from reactivex.subject import Subject
from support.waiting import until, wait_until

from rxcoord.leases import DistributedLease, LeaseLost, LeaseProvider, MemoryLeases

from .conftest import Backend


def collect(source: reactivex.Observable[Any]) -> tuple[list[Any], BaseException | None]:
    """Subscribe, wait for the end, return (items, error)."""
    items: list[Any] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def on_error(error: Exception) -> None:
        errors.append(error)
        done.set()

    source.subscribe(items.append, on_error, done.set)
    assert done.wait(20)
    return items, errors[0] if errors else None


def assert_free(provider: LeaseProvider, name: str) -> None:
    """The name can be taken (by a provider on the same store): the run released it."""
    lease = provider.try_acquire(name, 5.0)
    assert lease is not None, f"{name!r} is still taken"
    lease.release()


# -- job() or job(lease) -------------------------------------------------------------------


def test_a_job_without_a_parameter_is_called_without_the_lease(name: str) -> None:
    leases = MemoryLeases()
    items, error = collect(leases.run(name, lambda: "no lease needed"))
    assert (items, error) == (["no lease needed"], None)
    assert leases.stats().held == 0


async def test_an_async_job_without_a_parameter_is_run(name: str) -> None:
    leases = MemoryLeases()

    async def job() -> int:
        await asyncio.sleep(0)
        return 7

    assert await leases.run(name, job) == 7
    assert leases.stats().held == 0


def test_a_job_needing_two_parameters_is_a_type_error_at_the_call(name: str) -> None:
    leases = MemoryLeases()
    job: Callable[..., int] = lambda lease, retries: 1  # noqa: E731
    with pytest.raises(TypeError, match=r"fn\(\) or fn\(lease\)"):
        leases.run(name, job)
    assert leases.stats().granted == 0  # nothing was subscribed, nothing taken


# -- coroutines and awaitables ---------------------------------------------------------------


async def test_an_async_job_runs_under_the_lease_and_its_result_is_emitted(
    backend: Backend, name: str
) -> None:
    leases, other = backend.new(), backend.new()
    seen: list[tuple[bool, int | None]] = []

    async def job(lease: DistributedLease) -> int:
        await asyncio.sleep(0.05)  # suspended: the lease must still be held
        holder = await other.holder_async(name)
        token = None if holder is None else holder.token
        seen.append((await other.try_acquire_async(name, 5.0) is None, token))
        return lease.token

    token = await leases.run(name, job)
    assert isinstance(token, int)
    assert seen == [(True, token)]
    assert leases.stats().held == 0
    assert_free(other, name)


async def test_a_subscribed_async_job_holds_the_lease_until_it_has_ended(
    backend: Backend, name: str
) -> None:
    leases, other = backend.new(), backend.new()
    started, finish = asyncio.Event(), asyncio.Event()
    items: list[object] = []
    completed = threading.Event()

    async def job(lease: DistributedLease) -> str:
        started.set()
        await finish.wait()
        return "finished"

    leases.run(name, job).subscribe(items.append, on_completed=completed.set)
    await asyncio.wait_for(started.wait(), 10)
    assert await other.try_acquire_async(name, 5.0) is None  # in flight: still held
    holder = await leases.holder_async(name)
    assert holder is not None
    assert not holder.released
    finish.set()
    await until(completed.is_set, "the completion")
    assert items == ["finished"]
    await until(lambda: leases.stats().held == 0, "the release")
    assert_free(other, name)


async def test_an_async_job_that_outlives_its_lease_reports_lease_lost(
    backend: Backend, name: str
) -> None:
    other = backend.new()

    async def job(lease: DistributedLease) -> int:
        await asyncio.sleep(0.45)  # outlives at_most_for
        assert await other.try_acquire_async(name, 5.0) is not None  # and someone took over
        return 1

    with pytest.raises(LeaseLost):
        await backend.new().run(name, job, at_most_for=0.3)


async def test_an_async_job_with_keep_alive_outlives_at_most_for(
    backend: Backend, name: str
) -> None:
    other = backend.new()

    async def job(lease: DistributedLease) -> int:
        deadline = time.monotonic() + 1.6
        while time.monotonic() < deadline:
            assert await other.try_acquire_async(name, 5.0) is None
            await asyncio.sleep(0.05)
        return lease.stats().extensions

    # Renewals every at_most_for / 3 leave 2/3 s of slack for a busy CI machine; with 0.3 s a
    # renewal delayed past 0.2 s arrived after the expiry and was rightly refused (lease lost).
    extensions = await backend.new().run(name, job, at_most_for=1.0, keep_alive=True)
    assert extensions >= 2


async def test_an_async_job_failing_releases_the_lease_and_reports_its_error(
    name: str,
) -> None:
    leases = MemoryLeases()

    async def job(lease: DistributedLease) -> None:
        await asyncio.sleep(0)
        raise ValueError("job failed")

    with pytest.raises(ValueError, match="job failed"):
        await leases.run(name, job)
    assert leases.stats().held == 0


async def test_disposing_cancels_a_running_coroutine_and_releases_after_its_cleanup(
    backend: Backend, name: str
) -> None:
    leases, other = backend.new(), backend.new()
    started = asyncio.Event()
    cleanup: list[bool] = []  # was the name still taken during the cleanup?
    errors: list[Exception] = []

    async def job(lease: DistributedLease) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # a cleanup that takes a while
            cleanup.append(await other.try_acquire_async(name, 5.0) is None)
            raise

    subscription = leases.run(name, job).subscribe(on_error=errors.append)
    await asyncio.wait_for(started.wait(), 10)
    subscription.dispose()
    await until(lambda: bool(cleanup), "the job's cleanup")
    await until(lambda: leases.stats().held == 0, "the release")
    assert cleanup == [True]
    assert errors == []  # disposed: nothing is forwarded
    assert_free(other, name)


async def test_cancelling_the_awaiting_task_cancels_the_coroutine_under_the_lease(
    name: str,
) -> None:
    leases = MemoryLeases()
    started = asyncio.Event()
    cleanup: list[bool] = []

    async def job(lease: DistributedLease) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            cleanup.append(lease.held)

    async def awaiting() -> None:
        await leases.run(name, job)

    task = asyncio.create_task(awaiting())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: leases.stats().held == 0, "the release")
    assert cleanup == [True]


async def test_the_release_after_an_async_job_does_not_block_the_loop(name: str) -> None:
    # The release is a store round trip: it (and the completion after it) leaves the loop.
    leases = MemoryLeases()
    loop = asyncio.get_running_loop()
    completed = asyncio.Event()
    items: list[int] = []
    threads: list[threading.Thread] = []

    async def job(lease: DistributedLease) -> int:
        await asyncio.sleep(0)
        return 1

    def on_completed() -> None:
        threads.append(threading.current_thread())
        loop.call_soon_threadsafe(completed.set)

    leases.run(name, job).subscribe(items.append, on_completed=on_completed)
    await asyncio.wait_for(completed.wait(), 10)
    assert items == [1]
    assert threads[0] is not threading.current_thread()
    assert leases.stats().held == 0


def test_an_async_job_subscribed_without_a_loop_is_a_clear_error(name: str) -> None:
    leases = MemoryLeases()

    async def job(lease: DistributedLease) -> int:
        return 1  # pragma: no cover - never runs

    items, error = collect(leases.run(name, job))
    assert items == []
    assert isinstance(error, TypeError)
    assert "not subscribed on a running event loop" in str(error)
    assert "lock_async" in str(error)
    assert leases.stats().held == 0


class _Ready:
    """An awaitable that is neither a coroutine nor a future."""

    def __await__(self) -> Generator[Any, None, str]:
        yield from asyncio.sleep(0).__await__()
        return "awaited"


async def test_an_asyncio_future_or_another_awaitable_is_awaited(name: str) -> None:
    leases = MemoryLeases()
    loop = asyncio.get_running_loop()

    def future_job(lease: DistributedLease) -> asyncio.Future[int]:
        future: asyncio.Future[int] = loop.create_future()
        loop.call_soon_threadsafe(future.set_result, lease.token)
        return future

    assert isinstance(await leases.run(name, future_job), int)
    assert await leases.run(name, lambda: _Ready()) == "awaited"
    assert leases.stats().held == 0


# -- concurrent futures ----------------------------------------------------------------------


def test_a_concurrent_future_holds_the_lease_until_it_is_done(backend: Backend, name: str) -> None:
    leases, other = backend.new(), backend.new()
    finish = threading.Event()
    with ThreadPoolExecutor(1) as executor:

        def job(lease: DistributedLease) -> Future[int]:
            return executor.submit(lambda: finish.wait(10) and lease.token)

        items: list[object] = []
        completed = threading.Event()
        leases.run(name, job).subscribe(items.append, on_completed=completed.set)
        wait_until(lambda: leases.stats().held == 1, what="the grant")
        assert other.try_acquire(name, 5.0) is None  # the future is not done: still held
        finish.set()
        assert completed.wait(10)
    (token,) = items
    assert isinstance(token, int)
    assert token > 0
    wait_until(lambda: leases.stats().held == 0, what="the release")
    assert_free(other, name)


# -- Observables -----------------------------------------------------------------------------


def test_an_observable_job_emits_its_items_then_completes(name: str) -> None:
    leases = MemoryLeases()
    items, error = collect(leases.run(name, lambda lease: reactivex.of(1, 2, lease.token)))
    assert error is None
    assert items[:2] == [1, 2]
    assert len(items) == 3
    assert leases.stats().held == 0


def test_an_observable_job_holds_the_lease_until_it_completes(backend: Backend, name: str) -> None:
    leases, other = backend.new(), backend.new()
    subject: Subject[int] = Subject()
    items: list[int] = []
    completed = threading.Event()
    leases.run(name, lambda: subject).subscribe(items.append, on_completed=completed.set)
    wait_until(lambda: bool(subject.observers), what="the subscription to the job's Observable")
    subject.on_next(1)
    assert other.try_acquire(name, 5.0) is None  # items flow under the lease
    holder = other.holder(name)
    assert holder is not None
    assert not holder.released
    subject.on_next(2)
    subject.on_completed()
    assert completed.wait(10)
    assert items == [1, 2]
    assert leases.stats().held == 0
    assert_free(other, name)


def test_an_observable_job_failing_releases_the_lease_and_reports_its_error(name: str) -> None:
    leases = MemoryLeases()
    items, error = collect(leases.run(name, lambda: reactivex.throw(ValueError("stream failed"))))
    assert items == []
    assert isinstance(error, ValueError)
    assert leases.stats().held == 0


def test_disposing_an_observable_job_disposes_it_and_releases(backend: Backend, name: str) -> None:
    leases, other = backend.new(), backend.new()
    subject: Subject[int] = Subject()
    subscription = leases.run(name, lambda: subject).subscribe()
    wait_until(lambda: bool(subject.observers), what="the subscription to the job's Observable")
    subscription.dispose()
    assert not subject.observers  # the job's Observable was disposed
    wait_until(lambda: leases.stats().held == 0, what="the release")
    assert_free(other, name)
