"""KeyedLocks from asyncio: ``hold*_async`` waits without blocking the loop, is woken from any
thread, honours timeouts and task cancellation, and never leaks a lease on the way out.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from locks_support import is_free
from support.waiting import WAIT

from rxcoord import KeyedLocks, Lease
from rxcoord._errors import LockTimeout


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate()`` holds (bounded: a bug fails instead of hanging).

    The states awaited (a request registered in ``stats()``) have no event to wait on.
    """
    async with asyncio.timeout(WAIT):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)


async def test_hold_async_uncontended() -> None:
    locks = KeyedLocks()
    async with locks.hold_async("a") as lease:
        assert lease.keys == frozenset({"a"})
        assert not is_free(locks, "a")
    assert lease.released
    assert len(locks) == 0


async def test_tasks_are_served_in_request_order_without_blocking_the_loop() -> None:
    locks = KeyedLocks()
    order: list[int] = []
    ticks = 0

    async def task(i: int) -> None:
        async with locks.hold_async("a"):
            order.append(i)
            await asyncio.sleep(0)  # hold across a suspension: others must keep waiting

    async def ticker() -> None:
        nonlocal ticks
        while len(order) < 5:
            ticks += 1
            await asyncio.sleep(0)

    async with asyncio.TaskGroup() as group:
        group.create_task(ticker())
        for i in range(5):
            group.create_task(task(i))
    assert order == [0, 1, 2, 3, 4]
    assert ticks > 5  # the loop kept running while tasks waited
    assert len(locks) == 0


async def test_a_release_on_another_thread_wakes_the_waiting_task() -> None:
    locks = KeyedLocks()
    held = locks.hold("a")
    held.__enter__()
    waiter = asyncio.create_task(locks.hold_async("a").__aenter__())
    await until(lambda: locks.stats().waiting == 1)
    thread = threading.Thread(target=held.release)
    thread.start()
    lease = await asyncio.wait_for(waiter, WAIT)
    thread.join(WAIT)
    assert not lease.released
    lease.release()
    assert len(locks) == 0


async def test_bulk_and_global_async() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def bulk() -> None:
        async with locks.hold_many_async(["a", "b"]):
            order.append("bulk")

    async def everything() -> None:
        async with locks.hold_all_async() as lease:
            assert lease.is_global
            order.append("global")

    async with locks.hold_async("b"):
        tasks = [asyncio.create_task(bulk()), asyncio.create_task(everything())]
        await until(lambda: locks.stats().waiting == 2)
        assert order == []
    await asyncio.gather(*tasks)
    assert order == ["bulk", "global"]
    assert len(locks) == 0


async def test_timeout_raises_lock_timeout_and_withdraws() -> None:
    locks = KeyedLocks()
    async with locks.hold_async("a"):
        with pytest.raises(LockTimeout) as info:
            async with locks.hold_many_async(["b", "a"], timeout=0.01):
                pass
        assert isinstance(info.value, TimeoutError)
        assert len(locks) == 1  # b went away with the withdrawn request
        with pytest.raises(LockTimeout):
            async with locks.hold_async("a", timeout=0):
                pass
    assert locks.stats().timeouts_total == 1
    assert len(locks) == 0


async def test_cancelling_a_waiting_task_withdraws_its_request() -> None:
    locks = KeyedLocks()
    holder = await locks.hold_async("a").__aenter__()
    waiter = asyncio.create_task(locks.hold_many_async(["a", "b"]).__aenter__())
    await until(lambda: locks.stats().waiting == 1)
    assert not is_free(locks, "b")  # queued behind the waiting bulk request
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert is_free(locks, "b")
    assert locks.stats().cancelled_total == 1
    holder.release()
    assert len(locks) == 0


async def test_cancelled_right_after_the_grant_releases_the_lease() -> None:
    # The grant resolves the waiter's future through call_soon_threadsafe; the task is
    # cancelled before it gets to run, so nobody will ever use the lease: it must be released.
    locks = KeyedLocks()
    holder = locks.hold("a")
    holder.__enter__()
    waiter = asyncio.create_task(locks.hold_async("a").__aenter__())
    await until(lambda: locks.stats().waiting == 1)
    holder.release()  # granted now; the wake-up is queued on the loop
    assert locks.stats().held == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(locks) == 0
    assert locks.stats().held == 0


def test_a_grant_after_the_loop_closed_is_released() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a")
    holder.__enter__()
    loop = asyncio.new_event_loop()
    task = loop.create_task(locks.hold_async("a").__aenter__())
    loop.run_until_complete(asyncio.sleep(0))  # the task is now waiting
    assert locks.stats().waiting == 1
    loop.close()  # abandoned with the task still waiting
    holder.release()  # its wake-up cannot be delivered any more
    assert len(locks) == 0
    assert locks.stats().held == 0
    del task


async def test_run_with_an_async_function() -> None:
    locks = KeyedLocks()
    seen: list[bool] = []

    async def job() -> str:
        await asyncio.sleep(0)
        seen.append(is_free(locks, "a"))
        return "ok"

    async with locks.hold_async("a"):
        pending = asyncio.ensure_future(locks.run("a", job))
        await until(lambda: locks.stats().waiting == 1)
    assert await pending == "ok"
    assert seen == [False]  # the coroutine ran under the lease
    assert len(locks) == 0


async def test_run_disposed_while_the_coroutine_runs_cancels_it_and_releases() -> None:
    locks = KeyedLocks()
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    subscription = locks.run("a", job).subscribe(on_error=lambda e: None)
    await asyncio.wait_for(started.wait(), WAIT)
    assert not is_free(locks, "a")
    subscription.dispose()
    await asyncio.wait_for(cancelled.wait(), WAIT)
    assert is_free(locks, "a")


async def test_leases_are_returned_by_await_and_usable_as_context_managers() -> None:
    locks = KeyedLocks()
    lease: Lease = await locks.hold_async("a").__aenter__()
    with lease:
        assert not is_free(locks, "a")
    assert is_free(locks, "a")


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


# -- the inlined uncontended enter and exit of hold_async --------------------------------------


async def test_a_free_key_waits_for_an_earlier_global_request_on_the_async_fast_path() -> None:
    # The inlined grant takes a free key only when no global request is present: a key never
    # seen before still queues behind a waiting acquire_all.
    locks = KeyedLocks()
    order: list[str] = []

    async def everything() -> None:
        async with locks.hold_all_async():
            order.append("global")

    async def fresh_key() -> None:
        async with locks.hold_async("never-seen"):
            order.append("fresh")

    async with locks.hold_async("held"):
        glob = asyncio.create_task(everything())
        await until(lambda: locks.stats().global_waiting == 1)
        fresh = asyncio.create_task(fresh_key())
        await until(lambda: locks.stats().waiting == 2)
        assert order == []
    await asyncio.gather(glob, fresh)
    assert order == ["global", "fresh"]
    assert len(locks) == 0


async def test_the_async_fast_exit_hands_the_key_to_a_waiter_and_a_released_lease_is_skipped() -> (
    None
):
    locks = KeyedLocks()
    got: list[str] = []

    async def second() -> None:
        async with locks.hold_async("k"):
            got.append("second")

    async with locks.hold_async("k"):
        waiter = asyncio.create_task(second())
        await until(lambda: locks.stats().waiting == 1)
    await asyncio.wait_for(waiter, WAIT)  # the exit found a waiter: the general path granted it
    async with locks.hold_async("k") as lease:
        lease.release()  # released inside the block: the exit has nothing left to do
    assert got == ["second"]
    assert len(locks) == 0
    assert locks.stats().held == 0


async def test_a_hold_async_lease_may_be_released_from_another_thread_to_an_async_waiter() -> None:
    locks = KeyedLocks()
    holder = await locks.hold_async("k").__aenter__()
    waiting = asyncio.create_task(locks.hold_async("k").__aenter__())
    await until(lambda: locks.stats().waiting == 1)
    await asyncio.to_thread(holder.release)  # the grant reaches the loop from another thread
    lease = await asyncio.wait_for(waiting, WAIT)
    lease.release()
    assert len(locks) == 0
