"""Fleet admission in one process: the logic, on the memory store (several schedulers sharing
one store stand for several processes; tests/test_fleet_processes.py runs real processes on
real servers).

Each test is one promise of ``fleet=``: validation at construction, limits across members,
the fencing token a job can read, a lapsed permit reported as ``LeaseLost``, a store outage
reported as ``LeaseStoreUnavailable``, withdrawal of a job that left while waiting, nothing
left in the store, two round trips per uncontended job, fair shares across members.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from reactivex import operators as ops
from support.execution import WAIT, Gate, Outcome
from support.stores import FakeClock
from support.waiting import wait_until

from rxcoord import (
    FleetAdmission,
    FleetPermit,
    LeaseLost,
    LeaseStoreUnavailable,
    TenantScheduler,
    TenantTaskCoordinator,
    current_permit,
)
from rxcoord.leases import LeaseProvider, MemoryLeases, MemoryLeaseStore, SqliteLeases
from rxcoord.leases._permits import PermitReply


class Log:
    """Start/end of every job, checked for the limits afterwards (an invariant checker)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[float, int, str]] = []

    def job(self, tenant: str, hold: float = 0.0) -> Callable[[], int]:
        def run() -> int:
            with self.lock:
                self.events.append((time.monotonic(), 1, tenant))
            if hold:
                time.sleep(hold)
            permit = current_permit()
            assert permit is not None
            with self.lock:
                self.events.append((time.monotonic(), -1, tenant))
            return permit.token

        return run

    def peaks(self) -> tuple[int, dict[str, int]]:
        running = 0
        per: dict[str, int] = {}
        peak = 0
        peak_per: dict[str, int] = {}
        # Ends sort before starts at the same instant: a slot handed over is not an overlap.
        for _, delta, tenant in sorted(self.events):
            running += delta
            per[tenant] = per.get(tenant, 0) + delta
            peak = max(peak, running)
            peak_per[tenant] = max(peak_per.get(tenant, 0), per[tenant])
        return peak, peak_per


@pytest.fixture
def store() -> MemoryLeaseStore:
    return MemoryLeaseStore()


@pytest.fixture
def providers(store: MemoryLeaseStore) -> Iterator[Callable[[], MemoryLeases]]:
    made: list[MemoryLeases] = []

    def new() -> MemoryLeases:
        made.append(MemoryLeases(store))
        return made[-1]

    yield new
    for provider in made:
        provider.close()


def run_all(observables: list[Any]) -> list[Outcome]:
    outcomes = [Outcome() for _ in observables]
    for outcome, observable in zip(outcomes, observables, strict=True):
        outcome.subscribe_to(observable)
    for outcome in outcomes:
        assert outcome.done.wait(WAIT), "a job never finished"
    return outcomes


# -- construction -------------------------------------------------------------------------------


def test_bad_fleet_arguments_raise_at_construction(tmp_path: Any) -> None:
    provider = MemoryLeases()
    with pytest.raises(ValueError, match="name"):
        TenantScheduler(4, fleet=provider)
    with pytest.raises(ValueError, match="name"):
        TenantTaskCoordinator(fleet=provider)
    with pytest.raises(TypeError, match="lease provider"):
        TenantScheduler(4, name="x", fleet="redis://localhost")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        TenantTaskCoordinator(
            name="x", fleet=provider, admission=FleetAdmission(provider, "y", 1).lane("y")
        )
    with pytest.raises(ValueError, match="permit_at_most_for"):
        TenantScheduler(4, name="x", fleet=provider, permit_at_most_for=0)
    with pytest.raises(TypeError, match="tenant"):
        FleetAdmission(provider, "x", 2).lane(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tenant_limit"):
        FleetAdmission(provider, "x", 2).lane("t", tenant_limit=0)
    provider.close()


# -- limits, tokens, bookkeeping ------------------------------------------------------------------


def test_limits_hold_across_members_sharing_a_store(
    store: MemoryLeaseStore, providers: Callable[[], MemoryLeases]
) -> None:
    log = Log()
    members = [
        TenantScheduler(
            6, tenant_max_concurrency=2, tenant_max_queue_size=500, name="pay", fleet=providers()
        )
        for _ in range(4)
    ]
    jobs = [
        members[i % 4].execute(f"t{i % 3}", log.job(f"t{i % 3}", hold=0.001 * (1 + i % 3)))
        for i in range(600)
    ]
    outcomes = run_all(jobs)
    assert all(o.error is None for o in outcomes)
    peak, peak_per = log.peaks()
    assert peak <= 6
    assert all(p <= 2 for p in peak_per.values()), peak_per
    # Without the fleet the four members could run 24 at once; it was the fleet's bound, and
    # the members did run in parallel up to it.
    assert peak >= 4
    tokens = [o.values[0] for o in outcomes]
    assert len(set(tokens)) == len(tokens), "every job had a permit of its own"
    for member in members:
        member.close()
    assert store.permit_groups() == 0, "an idle fleet leaves nothing in the store"


class SlowLeases(MemoryLeases):
    """A memory provider whose permit steps take a while, like a round trip to a server."""

    def _permits_acquire(self, group: str, *args: Any, **rates: Any) -> PermitReply:
        time.sleep(0.0005)
        return super()._permits_acquire(group, *args, **rates)


def test_no_job_is_lost_while_tenants_come_and_go_under_contention(
    store: MemoryLeaseStore,
) -> None:
    # Many short-lived tenants on contended members: lanes are dropped and made again for the
    # same tenant while wake-up sweeps still hold the old ones (a sweep that dropped the new
    # lane once left its jobs waiting forever).
    slow = [SlowLeases(store) for _ in range(4)]
    members = [
        TenantScheduler(
            3, tenant_max_concurrency=1, tenant_max_queue_size=500, name="churn", fleet=provider
        )
        for provider in slow
    ]
    jobs = [members[i % 4].execute(f"t{i % 10}", lambda: None) for i in range(1500)]
    outcomes = run_all(jobs)
    assert all(o.error is None for o in outcomes)
    for member in members:
        member.close()
    for provider in slow:
        provider.close()
    assert store.permit_groups() == 0


def test_a_coordinator_shares_max_concurrency_with_its_namesakes(
    providers: Callable[[], MemoryLeases],
) -> None:
    log = Log()
    members = [
        TenantTaskCoordinator(name="mail", max_concurrency=3, max_queue_size=500, fleet=providers())
        for _ in range(3)
    ]
    outcomes = run_all([members[i % 3].execute(log.job("mail", 0.001)) for i in range(300)])
    assert all(o.error is None for o in outcomes)
    assert log.peaks()[0] == 3
    stats = members[0].stats().fleet
    assert stats is not None
    assert stats.name == "mail"
    assert stats.limit == 3
    assert stats.held == 0
    for member in members:
        member.close()


def test_async_jobs_read_their_permit(providers: Callable[[], MemoryLeases]) -> None:
    coordinator = TenantTaskCoordinator(name="a", max_concurrency=2, fleet=providers())

    async def job() -> int:
        await asyncio.sleep(0)
        permit = current_permit()
        assert isinstance(permit, FleetPermit)
        assert permit.valid
        return permit.token

    async def main() -> list[int]:
        return list(await asyncio.gather(*(coordinator.execute(job) for _ in range(20))))

    tokens = asyncio.run(main())
    assert len(set(tokens)) == 20
    assert current_permit() is None, "the permit is the job's, not its caller's"
    coordinator.close()


def test_an_uncontended_job_costs_two_round_trips(providers: Callable[[], MemoryLeases]) -> None:
    coordinator = TenantTaskCoordinator(name="rt", max_concurrency=4, fleet=providers())
    for _ in range(50):
        coordinator.execute(lambda: None).run()
    fleet = coordinator.stats().fleet
    assert fleet is not None
    # Each release may still be in flight when the next job asks: wait for the last one.
    deadline = time.monotonic() + WAIT
    while coordinator.stats().fleet.held != 0 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.001)
    coordinator.close()
    fleet = coordinator.stats().fleet
    assert fleet is not None
    assert fleet.granted == 50
    assert fleet.round_trips == 100, "one round trip to admit, one to release, per job"


def test_a_job_that_leaves_while_waiting_withdraws_its_demand(
    store: MemoryLeaseStore, providers: Callable[[], MemoryLeases]
) -> None:
    holder = TenantScheduler(1, name="w", fleet=providers())
    waiter = TenantScheduler(1, name="w", fleet=providers())
    gate = Gate("held")
    held = Outcome()
    held.subscribe_to(holder.execute("a", gate))
    assert gate.started.wait(WAIT)
    waiting = Outcome()
    subscription = waiting.subscribe_to(waiter.execute("b", lambda: "never"))
    deadline = time.monotonic() + WAIT
    while waiter.stats().fleet.waiting != 1:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.001)
    subscription.dispose()  # b's job leaves before its permit comes
    while waiter.stats().fleet.waiting != 0 or store._groups["w"].demand:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the demand was not withdrawn"
        time.sleep(0.001)
    gate.open()
    assert held.done.wait(WAIT)
    assert held.values == ["held"]
    assert waiting.values == []
    holder.close()
    waiter.close()
    assert store.permit_groups() == 0


# -- losing a permit, losing the store ------------------------------------------------------------


def test_a_permit_reclaimed_while_its_job_runs_fails_the_job_with_lease_lost(
    providers: Callable[[], MemoryLeases],
) -> None:
    clock = FakeClock()
    store = MemoryLeaseStore(clock=clock)
    provider = MemoryLeases(store)
    other = MemoryLeases(store)
    paused = TenantTaskCoordinator(
        name="p", max_concurrency=1, fleet=provider, permit_at_most_for=0.3
    )
    survivor = TenantTaskCoordinator(
        name="p", max_concurrency=1, fleet=other, permit_at_most_for=60
    )
    gate = Gate("stale")
    first = Outcome()
    first.subscribe_to(paused.execute(gate))
    assert gate.started.wait(WAIT)
    old = paused.stats().fleet
    clock.now += 10  # the store's clock passes the permit's expiry: it is reclaimed
    second = Outcome()

    def token() -> int:
        permit = current_permit()
        assert permit is not None
        return permit.token

    second.subscribe_to(survivor.execute(token))
    assert second.done.wait(WAIT), "the reclaimed permit was not granted to the next job"
    # The keep-alive (every 0.1 s here) learns from the store that the permit is gone.
    deadline = time.monotonic() + WAIT
    while paused.stats().fleet.lost != 1:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the keep-alive did not notice the loss"
        time.sleep(0.005)
    gate.open()
    assert first.done.wait(WAIT)
    assert isinstance(first.error, LeaseLost), "a stale job's result must not count"
    assert first.values == []
    assert second.values[0] > (old.granted if old else 0)
    stats = paused.stats().fleet
    assert stats is not None
    assert stats.lost == 1
    for c in (paused, survivor):
        c.close()
    provider.close()
    other.close()


class FlakyLeases(MemoryLeases):
    """A memory provider whose permit steps raise ``failure`` (and whose release steps raise
    ``release_failure``) while it is set: a store outage, or an error the backend did not map.
    ``released``: the tokens of the permits its release steps gave back."""

    failure: Exception | None = None
    release_failure: Exception | None = None

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []

    def _permits_acquire(self, group: str, *args: Any, **rates: Any) -> PermitReply:
        if self.failure is not None:
            raise self.failure
        return super()._permits_acquire(group, *args, **rates)

    def _permits_release(self, group: str, permits: Any, **options: Any) -> int:
        if self.release_failure is not None:
            raise self.release_failure
        self.released += [token for token, _ in permits]
        return super()._permits_release(group, permits, **options)


@pytest.mark.parametrize(
    "failure",
    [LeaseStoreUnavailable("the store is down (test)"), RuntimeError("a bug in a backend (test)")],
    ids=["store-down", "unexpected-error"],
)
def test_new_jobs_fail_with_the_store_error_while_the_store_fails(failure: Exception) -> None:
    """Whatever a permit step raises fails the jobs waiting for it (an error the backend did
    not map used to leave the tenant's lane busy for good: its jobs waited forever); the next
    jobs, once the store works again, run."""
    provider = FlakyLeases()
    coordinator = TenantTaskCoordinator(name="down", max_concurrency=2, fleet=provider)
    assert coordinator.execute(lambda: "up").run() == "up"
    provider.failure = failure
    with pytest.raises(type(failure)):
        coordinator.execute(lambda: "never").pipe(ops.timeout(WAIT)).run()
    provider.failure = None
    assert coordinator.execute(lambda: "up again").pipe(ops.timeout(WAIT)).run() == "up again"
    stats = coordinator.stats()
    assert stats.failed == 1
    assert stats.running == 0
    assert stats.fleet is not None
    assert stats.fleet.store_errors == 1
    coordinator.close()
    provider.close()


def test_a_release_step_that_fails_unexpectedly_does_not_stop_later_releases() -> None:
    """A release step that raises an error the backend did not map leaves its permits to
    expire; the next permits still go back to the store (the release flush used to stay
    marked as running, so no release was ever sent again)."""
    provider = FlakyLeases()
    provider.release_failure = RuntimeError("a bug in a backend (test)")
    coordinator = TenantTaskCoordinator(name="releases", max_concurrency=2, fleet=provider)
    assert coordinator.execute(lambda: 1).pipe(ops.timeout(WAIT)).run() == 1

    def release_failed() -> bool:
        fleet = coordinator.stats().fleet
        return fleet is not None and fleet.store_errors == 1

    wait_until(release_failed, what="the failed release step")
    provider.release_failure = None
    assert coordinator.execute(lambda: 2).pipe(ops.timeout(WAIT)).run() == 2
    wait_until(lambda: len(provider.released) == 1, what="the second permit given back")
    coordinator.close()
    provider.close()


def test_a_provider_without_permits_is_refused() -> None:
    class NoPermits(SqliteLeases):
        _permits_acquire = LeaseProvider._permits_acquire  # the base's refusal

    provider = NoPermits(":memory:")
    with pytest.raises(TypeError, match="no fleet permits"):
        TenantScheduler(2, name="n", fleet=provider)
    provider.close()


# -- fairness -------------------------------------------------------------------------------------


def test_a_flood_on_one_member_does_not_starve_light_tenants_on_another(
    providers: Callable[[], MemoryLeases],
) -> None:
    flooder = TenantScheduler(
        2, tenant_max_concurrency=2, tenant_max_queue_size=500, name="f", fleet=providers()
    )
    light = TenantScheduler(
        2, tenant_max_concurrency=2, tenant_max_queue_size=10, name="f", fleet=providers()
    )
    log: list[str] = []
    lock = threading.Lock()

    def job(tenant: str) -> Callable[[], None]:
        def run() -> None:
            with lock:
                log.append(tenant)
            time.sleep(0.002)

        return run

    flood = [flooder.execute("flood", job("flood")) for _ in range(200)]
    outcomes = [Outcome() for _ in flood]
    for outcome, observable in zip(outcomes, flood, strict=True):
        outcome.subscribe_to(observable)
    deadline = time.monotonic() + WAIT
    while len(log) < 10:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    lights = run_all([light.execute(f"l{i}", job(f"l{i}")) for i in range(5)])
    assert all(o.error is None for o in lights)
    with lock:
        before = len(log)
        first_light = min(i for i, t in enumerate(log) if t != "flood")
        last_light = max(i for i, t in enumerate(log) if t != "flood")
    # Five light tenants, each behind its share: they start within a handful of flood jobs,
    # not after the flood's backlog of ~190.
    assert last_light - first_light <= 15, log[first_light : last_light + 1]
    assert before < 150
    for outcome in outcomes:
        assert outcome.done.wait(WAIT)
    flooder.close()
    light.close()
