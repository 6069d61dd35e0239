"""The execution contract with asyncio: async jobs, ``await``, cancellation and timeouts.

Runs once per implementation, like ``test_execution.py``. Jobs that must outlast the test's next
step wait for an event (never a long sleep); timeouts run on a ``TestScheduler``'s clock, which
the test advances from the loop (the timeout is then delivered on it at once).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable

import pytest
from reactivex import operators as ops
from reactivex.testing import TestScheduler
from support.execution import ThreadedVirtualScheduler

from rxcoord import CoordinatorClosed, TooManyTasks

from .executors import Executor, MakeExecutor


async def forever() -> None:
    """Wait until cancelled."""
    await asyncio.get_running_loop().create_future()


async def test_await_an_async_job(executor: Executor) -> None:
    async def job() -> str:
        await asyncio.sleep(0)  # a real suspension point
        return "done"

    assert await executor.execute(job) == "done"


async def test_await_a_sync_job_from_asyncio_code(executor: Executor) -> None:
    assert await executor.execute(lambda: threading.current_thread().name) != "MainThread"


async def test_await_reraises_the_very_exception(executor: Executor) -> None:
    boom = KeyError("async boom")

    async def job() -> None:
        raise boom

    with pytest.raises(KeyError) as info:
        await executor.execute(job)
    assert info.value is boom


async def test_await_through_reactivex_operators(executor: Executor) -> None:
    async def job() -> int:
        return 20

    def plus_one(x: int) -> int:
        return x + 1

    assert await executor.execute(job).pipe(ops.map(plus_one)) == 21


async def test_async_jobs_respect_the_concurrency_limit(make_executor: MakeExecutor) -> None:
    running = 0
    most = 0
    release = asyncio.Event()
    three_in = asyncio.Event()

    async def job() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        if running == 3:
            three_in.set()
        await release.wait()
        running -= 1

    with make_executor(max_concurrency=3, max_queue_size=50) as executor:
        jobs = asyncio.gather(*(executor.execute(job) for _ in range(30)))
        await asyncio.wait_for(three_in.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0)  # loop turns in which a fourth job could start
        assert (running, executor.running, executor.queued) == (3, 3, 27)
        release.set()
        await jobs
    assert most == 3


async def test_keyed_async_jobs_run_in_subscription_order(make_executor: MakeExecutor) -> None:
    order: list[int] = []

    def job(i: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            for _ in range(5 - i % 5):  # later ones take fewer loop turns: they would finish first
                await asyncio.sleep(0)
            order.append(i)
            return i

        return run

    with make_executor(max_concurrency=4, max_queue_size=50) as executor:
        results = await asyncio.gather(*(executor.execute(job(i), key="k") for i in range(10)))
    assert results == list(range(10))
    assert order == list(range(10))


async def test_disposing_cancels_a_running_async_job_inside(make_executor: MakeExecutor) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    may_finish_cleanup = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.set()
            await may_finish_cleanup.wait()  # cleanup still holds the slot
            raise

    with make_executor(max_concurrency=1, max_queue_size=5) as executor:
        got: list[object] = []
        sub = executor.execute(job).subscribe(got.append, got.append)
        await asyncio.wait_for(started.wait(), 5)
        sub.dispose()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert executor.running == 1  # slot held while the job cleans up
        follower = asyncio.ensure_future(executor.execute(lambda: "next"))
        await asyncio.sleep(0)  # the follower subscribes
        assert (executor.running, executor.queued) == (1, 1)
        may_finish_cleanup.set()
        assert await asyncio.wait_for(follower, 5) == "next"
        assert got == []
        assert executor.stats().cancelled == 1


async def test_cancelling_the_awaiting_task_cancels_the_job(executor: Executor) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiter = asyncio.ensure_future(executor.execute(job))
    await asyncio.wait_for(started.wait(), 5)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_an_execution_is_a_coroutine_for_create_task_and_gather(executor: Executor) -> None:
    ran: list[int] = []

    async def job(i: int) -> int:
        ran.append(i)
        await asyncio.sleep(0)
        return i

    execution = executor.execute(functools.partial(job, 1))
    assert asyncio.iscoroutine(execution)
    assert await asyncio.create_task(execution) == 1  # create_task wants a coroutine
    both = executor.execute(functools.partial(job, 2)), executor.execute(functools.partial(job, 3))
    assert list(await asyncio.gather(*both)) == [2, 3]
    assert ran == [1, 2, 3]  # each submitted once


async def test_closing_an_execution_before_its_first_step_submits_nothing(
    make_executor: MakeExecutor,
) -> None:
    ran: list[str] = []

    async def job() -> None:
        ran.append("job")

    with make_executor(max_concurrency=1, max_queue_size=5) as executor:
        execution = executor.execute(job)
        execution.close()
        assert executor.running == 0
        assert executor.queued == 0
        await asyncio.sleep(0)
    assert ran == []


async def test_closing_an_execution_waiting_for_its_turn_withdraws_it(
    make_executor: MakeExecutor,
) -> None:
    release = asyncio.Event()
    started = asyncio.Event()
    ran: list[str] = []

    async def blocker() -> None:
        started.set()
        await release.wait()

    async def victim() -> None:
        ran.append("victim")

    with make_executor(max_concurrency=1, max_queue_size=5) as executor:
        first = asyncio.ensure_future(executor.execute(blocker))
        await asyncio.wait_for(started.wait(), 5)
        execution = executor.execute(victim)
        assert execution.send(None) is not None  # its first step: it queues behind the blocker
        assert executor.queued == 1
        execution.close()
        assert executor.queued == 0
        release.set()
        await first
    assert ran == []


async def test_timeout_of_an_async_job_cancels_it(make_executor: MakeExecutor) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    clock = TestScheduler()

    async def job() -> None:
        started.set()
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with make_executor(timeout=0.02, scheduler=clock) as executor:
        outcome = asyncio.ensure_future(executor.execute(job))
        await asyncio.sleep(0)
        # A job written as a lambda is sync at first: it is called on the clock. (Its timeout
        # counts from its hand-off at 0; an async def's from its start, at 0 as well.)
        clock.advance_by(0.001)
        await asyncio.wait_for(started.wait(), 5)
        clock.advance_by(0.018)
        await asyncio.sleep(0)
        assert not outcome.done()
        clock.advance_by(0.001)  # the deadline
        with pytest.raises(TimeoutError):
            await outcome
        await asyncio.wait_for(cancelled.wait(), 5)
        assert executor.stats().timed_out == 1


async def test_queued_async_job_cancelled_never_starts(make_executor: MakeExecutor) -> None:
    release = asyncio.Event()
    started = asyncio.Event()
    ran: list[str] = []

    async def blocker() -> None:
        started.set()
        await release.wait()

    async def victim() -> None:
        ran.append("victim")

    with make_executor(max_concurrency=1, max_queue_size=5) as executor:
        first = asyncio.ensure_future(executor.execute(blocker))
        await asyncio.wait_for(started.wait(), 5)
        sub = executor.execute(victim).subscribe()
        assert executor.queued == 1
        sub.dispose()
        assert executor.queued == 0
        release.set()
        await first
        await executor.execute(blocker)
    assert ran == []


async def test_too_many_tasks_when_awaited(make_executor: MakeExecutor) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def job() -> None:
        started.set()
        await release.wait()

    with make_executor(max_concurrency=1, max_queue_size=0, name="tiny") as executor:
        first = asyncio.ensure_future(executor.execute(job))
        await asyncio.wait_for(started.wait(), 5)
        with pytest.raises(TooManyTasks, match="'tiny'"):
            await executor.execute(job)
        release.set()
        await first


async def test_close_cancels_running_async_jobs_and_fails_their_subscribers(
    make_executor: MakeExecutor,
) -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    executor = make_executor(max_concurrency=1, max_queue_size=2)
    running = asyncio.ensure_future(executor.execute(job))
    queued = asyncio.ensure_future(executor.execute(job))
    await asyncio.wait_for(started.wait(), 5)
    executor.close()
    with pytest.raises(CoordinatorClosed):
        await running
    with pytest.raises(CoordinatorClosed):
        await queued
    await asyncio.wait_for(cancelled.wait(), 5)


def test_async_job_without_a_loop_is_a_clear_error(executor: Executor) -> None:
    async def job() -> int:
        return 1

    with pytest.raises(RuntimeError, match="running asyncio loop"):
        executor.execute(job).run()
    assert executor.stats().failed == 1


async def test_a_lambda_returning_a_coroutine_is_awaited_as_an_async_job(
    make_executor: MakeExecutor,
) -> None:
    hanging = asyncio.Event()
    cancelled = asyncio.Event()
    clock = ThreadedVirtualScheduler()  # the sync part on a thread, the timeout on the clock

    async def fetch(i: int) -> str:
        await asyncio.sleep(0)
        return f"page {i}"

    async def hang() -> None:
        hanging.set()
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with make_executor(max_concurrency=2) as executor:

        def page(i: int) -> Callable[[], Awaitable[str]]:
            return lambda: fetch(i)  # a plain lambda: not an async def function

        pages = await asyncio.gather(*(executor.execute(page(i)) for i in range(3)))
        assert pages == ["page 0", "page 1", "page 2"]
    with make_executor(max_concurrency=2, scheduler=clock) as executor:
        timed = asyncio.ensure_future(executor.execute(lambda: hang(), timeout=0.02))
        # The sync part returns the coroutine, which is awaited on this loop.
        await asyncio.wait_for(hanging.wait(), 5)
        clock.advance_by(0.02)
        with pytest.raises(TimeoutError):
            await timed
        await asyncio.wait_for(cancelled.wait(), 5)
        assert executor.running == 0
    clock.join()


def test_a_returned_coroutine_without_a_loop_is_a_clear_error(executor: Executor) -> None:
    async def fetch() -> int:
        return 1

    with pytest.raises(RuntimeError, match="awaitable"):
        executor.execute(lambda: fetch()).run()


async def test_a_job_raising_stop_iteration_fails_the_await_instead_of_hanging_it(
    make_executor: MakeExecutor,
) -> None:
    # asyncio refuses Future.set_exception(StopIteration()): the awaiter waited forever.
    def job() -> int:
        return next(iter(()))

    with make_executor(max_concurrency=1) as executor:
        async with asyncio.timeout(10):
            with pytest.raises(RuntimeError, match="StopIteration") as raised:
                await executor.execute(job)
    assert isinstance(raised.value.__cause__, StopIteration)
