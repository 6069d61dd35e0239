"""Retries that keep per-key order (issue 22): the coordinator's and the tenant scheduler's.

Timing is checked on a virtual clock (a ``TestScheduler`` passed as ``scheduler=``: sync jobs
run on it, and so do the waits between attempts); what is about threads and the loop runs on
real ones.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest
import reactivex
from loguru import logger
from reactivex import operators as ops
from reactivex.testing import TestScheduler
from support.execution import WAIT, Outcome
from support.waiting import wait_until

from rxcoord import (
    CoordinatorClosed,
    Retry,
    TenantScheduler,
    TenantTaskCoordinator,
    TooManyTasks,
)
from rxcoord._admission import FairShareGate


class Flaky:
    """A sync job that fails its first ``failures`` calls, logging each start."""

    def __init__(
        self,
        name: str,
        log: list[tuple[str, float]],
        clock: Callable[[], float],
        failures: int = 1,
        error: type[BaseException] = ConnectionError,
    ) -> None:
        self.name = name
        self.log = log
        self.clock = clock
        self.failures = failures
        self.error = error
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        self.log.append((self.name, self.clock()))
        if self.calls <= self.failures:
            raise self.error(f"{self.name} attempt {self.calls}")
        return self.name


def virtual(**options: Any) -> tuple[TenantTaskCoordinator, TestScheduler, Callable[[], float]]:
    clock = TestScheduler()
    options.setdefault("max_concurrency", 2)
    coordinator = TenantTaskCoordinator(scheduler=clock, **options)
    return coordinator, clock, lambda: clock.now.timestamp()


# -- 1. order ----------------------------------------------------------------------------------


def test_a_later_job_of_the_key_waits_for_the_retries_other_keys_go_on() -> None:
    c, clock, now = virtual(retry=Retry(attempts=3, backoff=1.0, jitter=0.0))
    log: list[tuple[str, float]] = []
    outcomes = [Outcome() for _ in range(3)]
    outcomes[0].subscribe_to(c.execute(Flaky("a1", log, now, failures=2), key="a"))
    outcomes[1].subscribe_to(c.execute(Flaky("a2", log, now, failures=0), key="a"))
    outcomes[2].subscribe_to(c.execute(Flaky("b1", log, now, failures=0), key="b"))
    clock.advance_to(10.0)
    # a1 fails at 0 and 1 (waits 1 s, then 2 s), succeeds at 3; a2 only then; b1 at once.
    assert log == [("a1", 0.0), ("b1", 0.0), ("a1", 1.0), ("a1", 3.0), ("a2", 3.0)]
    assert [o.values for o in outcomes] == [["a1"], ["a2"], ["b1"]]
    stats = c.stats()
    assert (stats.completed, stats.failed, stats.retries, stats.retrying) == (3, 0, 2, 0)
    c.close()


# -- 2. waiting costs nothing ------------------------------------------------------------------


def test_a_job_waiting_for_its_next_attempt_holds_no_slot_and_stays_in_progress() -> None:
    c, clock, now = virtual(
        max_concurrency=1, max_queue_size=1, retry=Retry(attempts=2, backoff=5.0, jitter=0.0)
    )
    log: list[tuple[str, float]] = []
    first, second = Outcome(), Outcome()
    first.subscribe_to(c.execute(Flaky("a", log, now), key="a"))
    clock.advance_to(0.5)
    stats = c.stats()
    assert (stats.retrying, stats.running, stats.work_in_progress) == (1, 0, 1)
    second.subscribe_to(c.execute(Flaky("b", log, now, failures=0), key="b"))
    clock.advance_to(1.0)  # the only slot is free during a's wait: b runs in it
    assert log == [("a", 0.0), ("b", 0.5)]
    # Still work in progress: the WIP limit (1 + 1) refuses a third job while a waits.
    refused = Outcome()
    refused.subscribe_to(c.execute(lambda: None))
    refused.subscribe_to(c.execute(lambda: None))
    assert isinstance(refused.error, TooManyTasks)
    clock.advance_to(10.0)
    assert log[-1] == ("a", 5.0)
    assert first.values == ["a"]
    c.close()


def test_between_attempts_the_thread_and_the_admission_permit_are_free() -> None:
    gate = FairShareGate(1)  # one permit for two coordinators
    flaky_started = threading.Event()
    calls = {"flaky": 0}
    other_ran = threading.Event()

    def flaky() -> str:
        calls["flaky"] += 1
        flaky_started.set()
        if calls["flaky"] == 1:
            raise ConnectionError("blinked")
        return "second attempt"

    retrying = TenantTaskCoordinator(
        max_concurrency=1,
        admission=gate.lane(1.0),
        retry=Retry(attempts=2, backoff=0.3, jitter=0.0),
    )
    other = TenantTaskCoordinator(max_concurrency=1, admission=gate.lane(1.0))
    with retrying, other:
        outcome = Outcome()
        outcome.subscribe_to(retrying.execute(flaky, key="k"))
        assert flaky_started.wait(WAIT)
        # During the backoff: the permit and retrying's only worker are free for others.
        wait_until(
            lambda: retrying.stats().retrying == 1, what="the job waits for its next attempt"
        )
        other.execute(other_ran.set).subscribe()
        assert other_ran.wait(0.25), "the other coordinator got no permit during the wait"
        assert retrying.stats().retrying == 1  # (the permit came while it still waited)
        ran_meanwhile = Outcome()
        ran_meanwhile.subscribe_to(retrying.execute(lambda: "its own slot", key="other"))
        assert ran_meanwhile.done.wait(WAIT)
        assert ran_meanwhile.values == ["its own slot"]
        assert outcome.done.wait(WAIT)
        assert outcome.values == ["second attempt"]


# -- 3. timing ---------------------------------------------------------------------------------


def test_the_waits_grow_by_the_multiplier_up_to_max_backoff() -> None:
    policy = Retry(attempts=6, backoff=1.0, multiplier=3.0, max_backoff=10.0, jitter=0.0)
    c, clock, now = virtual(retry=policy)
    log: list[tuple[str, float]] = []
    c.execute(Flaky("j", log, now, failures=5)).subscribe(on_error=lambda _: None)
    clock.advance_to(100.0)
    starts = [t for _, t in log]
    assert starts == [0.0, 1.0, 4.0, 13.0, 23.0, 33.0]  # waits 1, 3, 9, 10 (capped), 10
    assert [policy.wait(n) for n in range(1, 6)] == [1.0, 3.0, 9.0, 10.0, 10.0]


def test_jitter_keeps_each_wait_within_its_fraction() -> None:
    seeded = random.Random(7)
    policy = Retry(attempts=40, backoff=2.0, multiplier=1.0, jitter=0.25, random=seeded.random)
    waits = [policy.wait(n) for n in range(1, 40)]
    assert all(1.5 <= w <= 2.5 for w in waits)
    assert len({round(w, 6) for w in waits}) > 30  # randomised, not constant


def test_the_timeout_applies_to_each_attempt_and_a_timed_out_attempt_is_retried() -> None:
    c, clock, now = virtual(
        timeout=2.0, retry=Retry(attempts=3, backoff=1.0, multiplier=1.0, jitter=0.0)
    )
    starts: list[float] = []

    def slow_then_fast() -> reactivex.Observable[str]:
        starts.append(now())
        duration = 5.0 if len(starts) < 3 else 0.5  # two attempts run out of time
        return reactivex.timer(duration, scheduler=clock).pipe(ops.map(lambda _: "done"))

    outcome = Outcome()
    outcome.subscribe_to(c.execute(slow_then_fast, key="k"))
    clock.advance_to(20.0)
    assert starts == [0.0, 3.0, 6.0]  # 2 s attempt + 1 s wait, twice
    assert outcome.values == ["done"]
    stats = c.stats()
    assert (stats.timed_out, stats.retries, stats.completed) == (0, 2, 1)
    c.close()


def test_a_last_attempt_that_runs_out_of_time_times_the_job_out() -> None:
    c, clock, _ = virtual(timeout=2.0, retry=Retry(attempts=2, backoff=1.0, jitter=0.0))
    outcome = Outcome()
    outcome.subscribe_to(c.execute(lambda: reactivex.never(), key="k"))
    clock.advance_to(20.0)
    assert isinstance(outcome.error, TimeoutError)
    assert c.stats().timed_out == 1
    assert c.stats().work_in_progress == 0
    c.close()


def test_the_deadline_stops_new_attempts() -> None:
    c, clock, now = virtual(
        retry=Retry(attempts=10, backoff=2.0, multiplier=1.0, deadline=5.0, jitter=0.0)
    )
    log: list[tuple[str, float]] = []
    outcome = Outcome()
    outcome.subscribe_to(c.execute(Flaky("j", log, now, failures=10)))
    clock.advance_to(50.0)
    assert [t for _, t in log] == [0.0, 2.0, 4.0]  # a fourth would start at 6 > 5
    assert isinstance(outcome.error, ConnectionError)
    c.close()


# -- 4. the end --------------------------------------------------------------------------------


def test_after_the_last_attempt_the_subscriber_gets_the_last_exception_with_a_note() -> None:
    c, clock, now = virtual(name="orders", retry=Retry(attempts=3, backoff=1.0, jitter=0.0))
    log: list[tuple[str, float]] = []
    outcome = Outcome()
    outcome.subscribe_to(c.execute(Flaky("j", log, now, failures=5)))
    clock.advance_to(10.0)
    assert isinstance(outcome.error, ConnectionError)
    assert str(outcome.error) == "j attempt 3"  # the last one's
    assert "gave up after 3 attempts" in "".join(outcome.error.__notes__)
    assert c.stats().failed == 1
    c.close()


@pytest.mark.parametrize(
    "error", [ValueError, TooManyTasks, CoordinatorClosed], ids=lambda e: e.__name__
)
def test_a_type_not_retried_fails_at_once(error: type[Exception]) -> None:
    c, clock, now = virtual(
        retry=Retry(attempts=5, backoff=1.0, on=(ConnectionError, TooManyTasks), jitter=0.0)
    )
    log: list[tuple[str, float]] = []
    outcome = Outcome()
    outcome.subscribe_to(c.execute(Flaky("j", log, now, failures=5, error=error)))
    clock.advance_to(10.0)
    assert len(log) == 1  # TooManyTasks is in `on` and still never retried
    assert isinstance(outcome.error, error)
    assert not getattr(outcome.error, "__notes__", None)
    c.close()


def test_cancelled_error_is_never_retried() -> None:
    policy = Retry(on=(BaseException,))
    assert not policy.retries(asyncio.CancelledError())
    assert policy.retries(KeyboardInterrupt())


async def test_an_awaited_async_job_is_retried_inside_the_awaiting_task() -> None:
    attempts: list[asyncio.Task[Any] | None] = []

    async def flaky() -> str:
        attempts.append(asyncio.current_task())
        if len(attempts) < 3:
            raise ConnectionError("blinked")
        return "ok"

    async with TenantTaskCoordinator(
        max_concurrency=1, retry=Retry(attempts=3, backoff=0.01, jitter=0.0)
    ) as c:
        assert await c.execute(flaky, key="k") == "ok"
        assert attempts == [asyncio.current_task()] * 3  # no task of its own, any attempt
        assert c.stats().retries == 2


async def test_the_call_s_policy_wins_over_the_coordinator_s() -> None:
    calls = 0

    async def failing() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("down")

    async with TenantTaskCoordinator(retry=Retry(attempts=5, backoff=0.001)) as c:
        with pytest.raises(ConnectionError):
            await c.execute(failing, retry=Retry(attempts=2, backoff=0.001))
        assert calls == 2
        with pytest.raises(ConnectionError):
            await c.execute(failing, retry=Retry(attempts=1))
        assert calls == 3


# -- 5. cancellation and close ------------------------------------------------------------------


def test_disposing_during_a_wait_ends_the_job_and_frees_its_key() -> None:
    c, clock, now = virtual(retry=Retry(attempts=3, backoff=5.0, jitter=0.0))
    log: list[tuple[str, float]] = []
    later = Outcome()
    subscription = c.execute(Flaky("a1", log, now), key="a").subscribe(on_error=lambda _: None)
    later.subscribe_to(c.execute(Flaky("a2", log, now, failures=0), key="a"))
    clock.advance_to(1.0)
    assert ("a2", 0.0) not in log
    subscription.dispose()  # during a1's 5 s wait
    clock.advance_to(20.0)
    assert ("a2", 1.0) in log  # its key went on at once
    assert [name for name, _ in log].count("a1") == 1  # no attempt after the dispose
    assert later.values == ["a2"]
    assert c.stats().cancelled == 1
    c.close()


async def test_cancelling_the_awaiter_during_a_wait_ends_the_job() -> None:
    calls = 0
    failed = asyncio.Event()

    async def failing() -> None:
        nonlocal calls
        calls += 1
        failed.set()
        raise ConnectionError("down")

    async with TenantTaskCoordinator(retry=Retry(attempts=5, backoff=60.0)) as c:
        waiter = asyncio.ensure_future(c.execute(failing, key="k"))
        await failed.wait()
        await asyncio.sleep(0)  # the awaiting task decided the retry right after the failure
        assert c.stats().retrying == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert calls == 1
        assert c.stats().work_in_progress == 0
        assert await c.execute(lambda: "free", key="k") == "free"


def test_close_fails_jobs_waiting_for_their_next_attempt() -> None:
    c, clock, now = virtual(retry=Retry(attempts=3, backoff=5.0, jitter=0.0))
    log: list[tuple[str, float]] = []
    outcome = Outcome()
    outcome.subscribe_to(c.execute(Flaky("a", log, now), key="a"))
    clock.advance_to(1.0)
    c.close()
    assert isinstance(outcome.error, CoordinatorClosed)
    clock.advance_to(20.0)
    assert len(log) == 1  # no attempt after the close


async def test_a_draining_close_lets_waiting_jobs_finish_their_attempts() -> None:
    calls = 0
    failed = asyncio.Event()

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            failed.set()
            raise ConnectionError("blinked")
        return "finished"

    c = TenantTaskCoordinator(retry=Retry(attempts=3, backoff=0.05, jitter=0.0))
    waiter = asyncio.ensure_future(c.execute(flaky, key="k"))
    await failed.wait()
    await asyncio.sleep(0)
    assert c.stats().retrying == 1
    await c.aclose(drain=True)
    assert await waiter == "finished"
    assert calls == 3


# -- 6. visible ----------------------------------------------------------------------------------


def test_every_retry_is_logged_at_warning_with_key_attempt_wait_and_exception() -> None:
    records: list[Any] = []
    sink = logger.add(records.append, level="WARNING", format="{message}")
    logger.enable("rxcoord")
    try:
        c, clock, now = virtual(name="payments", retry=Retry(attempts=3, backoff=1.5, jitter=0))
        log: list[tuple[str, float]] = []
        c.execute(Flaky("j", log, now, failures=2), key="cust-7").subscribe()
        clock.advance_to(10.0)
        c.close()
    finally:
        logger.remove(sink)
        logger.disable("rxcoord")
    lines = [str(r.record["message"]) for r in records if "retrying" in r.record["message"]]
    assert len(lines) == 2
    assert "'cust-7'" in lines[0]
    assert "attempt 1 of 3" in lines[0]
    assert "ConnectionError('j attempt 1')" in lines[0]
    assert "retrying in 1.500 s" in lines[0]
    assert "retrying in 3.000 s" in lines[1]


# -- the tenant scheduler --------------------------------------------------------------------------


async def test_a_tenant_scheduler_retries_its_tenants_jobs() -> None:
    calls: dict[str, int] = {}

    async def flaky(tenant: str) -> str:
        calls[tenant] = calls.get(tenant, 0) + 1
        if calls[tenant] == 1:
            raise ConnectionError("blinked")
        return tenant

    async with TenantScheduler(2, retry=Retry(attempts=2, backoff=0.001)) as scheduler:
        assert await scheduler.execute("acme", flaky, "acme") == "acme"
        with pytest.raises(ConnectionError):
            await scheduler.execute("globex", flaky, "globex", retry=Retry(attempts=1))
        assert scheduler.stats().retries == 1


# -- 9. bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"attempts": 0}, ValueError, "attempts"),
        ({"attempts": 1.5}, TypeError, "attempts"),
        ({"backoff": -1}, ValueError, "backoff"),
        ({"backoff": float("nan")}, ValueError, "backoff"),
        ({"backoff": float("inf")}, ValueError, "backoff"),
        ({"max_backoff": 0.01, "backoff": 1}, ValueError, "max_backoff"),
        ({"multiplier": 0.5}, ValueError, "multiplier"),
        ({"jitter": 1.0}, ValueError, "jitter"),
        ({"jitter": -0.1}, ValueError, "jitter"),
        ({"jitter": "a"}, TypeError, "jitter"),
        ({"on": ("x",)}, TypeError, "on"),
        ({"on": ()}, TypeError, "on"),
        ({"on": (int,)}, TypeError, "on"),
        ({"deadline": 0}, ValueError, "deadline"),
    ],
)
def test_bad_policies_are_refused_with_the_fix(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Retry(**options)


def test_max_backoff_defaults_to_30_s_or_the_backoff_if_longer() -> None:
    assert Retry().max_backoff == 30.0
    assert Retry(backoff=60).max_backoff == 60.0


def test_a_single_exception_type_is_accepted_for_on() -> None:
    assert Retry(on=ConnectionError).on == (ConnectionError,)


def test_a_retry_that_is_not_a_policy_is_refused_at_the_call() -> None:
    with TenantTaskCoordinator() as c:
        with pytest.raises(TypeError, match="Retry"):
            c.execute(lambda: None, retry=cast(Any, 3))
        with pytest.raises(TypeError, match="Retry"):
            TenantTaskCoordinator(retry=cast(Any, 3))


# -- 8. stalled jobs -------------------------------------------------------------------------------


def test_a_job_in_progress_past_stall_after_fires_on_stall_once_and_shows_in_stats() -> None:
    stalls: list[tuple[Any, float]] = []
    fired = threading.Event()

    def on_stall(key: Any, elapsed: float) -> None:
        stalls.append((key, elapsed))
        fired.set()

    c, clock, now = virtual(
        stall_after=3.0, on_stall=on_stall, retry=Retry(attempts=3, backoff=2.0, jitter=0.0)
    )
    log: list[tuple[str, float]] = []
    # Attempts and the waits between them count together: 1 s attempts, 2 s and 4 s waits.
    c.execute(
        lambda: reactivex.timer(1.0, scheduler=clock).pipe(
            ops.flat_map(lambda _: reactivex.throw(ConnectionError("slow and failing")))
        ),
        key="cust-1",
    ).subscribe(on_error=lambda _: None)
    quick = Outcome()
    quick.subscribe_to(c.execute(Flaky("quick", log, now, failures=0), key="other"))
    clock.advance_to(2.5)
    assert (c.stats().stalled, c.stats().oldest) == (0, 2.5)
    clock.advance_to(3.5)
    assert fired.wait(WAIT)
    assert stalls == [("cust-1", 3.0)]
    assert c.stats().stalled == 1
    clock.advance_to(20.0)
    assert stalls == [("cust-1", 3.0)]  # once
    assert (c.stats().stalled, c.stats().oldest) == (0, 0.0)  # ended (failed after 3)
    c.close()


def test_on_stall_needs_stall_after() -> None:
    with pytest.raises(ValueError, match="stall_after"):
        TenantTaskCoordinator(on_stall=lambda key, elapsed: None)
