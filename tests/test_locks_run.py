"""KeyedLocks ``run*``: the job runner. Which job shapes it accepts, how it calls them (``fn()``
or ``fn(lease)``), what it emits, and that the lease is released only when the work has really
ended (a running executor job, a coroutine's cleanup, a job ``fn`` started while disposed).

Windows are held open with events and gates, not by letting time pass (see ``locks_support``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any

import pytest
import reactivex
from locks_support import ManualTimer, Notifications, is_free
from reactivex import Observable, abc
from reactivex import operators as ops
from reactivex.scheduler import NewThreadScheduler
from reactivex.testing import TestScheduler
from support.waiting import WAIT, until, wait_until

from rxcoord import KeyedLocks, Lease
from rxcoord._errors import LockTimeout
from rxcoord._locks._run import job_takes_lease

# -- job shapes: what run() emits for what fn returns -------------------------------------------


def test_run_releases_before_emitting_a_plain_result() -> None:
    locks = KeyedLocks()
    seen: list[tuple[str, bool]] = []

    def work() -> str:
        seen.append(("in fn", is_free(locks, "a")))
        return "done"

    locks.run("a", work).subscribe(lambda v: seen.append((v, is_free(locks, "a"))))
    assert seen == [("in fn", False), ("done", True)]
    assert len(locks) == 0


def test_run_keeps_the_lease_while_the_observable_runs() -> None:
    locks = KeyedLocks()
    seen: list[tuple[object, bool]] = []
    source = reactivex.of(1, 2)
    locks.run_many(["a", "b"], lambda: source).subscribe(
        lambda v: seen.append((v, is_free(locks, "b"))),
        on_completed=lambda: seen.append(("completed", is_free(locks, "b"))),
    )
    assert seen == [(1, False), (2, False), ("completed", True)]


def test_run_waits_its_turn_and_reports_errors() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    results: list[object] = []
    errors: list[Exception] = []

    def fail() -> None:
        raise ValueError("job failed")

    locks.run("a", lambda: "first").subscribe(results.append)
    locks.run("a", fail).subscribe(on_error=errors.append)
    locks.run_all(lambda: "global").subscribe(results.append)
    assert results == []
    holder.release()
    assert results == ["first", "global"]
    assert [str(e) for e in errors] == ["job failed"]
    assert len(locks) == 0


def test_disposing_run_disposes_the_work_and_releases() -> None:
    locks = KeyedLocks()
    scheduler = TestScheduler()
    disposed: list[bool] = []

    def work() -> Observable[int]:
        return reactivex.never().pipe(ops.finally_action(lambda: disposed.append(True)))

    subscription = locks.run("a", work, scheduler=scheduler).subscribe()
    assert len(locks) == 1  # granted, delivery waits for the scheduler
    scheduler.advance_by(1)
    assert not is_free(locks, "a")
    subscription.dispose()
    assert disposed == [True]
    assert is_free(locks, "a")

    holder = locks.hold("a").__enter__()
    waiting = locks.run("a", lambda: 1).subscribe()
    waiting.dispose()  # withdrawn while waiting
    holder.release()
    assert len(locks) == 0
    assert locks.stats().cancelled_total == 1


def test_disposing_run_while_fn_executes_keeps_the_lease_until_fn_returns() -> None:
    locks = KeyedLocks()
    entered, proceed = threading.Event(), threading.Event()
    started: list[bool] = []
    results: list[int] = []

    def later() -> Observable[int]:
        started.append(True)
        return reactivex.of(1)

    def fn() -> Observable[int]:
        entered.set()
        assert proceed.wait(WAIT)
        return reactivex.defer(lambda _: later())

    scheduler = NewThreadScheduler()
    subscription = locks.run("a", fn, scheduler=scheduler).subscribe(results.append)
    assert entered.wait(WAIT)
    subscription.dispose()
    assert not is_free(locks, "a")  # fn cannot be stopped, so it keeps its exclusion
    proceed.set()
    wait_until(lambda: is_free(locks, "a"))  # released as soon as fn returned
    assert started == []  # what fn returned was not started after the disposal
    assert results == []
    assert len(locks) == 0


def test_run_with_a_future() -> None:
    locks = KeyedLocks()
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    results: list[str] = []
    locks.run("a", lambda: future).subscribe(results.append)
    assert not is_free(locks, "a")  # held until the future completes
    future.set_result("value")
    assert results == ["value"]
    assert is_free(locks, "a")


def test_run_with_a_coroutine_outside_an_event_loop_is_an_error() -> None:
    locks = KeyedLocks()
    errors: list[Exception] = []

    async def job() -> int:
        return 1

    locks.run("a", job).subscribe(on_error=errors.append)
    assert isinstance(errors[0], TypeError)
    assert "event loop" in str(errors[0])
    assert len(locks) == 0  # and the coroutine was closed: no "never awaited" warning


def test_run_with_a_coroutine_in_a_loop() -> None:
    locks = KeyedLocks()

    async def main() -> int:
        async def job() -> int:
            await asyncio.sleep(0)
            assert not is_free(locks, "a")
            return 7

        result: int = await locks.run("a", job)
        return result

    assert asyncio.run(main()) == 7
    assert len(locks) == 0


def test_run_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    called: list[bool] = []
    errors: list[Exception] = []
    done = threading.Event()

    def failed(error: Exception) -> None:
        errors.append(error)
        done.set()

    locks.run("a", lambda: called.append(True), timeout=1).subscribe(on_error=failed)
    assert timer.fire() == 1
    assert done.wait(WAIT)  # the LockTimeout is delivered on rxcoord's delivery workers
    assert isinstance(errors[0], LockTimeout)
    assert called == []
    holder.release()
    assert len(locks) == 0


# -- the job-shape rule: fn() or fn(lease), decided once per call ---------------------------------


def test_a_job_taking_one_argument_gets_the_lease_it_runs_under() -> None:
    locks = KeyedLocks()
    seen: list[tuple[frozenset[object], bool]] = []

    def job(lease: Lease) -> str:
        seen.append((lease.keys, lease.released))
        return "done"

    results: list[str] = []
    locks.run_many(["a", "b"], job).subscribe(results.append)
    assert seen == [(frozenset({"a", "b"}), False)]
    assert results == ["done"]
    assert len(locks) == 0


def test_run_all_and_run_pass_the_lease_too() -> None:
    locks = KeyedLocks()
    leases: list[Lease] = []
    locks.run_all(leases.append).subscribe()
    locks.run("k", lambda lease: leases.append(lease)).subscribe()
    assert [lease.is_global for lease in leases] == [True, False]
    assert all(lease.released for lease in leases)  # released when the job returned


def test_a_job_may_release_its_lease_early() -> None:
    locks = KeyedLocks()
    seen: list[bool] = []

    def job(lease: Lease) -> int:
        lease.release()  # done with the key before the rest of the work
        seen.append(is_free(locks, "k"))
        return 1

    results: list[int] = []
    locks.run("k", job).subscribe(results.append)
    assert seen == [True]
    assert results == [1]  # and run() does not release it a second time
    assert len(locks) == 0


async def test_an_async_job_taking_the_lease_runs_on_the_loop() -> None:
    locks = KeyedLocks()

    async def job(lease: Lease) -> frozenset[object]:
        await asyncio.sleep(0)
        assert not is_free(locks, "a")
        return lease.keys

    assert await locks.run("a", job) == frozenset({"a"})
    assert len(locks) == 0


class _Job:
    def __init__(self) -> None:
        self.calls: list[object] = []

    def without(self) -> str:
        self.calls.append("none")
        return "without"

    def with_lease(self, lease: Lease) -> str:
        self.calls.append(lease)
        return "with"

    def __call__(self, lease: Lease) -> str:
        return self.with_lease(lease)


def _two(prefix: str, lease: Lease | None) -> str:
    assert lease is not None
    return f"{prefix}:{','.join(map(str, lease.keys))}"


def _defaulted(retries: int = 3) -> int:
    return retries


def _varargs(*args: object) -> int:
    return len(args)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(lambda job: lambda: "plain", "plain", id="lambda-no-args"),
        pytest.param(lambda job: job.without, "without", id="bound-method-no-args"),
        pytest.param(lambda job: job.with_lease, "with", id="bound-method-lease"),
        pytest.param(lambda job: job, "with", id="callable-object"),
        pytest.param(lambda job: functools.partial(_two, "p"), "p:k", id="partial-lease"),
        pytest.param(lambda job: functools.partial(_two, "p", lease=None), None, id="partial-kw"),
        pytest.param(lambda job: _defaulted, 3, id="default-kept: called without arguments"),
        pytest.param(lambda job: _varargs, 0, id="varargs: called without arguments"),
        pytest.param(lambda job: int, 0, id="builtin-class"),
    ],
)
def test_job_shapes(make: Any, expected: object) -> None:
    locks = KeyedLocks()
    fn = make(_Job())
    if expected is None:  # a partial binding the lease by keyword takes no argument now
        with pytest.raises(AssertionError):
            locks.run("k", fn).run()
        assert len(locks) == 0
        return
    results: list[object] = []
    locks.run("k", fn).subscribe(results.append)
    assert results == [expected]
    assert len(locks) == 0


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda a, b: None, id="two-arguments"),
        pytest.param(_two, id="function-two-arguments"),
        pytest.param(functools.partial(lambda a, b, c: None, 1), id="partial-two-left"),
        pytest.param(lambda *, lease: None, id="keyword-only"),
        pytest.param(42, id="not-callable"),
    ],
)
def test_a_job_that_takes_neither_shape_is_refused_at_the_call(fn: Any) -> None:
    locks = KeyedLocks()
    with pytest.raises(TypeError, match=r"fn\(\) or fn\(lease\)|callable"):
        locks.run("k", fn)  # at the call, not on subscription
    with pytest.raises(TypeError):
        locks.run_many(["a", "b"], fn)
    with pytest.raises(TypeError):
        locks.run_all(fn)
    assert len(locks) == 0
    assert locks.stats().contended_total == 0


def test_the_shape_is_decided_once_per_call_not_per_subscription() -> None:
    locks = KeyedLocks()
    calls: list[int] = []

    class Counting:
        """A callable whose signature lookups are counted (inspect reads __signature__)."""

        looked_up = 0

        @property
        def __signature__(self) -> Any:
            Counting.looked_up += 1
            import inspect

            return inspect.Signature(
                [inspect.Parameter("lease", inspect.Parameter.POSITIONAL_ONLY)]
            )

        def __call__(self, lease: Lease) -> int:
            calls.append(1)
            return 1

    source = locks.run("k", Counting())
    looked_up = Counting.looked_up
    for _ in range(3):
        source.subscribe()
    assert Counting.looked_up == looked_up == 1
    assert len(calls) == 3


def test_plain_functions_take_the_fast_path() -> None:
    def none() -> None: ...

    def one(lease: Lease) -> None: ...

    def one_defaulted(lease: Lease, extra: int = 0) -> None: ...

    assert job_takes_lease(none) is False
    assert job_takes_lease(one) is True
    assert job_takes_lease(one_defaulted) is True
    assert job_takes_lease(_defaulted) is False
    assert job_takes_lease(_Job().with_lease) is True
    assert job_takes_lease(_Job().without) is False


# -- the lease is kept until the work has really ended ------------------------------------------


def test_disposing_run_keeps_the_lease_while_a_running_executor_job_runs() -> None:
    locks = KeyedLocks()
    started, finish = threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        assert finish.wait(WAIT)
        return "done"

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        subscription = locks.run("k", lambda: executor.submit(job)).subscribe(
            on_error=lambda e: None
        )
        assert started.wait(WAIT)
        subscription.dispose()  # cancel() fails: the job is running
        assert not is_free(locks, "k")  # so it keeps its exclusion
        finish.set()
        wait_until(lambda: is_free(locks, "k"))  # released when the job returned
    assert len(locks) == 0


def test_disposing_run_cancels_a_queued_executor_job_and_releases() -> None:
    locks = KeyedLocks()
    blocker_started, unblock = threading.Event(), threading.Event()
    ran: list[bool] = []

    def blocker() -> None:
        blocker_started.set()
        assert unblock.wait(WAIT)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        executor.submit(blocker)
        assert blocker_started.wait(WAIT)
        subscription = locks.run("k", lambda: executor.submit(ran.append, True)).subscribe(
            on_error=lambda e: None
        )
        subscription.dispose()  # not started yet: cancel() succeeds, it will never run
        assert is_free(locks, "k")
        unblock.set()
    assert ran == []


def test_run_disposed_while_fn_runs_keeps_the_lease_for_the_job_fn_started() -> None:
    locks = KeyedLocks()
    scheduler = TestScheduler()  # fn runs inside advance_by(), on this thread
    job_started, finish = threading.Event(), threading.Event()
    subscriptions: list[abc.DisposableBase] = []

    def job() -> None:
        job_started.set()
        assert finish.wait(WAIT)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:

        def fn() -> concurrent.futures.Future[None]:
            future = executor.submit(job)
            assert job_started.wait(WAIT)
            subscriptions[0].dispose()  # disposed while fn runs ...
            return future  # ... and fn returns a job that cannot be stopped any more

        subscriptions.append(
            locks.run("k", fn, scheduler=scheduler).subscribe(on_error=lambda e: None)
        )
        scheduler.advance_by(1)  # fn ran and returned
        assert not is_free(locks, "k")  # the lease stays with the running job
        finish.set()
        wait_until(lambda: is_free(locks, "k"))
    assert len(locks) == 0


async def test_disposing_run_keeps_the_lease_through_the_coroutines_cleanup() -> None:
    locks = KeyedLocks()
    started, cleaning, cleaned = asyncio.Event(), asyncio.Event(), asyncio.Event()
    finish_cleanup = asyncio.Event()

    async def job() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await finish_cleanup.wait()  # e.g. rolling the entity back
            cleaned.set()

    subscription = locks.run("k", job).subscribe(on_error=lambda e: None)
    await asyncio.wait_for(started.wait(), WAIT)
    subscription.dispose()
    await asyncio.wait_for(cleaning.wait(), WAIT)
    assert not is_free(locks, "k")  # the cancelled coroutine still runs under the lease
    finish_cleanup.set()
    await asyncio.wait_for(cleaned.wait(), WAIT)
    await until(lambda: is_free(locks, "k"))
    assert len(locks) == 0


async def test_disposing_run_from_another_thread_keeps_the_lease_through_the_cleanup() -> None:
    locks = KeyedLocks()
    started, cleaning = asyncio.Event(), asyncio.Event()
    finish_cleanup = asyncio.Event()

    async def job() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await finish_cleanup.wait()

    subscription = locks.run("k", job).subscribe(on_error=lambda e: None)
    await asyncio.wait_for(started.wait(), WAIT)
    await asyncio.to_thread(subscription.dispose)
    await asyncio.wait_for(cleaning.wait(), WAIT)
    assert not is_free(locks, "k")
    finish_cleanup.set()
    await until(lambda: is_free(locks, "k"))


async def test_run_notifications_reach_an_asyncio_subscriber_on_its_loop() -> None:
    locks = KeyedLocks()
    holder = locks.hold("a").__enter__()
    recorder = Notifications()
    locks.run("a", lambda: "value").subscribe(recorder)  # subscribed on the loop
    await until(lambda: locks.stats().waiting == 1)
    await asyncio.to_thread(holder.release)  # granted, and fn run, on that thread
    assert await asyncio.to_thread(recorder.done.wait, WAIT)
    assert recorder.items == ["value"]
    assert set(recorder.threads) == {threading.get_ident()}  # on_next/on_completed on the loop


async def test_awaiting_run_whose_fn_raises_stop_iteration_raises_a_runtime_error() -> None:
    # reactivex's await turned it into a TypeError from asyncio ("StopIteration interacts
    # badly with generators"), hiding the job's own error.
    locks = KeyedLocks()

    def fn() -> int:
        return next(iter(()))

    async with asyncio.timeout(WAIT):
        with pytest.raises(RuntimeError, match="StopIteration") as raised:
            await locks.run("a", fn)
    assert isinstance(raised.value.__cause__, StopIteration)
    assert len(locks) == 0
