"""asyncio jobs on ``TenantTaskCoordinator``: ``await``, cancellation and timeouts.

* ``await coordinator.execute(fetch)`` runs an ``async def`` job under the coordinator's limit;
* cancelling the awaiting task cancels the job (``CancelledError`` inside it);
* a job that runs past its timeout fails with ``TimeoutError`` and is cancelled too;
* a job cancelled while still queued never starts.

Run: ``python examples/async_jobs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from rxcoord import TenantTaskCoordinator


async def main() -> None:
    events: list[str] = []

    async def fetch(i: int) -> str:
        await asyncio.sleep(0.01)
        return f"page {i}"

    async def slow(name: str) -> None:
        events.append(f"{name} started")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append(f"{name} cancelled inside the job")
            raise

    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=10, name="crawler") as c:
        # async def functions, or callables returning a coroutine, run on this loop
        pages = await asyncio.gather(*(c.execute(functools.partial(fetch, i)) for i in range(6)))
        print("fetched:", pages)

        task = asyncio.create_task(c.execute(lambda: slow("download")))
        await asyncio.sleep(0.05)
        task.cancel()  # the caller gives up: the running job is cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await task

        try:
            await c.execute(lambda: slow("report"), timeout=0.05)
        except TimeoutError as error:
            print("timed out:", error)

        blocker = asyncio.create_task(c.execute(lambda: fetch(99)))
        blocker2 = asyncio.create_task(c.execute(lambda: fetch(98)))
        await asyncio.sleep(0)
        queued = c.execute(lambda: slow("never")).subscribe()  # both slots busy: it queues
        queued.dispose()  # cancelled while queued: it never starts
        await asyncio.gather(blocker, blocker2)
        await asyncio.sleep(0.05)
        print("stats:", c.stats())

    for event in events:
        print(" -", event)
    assert "never started" not in events
    assert events == [
        "download started",
        "download cancelled inside the job",
        "report started",
        "report cancelled inside the job",
    ], events


if __name__ == "__main__":
    asyncio.run(main())
