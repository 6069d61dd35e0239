"""The fast paths of ``TenantTaskCoordinator``: each keeps every guarantee of the slow path.

* ``await execute(async_job)`` on a coordinator without an admission is done whole by the
  awaiting task (``_Awaited``): it claims its turn from ``serialize_by_key`` at once when its key
  is idle and a slot is free, else it waits for the turn on one future.
* A subscription that may start at once claims its turn the same way (no pipeline item).

The model test interleaves both with pipeline-queued subscriptions on the same keys: a job of a
key never overtakes an earlier one of that key, the cap and the WIP limit hold, a turn handed
to an awaiter that is cancelled at that very moment is given back, and every submission ends
exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reactivex import abc
from reactivex.testing import TestScheduler
from support.execution import WAIT, Gate, ManualScheduler, Outcome

from rxcoord import CoordinatorClosed, TenantTaskCoordinator, TooManyTasks


class Ledger:
    """What ran: start order, and the invariants checked as each job starts."""

    def __init__(self, max_concurrency: int) -> None:
        self.max_concurrency = max_concurrency
        self.lock = threading.Lock()
        self.started: list[tuple[Any, int]] = []
        self.active_keys: set[Any] = set()
        self.running = 0

    def enter(self, key: Any, i: int) -> None:
        with self.lock:
            assert key is None or key not in self.active_keys, f"two jobs of key {key} at once"
            self.running += 1
            assert self.running <= self.max_concurrency, "more jobs running than the cap"
            if key is not None:
                self.active_keys.add(key)
            self.started.append((key, i))

    def leave(self, key: Any) -> None:
        with self.lock:
            self.running -= 1
            self.active_keys.discard(key)


keys = st.sampled_from([None, "a", "b"])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("await"), keys, st.booleans()),  # a task awaits an async job
        st.tuples(st.just("subscribe"), keys, st.booleans()),  # a sync job, pipeline path
        st.tuples(st.just("finish"), st.integers(0, 40), st.just(False)),  # an async job ends
        st.tuples(st.just("run"), st.integers(0, 40), st.booleans()),  # a sync job runs
        st.tuples(st.just("cancel"), st.integers(0, 40), st.just(False)),
        st.tuples(st.just("tick"), st.integers(1, 3), st.just(False)),  # loop iterations
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    max_concurrency=st.integers(1, 3),
    max_queue=st.integers(0, 3),
    close_early=st.booleans(),
)
def test_model_of_fast_lane_and_queued_jobs_of_the_same_keys(
    ops: list[tuple[str, Any, Any]], max_concurrency: int, max_queue: int, close_early: bool
) -> None:
    asyncio.run(_model(ops, max_concurrency, max_queue, close_early))


async def _model(
    ops: list[tuple[str, Any, Any]], max_concurrency: int, max_queue: int, close_early: bool
) -> None:
    loop = asyncio.get_running_loop()
    scheduler = ManualScheduler()
    c = TenantTaskCoordinator(
        scheduler=scheduler, max_concurrency=max_concurrency, max_queue_size=max_queue
    )
    ledger = Ledger(max_concurrency)
    submitted: list[tuple[Any, int]] = []  # in submission order
    releases: dict[int, asyncio.Event] = {}
    awaiters: dict[int, asyncio.Task[Any]] = {}
    subscriptions: dict[int, tuple[abc.DisposableBase, Outcome]] = {}
    cancelled: set[int] = set()

    def async_job(i: int, key: Any) -> Callable[[], Any]:
        async def job() -> int:
            ledger.enter(key, i)
            try:
                await releases[i].wait()
            finally:
                ledger.leave(key)
            return i

        return job

    def sync_job(i: int, key: Any) -> Callable[[], int]:
        def job() -> int:
            ledger.enter(key, i)
            ledger.leave(key)
            return i

        return job

    async def awaiter(i: int, key: Any, wait: bool) -> Any:
        submitted.append((key, i))  # and submitted in this same step, without a suspension
        return await c.execute(async_job(i, key), key=key, overflow="wait" if wait else "reject")

    for op, arg, flag in ops:
        i = len(releases) + len(subscriptions)  # a fresh number for a new submission
        if op == "await":
            releases[i] = asyncio.Event()
            awaiters[i] = loop.create_task(awaiter(i, arg, flag))
        elif op == "subscribe":
            outcome = Outcome()
            submitted.append((arg, i))
            observable = c.execute(sync_job(i, arg), key=arg, overflow="wait" if flag else "reject")
            subscriptions[i] = (outcome.subscribe_to(observable), outcome)
        elif op == "finish":
            running = [j for _, j in ledger.started if j in releases and not releases[j].is_set()]
            if running:
                releases[running[arg % len(running)]].set()
        elif op == "run" and scheduler.actions:
            action = scheduler.actions.pop(arg % len(scheduler.actions))
            if flag:  # on another thread: turns reach awaiters through call_soon_threadsafe
                await loop.run_in_executor(None, action)
            else:
                action()
        elif op == "cancel" and (live := _live(awaiters, subscriptions)):
            j = live[arg % len(live)]
            cancelled.add(j)
            if j in awaiters:
                awaiters[j].cancel()
            else:
                subscriptions[j][0].dispose()
        elif op == "tick":
            for _ in range(arg):
                await asyncio.sleep(0)
        # One loop iteration after every op, so awaiting tasks submit promptly. A turn handed
        # in it still reaches its awaiter only after this coroutine's next op: a "cancel"
        # next lands between the turn and the awaiter's resumption.
        await asyncio.sleep(0)
        stats = c.stats()
        assert stats.running <= max_concurrency
        assert stats.work_in_progress <= max_concurrency + max_queue

    if close_early:
        c.close(wait=False)
    # Let everything end: open every async job, run every sync job, until all have ended.
    for _ in range(1000):
        for event in releases.values():
            event.set()
        while scheduler.actions:
            scheduler.actions.pop(0)()
        await asyncio.sleep(0)
        if all(t.done() for t in awaiters.values()) and all(
            o.done.is_set() for _, o in subscriptions.values()
        ):
            break
    pending = [i for i, t in awaiters.items() if not t.done()]
    assert not pending, f"awaiters never ended: {pending}"
    unended = [
        i for i, (_, o) in subscriptions.items() if i not in cancelled and not o.done.is_set()
    ]
    assert not unended, f"subscriptions never ended: {unended}"

    started = {i for _, i in ledger.started}
    assert len(started) == len(ledger.started), "a job ran twice"
    for i, task in awaiters.items():
        if task.cancelled():
            assert i in cancelled
            continue
        error = task.exception()
        if error is None:
            assert task.result() == i
            assert i in started
        else:
            assert isinstance(error, TooManyTasks | CoordinatorClosed), repr(error)
            # a refused or closed job never ran to a value (it may have started, then closed)
            assert isinstance(error, CoordinatorClosed) or i not in started
    for i, (_, outcome) in subscriptions.items():
        if outcome.done.is_set() and outcome.error is None:
            assert outcome.values == [i]
            assert i in started
        elif outcome.error is not None:
            assert isinstance(outcome.error, TooManyTasks | CoordinatorClosed)
    # Per key: jobs started in submission order (whatever path each took).
    rank = {i: n for n, (_, i) in enumerate(submitted)}
    for key in ("a", "b"):
        of_key = [rank[i] for k, i in ledger.started if k == key]
        assert of_key == sorted(of_key), f"key {key}: started {of_key}"
    if not close_early:
        await _all_slots_free(c, max_concurrency)
    c.close()
    final = c.stats()
    assert (final.queued, final.running, final.waiting) == (0, 0, 0)
    assert final.submitted == (
        final.completed + final.failed + final.rejected + final.cancelled + final.timed_out
    )


def _live(
    awaiters: dict[int, asyncio.Task[Any]],
    subscriptions: dict[int, tuple[abc.DisposableBase, Outcome]],
) -> list[int]:
    """The submissions not ended yet, oldest first: what a cancel may still reach."""
    return sorted(
        [i for i, t in awaiters.items() if not t.done()]
        + [i for i, (_, o) in subscriptions.items() if not o.done.is_set()]
    )


async def _all_slots_free(c: TenantTaskCoordinator, slots: int) -> None:
    """Every slot can still be used at once: none was leaked (stats cannot show that)."""
    all_in = asyncio.Event()
    inside = 0

    async def job() -> None:
        nonlocal inside
        inside += 1
        if inside == slots:
            all_in.set()
        await all_in.wait()

    probes = [asyncio.ensure_future(c.execute(job, overflow="wait")) for _ in range(slots)]
    await asyncio.wait_for(asyncio.gather(*probes), WAIT)


# -- the fast lane never overtakes ------------------------------------------------------------


async def test_an_awaited_job_queues_behind_a_queued_job_of_its_key_though_a_slot_is_free() -> None:
    async with TenantTaskCoordinator(max_concurrency=3) as c:
        order: list[str] = []
        running = Gate()
        first = Outcome()
        first.subscribe_to(c.execute(running, key="k"))
        assert await asyncio.to_thread(running.started.wait, WAIT)
        queued = Outcome()
        queued.subscribe_to(c.execute(lambda: order.append("queued"), key="k"))

        async def fast() -> None:
            order.append("awaited")

        awaited = asyncio.ensure_future(c.execute(fast, key="k"))
        other = await c.execute(lambda: "free key", key="other")  # a free key claims at once
        assert other == "free key"
        await asyncio.sleep(0.01)
        assert order == []
        assert not awaited.done()
        running.open()
        await asyncio.wait_for(awaited, WAIT)
        assert order == ["queued", "awaited"]


async def test_sequential_awaits_of_one_key_take_the_fast_lane_in_the_awaiting_task() -> None:
    async with TenantTaskCoordinator(max_concurrency=2) as c:
        me = asyncio.current_task()

        async def job(i: int) -> tuple[int, Any]:
            return i, asyncio.current_task()

        for i in range(50):
            assert await c.execute(functools.partial(job, i), key="k") == (i, me)
        assert c.stats().completed == 50
        assert c.stats().work_in_progress == 0


# -- a turn and a cancellation at the same moment -----------------------------------------------


async def test_a_turn_handed_to_an_awaiter_cancelled_before_it_resumes_is_given_back() -> None:
    loop = asyncio.get_running_loop()
    async with TenantTaskCoordinator(max_concurrency=1) as c:
        ran: list[str] = []
        second: asyncio.Task[Any] | None = None
        release = asyncio.Event()

        async def first_job() -> None:
            await release.wait()
            # Ends now: its slot goes to the second job's awaiter (its future resolved), and
            # this cancellation lands before that awaiter runs again.
            assert second is not None
            loop.call_soon(second.cancel)

        async def second_job() -> None:
            ran.append("second")

        first = asyncio.ensure_future(c.execute(first_job))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(c.execute(second_job))
        await asyncio.sleep(0)
        assert c.stats().queued == 1
        release.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        assert ran == []
        stats = c.stats()
        assert (stats.work_in_progress, stats.cancelled, stats.completed) == (0, 1, 1)
        assert await c.execute(lambda: "slot free") == "slot free"  # the slot was given back


async def test_a_turn_handed_from_a_worker_thread_to_a_cancelled_awaiter_is_given_back() -> None:
    async with TenantTaskCoordinator(max_concurrency=1) as c:
        gate = Gate()
        sync = Outcome()
        sync.subscribe_to(c.execute(gate))
        assert await asyncio.to_thread(gate.started.wait, WAIT)
        ran: list[str] = []

        async def job() -> None:
            ran.append("ran")

        waiting = asyncio.ensure_future(c.execute(job))
        await asyncio.sleep(0)
        waiting.cancel()  # withdrawn; its tombstone's turn comes from the worker thread
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.open()
        assert await asyncio.to_thread(sync.done.wait, WAIT)
        assert await c.execute(lambda: 1) == 1
        assert ran == []
        assert c.stats().work_in_progress == 0


# -- cancellation, timeouts and close inside the awaiting task ---------------------------------


async def test_a_job_that_swallows_the_close_cancellation_leaves_the_awaiter_uncancelled() -> None:
    c = TenantTaskCoordinator(max_concurrency=1)
    inside = asyncio.Event()

    async def job() -> str:
        inside.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "swallowed"  # a job that ignores its cancellation
        return "slept"

    async def awaiter() -> int:
        with pytest.raises(CoordinatorClosed):
            await c.execute(job)
        current = asyncio.current_task()
        assert current is not None
        return current.cancelling()  # the coordinator took its cancellation back

    task = asyncio.ensure_future(awaiter())
    await inside.wait()
    await c.aclose()
    assert await task == 0


async def test_an_awaiter_cancelled_while_close_cancels_its_job_is_cancelled() -> None:
    c = TenantTaskCoordinator(max_concurrency=1)
    inside = asyncio.Event()

    async def job() -> None:
        inside.set()
        await asyncio.sleep(60)

    task = asyncio.ensure_future(c.execute(job))
    await inside.wait()
    task.cancel()  # the awaiter's own wish, and then the close's cancellation: the first wins
    c.close(wait=False)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.stats().work_in_progress == 0


async def test_the_timeout_of_an_awaited_job_counts_from_its_start_not_its_submission() -> None:
    clock = TestScheduler()  # virtual time: the timeouts wait on it, the jobs on the loop
    c = TenantTaskCoordinator(scheduler=clock, max_concurrency=1, timeout=5.0)
    first_done, second_done = asyncio.Event(), asyncio.Event()
    second_started = asyncio.Event()

    async def first() -> str:
        await first_done.wait()
        return "first"

    async def second() -> str:
        second_started.set()
        await second_done.wait()
        return "second"

    a = asyncio.ensure_future(c.execute(first))
    b = asyncio.ensure_future(c.execute(second))
    await asyncio.sleep(0)
    clock.advance_by(3.0)  # first runs 3 s; second waits those 3 s in the queue
    first_done.set()
    assert await a == "first"
    await asyncio.wait_for(second_started.wait(), WAIT)
    clock.advance_by(4.0)  # 7 s after its submission, 4 s after its start: within 5 s
    second_done.set()
    assert await b == "second"
    assert c.stats().timed_out == 0
    await c.aclose()


async def test_an_awaited_job_times_out_inside_the_awaiting_task() -> None:
    clock = TestScheduler()
    c = TenantTaskCoordinator(scheduler=clock, max_concurrency=1, timeout=5.0)
    cancelled = asyncio.Event()
    inside = asyncio.Event()

    async def job() -> None:
        inside.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.ensure_future(c.execute(job))
    await inside.wait()
    clock.advance_by(5.0)
    with pytest.raises(TimeoutError):
        await task
    assert cancelled.is_set()
    assert c.stats().timed_out == 1
    assert c.stats().work_in_progress == 0
    await c.aclose()


async def test_refusals_on_the_awaited_path_raise_at_the_await() -> None:
    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=0)
    release = asyncio.Event()

    async def job() -> None:
        await release.wait()

    running = asyncio.ensure_future(c.execute(job))
    await asyncio.sleep(0)
    with pytest.raises(TooManyTasks):
        await c.execute(job)
    release.set()
    await running
    await c.aclose()
    with pytest.raises(CoordinatorClosed):
        await c.execute(job)
    stats = c.stats()
    assert (stats.rejected, stats.completed) == (2, 1)


# -- threads and tasks on one coordinator --------------------------------------------------------


async def test_threads_claiming_turns_and_awaiting_tasks_keep_each_keys_order_and_the_cap() -> None:
    # Sync subscriptions from threads take the pool's fast lane (or queue), awaited jobs from
    # the loop take theirs; each submitter keeps to keys of its own, so its submission order
    # is each key's order.
    cap = 3
    ledger = Ledger(cap)
    per_key: dict[str, list[int]] = {}
    n = 150

    async with TenantTaskCoordinator(max_concurrency=cap, max_queue_size=10_000) as c:

        def sync_job(key: str, i: int) -> int:
            ledger.enter(key, i)
            ledger.leave(key)
            return i

        def submit_from_thread(name: str, outcomes: list[Outcome]) -> None:
            for i in range(n):
                key = f"{name}-{i % 3}"
                per_key.setdefault(key, []).append(i)
                outcome = Outcome()
                outcome.subscribe_to(c.execute(functools.partial(sync_job, key, i), key=key))
                outcomes.append(outcome)

        async def async_job(key: str, i: int) -> int:
            ledger.enter(key, i)
            try:
                await asyncio.sleep(0)
            finally:
                ledger.leave(key)
            return i

        async def submit_from_loop() -> list[int]:
            tasks = []
            for i in range(n):
                key = f"loop-{i % 3}"
                per_key.setdefault(key, []).append(i)
                tasks.append(
                    asyncio.ensure_future(c.execute(functools.partial(async_job, key, i), key=key))
                )
                await asyncio.sleep(0)  # its submission happens now, in order
            return list(await asyncio.gather(*tasks))

        outcomes: dict[str, list[Outcome]] = {"t1": [], "t2": []}
        threads = [
            threading.Thread(target=submit_from_thread, args=(name, got))
            for name, got in outcomes.items()
        ]
        for thread in threads:
            thread.start()
        assert await submit_from_loop() == list(range(n))
        for thread in threads:
            await asyncio.to_thread(thread.join, WAIT)
        for got in outcomes.values():
            for i, outcome in enumerate(got):
                assert await asyncio.to_thread(outcome.done.wait, WAIT)
                assert outcome.values == [i]
    for key, submitted in per_key.items():
        assert [i for k, i in ledger.started if k == key] == submitted, key
    stats = c.stats()
    assert stats.completed == 3 * n
    assert stats.work_in_progress == 0
