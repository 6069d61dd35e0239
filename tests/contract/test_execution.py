"""The execution contract of ``execute``, for a coordinator and for a scheduler's tenant.

Each test runs once per implementation (``make_executor``, see ``conftest.py``). Timeouts run on
a virtual clock (``TestScheduler``, or ``ThreadedVirtualScheduler`` where a job must block on a
real thread while the clock moves); what a test waits for is an event, never a sleep.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import reactivex
from loguru import logger
from reactivex import abc
from reactivex import operators as ops
from reactivex.testing import TestScheduler
from support.execution import WAIT, Gate, Outcome, ThreadedVirtualScheduler

from rxcoord import CoordinatorClosed, CoordinatorState, TooManyTasks

from .executors import Executor, MakeExecutor


@pytest.fixture
def virtual() -> Iterator[ThreadedVirtualScheduler]:
    scheduler = ThreadedVirtualScheduler()
    yield scheduler
    scheduler.join()


class Tracker:
    """Counts jobs running at once, and notes a key entered twice at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.by_key: dict[Any, int] = {}
        self.violations: list[str] = []

    def enter(self, key: Any = None) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            if key is not None:
                if self.by_key.get(key):
                    self.violations.append(f"key {key!r} ran twice at once")
                self.by_key[key] = 1

    def leave(self, key: Any = None) -> None:
        with self.lock:
            self.running -= 1
            if key is not None:
                self.by_key[key] = 0

    def job(self, key: Any = None, value: Any = None) -> Callable[[], Any]:
        def run() -> Any:
            self.enter(key)
            self.leave(key)
            return value

        return run


# -- the API: cold, one submission per subscription, value or the very exception ---------------


def test_execute_is_cold_and_each_subscription_is_one_submission(
    make_executor: MakeExecutor,
) -> None:
    scheduler = TestScheduler()
    executor = make_executor(scheduler=scheduler)
    calls: list[int] = []

    def job() -> int:
        calls.append(1)
        return len(calls)

    observable = executor.execute(job)
    scheduler.advance_by(1)  # a job handed over at execute() would have run now
    assert calls == []
    assert executor.stats().submitted == 0
    first, second = Outcome(), Outcome()
    first.subscribe_to(observable)
    second.subscribe_to(observable)
    assert executor.stats().submitted == 2
    scheduler.advance_by(1)
    assert (first.values, second.values) == ([1], [2])
    assert first.completed
    assert second.completed


def test_emits_the_result_once_and_completes(executor: Executor) -> None:
    outcome = Outcome()
    outcome.subscribe_to(executor.execute(lambda: "result"))
    assert outcome.done.wait(WAIT)
    assert outcome.values == ["result"]
    assert outcome.completed


def test_errors_with_the_very_exception_the_job_raised(executor: Executor) -> None:
    boom = ValueError("job failed")

    def job() -> None:
        raise boom

    outcome = Outcome()
    outcome.subscribe_to(executor.execute(job))
    assert outcome.done.wait(WAIT)
    assert outcome.error is boom
    with pytest.raises(ValueError, match="job failed") as info:
        executor.execute(job).run()
    assert info.value is boom


def test_works_inside_reactivex_pipelines(executor: Executor) -> None:
    def plus_one(x: int) -> int:
        return x + 1

    assert executor.execute(lambda: 20).pipe(ops.map(plus_one)).run() == 21

    def constant(i: int) -> Callable[[], int]:
        return lambda: i

    merged = reactivex.merge(*(executor.execute(constant(i)) for i in range(5)))
    assert sorted(merged.pipe(ops.to_list()).run()) == [0, 1, 2, 3, 4]


def test_bad_execute_arguments_fail_at_the_call(executor: Executor) -> None:
    with pytest.raises(TypeError, match="callable"):
        executor.execute(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        executor.execute(lambda: 1, key=["unhashable"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        executor.execute(lambda: 1, timeout=-1)
    assert executor.stats().submitted == 0


# -- the work-in-progress counter ---------------------------------------------------------------


def test_rejects_beyond_concurrency_plus_queue_with_a_precise_message(executor: Executor) -> None:
    gates = [Gate(i) for i in range(5)]
    outcomes = [Outcome() for _ in gates]
    for gate, outcome in zip(gates, outcomes, strict=True):
        outcome.subscribe_to(executor.execute(gate))
    assert executor.work_in_progress == 5  # 2 running + 3 queued: the limit

    refused = Outcome()
    refused.subscribe_to(executor.execute(lambda: "never"))
    assert refused.done.is_set()  # at once, on the subscribing thread
    assert isinstance(refused.error, TooManyTasks)
    message = str(refused.error)
    assert "'test'" in message
    assert "5 jobs in progress" in message
    assert "limit 5" in message
    assert executor.work_in_progress == 5  # the counter was restored

    for gate in gates:
        gate.open()
    for outcome in outcomes:
        assert outcome.done.wait(WAIT)
    assert [o.values for o in outcomes] == [[0], [1], [2], [3], [4]]
    stats = executor.stats()
    assert (stats.submitted, stats.completed, stats.rejected) == (6, 5, 1)
    assert stats.work_in_progress == 0


def test_wip_is_decremented_before_the_result_is_delivered(make_executor: MakeExecutor) -> None:
    # Reactor decrements after delivery: a caller resubmitting from its callback gets a
    # spurious TooManyTasks when the coordinator is full. Here the slot is already free.
    executor = make_executor(max_concurrency=1, max_queue_size=0)
    second = Outcome()

    def resubmit(_: Any) -> None:
        second.subscribe_to(executor.execute(lambda: "second"))

    first = Outcome()
    executor.execute(lambda: "first").subscribe(resubmit, first.on_error, first.on_completed)
    assert second.done.wait(WAIT)
    assert second.error is None
    assert second.values == ["second"]


def test_virtual_time_wip_counting_and_rejection(make_executor: MakeExecutor) -> None:
    scheduler = TestScheduler()
    executor = make_executor(scheduler=scheduler, max_concurrency=1, max_queue_size=2)
    ran: list[tuple[float, int]] = []
    outcomes = [Outcome() for _ in range(4)]

    def submit(i: int) -> None:
        outcomes[i].subscribe_to(executor.execute(lambda: ran.append((scheduler.clock, i))))

    for i in range(4):
        scheduler.schedule_absolute(100 + i, lambda _s, _st, i=i: submit(i))  # type: ignore[misc]
    scheduler.advance_to(99)
    assert executor.work_in_progress == 0  # nothing submitted, nothing ran
    scheduler.advance_to(103)
    assert ran == [(100, 0), (101, 1), (102, 2), (103, 3)]
    assert all(o.error is None for o in outcomes)
    # Now fill it up within one instant: the job hand-offs only run when time advances.
    burst = [Outcome() for _ in range(4)]
    for outcome in burst:
        outcome.subscribe_to(executor.execute(lambda: None))
    assert [type(o.error) for o in burst] == [type(None)] * 3 + [TooManyTasks]
    assert executor.work_in_progress == 3
    scheduler.advance_to(104)
    assert executor.work_in_progress == 0


# -- concurrency -------------------------------------------------------------------------------


def test_never_more_than_max_concurrency_jobs_run(make_executor: MakeExecutor) -> None:
    # Every job holds its slot until the test lets it go, one at a time: at each step exactly
    # the limit is running, and a job started beyond it would be caught inside the tracker.
    tracker = Tracker()
    started: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()

    def job() -> None:
        tracker.enter()
        release = threading.Event()
        started.put(release)
        try:
            assert release.wait(WAIT)
        finally:
            tracker.leave()

    executor = make_executor(max_concurrency=3, max_queue_size=100)
    outcomes = [Outcome() for _ in range(60)]
    for outcome in outcomes:
        outcome.subscribe_to(executor.execute(job))
    held = [started.get(timeout=WAIT) for _ in range(3)]
    assert (executor.running, executor.queued) == (3, 57)
    for _ in range(57):
        held.pop(0).set()
        held.append(started.get(timeout=WAIT))
    for release in held:
        release.set()
    for outcome in outcomes:
        assert outcome.done.wait(WAIT)
        assert outcome.error is None
    assert tracker.most == 3  # reached, never exceeded


def test_a_cancelled_sync_job_keeps_its_slot_until_it_returns(
    make_executor: MakeExecutor,
) -> None:
    # Reactor frees the slot at once and over-subscribes; a Python thread cannot be killed.
    executor = make_executor(max_concurrency=1, max_queue_size=5)
    first = Gate("first")
    sub = Outcome().subscribe_to(executor.execute(first))
    assert first.started.wait(WAIT)
    sub.dispose()
    assert executor.stats().cancelled == 1

    second = Gate("second")
    outcome = Outcome()
    outcome.subscribe_to(executor.execute(second))
    # A freed slot would have started the second job right here, on this thread.
    assert (executor.running, executor.queued) == (1, 1)  # the cancelled job holds the slot
    assert not second.started.is_set()
    first.open()
    assert second.started.wait(WAIT)
    second.open()
    assert outcome.done.wait(WAIT)
    assert outcome.values == ["second"]


# -- cancellation ------------------------------------------------------------------------------


def test_a_queued_job_cancelled_never_starts_and_leaves_the_counters_at_once(
    make_executor: MakeExecutor,
) -> None:
    scheduler = TestScheduler()  # jobs run only when the test advances the clock
    executor = make_executor(scheduler=scheduler)  # 2 running + 3 queued
    ran: list[str] = []
    for name in ("a", "b"):
        Outcome().subscribe_to(executor.execute(lambda name=name: ran.append(name)))
    outcome = Outcome()
    sub = outcome.subscribe_to(executor.execute(lambda: ran.append("cancelled")))
    assert (executor.running, executor.queued) == (2, 1)
    sub.dispose()
    assert (executor.running, executor.queued) == (2, 0)  # at once
    # The freed queue slot is usable right away (Reactor leaked it).
    extra = [Outcome() for _ in range(3)]
    for o in extra:
        o.subscribe_to(executor.execute(lambda: ran.append("extra")))
    assert all(o.error is None for o in extra)
    assert (executor.running, executor.queued) == (2, 3)
    scheduler.advance_by(1)
    assert ran == ["a", "b", "extra", "extra", "extra"]
    assert all(o.done.is_set() for o in extra)
    assert not outcome.done.is_set()  # a cancelled subscriber hears nothing
    stats = executor.stats()
    assert (stats.cancelled, stats.completed, stats.work_in_progress) == (1, 5, 0)


def test_queued_jobs_cancelled_while_the_coordinator_is_stuck_leave_no_state_behind(
    make_executor: MakeExecutor,
) -> None:
    # The WIP limit stops counting a job cancelled while queued; without a purge each one
    # would stay in the pipeline's queues (with its subscriber) until the stuck job returns.
    ran: list[tuple[Any, int]] = []
    stuck = Gate()
    executor = make_executor(max_concurrency=1, max_queue_size=16)
    Outcome().subscribe_to(executor.execute(stuck, key="a"))
    assert stuck.started.wait(WAIT)
    live: list[Outcome] = []
    for i in range(5000):
        key = ("a", "b", None)[i % 3]
        sub = Outcome().subscribe_to(
            executor.execute(lambda key=key, i=i: ran.append((key, i)), key=key)
        )
        sub.dispose()
        if i % 500 == 7:  # a few stay, interleaved with the cancelled ones
            live.append(Outcome())
            live[-1].subscribe_to(
                executor.execute(lambda key=key, i=i: ran.append((key, i)), key=key)
            )
    gc.collect()
    tasks = sum(1 for obj in gc.get_objects() if type(obj).__name__ == "_Task")
    # Live work plus fewer tombstones than the purge floor (64) or the queue size.
    assert tasks <= 1 + len(live) + 64, f"{tasks} tasks retained"
    assert executor.stats().cancelled == 5000
    stuck.open()
    for outcome in live:
        assert outcome.done.wait(WAIT)
        assert outcome.error is None
    # Only the live jobs ran, and each key's in subscription order.
    assert sorted(i for _, i in ran) == [i for i in range(5000) if i % 500 == 7]
    for key in ("a", "b", None):
        of_key = [i for k, i in ran if k == key]
        assert of_key == sorted(of_key)


def test_a_running_sync_job_s_result_is_discarded(
    make_executor: MakeExecutor, virtual: ThreadedVirtualScheduler
) -> None:
    executor = make_executor(scheduler=virtual)
    gate = Gate("late")
    outcome = Outcome()
    sub = outcome.subscribe_to(executor.execute(gate))
    assert gate.started.wait(WAIT)
    sub.dispose()
    gate.open()
    virtual.wait_returned(1)  # the job's hand-off is over: its slot was freed before
    assert executor.running == 0
    assert outcome.values == []
    assert not outcome.done.is_set()
    stats = executor.stats()
    assert (stats.cancelled, stats.completed) == (1, 0)


def test_dispose_after_completion_is_a_noop(executor: Executor) -> None:
    outcome = Outcome()
    sub = outcome.subscribe_to(executor.execute(lambda: 1))
    assert outcome.done.wait(WAIT)
    before = executor.stats()
    sub.dispose()
    sub.dispose()
    assert executor.stats() == before
    assert outcome.values == [1]


# -- timeouts (on the virtual clock) -------------------------------------------------------------


def test_timeout_errors_the_subscriber_and_keeps_the_sync_job_s_slot(
    make_executor: MakeExecutor, virtual: ThreadedVirtualScheduler
) -> None:
    executor = make_executor(max_concurrency=1, max_queue_size=5, scheduler=virtual, name="t")
    slow = Gate("too late")
    outcome = Outcome()
    outcome.subscribe_to(executor.execute(slow, timeout=0.05))
    assert slow.started.wait(WAIT)
    virtual.advance_by(0.04)
    assert not outcome.done.is_set()
    virtual.advance_by(0.01)  # the deadline: the timeout fires (and is delivered) right here
    assert outcome.done.is_set()
    assert isinstance(outcome.error, TimeoutError)
    assert "0.05" in str(outcome.error)
    assert executor.running == 1  # the thread is still busy
    follower = Outcome()
    follower.subscribe_to(executor.execute(lambda: "next"))
    assert (executor.running, executor.queued) == (1, 1)  # behind the timed-out job
    slow.open()
    assert follower.done.wait(WAIT)
    assert follower.values == ["next"]
    assert outcome.values == []  # the late result was dropped
    assert executor.stats().timed_out == 1


def test_timeout_counts_from_the_start_not_from_the_submission(
    make_executor: MakeExecutor, virtual: ThreadedVirtualScheduler
) -> None:
    executor = make_executor(max_concurrency=1, max_queue_size=5, scheduler=virtual)
    blocker = Gate()
    Outcome().subscribe_to(executor.execute(blocker))
    assert blocker.started.wait(WAIT)
    queued = Outcome()
    queued.subscribe_to(executor.execute(lambda: "fine", timeout=0.05))
    virtual.advance_by(0.15)  # three timeouts' worth of waiting in the queue...
    assert not queued.done.is_set()
    blocker.open()
    assert queued.done.wait(WAIT)
    assert queued.error is None  # ...does not count
    assert queued.values == ["fine"]


def test_default_timeout_applies_and_per_call_timeout_overrides(
    make_executor: MakeExecutor, virtual: ThreadedVirtualScheduler
) -> None:
    executor = make_executor(max_concurrency=2, timeout=0.05, scheduler=virtual)
    hanging = Gate()
    by_default = Outcome()
    by_default.subscribe_to(executor.execute(hanging))
    assert hanging.started.wait(WAIT)
    virtual.advance_by(0.05)
    assert isinstance(by_default.error, TimeoutError)
    slowish = Gate("ok")
    relaxed = Outcome()
    relaxed.subscribe_to(executor.execute(slowish, timeout=5))
    assert slowish.started.wait(WAIT)
    virtual.advance_by(0.1)  # twice the default
    assert not relaxed.done.is_set()
    slowish.open()
    assert relaxed.done.wait(WAIT)
    assert relaxed.values == ["ok"]
    hanging.open()


# -- keyed jobs --------------------------------------------------------------------------------


def test_seed_scenario_ten_threads_one_customer_three_numbers_each(
    make_executor: MakeExecutor,
) -> None:
    shared: list[int] = []
    tracker = Tracker()
    executor = make_executor(max_concurrency=4, max_queue_size=20)
    first = Gate()  # the customer's first job holds the key while the threads submit
    Outcome().subscribe_to(executor.execute(first, key="customer-1"))
    assert first.started.wait(WAIT)

    def append_three(base: int) -> None:
        tracker.enter("customer-1")
        shared.extend(range(base, base + 3))
        tracker.leave("customer-1")

    outcomes = [Outcome() for _ in range(10)]
    barrier = threading.Barrier(10)

    def submit(i: int) -> None:
        barrier.wait()
        outcomes[i].subscribe_to(executor.execute(lambda: append_three(i * 10), key="customer-1"))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Four slots, but the ten jobs of one customer wait behind its running one.
    assert (executor.running, executor.queued) == (1, 10)
    first.open()
    for o in outcomes:
        assert o.done.wait(WAIT)
        assert o.error is None
    assert tracker.violations == []
    assert len(shared) == 30
    for i in range(0, 30, 3):
        assert shared[i + 1] == shared[i] + 1
        assert shared[i + 2] == shared[i] + 2


def test_equal_keys_run_one_at_a_time_in_subscription_order(make_executor: MakeExecutor) -> None:
    tracker = Tracker()
    order: list[int] = []
    both_keys = threading.Barrier(2, timeout=WAIT)  # the two keys' first jobs meet here
    heads = [Gate(), Gate()]
    executor = make_executor(max_concurrency=4, max_queue_size=100)
    outcomes = []
    for i in range(40):
        key = i % 2

        def run(key: int = key, i: int = i) -> int:
            tracker.enter(key)
            order.append(i)
            if i < 2:
                both_keys.wait()  # side by side, or BrokenBarrierError
                heads[i]()  # and hold the key
            tracker.leave(key)
            return i

        outcome = Outcome()
        outcome.subscribe_to(executor.execute(run, key=key))
        outcomes.append(outcome)
    for head in heads:
        assert head.started.wait(WAIT)
    assert (executor.running, executor.queued) == (2, 38)  # 4 slots, but 2 keys
    for head in heads:
        head.open()
    for i, o in enumerate(outcomes):
        assert o.done.wait(WAIT)
        assert (o.values, o.error) == ([i], None)
    assert tracker.violations == []
    assert [i for i in order if i % 2 == 0] == list(range(0, 40, 2))
    assert [i for i in order if i % 2 == 1] == list(range(1, 40, 2))
    assert tracker.most == 2  # the two keys ran side by side


def test_different_keys_and_unkeyed_jobs_run_concurrently(make_executor: MakeExecutor) -> None:
    barrier = threading.Barrier(3, timeout=WAIT)
    executor = make_executor(max_concurrency=3)
    outcomes = [Outcome() for _ in range(3)]
    for outcome, key in zip(outcomes, ["a", "b", None], strict=True):
        outcome.subscribe_to(executor.execute(barrier.wait, key=key))
    for o in outcomes:
        assert o.done.wait(WAIT)
        assert o.error is None  # all three were inside the barrier at once


# -- error isolation ---------------------------------------------------------------------------


def test_a_job_error_reaches_only_its_subscriber_and_processing_goes_on(
    make_executor: MakeExecutor,
) -> None:
    executor = make_executor(max_concurrency=2, max_queue_size=20)

    def fail() -> None:
        raise RuntimeError("only mine")

    outcomes = [Outcome() for _ in range(10)]
    for i, o in enumerate(outcomes):
        o.subscribe_to(executor.execute(fail if i % 3 == 0 else (lambda i=i: i), key=i % 2))
    for o in outcomes:
        assert o.done.wait(WAIT)
    for i, o in enumerate(outcomes):
        if i % 3 == 0:
            assert isinstance(o.error, RuntimeError)
        else:
            assert (o.values, o.error) == ([i], None)
    assert executor.execute(lambda: "still alive").run() == "still alive"


def test_a_subscriber_raising_in_on_next_breaks_nothing(executor: Executor) -> None:
    lock = threading.Lock()
    raised: list[int] = []
    all_raised = threading.Event()

    def bad(_: Any) -> None:
        with lock:
            raised.append(1)
            if len(raised) == 5:
                all_raised.set()
        raise ZeroDivisionError("subscriber bug")

    for _ in range(5):
        executor.execute(lambda: 1).subscribe(bad)
    assert all_raised.wait(WAIT)
    assert executor.execute(lambda: "fine").run() == "fine"
    stats = executor.stats()
    assert (stats.completed, stats.failed, stats.work_in_progress) == (6, 0, 0)


# -- close -------------------------------------------------------------------------------------


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rxcoord-closing")]


def test_close_fails_queued_and_running_jobs_and_leaves_no_thread(
    make_executor: MakeExecutor,
) -> None:
    executor = make_executor(max_concurrency=2, max_queue_size=5, name="closing")
    gates = [Gate(i) for i in range(2)]
    running = [Outcome() for _ in gates]
    for gate, outcome in zip(gates, running, strict=True):
        outcome.subscribe_to(executor.execute(gate))
    for gate in gates:
        assert gate.started.wait(WAIT)
    queued = [Outcome() for _ in range(3)]
    for outcome in queued:
        outcome.subscribe_to(executor.execute(lambda: "never"))
    assert len(pool_threads()) == 2

    closer = threading.Thread(target=executor.close)
    closer.start()
    for outcome in running + queued:
        assert outcome.done.wait(WAIT)
        assert isinstance(outcome.error, CoordinatorClosed)
    assert executor.state is CoordinatorState.CLOSING  # waiting for the sync jobs to return
    for gate in gates:
        gate.open()
    closer.join(WAIT)
    assert executor.state is CoordinatorState.CLOSED  # type: ignore[comparison-overlap]
    assert pool_threads() == []  # no thread left behind
    assert all(o.values == [] for o in running)

    late = Outcome()
    late.subscribe_to(executor.execute(lambda: 1))
    assert isinstance(late.error, CoordinatorClosed)
    executor.close()  # idempotent
    stats = executor.stats()
    assert stats.cancelled == 5
    assert stats.rejected == 1
    assert stats.work_in_progress == 0


def test_context_manager_and_dispose_close(make_executor: MakeExecutor) -> None:
    executor = make_executor(name="ctx")
    with executor.target as target:
        assert target is executor.target
        assert executor.execute(lambda: 1).run() == 1
    assert executor.state is CoordinatorState.CLOSED
    disposed = make_executor()
    assert isinstance(disposed.target, abc.DisposableBase)
    disposed.target.dispose()
    assert disposed.state is CoordinatorState.CLOSED
    with pytest.raises(CoordinatorClosed):
        disposed.execute(lambda: 1).run()


# -- thread-safety -----------------------------------------------------------------------------


def test_execute_subscribe_and_dispose_from_many_threads_at_once(
    make_executor: MakeExecutor,
) -> None:
    tracker = Tracker()
    executor = make_executor(max_concurrency=3, max_queue_size=10, name="mt")
    results: list[Outcome] = []
    lock = threading.Lock()
    limit_seen: list[int] = []
    barrier = threading.Barrier(6)

    def hammer(seed: int) -> None:
        barrier.wait()
        for i in range(150):
            outcome = Outcome()
            key = (seed + i) % 4
            sub = outcome.subscribe_to(executor.execute(tracker.job(key=key), key=key))
            limit_seen.append(executor.work_in_progress)
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
    # Quiescence without polling: one last job per key runs only after every earlier job of
    # its key (a cancelled one included) has returned, and the counters drop before delivery.
    last = [Outcome() for _ in range(4)]
    for key, outcome in enumerate(last):
        outcome.subscribe_to(executor.execute(lambda: None, key=key))
    for outcome in last:
        assert outcome.done.wait(WAIT)
        assert outcome.error is None
    stats = executor.stats()
    assert stats.work_in_progress == 0
    assert tracker.violations == []
    assert tracker.most <= 3
    assert max(limit_seen) <= 13
    assert stats.submitted == 904
    assert (
        stats.completed + stats.failed + stats.rejected + stats.cancelled + stats.timed_out
        == stats.submitted
    )


# -- logging -----------------------------------------------------------------------------------


def test_rejections_failures_and_subscriber_errors_are_logged(
    make_executor: MakeExecutor,
) -> None:
    records: list[Any] = []
    subscriber_logged = threading.Event()

    def sink(message: Any) -> None:
        records.append(message.record)
        if "subscriber" in message.record["message"]:
            subscriber_logged.set()

    handler = logger.add(sink, level="DEBUG")
    logger.enable("rxcoord")
    try:
        with make_executor(max_concurrency=1, max_queue_size=0, name="logged") as executor:
            gate = Gate()
            held = Outcome()
            held.subscribe_to(executor.execute(gate))
            Outcome().subscribe_to(executor.execute(lambda: 1))  # rejected
            gate.open()
            assert held.done.wait(WAIT)  # its slot was freed before this

            def fail() -> None:
                raise RuntimeError("job failure")

            failed = Outcome()
            failed.subscribe_to(executor.execute(fail))
            assert failed.done.wait(WAIT)  # logged before delivery

            def buggy(_: int) -> None:
                raise ZeroDivisionError("subscriber bug")

            executor.execute(lambda: 1).subscribe(buggy)
            assert subscriber_logged.wait(WAIT)
            stats = executor.stats()
    finally:
        logger.disable("rxcoord")
        logger.remove(handler)
    assert (stats.completed, stats.failed, stats.rejected) == (2, 1, 1)
    by_level = {(r["level"].name, r["message"].split(":")[0]) for r in records}
    assert ("INFO", "rejected") in by_level
    assert any(r["level"].name == "DEBUG" and "job failed" in r["message"] for r in records)
    assert any(r["level"].name == "ERROR" and "subscriber" in r["message"] for r in records)
    assert all(r["extra"].get("coordinator") == "logged" for r in records if "rxcoord" in r["name"])
