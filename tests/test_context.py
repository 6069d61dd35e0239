"""The caller's contextvars reach the jobs of ``KeyedLocks.run`` and ``LeaseProvider.run``.

Every job runs in a copy of the context of the call that subscribed (or awaited), whatever
thread runs it: the thread of another holder that released the keys, a scheduler's worker, the
thread a lease provider starts for the job, or the event loop for an ``async def`` job (issue
24: ``asyncio.to_thread`` semantics). Each test sets a ``ContextVar`` in the caller and reads
it inside the job; on a thread of its own the variable would read as unset.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator

import pytest
import reactivex
from reactivex.scheduler import ThreadPoolScheduler
from support.waiting import WAIT

from rxcoord import KeyedLocks
from rxcoord.leases import MemoryLeases, MemoryLeaseStore

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


@pytest.fixture
def pool() -> Iterator[ThreadPoolScheduler]:
    scheduler = ThreadPoolScheduler(2)
    yield scheduler
    scheduler.executor.shutdown(wait=True)


def seen_in_job() -> tuple[str | None, str]:
    return request_id.get(), threading.current_thread().name


def subscribe_in_context(observable: reactivex.Observable[object], rid: str) -> list[object]:
    """Subscribe on a thread of its own whose context has ``request_id = rid``."""
    results: list[object] = []
    done = threading.Event()

    def failed(error: Exception) -> None:
        results.append(error)
        done.set()

    def subscriber() -> None:
        request_id.set(rid)
        observable.subscribe(on_next=results.append, on_error=failed, on_completed=done.set)

    threading.Thread(target=subscriber).start()
    assert done.wait(WAIT)
    return results


# -- KeyedLocks.run ---------------------------------------------------------------------------


def test_locks_run_sync_job_on_the_releasing_thread_sees_the_subscribers_context() -> None:
    locks = KeyedLocks()
    holder = locks.hold("k").__enter__()  # the main thread holds the key; no id in its context
    started = threading.Event()
    results: list[object] = []
    done = threading.Event()

    def subscriber() -> None:
        request_id.set("req-1")
        locks.run("k", seen_in_job).subscribe(results.append, on_completed=done.set)
        started.set()

    threading.Thread(target=subscriber).start()
    assert started.wait(WAIT)
    holder.release()  # grants the waiting run: its job runs here, on the main thread
    assert done.wait(WAIT)
    assert results == [("req-1", threading.current_thread().name)]
    assert request_id.get() is None  # and nothing leaked into the releasing thread's context


def test_locks_run_sync_job_on_a_scheduler_sees_the_subscribers_context(
    pool: ThreadPoolScheduler,
) -> None:
    locks = KeyedLocks()
    (result,) = subscribe_in_context(locks.run("k", seen_in_job, scheduler=pool), "req-2")
    assert isinstance(result, tuple)
    assert result[0] == "req-2"
    assert result[1] != threading.current_thread().name


async def test_locks_run_async_job_sees_the_awaiting_tasks_context() -> None:
    locks = KeyedLocks()
    holder = locks.hold("k").__enter__()

    async def job() -> str | None:
        await asyncio.sleep(0)
        return request_id.get()

    async def caller() -> str | None:
        request_id.set("req-3")
        result: str | None = await locks.run("k", job)
        return result

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.01)
    # Released from another thread with a context of its own: the job still gets the caller's.
    releaser = threading.Thread(target=holder.release)
    releaser.start()
    assert await asyncio.wait_for(task, WAIT) == "req-3"
    releaser.join()


def test_locks_run_changes_in_the_job_stay_in_the_job() -> None:
    locks = KeyedLocks()
    request_id.set("outer")
    try:

        def job() -> str | None:
            request_id.set("inner")
            return request_id.get()

        assert locks.run("k", job).run() == "inner"
        assert request_id.get() == "outer"
    finally:
        request_id.set(None)


# -- LeaseProvider.run ------------------------------------------------------------------------


def test_lease_run_sync_job_on_its_own_thread_sees_the_subscribers_context() -> None:
    with MemoryLeases() as leases:
        results = subscribe_in_context(leases.run("job", seen_in_job), "req-4")
    assert results[0] == ("req-4", "rxcoord-memory-lease-deliver")


def test_lease_run_after_a_wait_sees_the_subscribers_context() -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as leases, MemoryLeases(store) as other:
        held = other.acquire("job")
        results: list[object] = []
        done = threading.Event()

        def subscriber() -> None:
            request_id.set("req-5")
            leases.run("job", seen_in_job, wait=True).subscribe(
                results.append, on_completed=done.set
            )

        threading.Thread(target=subscriber).start()
        threading.Timer(0.05, held.release).start()  # the grant comes from a timer/worker
        assert done.wait(WAIT)
    assert results[0] == ("req-5", results[0][1])  # type: ignore[index]


def test_lease_run_sync_job_on_a_scheduler_sees_the_subscribers_context(
    pool: ThreadPoolScheduler,
) -> None:
    with MemoryLeases() as leases:
        results = subscribe_in_context(leases.run("job", seen_in_job, scheduler=pool), "req-6")
    assert results[0][0] == "req-6"  # type: ignore[index]


async def test_lease_run_awaited_sync_job_sees_the_awaiting_tasks_context() -> None:
    with MemoryLeases() as leases:
        request_id.set("req-7")
        value, thread = await leases.run("job", seen_in_job)
    assert value == "req-7"
    assert thread != threading.current_thread().name  # it ran off the loop, in our context


async def test_lease_run_async_job_sees_the_awaiting_tasks_context() -> None:
    async def job() -> str | None:
        await asyncio.sleep(0)
        return request_id.get()

    with MemoryLeases() as leases:

        async def caller() -> str | None:
            request_id.set("req-8")
            result: str | None = await leases.run("job", job)
            return result

        assert await asyncio.wait_for(asyncio.create_task(caller()), WAIT) == "req-8"
