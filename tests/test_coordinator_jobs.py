"""The job shapes ``execute`` runs (the one job-runner contract): a value, an ``async def``, a
callable returning a coroutine, and a callable returning an Observable, run to its real end."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import reactivex
from reactivex import operators as ops
from reactivex.subject import Subject
from support.waiting import WAIT

from rxcoord import CoordinatorClosed, TenantTaskCoordinator


class Collect:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.error: Exception | None = None
        self.done = threading.Event()

    def on_next(self, item: Any) -> None:
        self.items.append(item)

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.done.set()

    def on_completed(self) -> None:
        self.done.set()


def test_an_observable_job_emits_every_item_and_holds_its_slot_until_it_ends() -> None:
    subject: Subject[int] = Subject()
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=5) as c:
        first, second = Collect(), Collect()
        c.execute(lambda: subject).subscribe(first.on_next, first.on_error, first.on_completed)
        c.execute(lambda: "next").subscribe(second.on_next, second.on_error, second.on_completed)
        for _ in range(1000):
            if subject.observers:  # the job returned it and the coordinator subscribed
                break
            threading.Event().wait(0.001)
        subject.on_next(1)
        subject.on_next(2)
        assert not second.done.wait(0.05)  # the Observable still runs: its slot is taken
        assert c.stats().running == 1
        subject.on_next(3)
        subject.on_completed()
        assert first.done.wait(WAIT)
        assert first.items == [1, 2, 3]
        assert second.done.wait(WAIT)
        assert second.items == ["next"]


def test_an_observable_job_s_error_reaches_its_subscriber() -> None:
    boom = RuntimeError("boom")
    with TenantTaskCoordinator(max_concurrency=1) as c:
        out = Collect()
        c.execute(lambda: reactivex.concat(reactivex.of(1), reactivex.throw(boom))).subscribe(
            out.on_next, out.on_error, out.on_completed
        )
        assert out.done.wait(WAIT)
        assert out.items == [1]
        assert out.error is boom


def test_disposing_an_observable_job_disposes_it_and_frees_the_slot() -> None:
    disposed = threading.Event()
    subject: Subject[int] = Subject()
    source = subject.pipe(ops.finally_action(disposed.set))
    with TenantTaskCoordinator(max_concurrency=1) as c:
        out = Collect()
        subscription = c.execute(lambda: source).subscribe(
            out.on_next, out.on_error, out.on_completed
        )
        for _ in range(1000):
            if c.stats().running == 1 and subject.observers:
                break
            threading.Event().wait(0.001)
        subscription.dispose()
        assert disposed.wait(WAIT)
        assert c.execute(lambda: 7).run() == 7  # the slot came back
        assert c.stats().cancelled == 1
        assert not out.done.is_set()  # nothing after the dispose


def test_an_observable_job_times_out_like_any_job() -> None:
    with TenantTaskCoordinator(max_concurrency=1, timeout=0.05) as c:
        with pytest.raises(TimeoutError):
            c.execute(lambda: reactivex.never()).run()
        assert c.execute(lambda: 1).run() == 1


def test_await_an_observable_job_gives_its_last_item() -> None:
    async def main() -> Any:
        async with TenantTaskCoordinator(max_concurrency=1) as c:
            return await c.execute(lambda: reactivex.of(1, 2, 3))

    assert asyncio.run(main()) == 3


class Guard:
    def __init__(self) -> None:
        self.log: list[str] = []

    def enter(self, key: Hashable) -> Hashable:
        self.log.append(f"enter {key}")
        return key

    def exit(self, token: Hashable) -> None:
        self.log.append(f"exit {token}")

    async def enter_async(self, key: Hashable) -> Hashable:
        return self.enter(key)

    async def exit_async(self, token: Hashable) -> None:
        self.exit(token)


def test_a_keyed_observable_job_stays_inside_its_key_guard_until_it_ends() -> None:
    guard = Guard()
    subject: Subject[str] = Subject()
    with TenantTaskCoordinator(max_concurrency=1, key_guard=guard) as c:
        out = Collect()
        c.execute(lambda: subject, key="k").subscribe(out.on_next, out.on_error, out.on_completed)
        for _ in range(1000):
            if subject.observers:
                break
            threading.Event().wait(0.001)
        subject.on_next("x")
        assert guard.log == ["enter k"]  # not left while the Observable runs
        subject.on_completed()
        assert out.done.wait(WAIT)
    assert guard.log == ["enter k", "exit k"]
    assert out.items == ["x"]


def test_close_stops_an_observable_job_with_coordinator_closed() -> None:
    c = TenantTaskCoordinator(max_concurrency=1)
    out = Collect()
    subject: Subject[int] = Subject()
    c.execute(lambda: subject).subscribe(out.on_next, out.on_error, out.on_completed)
    for _ in range(1000):
        if subject.observers:
            break
        threading.Event().wait(0.001)
    c.close()
    assert isinstance(out.error, CoordinatorClosed)
    assert not subject.observers  # disposed


# -- where a job runs: the code cache (rxcoord/_coordinator/_execution.py) ----------------------


async def test_a_lambda_returning_a_coroutine_is_called_on_the_loop_after_its_first_job() -> None:
    callers: list[str] = []
    tasks: list[asyncio.Task[Any] | None] = []

    async def handle(i: int) -> int:
        tasks.append(asyncio.current_task())
        return i

    def call(i: int) -> Any:
        callers.append(threading.current_thread().name)
        return handle(i)

    async with TenantTaskCoordinator(max_concurrency=2) as c:
        me = asyncio.current_task()
        results = [await c.execute(lambda i=i: call(i), key="k") for i in range(4)]
    assert results == [0, 1, 2, 3]
    assert callers[0] != threading.current_thread().name  # the first: a worker, once
    assert callers[1:] == [threading.current_thread().name] * 3  # then the loop, no hop
    assert tasks[1:] == [me] * 3  # inside the awaiting task itself


async def test_jobs_submitted_before_their_code_was_known_take_the_loop_at_their_turn() -> None:
    callers: list[str] = []

    async def handle(i: int) -> int:
        await asyncio.sleep(0)
        return i

    def call(i: int) -> Any:
        callers.append(threading.current_thread().name)
        return handle(i)

    async with TenantTaskCoordinator(max_concurrency=1, max_queue_size=100) as c:
        # All submitted at once (a gather): none of them ran when the others were counted.
        results = await asyncio.gather(*(c.execute(lambda i=i: call(i)) for i in range(20)))
    assert results == list(range(20))
    loop_thread = threading.current_thread().name
    assert callers.count(loop_thread) == 19  # only the first took a worker


async def test_a_wrapper_lambda_is_remembered_per_function_it_wraps() -> None:
    # A helper with one lambda for every function it forwards: an async function that went
    # through it must not bring a blocking function onto the loop after it.
    async def fetch() -> str:
        return "async"

    def blocking() -> str:
        time.sleep(0.001)
        return threading.current_thread().name

    async with TenantTaskCoordinator(max_concurrency=2) as c:

        def submit(fn: Callable[..., Any], *args: Any) -> Any:
            return c.execute(lambda: fn(*args))

        for _ in range(3):
            assert await submit(fetch) == "async"
        assert await submit(blocking) != threading.current_thread().name  # a worker's name


async def test_a_remembered_code_that_returns_a_value_is_forgotten() -> None:
    callers: list[str] = []

    async def handle() -> str:
        return "async"

    def dispatch(kind: str) -> Any:
        callers.append(threading.current_thread().name)
        return handle() if kind == "async" else "sync"

    async with TenantTaskCoordinator(max_concurrency=1) as c:
        for kind in ("async", "async", "sync", "sync"):
            await c.execute(lambda kind=kind: dispatch(kind))
    here = threading.current_thread().name
    # worker (unknown), loop (remembered), loop (still remembered: it returns a value, so the
    # code is forgotten), worker again.
    assert [name == here for name in callers] == [False, True, True, False]
