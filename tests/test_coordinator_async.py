"""``TenantTaskCoordinator`` with asyncio on an ``AsyncIOScheduler`` of its own.

The async contract (``await``, cancellation, timeouts, ``TooManyTasks``, disguised async jobs) is
shared with a scheduler's tenant and lives in ``tests/contract/test_execution_async.py``."""

from __future__ import annotations

import asyncio
import threading

from reactivex.scheduler.eventloop import AsyncIOScheduler

from rxcoord import TenantTaskCoordinator


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
