"""``Rate``, the GCRA bucket (``rxcoord/_core/rate.py``) and ``RateAdmission``, in virtual time.

* bad input fails at construction with the fix in the message;
* the bucket answers like a tiny exact reference model (a token bucket in ``Fraction``s), for
  any sequence of starts and queries (hypothesis; times and intervals are dyadic, so the
  float arithmetic is exact and the two must agree to the bit);
* ``RateAdmission`` driven through the ``Admission`` protocol on a clock the test moves: the
  bound on starts, FIFO, waiting (not failing) with no thread and no poll, the token taken at
  the grant of the admission behind it, and every withdrawal race.
"""

from __future__ import annotations

import math
import threading
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reactivex.testing import TestScheduler
from support.rates import ManualClock, assert_within_rate, rate_excess

from rxcoord import Admission, AdmissionTicket, Rate
from rxcoord._admission import FairShareGate, RateAdmission
from rxcoord._core import rate as gcra
from rxcoord._core.clock import MONOTONIC, SchedulerClock, clock_for
from rxcoord._rate import RateStats

# -- Rate: the policy class -------------------------------------------------------------------


def test_a_rate_is_a_frozen_value_with_its_interval() -> None:
    rate = Rate(100, per=2.0, burst=5)
    assert (rate.count, rate.per, rate.burst) == (100.0, 2.0, 5)
    assert rate.interval == 0.02
    assert rate == Rate(100.0, per=2, burst=5)
    assert repr(rate) == "Rate(100, per=2, burst=5)"
    assert Rate(0.5).interval == 2.0  # one start every 2 seconds
    with pytest.raises(AttributeError):
        rate.count = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((0,), {}, ValueError, r"count must be a finite number > 0.*rate=None"),
        ((-1,), {}, ValueError, "count must be a finite number > 0"),
        ((math.nan,), {}, ValueError, "count must be a finite number > 0"),
        ((math.inf,), {}, ValueError, "must be finite.*pass rate=None"),
        (("10",), {}, TypeError, r"count must be a number of starts per period"),
        ((True,), {}, TypeError, "count must be a number"),
        ((10,), {"per": 0}, ValueError, r"per must be a finite number of seconds > 0.*per=60"),
        ((10,), {"per": -1.0}, ValueError, "per must be a finite number of seconds > 0"),
        ((10,), {"per": math.nan}, ValueError, "per must be a finite number of seconds > 0"),
        ((10,), {"per": math.inf}, ValueError, "per must be finite"),
        ((10,), {"per": None}, TypeError, "per must be a number of seconds"),
        ((10,), {"burst": 0}, ValueError, r"burst must be at least 1 \(1: starts evenly"),
        ((10,), {"burst": -3}, ValueError, "burst must be at least 1"),
        ((10,), {"burst": 2.5}, TypeError, "burst must be an int"),
        ((10,), {"burst": True}, TypeError, "burst must be an int"),
    ],
)
def test_bad_rates_are_refused_with_the_fix(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Rate(*args, **kwargs)


# -- the GCRA bucket against a reference model ------------------------------------------------


class ReferenceBucket:
    """A token bucket in exact arithmetic: ``level`` tokens (at most ``burst``), refilled at
    one per ``interval``; a start takes one."""

    def __init__(self, interval: Fraction, burst: int, now: Fraction) -> None:
        self.interval = interval
        self.burst = burst
        self.level = Fraction(burst)
        self.at = now

    def _refill(self, now: Fraction) -> None:
        self.level = min(Fraction(self.burst), self.level + (now - self.at) / self.interval)
        self.at = now

    def wait(self, now: Fraction, n: int) -> Fraction:
        self._refill(now)
        return max(Fraction(0), (n - self.level) * self.interval)

    def available(self, now: Fraction) -> int:
        self._refill(now)
        return math.floor(self.level)

    def take(self, now: Fraction, n: int) -> None:
        self._refill(now)
        assert self.level >= n
        self.level -= n


steps = st.lists(
    st.tuples(
        st.integers(0, 200),  # time passes, in 1/64 s
        st.sampled_from(["take-all", "take-one", "wait"]),
        st.integers(1, 6),  # n for a wait query
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(interval=st.integers(1, 128), burst=st.integers(1, 5), script=steps)
def test_the_bucket_answers_like_a_token_bucket(
    interval: int, burst: int, script: list[tuple[int, str, int]]
) -> None:
    step = Fraction(1, 64)
    now = Fraction(1000)
    reference = ReferenceBucket(interval * step, burst, now)
    bucket = gcra.Bucket(float(interval * step), burst)
    for ticks, action, n in script:
        now += ticks * step
        t = float(now)
        assert bucket.available(t) == reference.available(now)
        assert bucket.wait(t, n) == float(reference.wait(now, n)), (t, n)
        assert bucket.full(t) == (reference.available(now) == burst and reference.level == burst)
        if action == "take-all":
            k = bucket.available(t)
            if k:
                bucket.take(t, k)
                reference.take(now, k)
        elif action == "take-one" and bucket.wait(t) == 0.0:
            bucket.take(t)
            reference.take(now, 1)


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(1, 50),
    per=st.sampled_from([0.25, 1.0, 3.0]),
    burst=st.integers(1, 4),
    gaps=st.lists(st.floats(0.0, 0.5), max_size=80),
)
def test_starts_taken_as_soon_as_allowed_keep_the_bound(
    count: int, per: float, burst: int, gaps: list[float]
) -> None:
    """Jobs arrive at random; each starts at the first moment the bucket allows it."""
    rate = Rate(count, per=per, burst=burst)
    bucket = gcra.Bucket(rate.interval, rate.burst)
    now = 50.0
    starts = []
    for gap in gaps:
        now += gap
        now += bucket.wait(now)
        bucket.take(now)
        starts.append(now)
    assert rate_excess(starts, rate) <= 1e-6


def test_the_bound_check_finds_a_violation() -> None:
    rate = Rate(10, per=1.0, burst=2)
    assert_within_rate([0.0, 0.0, 0.1, 0.2, 0.3], rate)
    with pytest.raises(AssertionError, match="3 starts in"):
        assert_within_rate([0.0, 0.0, 0.05], rate)
    assert rate_excess([0.0, 0.0, 0.05], rate, slack=0.05) <= 0  # within a 50 ms lag


# -- clocks -----------------------------------------------------------------------------------


def test_clock_for_picks_virtual_time_for_a_virtual_scheduler() -> None:
    scheduler = TestScheduler()
    clock = clock_for(scheduler)
    assert isinstance(clock, SchedulerClock)
    assert clock_for(None) is MONOTONIC
    fired: list[float] = []
    clock.call_later(1 / 3, lambda: fired.append(clock.now()))
    scheduler.advance_by(0.3333)
    assert fired == []
    scheduler.advance_by(0.001)
    # Rounded up to whole microseconds, never down (see SchedulerClock).
    assert fired
    assert fired[0] >= 1 / 3
    cancel = clock.call_later(1.0, lambda: fired.append(-1.0))
    cancel()
    scheduler.advance_by(2.0)
    assert -1.0 not in fired


# -- RateAdmission through the Admission protocol ---------------------------------------------


class Grants:
    """Tickets of one test: each records when it was granted (or refused)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.at: dict[AdmissionTicket, float] = {}
        self.released: list[object] = []

    def ticket(self, key: object = None) -> AdmissionTicket:
        ticket = AdmissionTicket(self.released.append, key)
        ticket._waiter.bind(lambda: self.at.setdefault(ticket, self.clock.now()))
        return ticket

    def times(self) -> list[float]:
        return sorted(self.at.values())


def test_a_rate_admission_is_an_admission_and_grants_within_the_rate() -> None:
    clock = ManualClock()
    rate = Rate(10, per=1.0, burst=3)
    admission = RateAdmission(rate, clock=clock)
    assert isinstance(admission, Admission)
    grants = Grants(clock)
    tickets = [grants.ticket(i) for i in range(40)]
    for ticket in tickets:
        admission.request(ticket)
    assert len(grants.at) == 3, "the burst passes at once"
    assert clock.pending == 1, "one timer for every waiter, no thread, no poll"
    for _ in range(400):  # 5.2 s in uneven steps: timers fire at their own times within each
        clock.advance(0.013)
    assert len(grants.at) == 40, "waiting, not failing: every job got its turn"
    assert_within_rate(grants.times(), rate)
    # FIFO: granted in the order they asked
    assert sorted(tickets, key=lambda t: grants.at[t]) == tickets
    # Evenly spaced after the burst: one every 0.1 s, to the clock's resolution.
    gaps = [b - a for a, b in zip(grants.times()[3:], grants.times()[4:], strict=False)]
    assert all(gap == pytest.approx(0.1) for gap in gaps), gaps
    stats = admission.stats()
    assert stats.waits == 37
    assert stats.waiting == 0
    assert stats.waited == pytest.approx(sum(grants.at[t] - 1000.0 for t in tickets[3:]))


def test_a_rate_admission_in_virtual_time_is_exact() -> None:
    """Guarantee 8: on a reactivex virtual-time scheduler the waits are virtual and exact."""
    scheduler = TestScheduler()
    clock = clock_for(scheduler)
    rate = Rate(7, per=1.0, burst=1)
    admission = RateAdmission(rate, clock=clock)
    granted: list[float] = []
    for _ in range(50):
        ticket = AdmissionTicket(lambda _p: None, None)
        ticket._waiter.bind(lambda: granted.append(clock.now()))
        admission.request(ticket)
    scheduler.advance_by(100.0)
    assert len(granted) == 50
    assert_within_rate(granted, rate)
    assert granted[-1] - granted[0] == pytest.approx(49 / 7, abs=50e-6)  # no time lost


def test_a_withdrawn_waiter_leaves_the_queue_and_its_place_goes_to_the_next() -> None:
    clock = ManualClock()
    admission = RateAdmission(Rate(1, per=1.0), clock=clock)
    grants = Grants(clock)
    first, second, third = grants.ticket(), grants.ticket(), grants.ticket()
    for ticket in (first, second, third):
        admission.request(ticket)
    assert first in grants.at
    assert admission.withdraw(second)
    assert not admission.withdraw(second), "withdrawn once"
    assert not admission.withdraw(first), "granted: nothing to withdraw"
    clock.advance(1.0)
    assert grants.at[third] == 1001.0
    assert admission.stats().waiting == 0
    assert clock.pending == 0, "nobody waits: no timer left behind"


class ManualAdmission:
    """An admission the test grants by hand (stands for a gate or a fleet lane)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[AdmissionTicket] = []
        self.released: list[object] = []

    def request(self, ticket: AdmissionTicket) -> None:
        with self.lock:
            self.waiting.append(ticket)

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        with self.lock:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                return True
            return False

    def release(self, permit: object) -> None:
        self.released.append(permit)

    def grant_all(self, permit: object = "p") -> None:
        with self.lock:
            tickets, self.waiting = self.waiting, []
        for ticket in tickets:
            ticket.grant(permit)


def test_chained_the_token_is_taken_when_the_admission_behind_grants() -> None:
    """Jobs waiting at the admission behind cannot start beyond the rate when it lets them all
    go at once: only as many are handed on as the rate has tokens for, and each token is
    taken at the grant (the start)."""
    clock = ManualClock()
    rate = Rate(10, per=1.0, burst=2)
    behind = ManualAdmission()
    admission = RateAdmission(rate, clock=clock, then=behind)
    grants = Grants(clock)
    tickets = [grants.ticket() for _ in range(20)]
    for ticket in tickets:
        admission.request(ticket)
    assert len(behind.waiting) == 2, "handed on: only what the rate has tokens for"
    assert admission.stats().waiting == 18, "the others wait for the rate, asking nothing"
    for _ in range(30):
        clock.advance(0.25)  # the admission behind is slow: it grants in batches
        behind.grant_all()
    assert len(grants.at) == 20
    assert_within_rate(grants.times(), rate)
    assert all(ticket.permit == "p" for ticket in tickets), "the permit behind is the job's"
    admission.release("p")
    assert behind.released == ["p"], "a permit goes back to the admission behind"


def test_chained_withdrawals_in_every_state_lose_nothing() -> None:
    clock = ManualClock()
    behind = ManualAdmission()
    admission = RateAdmission(Rate(1, per=1.0, burst=3), clock=clock, then=behind)
    grants = Grants(clock)
    handed = [grants.ticket() for _ in range(3)]
    queued = grants.ticket()
    for ticket in (*handed, queued):
        admission.request(ticket)
    assert len(behind.waiting) == 3
    # 1. handed on, pending behind: withdrawn there too; its claimed token is free again.
    handed[0]._waiter.cancel()
    assert admission.withdraw(handed[0])
    assert handed[0] not in [t for t in behind.waiting if t.pending]
    assert admission.stats().waiting == 0, "the freed token let the queued ticket through"
    assert len(behind.waiting) == 3
    # 2. granted behind but not taken here yet: its permit goes back behind.
    onward = behind.waiting[0]
    original = onward._waiter._wake
    onward._waiter._wake = None  # hold the wake-up back: the grant is decided, not seen
    onward.grant("late")
    handed[1]._waiter.cancel()
    assert admission.withdraw(handed[1])
    assert behind.released == ["late"], "a permit granted to a job that left goes back"
    assert original is not None
    original()  # the wake-up arrives after all: nothing happens twice
    assert handed[1] not in grants.at
    # 3. granted and taken: the job left too late; its permit comes back through release.
    handed[2]._waiter.cancel()
    behind.grant_all("p2")
    assert behind.released.count("p2") >= 1
    assert not admission.withdraw(handed[2])
    # The queued ticket is served normally.
    assert queued in grants.at or any(t.pending for t in behind.waiting)


def test_chained_a_refusal_behind_fails_the_job_and_frees_its_token() -> None:
    clock = ManualClock()
    behind = ManualAdmission()
    admission = RateAdmission(Rate(1, per=10.0), clock=clock, then=behind)
    grants = Grants(clock)
    first, second = grants.ticket(), grants.ticket()
    admission.request(first)
    admission.request(second)
    error = RuntimeError("store down")
    refused = behind.waiting.pop(0)
    refused.refuse(error)
    assert first.error is error
    assert len(behind.waiting) == 1, "the refused job took no token: the next goes on at once"


def test_a_chained_rate_in_front_of_a_gate_waits_without_a_permit() -> None:
    clock = ManualClock()
    gate = FairShareGate(1, clock=clock)
    admission = RateAdmission(Rate(2, per=1.0), clock=clock, then=gate.lane(1.0))
    grants = Grants(clock)
    tickets = [grants.ticket() for _ in range(4)]
    for ticket in tickets:
        admission.request(ticket)
    assert gate.running == 1
    assert gate.stats().waiting == 0, "rate waiters hold no permit and wait at no gate"
    ended: set[AdmissionTicket] = set()
    for _ in range(10):
        clock.advance(0.5)
        for ticket in set(grants.at) - ended:  # the jobs end: their permits go back
            ended.add(ticket)
            admission.release(ticket.permit)
    assert len(grants.at) == 4
    assert gate.running == 0
    assert_within_rate(grants.times(), Rate(2, per=1.0))


def test_closed_it_passes_nothing() -> None:
    clock = ManualClock()
    admission = RateAdmission(Rate(1, per=1.0), clock=clock)
    grants = Grants(clock)
    a, b = grants.ticket(), grants.ticket()
    admission.request(a)
    admission.request(b)
    admission.close()
    clock.advance(5.0)
    assert b not in grants.at
    assert admission.withdraw(b)
    assert admission.stats() == RateStats(waits=0, waited=0.0, waiting=0)


def test_try_pass_takes_a_token_inline_only_when_nobody_waits() -> None:
    """The fast path a coordinator may take (no ticket when the rate has a token and nobody
    waits) keeps the bound and the FIFO order of the waiters."""
    clock = ManualClock()
    rate = Rate(2, per=1.0, burst=2)
    admission = RateAdmission(rate, clock=clock)
    grants = Grants(clock)
    passed: list[float] = []
    assert admission.try_pass()
    passed.append(clock.now())
    waiter = grants.ticket()
    admission.request(waiter)  # takes the burst's second token at once
    assert grants.at[waiter] == 1000.0
    assert not admission.try_pass(), "no token left"
    queued = grants.ticket()
    admission.request(queued)
    clock.advance(0.6)  # a token came back, but a ticket waits: it gets it, not try_pass
    assert queued in grants.at
    assert not admission.try_pass()
    clock.advance(0.5)
    assert admission.try_pass()
    passed.append(clock.now())
    assert_within_rate([*passed, *grants.times()], rate)
    assert not RateAdmission(rate, clock=clock, then=ManualAdmission()).try_pass()
