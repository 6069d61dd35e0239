"""The job shapes ``execute`` runs (the one job-runner contract): a value, an ``async def``, a
callable returning a coroutine, and a callable returning an Observable, run to its real end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
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
