"""Guarantees only ``TenantTaskCoordinator`` has: its own arguments, custom schedulers, its
stats, the shared timer thread, pipeline faults and regressions of its close and disguised async
jobs. What a coordinator shares with a scheduler's tenant (the ``execute`` contract) is tested
once for both in ``tests/contract/``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from reactivex import abc
from reactivex.scheduler import ThreadPoolScheduler
from support.execution import WAIT, Gate, Outcome

from rxcoord import CoordinatorClosed, CoordinatorStats, TenantTaskCoordinator


@pytest.fixture
def coordinator() -> Iterator[TenantTaskCoordinator]:
    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=3, name="test") as c:
        yield c


# -- arguments ---------------------------------------------------------------------------------


def test_bad_constructor_arguments_fail_at_the_call() -> None:
    # execute()'s own argument checks are in the contract suite.
    with pytest.raises(ValueError, match="max_concurrency"):
        TenantTaskCoordinator(max_concurrency=0)
    with pytest.raises(ValueError, match="max_queue_size"):
        TenantTaskCoordinator(max_queue_size=-1)
    with pytest.raises(TypeError, match="max_concurrency"):
        TenantTaskCoordinator(max_concurrency=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        TenantTaskCoordinator(timeout=0)
    with pytest.raises(TypeError, match="scheduler"):
        TenantTaskCoordinator(scheduler="pool")  # type: ignore[arg-type]


# -- timeouts ---------------------------------------------------------------------------------


def test_ten_thousand_pending_timeouts_use_no_extra_threads() -> None:
    import asyncio

    async def main() -> int:
        with TenantTaskCoordinator(max_concurrency=10_000, max_queue_size=0) as c:
            release = asyncio.Event()
            all_in = asyncio.Event()
            entered = 0

            async def job() -> None:
                nonlocal entered
                entered += 1
                if entered == 10_000:
                    all_in.set()
                await release.wait()

            subs = [c.execute(job, timeout=60).subscribe() for _ in range(10_000)]
            await asyncio.wait_for(all_in.wait(), WAIT)  # every job is inside, timers pending
            assert c.running == 10_000
            threads = threading.active_count()
            release.set()
            for sub in subs:
                sub.dispose()
            return threads

    before = threading.active_count()
    during = asyncio.run(main())
    assert during <= before + 1  # at most the shared timer thread


# -- custom schedulers --------------------------------------------------------------------------


class FailingScheduler(ThreadPoolScheduler):
    """A scheduler that refuses the first ``failures`` hand-offs."""

    def __init__(self, failures: int) -> None:
        super().__init__(2)
        self.failures = failures

    def schedule(self, action: Any, state: Any = None) -> abc.DisposableBase:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("scheduler is broken")
        return super().schedule(action, state)


def test_a_failing_scheduler_reaches_the_caller_instead_of_hanging_it() -> None:
    scheduler = FailingScheduler(failures=2)
    with TenantTaskCoordinator(scheduler=scheduler, max_concurrency=1) as c:
        outcomes = [Outcome() for _ in range(3)]
        for o in outcomes:
            o.subscribe_to(c.execute(lambda: "ok"))
        for o in outcomes:
            assert o.done.wait(WAIT)
        assert [str(o.error) for o in outcomes[:2]] == ["scheduler is broken"] * 2
        assert outcomes[2].values == ["ok"]
        assert c.work_in_progress == 0
    scheduler.executor.shutdown()


def test_sync_jobs_on_an_asyncio_scheduler_from_other_threads() -> None:
    # AsyncIOScheduler is not thread-safe: the hand-off must use call_soon_threadsafe, or the
    # loop never wakes up for a job submitted from another thread.
    import asyncio

    from reactivex.scheduler.eventloop import AsyncIOScheduler

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        with TenantTaskCoordinator(scheduler=AsyncIOScheduler(loop), max_concurrency=2) as c:
            ran_on: list[threading.Thread] = []
            outcome = Outcome()
            outcome.subscribe_to(c.execute(lambda: ran_on.append(threading.current_thread())))
            assert outcome.done.wait(WAIT)
            assert ran_on == [thread]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


# -- introspection and faults ------------------------------------------------------------------


def test_stats_is_a_frozen_snapshot(coordinator: TenantTaskCoordinator) -> None:
    stats = coordinator.stats()
    assert isinstance(stats, CoordinatorStats)
    with pytest.raises(AttributeError):
        stats.submitted = 5  # type: ignore[misc]
    assert (stats.name, stats.max_concurrency, stats.max_queue_size) == ("test", 2, 3)
    assert "test" in repr(coordinator)


def test_timeout_errors_are_not_delivered_on_the_shared_timer_thread() -> None:
    # A subscriber that blocks in on_error must not hold up other jobs' timeouts (or lease
    # renewals): the delivery runs off the process-wide timer thread.
    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=5) as c:
        release = threading.Event()
        first_thread: list[str] = []
        first_delivered = threading.Event()

        def slow_on_error(_: Exception) -> None:
            first_thread.append(threading.current_thread().name)
            first_delivered.set()
            release.wait(WAIT)

        gates = [Gate(), Gate()]
        c.execute(gates[0], timeout=0.02).subscribe(on_error=slow_on_error)
        assert first_delivered.wait(WAIT)  # the first timeout fired (real timer: its thread)
        second = Outcome()
        second.subscribe_to(c.execute(gates[1], timeout=0.02))
        assert second.done.wait(WAIT)  # fired while the first subscriber still blocks
        assert isinstance(second.error, TimeoutError)
        assert first_thread[0] != "rxcoord-timer"
        release.set()
        for gate in gates:
            gate.open()


def test_close_never_starts_a_queued_job_while_it_notifies_subscribers() -> None:
    idle = threading.Event()  # set once the running job's thread has freed its slot
    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=10, on_idle=idle.set)
    first = Gate("first")
    ran: list[int] = []

    def on_error(_: Exception) -> None:
        # close() is delivering CoordinatorClosed here; meanwhile the running job returns and
        # frees its slot. No queued job may start from it (one that did would keep the
        # coordinator busy, and run: see ``ran``).
        first.open()
        assert idle.wait(WAIT)

    c.execute(first).subscribe(on_error=on_error)
    assert first.started.wait(WAIT)
    queued = [Outcome() for _ in range(5)]
    for i, o in enumerate(queued):

        def job(i: int = i) -> None:
            ran.append(i)

        o.subscribe_to(c.execute(job))
    c.close()
    assert ran == []
    assert all(isinstance(o.error, CoordinatorClosed) for o in queued)
    assert c.stats().work_in_progress == 0


def test_a_coroutine_returned_after_its_loop_closed_frees_the_slot() -> None:
    import asyncio

    idle = threading.Event()
    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=5, on_idle=idle.set)
    gate = threading.Event()

    async def fetch() -> int:
        return 1

    def job() -> Any:
        gate.wait(WAIT)
        return fetch()  # an async job in disguise, finished only after the loop is gone

    async def subscribe_on_a_loop() -> None:
        c.execute(job).subscribe()

    asyncio.run(subscribe_on_a_loop())  # the subscriber's loop is closed from here on
    gate.set()
    assert idle.wait(WAIT)  # the slot was freed
    assert c.running == 0
    assert c.execute(lambda: "next").run() == "next"
    assert c.stats().failed == 1
    c.close()


def test_cancelling_during_the_sync_part_of_a_disguised_async_job_closes_the_coroutine() -> None:
    import asyncio

    idle = threading.Event()
    c = TenantTaskCoordinator(max_concurrency=1, on_idle=idle.set)
    gate = threading.Event()
    started = threading.Event()

    async def fetch() -> int:
        return 1

    def job() -> Any:
        started.set()
        gate.wait(WAIT)
        return fetch()

    async def main() -> None:
        sub = c.execute(job).subscribe()
        assert started.wait(WAIT)
        sub.dispose()
        gate.set()
        assert idle.wait(WAIT)  # the job returned its coroutine and was finished
        assert c.running == 0

    asyncio.run(main())
    gc.collect()  # an unawaited coroutine would warn here (an error under filterwarnings)
    c.close()
