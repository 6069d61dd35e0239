"""Hypothesis models of the fleet permit table against the implementations.

Two machines:

* ``PermitLimits`` on the memory store with a controllable clock: grant, release, expire
  (the clock moves), keep-alive (extend) and crash (a holder that never releases) against an
  independent model of what must hold: never more than the limits out, never a token reused
  or smaller than an earlier one, a full grant whenever nobody else waits, release and extend
  exactly as the model says, and nothing left once everything is released.
* ``SameAsReference`` on every backend: the same random steps on the store and on the
  reference ``PermitGroup`` (no expiry: long durations), with equal answers (grant counts,
  running counts, release counts, lost tokens): the Lua scripts, the PL/pgSQL functions and
  the SQLite transactions implement the table the reference defines, fairness included.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from rxcoord.leases import LeaseProvider, MemoryLeases, MemoryLeaseStore
from rxcoord.leases._permits import PermitGroup

from .conftest import Backend

TENANTS = ("a", "b", "c")
LIMIT = 4
TENANT_LIMIT = 2
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5}
GROUP_RATE = (1e4, 5)  # (interval s, burst): see SameAsReference.acquire
TENANT_RATES = {"a": (1e4, 2), "b": None, "c": (1e4, 1)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PermitLimits(RuleBasedStateMachine):
    """The table's promises, on the memory store, with time."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store = MemoryLeaseStore(clock=self.clock)
        self.provider = MemoryLeases(self.store)
        self.group = "g"
        self.held: dict[int, tuple[str, float]] = {}  # token -> (tenant, until): the model
        self.orphans: set[int] = set()  # held by a crashed holder: never released
        self.waiting: dict[str, float] = {}  # tenant -> demand until
        self.last_token = 0

    def _expire(self) -> None:
        now = self.clock.now
        for token, (_, until) in list(self.held.items()):
            if until <= now:
                del self.held[token]
                self.orphans.discard(token)
        self.waiting = {t: u for t, u in self.waiting.items() if u > now}

    def _count(self, tenant: str) -> int:
        return sum(1 for owner, _ in self.held.values() if owner == tenant)

    @rule(
        tenant=st.sampled_from(TENANTS),
        want=st.integers(0, 3),
        more=st.booleans(),
        most=st.sampled_from([1.0, 5.0]),
    )
    def acquire(self, tenant: str, want: int, more: bool, most: float) -> None:
        self._expire()
        running = len(self.held)
        mine = self._count(tenant)
        room = max(0, min(want, TENANT_LIMIT - mine, LIMIT - running))
        others_wait = any(t != tenant for t in self.waiting)
        reply = self.provider._permits_acquire(
            self.group, tenant, want, WEIGHTS[tenant], TENANT_LIMIT, LIMIT, most, 2.0, more
        )
        assert len(reply.tokens) <= room, "granted beyond a limit"
        if not others_wait:
            assert len(reply.tokens) == room, "nobody else waits: the grant must be whole"
        assert all(t > self.last_token for t in reply.tokens), "tokens must grow"
        assert list(reply.tokens) == sorted(set(reply.tokens))
        if reply.tokens:
            self.last_token = reply.tokens[-1]
        for token in reply.tokens:
            self.held[token] = (tenant, self.clock.now + most)
        assert reply.running == len(self.held)
        assert reply.tenant_running == self._count(tenant)
        if len(reply.tokens) < want or more:
            self.waiting[tenant] = max(self.waiting.get(tenant, 0.0), self.clock.now + 2.0)
        else:
            self.waiting.pop(tenant, None)
        if len(reply.tokens) < want and self.held:
            assert reply.wake_in is not None
            assert reply.wake_in <= max(u for _, u in self.held.values()) - self.clock.now

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._expire()
        live = sorted(set(self.held) - self.orphans)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
        stale = data.draw(st.lists(st.integers(1, max(1, self.last_token)), max_size=2))
        pairs = [(t, self.held[t][0]) for t in chosen]
        pairs += [(t, "a") for t in stale if t not in self.held]
        expected = len(chosen)
        assert self.provider._permits_release(self.group, pairs) == expected
        for token in chosen:
            del self.held[token]

    @rule(data=st.data(), most=st.sampled_from([1.0, 5.0]))
    def keep_alive(self, data: st.DataObject, most: float) -> None:
        self._expire()
        live = sorted(self.held)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
        gone = data.draw(st.lists(st.integers(1, max(1, self.last_token)), max_size=2, unique=True))
        gone = [t for t in gone if t not in self.held]
        pairs = [(t, self.held[t][0]) for t in chosen] + [(t, "b") for t in gone]
        lost = self.provider._permits_extend(self.group, pairs, most)
        assert sorted(lost) == sorted(set(gone))
        for token in chosen:
            self.held[token] = (self.held[token][0], self.clock.now + most)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        live = sorted(set(self.held) - self.orphans)
        if live:
            self.orphans.update(data.draw(st.lists(st.sampled_from(live), unique=True)))

    @invariant()
    def within_limits(self) -> None:
        self._expire()
        assert len(self.held) <= LIMIT
        for tenant in TENANTS:
            assert self._count(tenant) <= TENANT_LIMIT

    def teardown(self) -> None:
        self._expire()
        live = sorted(set(self.held) - self.orphans)
        self.provider._permits_release(self.group, [(t, self.held[t][0]) for t in live])
        for tenant in TENANTS:
            self.provider._permits_acquire(
                self.group, tenant, 0, 1.0, TENANT_LIMIT, LIMIT, 1.0, 2.0, False
            )
        self.clock.now += 10.0  # the orphans expire
        self.provider._permits_acquire(
            self.group, "a", 0, 1.0, TENANT_LIMIT, LIMIT, 1.0, 2.0, False
        )
        assert self.store.permit_groups() == 0, "an idle group must leave nothing behind"
        self.provider.close()


def test_the_permit_table_keeps_its_promises() -> None:
    run_state_machine_as_test(
        PermitLimits,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None),
    )


class SameAsReference(RuleBasedStateMachine):
    """A backend and the reference table, step by step, must answer alike."""

    provider: LeaseProvider

    def __init__(self) -> None:
        super().__init__()
        self.group = f"m-{uuid.uuid4().hex[:10]}"
        self.reference = PermitGroup()
        counter = itertools.count(1)
        self.next_token = lambda: next(counter)
        self.held: dict[int, tuple[str, int]] = {}  # store token -> (tenant, reference token)
        self.rated = False  # a grant took rate tokens: the group keeps its buckets (1e4 s)

    @initialize()
    def start(self) -> None:
        assert self.provider is not None

    @rule(
        tenant=st.sampled_from(TENANTS),
        want=st.integers(0, 3),
        more=st.booleans(),
        rated=st.booleans(),
    )
    def acquire(self, tenant: str, want: int, more: bool, rated: bool) -> None:
        args: tuple[Any, ...] = (
            tenant,
            want,
            WEIGHTS[tenant],
            TENANT_LIMIT,
            LIMIT,
            600.0,
            600.0,
            more,
        )
        # Rates so slow that no token comes back during a run (the reference's clock stands
        # still, the store's moves a few ms): bursts, per-tenant buckets, and no reservation
        # for a tenant over its own rate must come out alike.
        rates: dict[str, Any] = (
            {"rate": GROUP_RATE, "tenant_rate": TENANT_RATES[tenant]} if rated else {}
        )
        reply = self.provider._permits_acquire(self.group, *args, **rates)
        self.rated = self.rated or bool(rated and reply.tokens)
        expected, _ = self.reference.acquire(0.0, self.next_token, *args, *rates.values())
        assert len(reply.tokens) == len(expected.tokens)
        assert (reply.running, reply.tenant_running) == (expected.running, expected.tenant_running)
        assert (reply.wake_in is None) == (expected.wake_in is None)
        assert (reply.rate_wait > 0) == (expected.rate_wait > 0)
        assert (reply.group_rate_wait > 0) == (expected.group_rate_wait > 0)
        for token, ref in zip(reply.tokens, expected.tokens, strict=True):
            self.held[token] = (tenant, ref)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = sorted(self.held)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
        got = self.provider._permits_release(self.group, [(t, self.held[t][0]) for t in chosen])
        want = self.reference.release(0.0, [(self.held[t][1], self.held[t][0]) for t in chosen])
        assert got == want == len(chosen)
        for token in chosen:
            del self.held[token]

    @rule(data=st.data())
    def keep_alive(self, data: st.DataObject) -> None:
        live = sorted(self.held)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
        assert (
            self.provider._permits_extend(self.group, [(t, self.held[t][0]) for t in chosen], 600.0)
            == []
        )

    def teardown(self) -> None:
        self.provider._permits_release(self.group, [(t, p[0]) for t, p in self.held.items()])
        for tenant in TENANTS:
            self.provider._permits_acquire(
                self.group, tenant, 0, 1.0, TENANT_LIMIT, LIMIT, 600.0, 600.0, False
            )
        type(self).rated_groups += self.rated

    rated_groups = 0  # groups left holding rate buckets only (one record each)


def test_every_backend_implements_the_reference_table(backend: Backend) -> None:
    provider = backend.new()
    before = backend.records()

    class Machine(SameAsReference):
        pass

    Machine.provider = provider
    examples = 60 if backend.id == "memory" else 15
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    # Beyond the token sequence (one record; on a Redis Cluster one per hash slot used, i.e.
    # at most one per group here) and the rate buckets of groups that took rate tokens (one
    # record each: they stay until full again, 1e4 s), idle groups leave nothing behind.
    kept = Machine.rated_groups
    assert backend.records() <= before + min(examples, backend.bookkeeping) + kept, "a leak"


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
