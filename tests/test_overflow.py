"""Backpressure instead of rejection (``overflow="wait"``), the asyncio lifecycle and the
draining close, on ``TenantTaskCoordinator`` and ``TenantScheduler``."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reactivex import abc
from support.execution import ManualScheduler
from support.waiting import WAIT

from rxcoord import CoordinatorClosed, TenantScheduler, TenantTaskCoordinator, TooManyTasks
from rxcoord._admission import FairShareGate


class Meter:
    """Counts jobs running at once and the order they started in (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started: list[Any] = []

    def enter(self, tag: Any) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.started.append(tag)

    def leave(self) -> None:
        with self.lock:
            self.running -= 1


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["block", "", "WAIT", None, 1, True])
def test_overflow_other_than_the_two_strings_raises_at_the_call(bad: Any) -> None:
    with pytest.raises(ValueError, match='overflow must be "reject"'):
        TenantTaskCoordinator(overflow=bad)
    with pytest.raises(ValueError, match='overflow must be "reject"'):
        TenantScheduler(overflow=bad)
    with TenantTaskCoordinator() as c, TenantScheduler() as s:
        if bad is not None:  # None is "the coordinator's default" for a call
            with pytest.raises(ValueError, match='overflow must be "reject"'):
                c.execute(lambda: 1, overflow=bad)
            with pytest.raises(ValueError, match='overflow must be "reject"'):
                s.execute("t", lambda: 1, overflow=bad)


# -- waiting for room -------------------------------------------------------------------------


async def test_wait_admits_several_times_the_limit_none_rejected_order_and_limit_kept() -> None:
    meter = Meter()
    limit_checks: list[int] = []
    c = TenantTaskCoordinator(max_concurrency=4, max_queue_size=4, overflow="wait")

    def job(key: int, seq: int) -> Callable[[], Any]:
        async def run() -> tuple[int, int]:
            meter.enter((key, seq))
            limit_checks.append(c.work_in_progress)
            await asyncio.sleep(0)
            meter.leave()
            return key, seq

        return run

    async def producer(key: int) -> list[tuple[int, int]]:
        return [await c.execute(job(key, seq), key=key) for seq in range(5)]

    async def flood() -> list[Any]:
        # 80 submissions at once from one task, 10x the limit: they wait, none is refused
        return await asyncio.gather(*(c.execute(job(100 + i, 0)) for i in range(80)))

    results = await asyncio.gather(*(producer(k) for k in range(10)), flood())
    for key, got in enumerate(results[:10]):
        assert got == [(key, seq) for seq in range(5)]  # per-key order
    assert len(results[10]) == 80
    assert c.stats().rejected == 0
    assert max(limit_checks) <= 8  # the WIP limit is never exceeded
    assert meter.most <= 4
    keyed = [seq for tag in meter.started if tag[0] < 100 for seq in [tag]]
    for key in range(10):
        assert [s for k, s in keyed if k == key] == list(range(5))
    await c.aclose()


def test_waiters_are_admitted_in_fifo_order() -> None:
    meter = Meter()
    gate = threading.Event()
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, overflow="wait") as c:
        c.execute(lambda: gate.wait(WAIT)).subscribe()
        done = threading.Semaphore(0)
        for i in range(20):

            def job(i: int = i) -> None:
                meter.enter(i)
                meter.leave()

            c.execute(job).subscribe(on_completed=done.release)
        assert c.stats().waiting == 20
        assert c.stats().work_in_progress == 1  # waiting is not work in progress
        gate.set()
        for _ in range(20):
            assert done.acquire(timeout=WAIT)
    assert meter.started == list(range(20))


def test_a_rejecting_call_on_a_waiting_coordinator_and_vice_versa() -> None:
    gate = threading.Event()
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0) as c:
        c.execute(lambda: gate.wait(WAIT)).subscribe()
        errors: list[Exception] = []
        c.execute(lambda: 1).subscribe(on_error=errors.append)
        assert isinstance(errors[0], TooManyTasks)
        assert 'overflow="wait"' in str(errors[0])  # the message names the remedy
        got: list[int] = []
        c.execute(lambda: 2, overflow="wait").subscribe(got.append)  # the call's value wins
        assert c.stats().waiting == 1
        gate.set()
        deadline = time.monotonic() + WAIT
        while not got and time.monotonic() < deadline:
            time.sleep(0.001)
        assert got == [2]
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, overflow="wait") as c:
        hold = threading.Event()
        c.execute(lambda: hold.wait(WAIT)).subscribe()
        c.execute(lambda: 3).subscribe()  # waits
        refused: list[Exception] = []
        c.execute(lambda: 4, overflow="reject").subscribe(on_error=refused.append)
        assert isinstance(refused[0], TooManyTasks)
        hold.set()


def test_run_blocks_until_room_instead_of_failing() -> None:
    gate = threading.Event()
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, overflow="wait") as c:
        c.execute(lambda: gate.wait(WAIT)).subscribe()
        threading.Timer(0.05, gate.set).start()
        assert c.execute(lambda: "after").run() == "after"


def test_cancelled_waiting_submissions_never_run_and_leave_nothing_behind() -> None:
    gate = threading.Event()
    ran: list[int] = []
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=1, overflow="wait") as c:
        done = threading.Event()
        c.execute(lambda: gate.wait(WAIT)).subscribe(on_completed=done.set)
        c.execute(lambda: None).subscribe()  # queued
        subscriptions = [
            c.execute(functools.partial(ran.append, i)).subscribe() for i in range(200)
        ]
        assert c.stats().waiting == 200
        for s in subscriptions[:-1]:
            s.dispose()
        stats = c.stats()
        assert stats.waiting == 1
        assert stats.cancelled == 199
        assert len(c._table._waiters) < 200  # the deque is purged, not left to grow
        gate.set()
        assert done.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while c.stats().work_in_progress and time.monotonic() < deadline:
            time.sleep(0.001)
    assert ran == [199]
    final = c.stats()
    assert final.waiting == 0
    assert final.work_in_progress == 0


async def test_cancelling_an_awaiting_task_withdraws_its_waiting_submission() -> None:
    gate = asyncio.Event()
    ran: list[str] = []
    async with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, overflow="wait") as c:
        holder = asyncio.ensure_future(c.execute(gate.wait))
        await asyncio.sleep(0)

        async def never() -> None:
            ran.append("never")

        waiter = asyncio.ensure_future(c.execute(never))
        await asyncio.sleep(0)
        assert c.stats().waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert c.stats().waiting == 0
        gate.set()
        await holder
    assert ran == []


def test_close_fails_waiting_submissions_with_coordinator_closed() -> None:
    gate = threading.Event()
    c = TenantTaskCoordinator(max_concurrency=1, max_queue_size=0, overflow="wait")
    c.execute(lambda: gate.wait(WAIT)).subscribe(on_error=lambda _: None)
    errors: list[Exception] = []
    c.execute(lambda: 1).subscribe(on_error=errors.append)
    gate.set()
    c.close()
    assert all(isinstance(e, CoordinatorClosed) for e in errors)
    assert c.stats().waiting == 0


def test_sync_threads_and_asyncio_tasks_share_one_waiting_coordinator() -> None:
    meter = Meter()
    c = TenantTaskCoordinator(max_concurrency=3, max_queue_size=2, overflow="wait")

    def sync_job(tag: Any) -> Callable[[], Any]:
        def run() -> Any:
            meter.enter(tag)
            time.sleep(0.0005)
            meter.leave()
            return tag

        return run

    results: list[Any] = []
    lock = threading.Lock()

    def thread_producer(n: int) -> None:
        for i in range(20):
            value = c.execute(sync_job(("t", n, i)), key=("t", n)).run()
            with lock:
                results.append(value)

    async def async_side() -> list[Any]:
        async def job(tag: Any) -> Any:
            meter.enter(tag)
            await asyncio.sleep(0)
            meter.leave()
            return tag

        return await asyncio.gather(
            *(c.execute(functools.partial(job, ("a", i)), key=("a", i % 3)) for i in range(60))
        )

    threads = [threading.Thread(target=thread_producer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    from_loop = asyncio.run(async_side())
    for t in threads:
        t.join(WAIT)
    c.close()
    assert len(results) == 80
    assert len(from_loop) == 60
    assert c.stats().rejected == 0
    assert meter.most <= 3
    for n in range(4):  # per-key order for the thread producers
        mine = [tag[2] for tag in meter.started if tag[0] == "t" and tag[1] == n]
        assert mine == list(range(20))


def test_the_scheduler_waits_per_tenant() -> None:
    gate = threading.Event()
    with TenantScheduler(
        max_concurrency=2, tenant_max_concurrency=1, tenant_max_queue_size=0, overflow="wait"
    ) as s:
        s.execute("a", lambda: gate.wait(WAIT)).subscribe()
        got: list[int] = []
        done = threading.Semaphore(0)
        for i in range(5):
            s.execute("a", functools.partial(got.append, i)).subscribe(on_completed=done.release)
        assert s.stats().waiting == 5
        assert s.stats("a").waiting == 5
        assert s.execute("b", lambda: "b").run() == "b"  # another tenant is not held up
        gate.set()
        for _ in range(5):
            assert done.acquire(timeout=WAIT)
        assert got == list(range(5))
        assert s.stats().rejected == 0


# -- lifecycle: async with, aclose, drain ---------------------------------------------------


class Ticker:
    """Proves the loop was never blocked: the longest gap between its ticks."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                self.longest = max(self.longest, now - last)
                last = now

        self._task = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_aclose_awaits_running_sync_jobs_without_blocking_the_loop() -> None:
    release = threading.Event()
    c = TenantTaskCoordinator(max_concurrency=2)
    returned = threading.Event()
    started = threading.Event()

    def slow() -> None:
        started.set()
        release.wait(WAIT)
        returned.set()

    c.execute(slow).subscribe(on_error=lambda _: None)
    assert started.wait(WAIT)
    async with Ticker() as ticker:
        closing = asyncio.ensure_future(c.aclose())
        await asyncio.sleep(0.1)  # the loop keeps ticking while aclose waits for the thread
        assert not closing.done()
        release.set()
        await closing
    assert returned.is_set()  # aclose returned only after the job's thread did
    # a blocked loop would show one gap of the whole wait (>= 0.1 s); generous bound for noise
    assert ticker.longest < 0.09


async def test_async_with_closes_coordinator_and_scheduler() -> None:
    async with TenantTaskCoordinator() as c:
        assert await c.execute(lambda: 1) == 1
    assert c.state.value == "closed"
    async with TenantScheduler() as s:
        assert await s.execute("t", lambda: 2) == 2
    assert s.state.value == "closed"


def test_drain_delivers_every_accepted_result_and_refuses_new_work() -> None:
    gate = threading.Event()
    c = TenantTaskCoordinator(max_concurrency=2, max_queue_size=10)
    results: list[int] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def job(i: int) -> Callable[[], int]:
        def run() -> int:
            gate.wait(WAIT)
            return i

        return run

    def keep(value: int) -> None:
        with lock:
            results.append(value)

    for i in range(12):
        c.execute(job(i), key=i % 3).subscribe(keep, errors.append)
    closer = threading.Thread(target=c.close, kwargs={"drain": True})
    closer.start()
    deadline = time.monotonic() + WAIT
    while c.state.value == "open" and time.monotonic() < deadline:
        time.sleep(0.001)
    refused: list[Exception] = []
    c.execute(lambda: 99).subscribe(on_error=refused.append)
    assert isinstance(refused[0], CoordinatorClosed)
    gate.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert sorted(results) == list(range(12))
    assert errors == []
    assert c.state.value == "closed"


async def test_aclose_drain_on_the_loop_lets_async_jobs_finish() -> None:
    c = TenantTaskCoordinator(max_concurrency=2, max_queue_size=10)

    async def job(i: int) -> int:
        await asyncio.sleep(0.01)
        return i

    futures = [asyncio.ensure_future(c.execute(functools.partial(job, i))) for i in range(8)]
    await asyncio.sleep(0)
    async with Ticker() as ticker:
        await c.aclose(drain=True)
    assert [await f for f in futures] == list(range(8))
    assert ticker.longest < 0.09


async def test_a_blocking_drain_on_the_jobs_loop_is_refused() -> None:
    c = TenantTaskCoordinator(max_concurrency=1)
    gate = asyncio.Event()
    pending = asyncio.ensure_future(c.execute(gate.wait))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="aclose"):
        c.close(drain=True)
    gate.set()
    await pending
    await c.aclose()


def test_scheduler_drain_finishes_every_tenant() -> None:
    gate = threading.Event()
    s = TenantScheduler(max_concurrency=2, tenant_max_concurrency=1, tenant_max_queue_size=5)
    results: list[str] = []
    lock = threading.Lock()

    def keep(value: str) -> None:
        with lock:
            results.append(value)

    for tenant in "abc":
        for i in range(3):

            def job(tag: str = f"{tenant}{i}") -> str:
                gate.wait(WAIT)
                return tag

            s.execute(tenant, job).subscribe(keep)
    threading.Timer(0.05, gate.set).start()
    s.close(drain=True)
    assert sorted(results) == sorted(f"{t}{i}" for t in "abc" for i in range(3))


# -- a model of submit / cancel / run / close, with waiting -----------------------------------


def _recorder(
    log: list[str],
) -> tuple[Callable[[Any], None], Callable[[Exception], None], Callable[[], None]]:
    def on_next(_: Any) -> None:
        log.append("value")

    def on_error(error: Exception) -> None:
        log.append(type(error).__name__)

    def on_completed() -> None:
        log.append("completed")

    return on_next, on_error, on_completed


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from([None, "a", "b"]), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 40), st.just(False)),
        st.tuples(st.just("run"), st.integers(0, 40), st.just(False)),
        st.tuples(st.just("close"), st.just(None), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_model_of_submit_cancel_run_close_with_waiting(ops: list[tuple[Any, Any, bool]]) -> None:
    max_concurrency, max_queue = 2, 2
    scheduler = ManualScheduler()
    c = TenantTaskCoordinator(
        scheduler=scheduler, max_concurrency=max_concurrency, max_queue_size=max_queue
    )
    outcomes: dict[int, list[str]] = {}
    subscriptions: list[abc.DisposableBase] = []
    started: list[tuple[Any, int]] = []
    closed = False

    for op, arg, flag in ops:
        if op == "submit":
            i = len(subscriptions)
            outcomes[i] = []

            def job(i: int = i, key: Any = arg) -> int:
                started.append((key, i))
                return i

            subscriptions.append(
                c.execute(job, key=arg, overflow="wait" if flag else "reject").subscribe(
                    *_recorder(outcomes[i])
                )
            )
        elif op == "cancel" and subscriptions:
            subscriptions[arg % len(subscriptions)].dispose()
        elif op == "run" and scheduler.actions:
            scheduler.actions.pop(arg % len(scheduler.actions))()
        elif op == "close" and not closed:
            closed = True
            if flag:  # a drain: run everything first, as the worker threads would
                while scheduler.actions:
                    scheduler.actions.pop(0)()
            c.close()
        stats = c.stats()
        assert stats.running <= max_concurrency
        assert stats.work_in_progress <= max_concurrency + max_queue
        assert stats.waiting >= 0
        # no submission waits while there is room and nothing else holds it back
        if stats.waiting:
            assert stats.work_in_progress == max_concurrency + max_queue or closed
    while scheduler.actions:  # let what runs finish
        scheduler.actions.pop(0)()
    c.close()
    final = c.stats()
    assert final.waiting == 0
    assert final.work_in_progress == 0
    # every submission ended exactly once, and what was disposed before its end saw nothing
    for i, got in outcomes.items():
        assert len([o for o in got if o != "value"]) <= 1, (i, got)
    # per key, jobs started in submission order
    for key in ("a", "b"):
        order = [i for k, i in started if k == key]
        assert order == sorted(order)
    assert len({i for _, i in started}) == len(started)  # nothing ran twice


# -- the inline fast path of ``await execute(async_job)`` -------------------------------------


async def test_awaited_async_jobs_run_in_the_awaiting_task() -> None:
    async with TenantTaskCoordinator(max_concurrency=2) as c:
        outer = asyncio.current_task()

        async def job() -> asyncio.Task[Any] | None:
            return asyncio.current_task()

        assert await c.execute(job) is outer  # no task of its own


async def test_an_awaited_job_under_an_admission_times_out_from_its_start() -> None:
    # The awaiting task arms the timeout as the job starts inside it (after its turn and its
    # permit), so time spent waiting for the permit does not count; the job is then cancelled
    # in the awaiting task and the awaiter gets TimeoutError, not CancelledError.
    gate = FairShareGate(1)
    c = TenantTaskCoordinator(max_concurrency=2, timeout=0.2, admission=gate.lane(1.0))
    hold = asyncio.Event()
    cancelled = asyncio.Event()

    async def holder() -> str:
        await hold.wait()
        return "held"

    async def job() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    first = asyncio.ensure_future(c.execute(holder, timeout=60))  # the gate's one permit
    await asyncio.sleep(0)
    second = asyncio.ensure_future(c.execute(job))
    await asyncio.sleep(0.3)  # longer than the timeout, spent waiting for the permit
    assert not second.done()
    hold.set()
    assert await first == "held"
    with pytest.raises(TimeoutError):
        await second
    assert cancelled.is_set()
    assert c.stats().timed_out == 1
    await c.aclose()


async def test_cancelling_the_awaiter_cancels_an_inline_job_and_frees_its_slot() -> None:
    async with TenantTaskCoordinator(max_concurrency=1) as c:
        inside = asyncio.Event()
        cancelled = asyncio.Event()

        async def job() -> None:
            inside.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        waiter = asyncio.ensure_future(c.execute(job))
        await inside.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert cancelled.is_set()
        assert c.stats().work_in_progress == 0
        assert await c.execute(lambda: 5) == 5  # the slot is free again


async def test_close_fails_an_inline_job_with_coordinator_closed_not_cancelled() -> None:
    c = TenantTaskCoordinator(max_concurrency=1)
    inside = asyncio.Event()

    async def job() -> None:
        inside.set()
        await asyncio.sleep(60)

    waiter = asyncio.ensure_future(c.execute(job))
    await inside.wait()
    await c.aclose()
    with pytest.raises(CoordinatorClosed):
        await waiter
    assert not waiter.cancelled()
