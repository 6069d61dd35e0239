"""The Admission and KeyGuard seams of ``TenantTaskCoordinator``, and the fair-share gate.

A hand-written admission that grants only when the test says so stands in for any policy (a
gate shared by tenants, a fleet-wide limit): the coordinator must run a job only once granted,
give every permit back exactly once, and never lose one to a job that left.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.waiting import WAIT

from rxcoord import (
    Admission,
    AdmissionTicket,
    CoordinatorClosed,
    TenantTaskCoordinator,
)
from rxcoord._admission import FairShareGate


class ManualAdmission:
    """Queues tickets; the test grants them. Records every withdraw and release."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[AdmissionTicket] = []
        self.withdrawn: list[AdmissionTicket] = []
        self.released: list[object] = []
        self.out = 0  # permits granted and not released yet

    def request(self, ticket: AdmissionTicket) -> None:
        with self.lock:
            self.waiting.append(ticket)

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        with self.lock:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                self.withdrawn.append(ticket)
                return True
            return False

    def release(self, permit: object) -> None:
        with self.lock:
            self.released.append(permit)
            self.out -= 1

    def grant_next(self, permit: object) -> bool | None:
        """Grant the oldest waiting ticket; None if none waits (it was withdrawn first)."""
        with self.lock:
            if not self.waiting:
                return None
            ticket = self.waiting.pop(0)
            self.out += 1
        return ticket.grant(permit)


class Outcome:
    def __init__(self) -> None:
        self.values: list[Any] = []
        self.error: Exception | None = None
        self.done = threading.Event()

    def on_next(self, value: Any) -> None:
        self.values.append(value)

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.done.set()

    def on_completed(self) -> None:
        self.done.set()


def test_a_manual_admission_is_an_admission() -> None:
    assert isinstance(ManualAdmission(), Admission)
    assert isinstance(FairShareGate(1).lane(1.0), Admission)


def test_a_job_runs_only_once_granted_and_gives_its_permit_back() -> None:
    admission = ManualAdmission()
    with TenantTaskCoordinator(max_concurrency=2, admission=admission) as c:
        ran = threading.Event()
        outcome = Outcome()

        def job() -> int:
            ran.set()
            return 42

        c.execute(job, key="k").subscribe(outcome.on_next, outcome.on_error, outcome.on_completed)
        assert len(admission.waiting) == 1
        assert admission.waiting[0].key == "k"
        assert c.stats().queued == 1  # waiting for its permit counts as queued
        assert not ran.is_set()
        assert admission.grant_next("permit-1")
        assert outcome.done.wait(WAIT)
        assert outcome.values == [42]
        assert admission.released == ["permit-1"]
        assert admission.out == 0
        assert c.stats().work_in_progress == 0


def test_a_job_cancelled_before_its_grant_is_withdrawn_and_a_late_grant_comes_back() -> None:
    admission = ManualAdmission()
    with TenantTaskCoordinator(max_concurrency=2, admission=admission) as c:
        ran: list[int] = []
        subscription = c.execute(lambda: ran.append(1)).subscribe()
        ticket = admission.waiting[0]
        subscription.dispose()
        assert admission.withdrawn == [ticket]
        assert c.stats().work_in_progress == 0
        # An admission that decided to grant just before the withdrawal reached it:
        assert not ticket.grant("late")
        assert admission.released == ["late"]
        assert ran == []


def _race_grant_and_dispose() -> None:
    admission = ManualAdmission()
    with TenantTaskCoordinator(max_concurrency=1, admission=admission) as c:
        ended = threading.Event()
        subscription = c.execute(ended.set).subscribe()
        barrier = threading.Barrier(2)
        granted: list[bool | None] = []

        def grant() -> None:
            barrier.wait()
            granted.append(admission.grant_next("p"))

        granter = threading.Thread(target=grant)
        granter.start()
        barrier.wait()
        subscription.dispose()
        granter.join()
        if granted == [True]:  # the job took the permit: it runs to its end, then releases
            assert ended.wait(WAIT)
            c.close()  # joins the worker: the release has happened
        if granted == [None]:  # withdrawn before the grant: no permit ever went out
            assert admission.released == []
            assert len(admission.withdrawn) == 1
        else:  # granted (used, or given straight back because the job had left)
            assert admission.released == ["p"]
        assert admission.out == 0
        assert c.stats().work_in_progress == 0


def test_a_grant_racing_a_dispose_is_used_or_given_back_never_lost() -> None:
    for _ in range(300):
        _race_grant_and_dispose()


def test_close_fails_jobs_waiting_for_a_permit_and_withdraws_them() -> None:
    admission = ManualAdmission()
    c = TenantTaskCoordinator(max_concurrency=2, admission=admission)
    outcome = Outcome()
    c.execute(lambda: 1).subscribe(outcome.on_next, outcome.on_error, outcome.on_completed)
    c.close()
    assert isinstance(outcome.error, CoordinatorClosed)
    assert len(admission.withdrawn) == 1
    assert admission.out == 0


def test_a_bad_admission_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"admission must implement rxcoord\.Admission"):
        TenantTaskCoordinator(admission=object())  # type: ignore[arg-type]


class RecordingGuard:
    """A key guard that logs enter/exit; ``fail_exit`` makes exit raise (a lost lease)."""

    def __init__(self, fail_exit: bool = False) -> None:
        self.log: list[tuple[str, Hashable]] = []
        self.fail_exit = fail_exit

    def enter(self, key: Hashable) -> Hashable:
        self.log.append(("enter", key))
        return key

    def exit(self, token: Hashable) -> None:
        self.log.append(("exit", token))
        if self.fail_exit:
            raise RuntimeError(f"lost {token}")

    async def enter_async(self, key: Hashable) -> Hashable:
        return self.enter(key)

    async def exit_async(self, token: Hashable) -> None:
        self.exit(token)


def test_keyed_jobs_run_inside_the_key_guard_unkeyed_ones_do_not() -> None:
    guard = RecordingGuard()
    with TenantTaskCoordinator(max_concurrency=1, key_guard=guard) as c:
        inside: list[list[tuple[str, Hashable]]] = []
        c.execute(lambda: inside.append(list(guard.log)), key="a").run()
        c.execute(lambda: inside.append(list(guard.log))).run()
    assert inside[0] == [("enter", "a")]  # the job ran after enter, before exit
    assert guard.log == [("enter", "a"), ("exit", "a")]  # the unkeyed job entered nothing


async def test_async_keyed_jobs_run_inside_the_key_guard() -> None:
    guard = RecordingGuard()
    seen: list[list[tuple[str, Hashable]]] = []

    async def job() -> int:
        seen.append(list(guard.log))
        return 7

    with TenantTaskCoordinator(max_concurrency=1, key_guard=guard) as c:
        assert await c.execute(job, key="b") == 7
    assert seen == [[("enter", "b")]]
    assert guard.log == [("enter", "b"), ("exit", "b")]


def test_a_failing_guard_exit_fails_the_job_s_subscriber() -> None:
    guard = RecordingGuard(fail_exit=True)
    with (
        TenantTaskCoordinator(max_concurrency=1, key_guard=guard) as c,
        pytest.raises(RuntimeError, match="lost k"),
    ):
        c.execute(lambda: 1, key="k").run()


def test_leases_and_key_guard_are_exclusive() -> None:
    from rxcoord.leases import MemoryLeases

    with MemoryLeases() as leases, pytest.raises(ValueError, match="not both"):
        TenantTaskCoordinator(leases=leases, key_guard=RecordingGuard())


def test_leases_must_be_a_provider() -> None:
    with pytest.raises(TypeError, match="leases must be a lease provider"):
        TenantTaskCoordinator(leases="redis://x")  # type: ignore[arg-type]


# -- the fair-share gate, on its own ----------------------------------------------------------


def _tickets(gate: FairShareGate, log: list[str], name: str) -> AdmissionTicket:
    ticket = AdmissionTicket(lambda _: None, name)
    ticket._waiter.bind(lambda: log.append(name))
    return ticket


def test_the_gate_grants_at_most_limit_and_round_robins_equal_weights() -> None:
    gate = FairShareGate(1)
    a, b = gate.lane(1.0), gate.lane(1.0)
    log: list[str] = []
    holder = _tickets(gate, log, "a0")
    a.request(holder)
    for i in range(1, 4):
        a.request(_tickets(gate, log, f"a{i}"))
    for i in range(3):
        b.request(_tickets(gate, log, f"b{i}"))
    assert log == ["a0"]
    for _ in range(6):
        a.release(None)  # whichever lane: the gate counts permits, not lanes
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]
    assert gate.running == 1


def test_the_gate_shares_by_weight() -> None:
    gate = FairShareGate(1)
    heavy, light = gate.lane(3.0), gate.lane(1.0)
    log: list[str] = []
    heavy.request(_tickets(gate, log, "start"))
    for i in range(12):
        heavy.request(_tickets(gate, log, f"h{i}"))
        light.request(_tickets(gate, log, f"l{i}"))
    for _ in range(12):
        heavy.release(None)
    grants = log[1:]
    heavy_share = sum(name.startswith("h") for name in grants)
    assert 8 <= heavy_share <= 10  # 3 : 1 of 12 starts, give or take the first
    assert heavy_share + sum(name.startswith("l") for name in grants) == 12


def test_a_grant_to_a_ticket_that_left_passes_the_permit_on() -> None:
    gate = FairShareGate(1)
    lane = gate.lane(1.0)
    log: list[str] = []
    lane.request(_tickets(gate, log, "holder"))
    gone = AdmissionTicket(lambda permit: lane.release(permit), "gone")
    lane.request(gone)
    lane.request(_tickets(gate, log, "next"))
    gone._waiter.cancel()  # left without withdrawing (the withdrawal is racing)
    lane.release(None)  # the holder ends: "gone" gets the permit, gives it back, "next" runs
    assert log == ["holder", "next"]
    assert gate.running == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["request", "cancel", "finish"]), st.integers(0, 5)),
        max_size=50,
    )
)
def test_the_gate_never_exceeds_its_limit_nor_loses_a_permit(ops: list[tuple[str, int]]) -> None:
    """A model check: permits out == tickets granted and not yet finished, always <= limit."""
    limit = 2
    gate = FairShareGate(limit)
    lanes = [gate.lane(w) for w in (1.0, 2.0, 3.0)]
    live: list[tuple[AdmissionTicket, Admission]] = []  # requested, not finished nor cancelled

    for op, i in ops:
        if op == "request":
            lane = lanes[i % 3]
            ticket = AdmissionTicket(lane.release, None)
            live.append((ticket, lane))
            lane.request(ticket)
        elif op == "cancel" and live:
            ticket, lane = live.pop(i % len(live))
            if ticket._waiter.cancel() == 0:  # PENDING: take it out of the queue
                lane.withdraw(ticket)  # GRANTED: the waiter has given the permit back
        elif op == "finish":
            granted = [(t, lane) for t, lane in live if t._waiter.state == 1]
            if granted:
                ticket, lane = granted[i % len(granted)]
                live.remove((ticket, lane))
                assert ticket._waiter.take() is ticket
                lane.release(ticket.permit)  # the job ended
        out = sum(1 for t, _ in live if t._waiter.state == 1)
        assert gate.running == out <= limit
        # no ticket waits while a permit is free
        if gate.running < limit:
            assert all(t._waiter.state == 1 for t, _ in live)
