"""Fleet-wide rates in one process, on the memory store (several schedulers sharing one store
stand for several processes; tests/leases/test_fleet_processes.py runs real processes on
real servers).

* the bound, fleet-wide and per tenant, on the store's grant times (``FleetPermit.granted_at``,
  exact) and on the jobs' own start times (with a small lag allowed);
* waiting, not failing, and no polling: a lane told to wait for its rate makes no round trip
  before the time the store gave (``FleetStats.round_trips``);
* no head-of-line blocking: a tenant waiting for its own rate does not delay another tenant;
* the statistics (``FleetStats.rate_waits``, ``rate_waited``, ``rate_limited``);
* bad input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from support.rates import assert_within_rate

from rxcoord import (
    FleetAdmission,
    Rate,
    TenantScheduler,
    TenantTaskCoordinator,
    current_permit,
)
from rxcoord.leases import MemoryLeases, MemoryLeaseStore

WAIT = 30.0


class Starts:
    """Every job's tenant, grant time on the store's clock, and own start time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[str, float, float]] = []
        self.done = threading.Semaphore(0)

    def job(self, tenant: str) -> Callable[[], None]:
        def run() -> None:
            permit = current_permit()
            assert permit is not None
            with self.lock:
                self.rows.append((tenant, permit.granted_at, time.monotonic()))

        return run

    def submit(self, scheduler: TenantScheduler, tenant: str, count: int) -> None:
        for _ in range(count):
            scheduler.execute(tenant, self.job(tenant)).subscribe(
                on_completed=self.done.release, on_error=lambda _e: self.done.release()
            )

    def wait(self, count: int) -> None:
        for _ in range(count):
            assert self.done.acquire(timeout=WAIT), "a job never finished"

    def granted(self, tenant: str | None = None) -> list[float]:
        return [g for t, g, _ in self.rows if tenant is None or t == tenant]

    def started(self, tenant: str | None = None) -> list[float]:
        return [s for t, _, s in self.rows if tenant is None or t == tenant]


def test_the_fleet_rates_hold_across_members_sharing_a_store() -> None:
    store = MemoryLeaseStore()
    rate = Rate(30, per=1.0, burst=3)
    tenant_rate = Rate(12, per=1.0)
    providers = [MemoryLeases(store) for _ in range(3)]
    members = [
        TenantScheduler(
            8,
            tenant_max_concurrency=4,
            tenant_max_queue_size=100,
            name="api",
            fleet=provider,
            rate=rate,
            tenant_rate=tenant_rate,
        )
        for provider in providers
    ]
    starts = Starts()
    for i, member in enumerate(members):
        starts.submit(member, "a", 10)
        starts.submit(member, "b", 10)
        starts.submit(member, f"solo{i}", 5)
    starts.wait(75)
    # Exact on the store's clock: the grant is the start the rates counted.
    assert_within_rate(starts.granted(), rate)
    for tenant in ("a", "b", "solo0"):
        assert_within_rate(starts.granted(tenant), tenant_rate)
    # The jobs' own start times lag their grants a little.
    assert_within_rate(starts.started(), rate, slack=0.05)
    stats = members[0].stats().fleet
    assert stats is not None
    assert stats.rate_waits > 0
    assert stats.rate_waited > 0
    for member in members:
        member.close()
    for provider in providers:
        provider.close()


def test_a_lane_waiting_for_its_rate_makes_no_round_trip_before_its_time() -> None:
    """Ten jobs at 4 per second in one process: a grant, and at most one refusal (which gives
    the time) per job, plus the demand's refresh and the releases. A waiter that polled would
    make hundreds of round trips in these 2.5 seconds."""
    provider = MemoryLeases()
    fleet = FleetAdmission(provider, "slow", 4, rate=Rate(4, per=1.0))
    with TenantTaskCoordinator(
        name="slow", max_concurrency=4, max_queue_size=20, admission=fleet.lane("slow")
    ) as coordinator:
        outcomes = [coordinator.execute(lambda: time.monotonic()) for _ in range(10)]
        results: list[float] = []
        done = threading.Semaphore(0)
        for observable in outcomes:
            observable.subscribe(results.append, on_completed=done.release)
        for _ in range(10):
            assert done.acquire(timeout=WAIT)
        stats = fleet.stats()
    assert_within_rate(results, Rate(4, per=1.0), slack=0.05)
    assert stats.granted == 10
    assert stats.round_trips <= 10 + 10 + 10 + 4, stats  # grants, refusals, releases, refreshes
    assert stats.rate_waits == 9
    fleet.close()
    provider.close()


def test_a_tenant_waiting_for_its_own_rate_does_not_delay_another() -> None:
    provider = MemoryLeases()
    with TenantScheduler(
        2,
        tenant_max_concurrency=2,
        tenant_max_queue_size=50,
        name="hol",
        fleet=provider,
        tenant_rate={"slow": Rate(1, per=5.0)},
    ) as scheduler:
        starts = Starts()
        began = time.monotonic()
        starts.submit(scheduler, "slow", 3)
        starts.submit(scheduler, "fast", 20)
        deadline = time.monotonic() + WAIT
        while len(starts.started("fast")) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        fast = starts.started("fast")
        assert len(fast) == 20
        # 20 trivial jobs through 2 permits: a fraction of a second, not slow's 5-second beat.
        assert max(fast) - began < 2.0
        assert len(starts.started("slow")) == 1
        limited = scheduler.stats().fleet
        assert limited is not None
        assert set(limited.rate_limited) == {"slow"}
        assert 0 < limited.rate_limited["slow"] <= 5.0
    provider.close()


def test_fleet_rates_are_checked() -> None:
    provider = MemoryLeases()
    with pytest.raises(TypeError, match=r"rate must be an rxcoord\.Rate"):
        FleetAdmission(provider, "x", 2, rate=3)  # type: ignore[arg-type]
    fleet = FleetAdmission(provider, "x", 2)
    with pytest.raises(TypeError, match=r"rate must be an rxcoord\.Rate"):
        fleet.lane("t", rate="fast")  # type: ignore[arg-type]
    fleet.close()
    provider.close()
