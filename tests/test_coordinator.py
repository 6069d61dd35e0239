"""Guarantees of ``TenantTaskCoordinator`` on real threads, real loops and in virtual time."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import reactivex
from loguru import logger
from reactivex import abc
from reactivex import operators as ops
from reactivex.scheduler import ThreadPoolScheduler
from reactivex.testing import TestScheduler

from rxcoord import (
    CoordinatorClosed,
    CoordinatorState,
    CoordinatorStats,
    TenantTaskCoordinator,
    TooManyTasks,
)

WAIT = 10.0  # generous bound for events that must happen; never reached when the code is right


class Outcome:
    """Collects what one subscription received."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.error: Exception | None = None
        self.completed = False
        self.done = threading.Event()

    def on_next(self, value: Any) -> None:
        self.values.append(value)

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.done.set()

    def on_completed(self) -> None:
        self.completed = True
        self.done.set()

    def subscribe_to(self, observable: reactivex.Observable[Any]) -> abc.DisposableBase:
        return observable.subscribe(self.on_next, self.on_error, self.on_completed)


class Gate:
    """A job that records that it started and returns ``value`` once opened."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.started = threading.Event()
        self.opened = threading.Event()
        self.returned = threading.Event()

    def __call__(self) -> Any:
        self.started.set()
        assert self.opened.wait(WAIT), "gate never opened"
        self.returned.set()
        return self.value

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def coordinator() -> Iterator[TenantTaskCoordinator]:
    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=3, name="test") as c:
        yield c


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# -- the API: cold, one submission per subscription, value or the very exception ---------------


def test_execute_is_cold_and_each_subscription_is_one_submission(
    coordinator: TenantTaskCoordinator,
) -> None:
    calls: list[int] = []

    def job() -> int:
        calls.append(1)
        return len(calls)

    observable = coordinator.execute(job)
    time.sleep(0.01)
    assert calls == []
    assert coordinator.stats().submitted == 0
    assert observable.run() == 1
    assert observable.run() == 2
    assert coordinator.stats().submitted == 2


def test_emits_the_result_once_and_completes(coordinator: TenantTaskCoordinator) -> None:
    outcome = Outcome()
    outcome.subscribe_to(coordinator.execute(lambda: "result"))
    assert outcome.done.wait(WAIT)
    assert outcome.values == ["result"]
    assert outcome.completed


def test_errors_with_the_very_exception_the_job_raised(coordinator: TenantTaskCoordinator) -> None:
    boom = ValueError("job failed")

    def job() -> None:
        raise boom

    outcome = Outcome()
    outcome.subscribe_to(coordinator.execute(job))
    assert outcome.done.wait(WAIT)
    assert outcome.error is boom
    with pytest.raises(ValueError, match="job failed") as info:
        coordinator.execute(job).run()
    assert info.value is boom


def test_works_inside_reactivex_pipelines(coordinator: TenantTaskCoordinator) -> None:
    def plus_one(x: int) -> int:
        return x + 1

    result = coordinator.execute(lambda: 20).pipe(ops.map(plus_one)).run()
    assert result == 21

    def constant(i: int) -> Callable[[], int]:
        return lambda: i

    merged = reactivex.merge(*(coordinator.execute(constant(i)) for i in range(5)))
    assert sorted(merged.pipe(ops.to_list()).run()) == [0, 1, 2, 3, 4]


def test_bad_arguments_fail_at_the_call() -> None:
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
    with TenantTaskCoordinator() as c:
        with pytest.raises(TypeError, match="callable"):
            c.execute(42)  # type: ignore[call-overload]
        with pytest.raises(TypeError):
            c.execute(lambda: 1, key=["unhashable"])  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="timeout"):
            c.execute(lambda: 1, timeout=-1)


# -- 1. the work-in-progress counter ------------------------------------------------------------


def test_rejects_beyond_concurrency_plus_queue_with_a_precise_message(
    coordinator: TenantTaskCoordinator,
) -> None:
    gates = [Gate(i) for i in range(5)]
    outcomes = [Outcome() for _ in gates]
    for gate, outcome in zip(gates, outcomes, strict=True):
        outcome.subscribe_to(coordinator.execute(gate))
    assert coordinator.work_in_progress == 5  # 2 running + 3 queued: the limit

    refused = Outcome()
    refused.subscribe_to(coordinator.execute(lambda: "never"))
    assert refused.done.is_set()  # at once, on the subscribing thread
    assert isinstance(refused.error, TooManyTasks)
    message = str(refused.error)
    assert "'test'" in message
    assert "5 jobs in progress" in message
    assert "limit 5" in message
    assert coordinator.work_in_progress == 5  # the counter was restored

    for gate in gates:
        gate.open()
    for outcome in outcomes:
        assert outcome.done.wait(WAIT)
    assert [o.values for o in outcomes] == [[0], [1], [2], [3], [4]]
    stats = coordinator.stats()
    assert (stats.submitted, stats.completed, stats.rejected) == (6, 5, 1)
    assert stats.work_in_progress == 0


def test_wip_is_decremented_before_the_result_is_delivered() -> None:
    # Reactor decrements after delivery: a caller resubmitting from its callback gets a
    # spurious TooManyTasks when the coordinator is full. Here the slot is already free.
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0) as c:
        second = Outcome()

        def resubmit(_: Any) -> None:
            second.subscribe_to(c.execute(lambda: "second"))

        first = Outcome()
        c.execute(lambda: "first").subscribe(resubmit, first.on_error, first.on_completed)
        assert second.done.wait(WAIT)
        assert second.error is None
        assert second.values == ["second"]


def test_virtual_time_wip_counting_and_rejection() -> None:
    scheduler = TestScheduler()
    c = TenantTaskCoordinator(scheduler=scheduler, max_concurrency=1, max_queue_size=2)
    ran: list[tuple[float, int]] = []
    outcomes = [Outcome() for _ in range(4)]

    def submit(i: int) -> None:
        outcomes[i].subscribe_to(c.execute(lambda: ran.append((scheduler.clock, i))))

    for i in range(4):
        scheduler.schedule_absolute(100 + i, lambda _s, _st, i=i: submit(i))  # type: ignore[misc]
    scheduler.advance_to(99)
    assert c.work_in_progress == 0  # nothing submitted, nothing ran
    scheduler.advance_to(103)
    assert ran == [(100, 0), (101, 1), (102, 2), (103, 3)]
    assert all(o.error is None for o in outcomes)
    # Now fill it up within one instant: the job hand-offs only run when time advances.
    burst = [Outcome() for _ in range(4)]
    for outcome in burst:
        outcome.subscribe_to(c.execute(lambda: None))
    assert [type(o.error) for o in burst] == [type(None)] * 3 + [TooManyTasks]
    assert c.work_in_progress == 3
    scheduler.advance_to(104)
    assert c.work_in_progress == 0
    c.close()


# -- 2. concurrency ---------------------------------------------------------------------------


class Tracker:
    """Counts jobs running at once, per coordinator and per key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.by_key: dict[Any, int] = {}
        self.violations: list[str] = []

    def job(self, key: Any = None, delay: float = 0.001, value: Any = None) -> Callable[[], Any]:
        def run() -> Any:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
                if key is not None:
                    if self.by_key.get(key):
                        self.violations.append(f"key {key!r} ran twice at once")
                    self.by_key[key] = 1
            time.sleep(delay)
            with self.lock:
                self.running -= 1
                if key is not None:
                    self.by_key[key] = 0
            return value

        return run


def test_never_more_than_max_concurrency_jobs_run() -> None:
    tracker = Tracker()
    with TenantTaskCoordinator(max_concurrency=3, max_queue_size=100) as c:
        outcomes = [Outcome() for _ in range(60)]
        for outcome in outcomes:
            outcome.subscribe_to(c.execute(tracker.job(delay=0.002)))
        for outcome in outcomes:
            assert outcome.done.wait(WAIT)
    assert tracker.most == 3  # reached, never exceeded


def test_a_cancelled_sync_job_keeps_its_slot_until_it_returns() -> None:
    # Reactor frees the slot at once and over-subscribes; a Python thread cannot be killed.
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
        first = Gate("first")
        sub = Outcome().subscribe_to(c.execute(first))
        assert first.started.wait(WAIT)
        sub.dispose()
        assert c.stats().cancelled == 1

        second = Gate("second")
        outcome = Outcome()
        outcome.subscribe_to(c.execute(second))
        time.sleep(0.05)
        assert not second.started.is_set()  # the cancelled job still holds the only slot
        assert c.running == 1
        first.open()
        assert second.started.wait(WAIT)
        second.open()
        assert outcome.done.wait(WAIT)
        assert outcome.values == ["second"]


# -- 3. cancellation -------------------------------------------------------------------------


def test_a_queued_job_cancelled_never_starts_and_leaves_the_counters_at_once(
    coordinator: TenantTaskCoordinator,
) -> None:
    blockers = [Gate(), Gate()]
    for gate in blockers:
        Outcome().subscribe_to(coordinator.execute(gate))
    queued = Gate()
    outcome = Outcome()
    sub = outcome.subscribe_to(coordinator.execute(queued))
    assert (coordinator.running, coordinator.queued) == (2, 1)
    sub.dispose()
    assert (coordinator.running, coordinator.queued) == (2, 0)  # at once
    # The freed queue slot is usable right away (Reactor leaked it).
    extra = [Outcome() for _ in range(3)]
    for o in extra:
        o.subscribe_to(coordinator.execute(lambda: "extra"))
    assert all(o.error is None for o in extra)
    for gate in blockers:
        gate.open()
    for o in extra:
        assert o.done.wait(WAIT)
    time.sleep(0.02)
    assert not queued.started.is_set()
    assert not outcome.done.is_set()  # a cancelled subscriber hears nothing
    assert coordinator.stats().cancelled == 1


def test_queued_jobs_cancelled_while_the_coordinator_is_stuck_leave_no_state_behind() -> None:
    # The WIP limit stops counting a job cancelled while queued; without a purge each one
    # would stay in the pipeline's queues (with its subscriber) until the stuck job returns.
    ran: list[tuple[Any, int]] = []
    stuck = Gate()
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=16) as c:
        Outcome().subscribe_to(c.execute(stuck, key="a"))
        assert stuck.started.wait(WAIT)
        live: list[Outcome] = []
        for i in range(5000):
            key = ("a", "b", None)[i % 3]
            sub = Outcome().subscribe_to(
                c.execute(lambda key=key, i=i: ran.append((key, i)), key=key)
            )
            sub.dispose()
            if i % 500 == 7:  # a few stay, interleaved with the cancelled ones
                live.append(Outcome())
                live[-1].subscribe_to(c.execute(lambda key=key, i=i: ran.append((key, i)), key=key))
        gc.collect()
        tasks = sum(1 for obj in gc.get_objects() if type(obj).__name__ == "_Task")
        # Live work plus fewer tombstones than the purge floor (64) or the queue size.
        assert tasks <= 1 + len(live) + 64, f"{tasks} tasks retained"
        assert c.stats().cancelled == 5000
        stuck.open()
        for outcome in live:
            assert outcome.done.wait(WAIT)
            assert outcome.error is None
    # Only the live jobs ran, and each key's in subscription order.
    assert sorted(i for _, i in ran) == [i for i in range(5000) if i % 500 == 7]
    for key in ("a", "b", None):
        of_key = [i for k, i in ran if k == key]
        assert of_key == sorted(of_key)


def test_a_running_sync_job_s_result_is_discarded(coordinator: TenantTaskCoordinator) -> None:
    gate = Gate("late")
    outcome = Outcome()
    sub = outcome.subscribe_to(coordinator.execute(gate))
    assert gate.started.wait(WAIT)
    sub.dispose()
    gate.open()
    assert gate.returned.wait(WAIT)
    wait_until(lambda: coordinator.running == 0, "the slot to free")
    assert outcome.values == []
    assert not outcome.done.is_set()
    stats = coordinator.stats()
    assert (stats.cancelled, stats.completed) == (1, 0)


def test_dispose_after_completion_is_a_noop(coordinator: TenantTaskCoordinator) -> None:
    outcome = Outcome()
    sub = outcome.subscribe_to(coordinator.execute(lambda: 1))
    assert outcome.done.wait(WAIT)
    before = coordinator.stats()
    sub.dispose()
    sub.dispose()
    assert coordinator.stats() == before
    assert outcome.values == [1]


# -- 4. timeouts ------------------------------------------------------------------------------


def test_timeout_errors_the_subscriber_and_keeps_the_sync_job_s_slot() -> None:
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5, name="t") as c:
        slow = Gate("too late")
        outcome = Outcome()
        outcome.subscribe_to(c.execute(slow, timeout=0.05))
        assert outcome.done.wait(WAIT)
        assert isinstance(outcome.error, TimeoutError)
        assert "0.05" in str(outcome.error)
        assert c.running == 1  # the thread is still busy
        follower = Outcome()
        follower.subscribe_to(c.execute(lambda: "next"))
        time.sleep(0.02)
        assert not follower.done.is_set()
        slow.open()
        assert follower.done.wait(WAIT)
        assert follower.values == ["next"]
        assert outcome.values == []  # the late result was dropped
        assert c.stats().timed_out == 1


def test_timeout_counts_from_the_start_not_from_the_submission() -> None:
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
        blocker = Gate()
        Outcome().subscribe_to(c.execute(blocker))
        queued = Outcome()
        queued.subscribe_to(c.execute(lambda: "fine", timeout=0.05))
        time.sleep(0.15)  # three timeouts' worth of waiting in the queue...
        blocker.open()
        assert queued.done.wait(WAIT)
        assert queued.error is None  # ...does not count
        assert queued.values == ["fine"]


def test_default_timeout_applies_and_per_call_timeout_overrides() -> None:
    with TenantTaskCoordinator(max_concurrency=2, timeout=0.05) as c:
        hanging = Gate()
        by_default = Outcome()
        by_default.subscribe_to(c.execute(hanging))
        assert by_default.done.wait(WAIT)
        assert isinstance(by_default.error, TimeoutError)
        relaxed = Outcome()

        def slowish() -> str:
            time.sleep(0.1)
            return "ok"

        relaxed.subscribe_to(c.execute(slowish, timeout=5))
        assert relaxed.done.wait(WAIT)
        assert relaxed.values == ["ok"]
        hanging.open()


def test_ten_thousand_pending_timeouts_use_no_extra_threads() -> None:
    import asyncio

    async def main() -> int:
        with TenantTaskCoordinator(max_concurrency=10_000, max_queue_size=0) as c:
            release = asyncio.Event()

            async def job() -> None:
                await release.wait()

            subs = [c.execute(job, timeout=60).subscribe() for _ in range(10_000)]
            await asyncio.sleep(0.05)
            assert c.running == 10_000
            threads = threading.active_count()
            release.set()
            for sub in subs:
                sub.dispose()
            return threads

    before = threading.active_count()
    during = asyncio.run(main())
    assert during <= before + 1  # at most the shared timer thread


# -- 5. keyed jobs ------------------------------------------------------------------------------


def test_seed_scenario_ten_threads_one_customer_three_numbers_each() -> None:
    shared: list[int] = []
    with TenantTaskCoordinator(max_concurrency=4, max_queue_size=20) as c:

        def append_three(base: int) -> None:
            for n in range(base, base + 3):
                shared.append(n)
                time.sleep(0.001)  # invite interleaving: only the key prevents it

        outcomes = [Outcome() for _ in range(10)]
        barrier = threading.Barrier(10)

        def submit(i: int) -> None:
            barrier.wait()
            outcomes[i].subscribe_to(c.execute(lambda: append_three(i * 10), key="customer-1"))

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in outcomes:
            assert o.done.wait(WAIT)
    assert len(shared) == 30
    for i in range(0, 30, 3):
        assert shared[i + 1] == shared[i] + 1
        assert shared[i + 2] == shared[i] + 2


def test_equal_keys_run_one_at_a_time_in_subscription_order() -> None:
    tracker = Tracker()
    order: list[int] = []
    with TenantTaskCoordinator(max_concurrency=4, max_queue_size=100) as c:
        outcomes = []
        for i in range(40):
            key = i % 2
            job = tracker.job(key=key, delay=0.001)

            def run(job: Callable[[], Any] = job, i: int = i) -> int:
                order.append(i)
                job()
                return i

            outcome = Outcome()
            outcome.subscribe_to(c.execute(run, key=key))
            outcomes.append(outcome)
        for o in outcomes:
            assert o.done.wait(WAIT)
    assert tracker.violations == []
    assert [i for i in order if i % 2 == 0] == list(range(0, 40, 2))
    assert [i for i in order if i % 2 == 1] == list(range(1, 40, 2))
    assert tracker.most == 2  # the two keys ran side by side


def test_different_keys_and_unkeyed_jobs_run_concurrently() -> None:
    barrier = threading.Barrier(3, timeout=WAIT)
    with TenantTaskCoordinator(max_concurrency=3) as c:
        outcomes = [Outcome() for _ in range(3)]
        for outcome, key in zip(outcomes, ["a", "b", None], strict=True):
            outcome.subscribe_to(c.execute(barrier.wait, key=key))
        for o in outcomes:
            assert o.done.wait(WAIT)
            assert o.error is None  # all three were inside the barrier at once


# -- 6. error isolation and the traps -----------------------------------------------------------


def test_a_job_error_reaches_only_its_subscriber_and_processing_goes_on() -> None:
    coordinator = TenantTaskCoordinator(max_concurrency=2, max_queue_size=20)

    def fail() -> None:
        raise RuntimeError("only mine")

    outcomes = [Outcome() for _ in range(10)]
    for i, o in enumerate(outcomes):
        o.subscribe_to(coordinator.execute(fail if i % 3 == 0 else (lambda i=i: i), key=i % 2))
    for o in outcomes:
        assert o.done.wait(WAIT)
    for i, o in enumerate(outcomes):
        if i % 3 == 0:
            assert isinstance(o.error, RuntimeError)
        else:
            assert (o.values, o.error) == ([i], None)
    assert coordinator.execute(lambda: "still alive").run() == "still alive"
    coordinator.close()


def test_a_subscriber_raising_in_on_next_breaks_nothing(coordinator: TenantTaskCoordinator) -> None:
    def bad(_: Any) -> None:
        raise ZeroDivisionError("subscriber bug")

    for _ in range(5):
        coordinator.execute(lambda: 1).subscribe(bad)
    wait_until(lambda: coordinator.work_in_progress == 0, "jobs to finish")
    assert coordinator.execute(lambda: "fine").run() == "fine"


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


# -- 7. close ----------------------------------------------------------------------------------


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rxcoord-closing")]


def test_close_fails_queued_and_running_jobs_and_leaves_no_thread() -> None:
    c = TenantTaskCoordinator(max_concurrency=2, max_queue_size=5, name="closing")
    gates = [Gate(i) for i in range(2)]
    running = [Outcome() for _ in gates]
    for gate, outcome in zip(gates, running, strict=True):
        outcome.subscribe_to(c.execute(gate))
    for gate in gates:
        assert gate.started.wait(WAIT)
    queued = [Outcome() for _ in range(3)]
    for outcome in queued:
        outcome.subscribe_to(c.execute(lambda: "never"))
    assert len(pool_threads()) == 2

    closer = threading.Thread(target=c.close)
    closer.start()
    for outcome in running + queued:
        assert outcome.done.wait(WAIT)
        assert isinstance(outcome.error, CoordinatorClosed)
    assert c.state is CoordinatorState.CLOSING  # waiting for the sync jobs to return
    for gate in gates:
        gate.open()
    closer.join(WAIT)
    assert c.state is CoordinatorState.CLOSED  # type: ignore[comparison-overlap]
    assert pool_threads() == []  # no thread left behind
    assert all(o.values == [] for o in running)

    late = Outcome()
    late.subscribe_to(c.execute(lambda: 1))
    assert isinstance(late.error, CoordinatorClosed)
    c.close()  # idempotent
    stats = c.stats()
    assert stats.cancelled == 5
    assert stats.rejected == 1
    assert stats.work_in_progress == 0


def test_context_manager_and_dispose_close() -> None:
    with TenantTaskCoordinator(name="ctx") as c:
        assert c.execute(lambda: 1).run() == 1
    assert c.state is CoordinatorState.CLOSED
    d = TenantTaskCoordinator()
    assert isinstance(d, abc.DisposableBase)
    d.dispose()
    assert d.state is CoordinatorState.CLOSED
    with pytest.raises(CoordinatorClosed):
        d.execute(lambda: 1).run()


# -- 8. thread-safety ---------------------------------------------------------------------------


def test_execute_subscribe_and_dispose_from_many_threads_at_once() -> None:
    tracker = Tracker()
    with TenantTaskCoordinator(max_concurrency=3, max_queue_size=10, name="mt") as c:
        results: list[Outcome] = []
        lock = threading.Lock()
        limit_seen: list[int] = []
        barrier = threading.Barrier(6)

        def hammer(seed: int) -> None:
            barrier.wait()
            for i in range(150):
                outcome = Outcome()
                key = (seed + i) % 4
                sub = outcome.subscribe_to(c.execute(tracker.job(key=key, delay=0), key=key))
                limit_seen.append(c.work_in_progress)
                if i % 5 == 0:
                    sub.dispose()
                else:
                    with lock:
                        results.append(outcome)

        threads = [threading.Thread(target=hammer, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in results:
            assert o.done.wait(WAIT)
        wait_until(lambda: c.work_in_progress == 0, "quiescence")
        stats = c.stats()
    assert tracker.violations == []
    assert tracker.most <= 3
    assert max(limit_seen) <= 13
    assert stats.submitted == 900
    assert (
        stats.completed + stats.failed + stats.rejected + stats.cancelled + stats.timed_out
        == stats.submitted
    )


# -- 9. introspection and 10. logging ----------------------------------------------------------


def test_stats_is_a_frozen_snapshot(coordinator: TenantTaskCoordinator) -> None:
    stats = coordinator.stats()
    assert isinstance(stats, CoordinatorStats)
    with pytest.raises(AttributeError):
        stats.submitted = 5  # type: ignore[misc]
    assert (stats.name, stats.max_concurrency, stats.max_queue_size) == ("test", 2, 3)
    assert "test" in repr(coordinator)


def test_rejections_failures_and_subscriber_errors_are_logged() -> None:
    records: list[Any] = []
    sink = logger.add(lambda m: records.append(m.record), level="DEBUG")
    logger.enable("rxcoord")
    try:
        with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, name="logged") as c:
            gate = Gate()
            Outcome().subscribe_to(c.execute(gate))
            Outcome().subscribe_to(c.execute(lambda: 1))  # rejected
            gate.open()
            wait_until(lambda: c.work_in_progress == 0, "idle")

            def fail() -> None:
                raise RuntimeError("job failure")

            Outcome().subscribe_to(c.execute(fail))
            wait_until(lambda: c.stats().failed == 1, "the failing job")
            wait_until(lambda: c.work_in_progress == 0, "idle")

            def buggy(_: int) -> None:
                raise ZeroDivisionError("subscriber bug")

            c.execute(lambda: 1).subscribe(buggy)
            wait_until(lambda: c.stats().completed == 2, "the last job")
            wait_until(lambda: any("subscriber" in r["message"] for r in records), "the log")
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
    by_level = {(r["level"].name, r["message"].split(":")[0]) for r in records}
    assert ("INFO", "rejected") in by_level
    assert any(r["level"].name == "DEBUG" and "job failed" in r["message"] for r in records)
    assert any(r["level"].name == "ERROR" and "subscriber" in r["message"] for r in records)
    assert all(r["extra"].get("coordinator") == "logged" for r in records if "rxcoord" in r["name"])


def test_a_pipeline_fault_fails_live_jobs_and_a_fresh_pipeline_takes_over() -> None:
    # Nothing in the pipeline raises by design (the tests above try hard); this injects a fault
    # to prove the defensive path: no caller hangs, the fault is logged, service continues.
    records: list[str] = []
    sink = logger.add(lambda m: records.append(m.record["level"].name), level="CRITICAL")
    logger.enable("rxcoord")
    try:
        with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
            gate = Gate()
            running, queued = Outcome(), Outcome()
            running.subscribe_to(c.execute(gate))
            queued.subscribe_to(c.execute(lambda: "never"))
            assert gate.started.wait(WAIT)
            boom = RuntimeError("injected pipeline fault")
            c._pipeline.fail(boom)  # as if the source had failed
            assert running.error is boom
            assert queued.error is boom
            gate.open()
            assert c.execute(lambda: "after").run() == "after"
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
    assert records == ["CRITICAL"]


# -- regressions found in review ----------------------------------------------------------------


def test_timeout_errors_are_not_delivered_on_the_shared_timer_thread() -> None:
    # A subscriber that blocks in on_error must not hold up other jobs' timeouts (or lease
    # renewals): the delivery runs off the process-wide timer thread.
    with TenantTaskCoordinator(max_concurrency=2, max_queue_size=5) as c:
        release = threading.Event()
        first_thread: list[str] = []

        def slow_on_error(_: Exception) -> None:
            first_thread.append(threading.current_thread().name)
            release.wait(WAIT)

        gates = [Gate(), Gate()]
        c.execute(gates[0], timeout=0.02).subscribe(on_error=slow_on_error)
        wait_until(lambda: bool(first_thread), "the first timeout")
        second = Outcome()
        second.subscribe_to(c.execute(gates[1], timeout=0.02))
        assert second.done.wait(WAIT)  # fired while the first subscriber still blocks
        assert isinstance(second.error, TimeoutError)
        assert first_thread[0] != "rxcoord-timer"
        release.set()
        for gate in gates:
            gate.open()


def test_close_never_starts_a_queued_job_while_it_notifies_subscribers() -> None:
    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=10)
    first = Gate("first")
    ran: list[int] = []

    def on_error(_: Exception) -> None:
        # close() is delivering CoordinatorClosed here; meanwhile the running job returns and
        # frees its slot. No queued job may start from it.
        first.open()
        assert first.returned.wait(WAIT)
        time.sleep(0.02)

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

    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=5)
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
    wait_until(lambda: c.running == 0, "the slot to be freed")
    assert c.execute(lambda: "next").run() == "next"
    assert c.stats().failed == 1
    c.close()


def test_cancelling_during_the_sync_part_of_a_disguised_async_job_closes_the_coroutine() -> None:
    import asyncio
    import gc

    c = TenantTaskCoordinator(max_concurrency=1)
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
        await asyncio.sleep(0)
        wait_until(lambda: c.running == 0, "the job to finish")

    asyncio.run(main())
    gc.collect()  # an unawaited coroutine would warn here (an error under filterwarnings)
    c.close()
