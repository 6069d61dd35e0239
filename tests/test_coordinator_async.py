"""``TenantTaskCoordinator`` with asyncio: async jobs, ``await``, cancellation and timeouts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from reactivex import operators as ops
from reactivex.scheduler.eventloop import AsyncIOScheduler

from rxcoord import CoordinatorClosed, TenantTaskCoordinator, TooManyTasks


@pytest_asyncio.fixture
async def coordinator() -> AsyncIterator[TenantTaskCoordinator]:
    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=10, name="aio") as c:
        yield c


async def test_await_an_async_job(coordinator: TenantTaskCoordinator) -> None:
    async def job() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await coordinator.execute(job) == "done"


async def test_await_a_sync_job_from_asyncio_code(coordinator: TenantTaskCoordinator) -> None:
    assert await coordinator.execute(lambda: threading.current_thread().name) != "MainThread"


async def test_await_reraises_the_very_exception(coordinator: TenantTaskCoordinator) -> None:
    boom = KeyError("async boom")

    async def job() -> None:
        raise boom

    with pytest.raises(KeyError) as info:
        await coordinator.execute(job)
    assert info.value is boom


async def test_await_through_reactivex_operators(coordinator: TenantTaskCoordinator) -> None:
    async def job() -> int:
        return 20

    def plus_one(x: int) -> int:
        return x + 1

    assert await coordinator.execute(job).pipe(ops.map(plus_one)) == 21


async def test_async_jobs_respect_the_concurrency_limit() -> None:
    running = 0
    most = 0

    async def job() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.005)
        running -= 1

    with TenantTaskCoordinator(max_concurrency=3, max_queue_size=50) as c:
        await asyncio.gather(*(c.execute(job) for _ in range(30)))
    assert most == 3


async def test_keyed_async_jobs_run_in_subscription_order() -> None:
    order: list[int] = []

    def job(i: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            await asyncio.sleep(0.001 * (5 - i % 5))  # later ones would finish first
            order.append(i)
            return i

        return run

    with TenantTaskCoordinator(max_concurrency=4, max_queue_size=50) as c:
        results = await asyncio.gather(*(c.execute(job(i), key="k") for i in range(10)))
    assert results == list(range(10))
    assert order == list(range(10))


async def test_disposing_cancels_a_running_async_job_inside() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    cleaned_up = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.sleep(0.02)  # cleanup still holds the slot
            cleaned_up.set()
            raise

    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
        got: list[object] = []
        sub = c.execute(job).subscribe(got.append, got.append)
        await asyncio.wait_for(started.wait(), 5)
        sub.dispose()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert c.running == 1  # slot held while the job cleans up
        follower = asyncio.ensure_future(c.execute(lambda: "next"))
        await asyncio.wait_for(cleaned_up.wait(), 5)
        assert await asyncio.wait_for(follower, 5) == "next"
        assert got == []
        assert c.stats().cancelled == 1


async def test_cancelling_the_awaiting_task_cancels_the_job() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with TenantTaskCoordinator() as c:
        waiter = asyncio.ensure_future(c.execute(job))
        await asyncio.wait_for(started.wait(), 5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(cancelled.wait(), 5)


async def test_timeout_of_an_async_job_cancels_it() -> None:
    cancelled = asyncio.Event()

    async def job() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with TenantTaskCoordinator(timeout=0.02) as c:
        with pytest.raises(TimeoutError):
            await c.execute(job)
        await asyncio.wait_for(cancelled.wait(), 5)
        assert c.stats().timed_out == 1


async def test_queued_async_job_cancelled_never_starts() -> None:
    release = asyncio.Event()
    ran: list[str] = []

    async def blocker() -> None:
        await release.wait()

    async def victim() -> None:
        ran.append("victim")

    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
        first = asyncio.ensure_future(c.execute(blocker))
        await asyncio.sleep(0)
        sub = c.execute(victim).subscribe()
        assert c.queued == 1
        sub.dispose()
        assert c.queued == 0
        release.set()
        await first
        await c.execute(blocker)
    assert ran == []


async def test_too_many_tasks_when_awaited() -> None:
    release = asyncio.Event()

    async def job() -> None:
        await release.wait()

    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, name="tiny") as c:
        first = asyncio.ensure_future(c.execute(job))
        await asyncio.sleep(0)
        with pytest.raises(TooManyTasks, match="'tiny'"):
            await c.execute(job)
        release.set()
        await first


async def test_close_cancels_running_async_jobs_and_fails_their_subscribers() -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=2)
    running = asyncio.ensure_future(c.execute(job))
    queued = asyncio.ensure_future(c.execute(job))
    await asyncio.wait_for(started.wait(), 5)
    c.close()
    with pytest.raises(CoordinatorClosed):
        await running
    with pytest.raises(CoordinatorClosed):
        await queued
    await asyncio.wait_for(cancelled.wait(), 5)


def test_async_job_without_a_loop_is_a_clear_error() -> None:
    async def job() -> int:
        return 1

    with TenantTaskCoordinator() as c:
        with pytest.raises(RuntimeError, match="running asyncio loop"):
            c.execute(job).run()
        assert c.stats().failed == 1


def test_async_jobs_on_an_asyncio_scheduler_submitted_from_another_thread() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        ran_on: list[threading.Thread] = []

        async def job() -> str:
            ran_on.append(threading.current_thread())
            await asyncio.sleep(0)
            return "on the loop"

        with TenantTaskCoordinator(scheduler=AsyncIOScheduler(loop)) as c:
            assert c.execute(job).run() == "on the loop"  # .run() blocks this thread
        assert ran_on == [thread]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_a_lambda_returning_a_coroutine_is_awaited_as_an_async_job() -> None:
    cancelled = asyncio.Event()

    async def fetch(i: int) -> str:
        await asyncio.sleep(0)
        return f"page {i}"

    async def hang() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with TenantTaskCoordinator(max_concurrency=2) as c:

        def page(i: int) -> Callable[[], Awaitable[str]]:
            return lambda: fetch(i)  # a plain lambda: not an async def function

        pages = await asyncio.gather(*(c.execute(page(i)) for i in range(3)))
        assert pages == ["page 0", "page 1", "page 2"]
        with pytest.raises(TimeoutError):
            await c.execute(lambda: hang(), timeout=0.02)
        await asyncio.wait_for(cancelled.wait(), 5)
        assert c.running == 0


def test_a_returned_coroutine_without_a_loop_is_a_clear_error() -> None:
    async def fetch() -> int:
        return 1

    with TenantTaskCoordinator() as c, pytest.raises(RuntimeError, match="awaitable"):
        c.execute(lambda: fetch()).run()


async def test_a_job_raising_stop_iteration_fails_the_await_instead_of_hanging_it() -> None:
    # asyncio refuses Future.set_exception(StopIteration()): the awaiter waited forever.
    def job() -> int:
        return next(iter(()))

    with TenantTaskCoordinator(max_concurrency=1) as c:
        async with asyncio.timeout(10):
            with pytest.raises(RuntimeError, match="StopIteration") as raised:
                await c.execute(job)
    assert isinstance(raised.value.__cause__, StopIteration)
