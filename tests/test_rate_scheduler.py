"""Rates inside the fair-share gate and ``TenantScheduler(rate=, tenant_rate=)``.

Logic on a clock the test moves (``ManualClock``) or on a reactivex ``TestScheduler`` (the
whole scheduler in virtual time: guarantee 8); one run on real threads checks the same bound
on real time. Each test names the guarantee it checks:

* the bound, per tenant and for all tenants together (a sweep over the start times);
* waiting, not failing, holding no permit: ``TooManyTasks`` still bounds the queues;
* no head-of-line blocking: a tenant waiting for its own rate never delays one within its rate,
  and the weights pick among the tenants that may start; FIFO within a tenant;
* a tenant's rate outlives its eviction (else an evicted tenant would start over with a full
  bucket), and is forgotten once full again;
* bad input at construction, a bad callable at the tenant's first job.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import pytest
from reactivex.testing import TestScheduler
from support.rates import ManualClock, assert_within_rate

from rxcoord import AdmissionTicket, Rate, TenantScheduler, TooManyTasks
from rxcoord._admission import FairShareGate

# -- the gate, on a manual clock --------------------------------------------------------------


class Lanes:
    """Tickets of one gate test: each records its grant time; ``end()`` gives permits back."""

    def __init__(self, gate: FairShareGate, clock: ManualClock) -> None:
        self.gate = gate
        self.clock = clock
        self.granted: list[tuple[float, str, int]] = []  # (time, lane, n-th ticket of it)
        self.lanes: dict[str, Any] = {}
        self.running: list[str] = []

    def add(self, name: str, weight: float = 1.0, rate: Rate | None = None) -> None:
        self.lanes[name] = self.gate.lane(weight, rate=rate, key=name)

    def submit(self, name: str, count: int) -> list[AdmissionTicket]:
        tickets = []
        for i in range(count):
            ticket = AdmissionTicket(lambda _p: None, None)

            def granted(name: str = name, i: int = i) -> None:
                self.granted.append((self.clock.now(), name, i))
                self.running.append(name)

            ticket._waiter.bind(granted)
            tickets.append(ticket)
            self.lanes[name].request(ticket)
        return tickets

    def end(self) -> None:
        """Every job running now ends (in grant order); those their permits go to run on."""
        ending, self.running = self.running, []
        for name in ending:
            self.lanes[name].release(None)

    def times(self, name: str | None = None) -> list[float]:
        return [t for t, lane, _ in self.granted if name is None or lane == name]


def test_the_gate_rate_bounds_every_lane_together_and_the_weights_share_it() -> None:
    clock = ManualClock()
    rate = Rate(10, per=1.0, burst=2)
    gate = FairShareGate(100, rate=rate, clock=clock)
    lanes = Lanes(gate, clock)
    lanes.add("heavy", weight=3.0)
    lanes.add("light", weight=1.0)
    lanes.submit("heavy", 200)
    lanes.submit("light", 200)
    for _ in range(100):
        clock.advance(0.1)
        lanes.end()
    assert_within_rate(lanes.times(), rate)
    assert len(lanes.times()) == pytest.approx(2 + 10 * 10, abs=1)
    ratio = len(lanes.times("heavy")) / len(lanes.times("light"))
    assert 2.5 <= ratio <= 3.5, "the rate's starts are shared by weight"
    stats = gate.stats()
    assert stats.rate_waits > 90
    assert stats.running == 0


def test_a_lane_waiting_for_its_own_rate_never_holds_back_another() -> None:
    """No head-of-line blocking: 'slow' is furthest behind its share (it has started least)
    and has jobs waiting, but its rate has no token: the one free permit goes to 'fast' at
    once, every time, and 'slow' gets its starts when its rate allows."""
    clock = ManualClock()
    gate = FairShareGate(1, clock=clock)
    lanes = Lanes(gate, clock)
    slow_rate = Rate(1, per=1.0)
    lanes.add("slow", rate=slow_rate)
    lanes.add("fast")
    lanes.submit("slow", 5)
    lanes.submit("fast", 30)
    for _ in range(60):
        clock.advance(0.05)
        lanes.end()  # each job lasts one step: the single permit changes hands every step
    fast = lanes.times("fast")
    slow = lanes.times("slow")
    assert len(fast) == 30
    # at its rate's times, or the step after (the permit is busy until a step ends)
    assert slow == pytest.approx([1000.0, 1001.0, 1002.0], abs=0.051)
    # The permit never idled while fast waited: fast started at every step but the one slow
    # took at about 1001.0 (a lane holding the permit while it slept would stall fast).
    gaps = [b - a for a, b in itertools.pairwise(fast)]
    assert max(gaps) == pytest.approx(0.1)
    assert sum(gap > 0.06 for gap in gaps) == 1
    assert lanes.lanes["slow"].stats().waits == 2  # its 2nd and 3rd waited for its rate


def test_fifo_within_a_lane_and_the_bound_per_lane() -> None:
    clock = ManualClock()
    rates = {"a": Rate(5, per=1.0, burst=3), "b": Rate(2, per=1.0)}
    gate = FairShareGate(4, clock=clock)
    lanes = Lanes(gate, clock)
    for name, rate in rates.items():
        lanes.add(name, rate=rate)
        lanes.submit(name, 15)
    for _ in range(100):
        clock.advance(0.1)
        lanes.end()
    for name, rate in rates.items():
        order = [i for _, lane, i in lanes.granted if lane == name]
        assert order == sorted(order), "FIFO within a tenant"
        assert_within_rate(lanes.times(name), rate)
    assert len(lanes.times("a")) == 15
    assert len(lanes.times("b")) == 15


def test_a_lanes_rate_outlives_the_lane_until_its_bucket_is_full() -> None:
    clock = ManualClock()
    gate = FairShareGate(10, clock=clock)
    rate = Rate(1, per=1.0, burst=2)
    lanes = Lanes(gate, clock)
    lanes.add("t", rate=rate)
    lanes.submit("t", 2)
    lanes.end()
    assert lanes.times("t") == [1000.0, 1000.0]
    lanes.add("t", rate=rate)  # the tenant was evicted and comes back at once
    lanes.submit("t", 1)
    assert len(lanes.times("t")) == 2, "a new lane of the same tenant starts from its bucket"
    clock.advance(1.0)
    assert lanes.times("t")[-1] == 1001.0
    assert gate.stats().rate_buckets == 1
    clock.advance(10.0)  # full again: the same as a fresh one, so forgotten on the next sweep
    for i in range(70):
        lanes.add(f"other{i}", rate=rate)
    assert gate.stats().rate_buckets < 71


def test_the_gate_timer_stops_when_closed() -> None:
    clock = ManualClock()
    gate = FairShareGate(5, rate=Rate(1, per=1.0), clock=clock)
    lanes = Lanes(gate, clock)
    lanes.add("a")
    lanes.submit("a", 3)
    assert clock.pending == 1
    gate.close()
    assert clock.pending == 0
    clock.advance(5.0)
    assert len(lanes.times()) == 1


# -- TenantScheduler in virtual time ----------------------------------------------------------


class VirtualRun:
    """A TenantScheduler on a TestScheduler: jobs record the virtual time they start at."""

    def __init__(self, **options: Any) -> None:
        self.clock = TestScheduler()
        self.scheduler = TenantScheduler(scheduler=self.clock, **options)
        self.starts: list[tuple[float, Hashable, int]] = []
        self.results: list[Any] = []
        self.errors: list[Exception] = []

    def submit(self, tenant: Hashable, count: int, key: Hashable | None = None) -> None:
        for i in range(count):

            def job(tenant: Hashable = tenant, i: int = i) -> int:
                self.starts.append((self.clock.clock, tenant, i))
                return i

            self.scheduler.execute(tenant, job, key=key).subscribe(
                self.results.append, self.errors.append
            )

    def times(self, tenant: Hashable | None = None) -> list[float]:
        return [t for t, who, _ in self.starts if tenant is None or who == tenant]


def test_tenant_scheduler_rates_run_in_virtual_time() -> None:
    """Guarantee 8 and the bound: 40 jobs of two tenants under a global and a tenant rate,
    run by advancing a TestScheduler (no real time passes: the test takes milliseconds)."""
    rate = Rate(5, per=1.0, burst=2)
    tenant_rate = Rate(3, per=1.0)
    run = VirtualRun(max_concurrency=4, rate=rate, tenant_rate=tenant_rate)
    run.submit("a", 20)
    run.submit("b", 20)
    started = time.monotonic()
    run.clock.advance_to(100.0)
    assert time.monotonic() - started < 30, "virtual, not real, waiting"
    assert sorted(run.results) == sorted(list(range(20)) * 2), "waiting, not failing"
    assert run.errors == []
    assert_within_rate(run.times(), rate)
    assert_within_rate(run.times("a"), tenant_rate)
    assert_within_rate(run.times("b"), tenant_rate)
    # The global rate is the bottleneck (5/s < 2 x 3/s): no start is lost to it.
    assert max(run.times()) == pytest.approx((40 - 2) / 5, abs=1e-5)
    run.scheduler.close()


def test_a_tenant_over_its_rate_never_delays_a_tenant_within_its_rate() -> None:
    run = VirtualRun(max_concurrency=2, tenant_rate={"slow": Rate(1, per=10.0)})
    run.submit("slow", 3)
    run.submit("fast", 30)
    run.clock.advance_to(0.001)
    assert run.times("fast") == [0.0] * 30, "fast ran at once, whatever slow waits for"
    run.clock.advance_to(30.0)
    assert run.times("slow") == [0.0, 10.0, 20.0]
    run.scheduler.close()


def test_waiting_jobs_still_count_against_the_queue_bound() -> None:
    run = VirtualRun(
        max_concurrency=4,
        tenant_max_concurrency=1,
        tenant_max_queue_size=3,
        tenant_rate=Rate(1, per=1.0),
    )
    run.submit("t", 6)
    assert [type(e) for e in run.errors] == [TooManyTasks, TooManyTasks]
    run.clock.advance_to(10.0)
    assert sorted(run.results) == [0, 1, 2, 3]
    assert run.times("t") == [0.0, 1.0, 2.0, 3.0]
    run.scheduler.close()


def test_per_key_order_is_kept_under_a_rate() -> None:
    run = VirtualRun(max_concurrency=3, tenant_max_concurrency=3, rate=Rate(4, per=1.0))
    run.submit("t", 12, key="k")
    run.clock.advance_to(10.0)
    assert [i for _, _, i in run.starts] == list(range(12))
    run.scheduler.close()


def test_an_evicted_tenant_comes_back_within_its_rate() -> None:
    """idle_timeout=0 evicts a tenant the moment its last job ends; one job at a time would
    otherwise start each time with a fresh bucket."""
    run = VirtualRun(max_concurrency=2, idle_timeout=0.0, tenant_rate=Rate(2, per=1.0))
    for _ in range(6):
        run.submit("t", 1)
        run.clock.advance_by(0.01)
    run.clock.advance_to(10.0)
    assert run.times("t") == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], abs=1e-5)
    run.scheduler.close()


def test_tenant_rates_from_a_mapping_or_a_callable() -> None:
    rates: dict[Hashable, Rate] = {"a": Rate(1, per=1.0)}
    run = VirtualRun(max_concurrency=5, tenant_rate=rates)
    run.submit("a", 2)
    run.submit("b", 2)  # not in the mapping: no rate of its own
    run.clock.advance_to(5.0)
    assert run.times("a") == [0.0, 1.0]
    assert run.times("b") == [0.0, 0.0]
    run.scheduler.close()

    def per_tenant(tenant: Hashable) -> Rate | None:
        return None if tenant == "free" else Rate(2, per=1.0)

    run = VirtualRun(max_concurrency=5, tenant_rate=per_tenant)
    run.submit("free", 2)
    run.submit("paid", 2)
    run.clock.advance_to(5.0)
    assert run.times("free") == [0.0, 0.0]
    assert run.times("paid") == [0.0, 0.5]
    run.scheduler.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rate": 10}, r"rate must be an rxcoord.Rate, e.g. Rate\(100, per=1.0\), or None"),
        ({"rate": {"a": Rate(1)}}, "rate must be an rxcoord.Rate"),
        ({"tenant_rate": 5}, "tenant_rate must be an rxcoord.Rate .every tenant., a mapping"),
        ({"tenant_rate": "1/s"}, "tenant_rate must be an rxcoord.Rate"),
        ({"tenant_rate": {"acme": 100}}, r"tenant_rate\['acme'\] must be an rxcoord.Rate"),
    ],
)
def test_bad_rates_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        TenantScheduler(**options)


def test_a_callable_returning_a_non_rate_fails_that_tenants_first_job() -> None:
    def rates(tenant: Hashable) -> Any:
        return Rate(1) if tenant == "good" else 100

    with TenantScheduler(4, tenant_rate=rates) as scheduler:
        with pytest.raises(TypeError, match=r"tenant_rate\('bad'\) returned a value that must"):
            scheduler.execute("bad", lambda: 1).run()
        assert scheduler.stats().tenants == 0
        assert scheduler.execute("good", lambda: 2).run() == 2


# -- on real threads --------------------------------------------------------------------------


def test_tenant_scheduler_rates_hold_on_real_time() -> None:
    """The same bound with real threads and the real timer. The log is each job's own start
    time, a little after its grant: the sweep allows 50 ms of that lag (a job that ran 2x
    the rate would still exceed it by far)."""
    rate = Rate(40, per=1.0, burst=2)
    tenant_rate = Rate(25, per=1.0)
    starts: dict[str, list[float]] = {"a": [], "b": []}
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def job(tenant: str) -> Callable[[], None]:
        def run() -> None:
            with lock:
                starts[tenant].append(time.monotonic())

        return run

    with TenantScheduler(4, tenant_max_queue_size=100, rate=rate, tenant_rate=tenant_rate) as s:
        for tenant in ("a", "b") * 30:
            s.execute(tenant, job(tenant)).subscribe(on_completed=done.release)
        for _ in range(60):
            assert done.acquire(timeout=30)
        stats = s.stats()
    assert stats.completed == 60
    assert_within_rate(starts["a"] + starts["b"], rate, slack=0.05)
    assert_within_rate(starts["a"], tenant_rate, slack=0.05)
    assert_within_rate(starts["b"], tenant_rate, slack=0.05)
