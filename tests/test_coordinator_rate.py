"""``TenantTaskCoordinator(rate=...)`` (issue 23): the bound, waiting that holds nothing, order.

On the virtual clock (a ``TestScheduler`` as ``scheduler=``: the rate waits in virtual time),
and once on real threads and a real loop for the fast path.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest
import reactivex
from reactivex import operators as ops
from reactivex.testing import TestScheduler
from support.execution import Outcome
from support.rates import assert_within_rate

from rxcoord import Rate, TenantTaskCoordinator, TooManyTasks
from rxcoord._admission import FairShareGate
from rxcoord.leases import MemoryLeases


def logged(clock: TestScheduler, starts: list[tuple[Any, float]], name: Any) -> Any:
    def job() -> Any:
        starts.append((name, clock.now.timestamp()))
        return name

    return job


def test_the_starts_keep_the_rate_s_bound_in_virtual_time() -> None:
    clock = TestScheduler()
    rate = Rate(10, per=1.0)  # burst 1: evenly spaced, a tenth of a second apart
    c = TenantTaskCoordinator(scheduler=clock, max_concurrency=4, max_queue_size=50, rate=rate)
    starts: list[tuple[Any, float]] = []
    for i in range(30):
        c.execute(logged(clock, starts, i)).subscribe()
    clock.advance_to(10.0)
    times = [t for _, t in starts]
    assert len(times) == 30
    assert_within_rate(times, rate)
    assert times == pytest.approx([i / 10 for i in range(30)])  # and no slower than it
    stats = c.stats()
    assert stats.rate is not None
    assert stats.rate.waits == 29  # the first passed at once, the others waited their turn
    # Waited at the rate only (the rest of the queue waits for a slot, not for the rate): at
    # most 4 at once there, each at most 0.4 s.
    assert 0 < stats.rate.waited <= 29 * 0.4 + 1e-9
    c.close()


def test_a_burst_passes_back_to_back_after_idling() -> None:
    clock = TestScheduler()
    rate = Rate(2, per=1.0, burst=3)
    c = TenantTaskCoordinator(scheduler=clock, max_concurrency=8, rate=rate)
    starts: list[tuple[Any, float]] = []
    clock.advance_to(5.0)  # idle long enough to have the whole burst
    for i in range(7):
        c.execute(logged(clock, starts, i)).subscribe()
    clock.advance_to(20.0)
    times = [t for _, t in starts]
    assert times[:3] == [5.0, 5.0, 5.0]
    assert_within_rate(times, rate)
    c.close()


def test_per_key_order_and_the_queue_bound_hold_under_a_rate() -> None:
    clock = TestScheduler()
    c = TenantTaskCoordinator(
        scheduler=clock, max_concurrency=2, max_queue_size=3, rate=Rate(1, per=1.0)
    )
    starts: list[tuple[Any, float]] = []
    outcomes = [Outcome() for _ in range(6)]
    for i, outcome in enumerate(outcomes):
        outcome.subscribe_to(c.execute(logged(clock, starts, i), key="k" if i % 2 else "j"))
    assert isinstance(outcomes[5].error, TooManyTasks)  # 2 + 3: waiting does not lift it
    clock.advance_to(10.0)
    assert [name for name, _ in starts] == [0, 1, 2, 3, 4]
    assert [t for _, t in starts] == [0.0, 1.0, 2.0, 3.0, 4.0]
    c.close()


def test_waiting_for_the_rate_holds_no_permit_of_the_admission_behind_it() -> None:
    clock = TestScheduler()
    gate = FairShareGate(1)
    limited = TenantTaskCoordinator(
        scheduler=clock, max_concurrency=2, admission=gate.lane(1.0), rate=Rate(1, per=10.0)
    )
    other = TenantTaskCoordinator(scheduler=clock, max_concurrency=1, admission=gate.lane(1.0))
    starts: list[tuple[Any, float]] = []
    limited.execute(logged(clock, starts, "first")).subscribe()
    limited.execute(logged(clock, starts, "waits for the rate")).subscribe()
    clock.advance_to(1.0)
    other.execute(logged(clock, starts, "other")).subscribe()  # the one permit is free
    clock.advance_to(2.0)
    assert [name for name, _ in starts] == ["first", "other"]
    clock.advance_to(20.0)
    assert starts[-1] == ("waits for the rate", 10.0)
    limited.close()
    other.close()


async def test_within_the_rate_jobs_pass_without_waiting_on_the_real_clock() -> None:
    async def job(i: int) -> int:
        await asyncio.sleep(0)
        return i

    async with TenantTaskCoordinator(max_concurrency=4, rate=Rate(10_000, per=1.0, burst=50)) as c:
        assert await asyncio.gather(*(c.execute(job, i) for i in range(20))) == list(range(20))
        stats = c.stats()
        assert stats.rate is not None
        assert stats.rate.waits == 0  # the fast path: no ticket, no timer


def test_a_coordinator_with_a_fleet_shares_its_rate_through_the_store() -> None:
    clock_starts: list[float] = []
    lock = threading.Lock()

    def job() -> None:
        import time

        with lock:
            clock_starts.append(time.monotonic())

    rate = Rate(20, per=1.0)
    with MemoryLeases() as leases:
        members = [
            TenantTaskCoordinator(name="rated", fleet=leases, max_concurrency=4, rate=rate)
            for _ in range(2)
        ]
        outcomes = [Outcome() for _ in range(20)]
        for i, outcome in enumerate(outcomes):
            outcome.subscribe_to(members[i % 2].execute(job))
        assert all(o.done.wait(10) for o in outcomes)
        for member in members:
            member.close()
    # Two coordinators, one rate: 20 starts at 20/s take about a second, not half of it.
    assert_within_rate(clock_starts, rate, slack=0.05)


def test_a_rate_that_is_not_a_rate_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="Rate"):
        TenantTaskCoordinator(rate=cast(Any, 10))


def test_an_observable_job_under_a_rate_keeps_its_slot_until_it_ends() -> None:
    clock = TestScheduler()
    c = TenantTaskCoordinator(scheduler=clock, max_concurrency=1, rate=Rate(100, per=1.0))
    out = Outcome()
    out.subscribe_to(c.execute(lambda: reactivex.timer(1.0, scheduler=clock).pipe(ops.map(str))))
    clock.advance_to(5.0)
    assert out.values == ["0"]
    c.close()
