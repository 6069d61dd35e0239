"""The fleet permit table's contract (rxcoord/leases/_permits.py), on every backend.

These call the three store primitives directly: what a fleet admission builds on. Each test
is one promise of the table: limits in one atomic step, tokens from the store-wide sequence,
the stride rule's reservation for a tenant further behind, demand that expires, permits that
expire and can be extended, notifications on release, and nothing left once a group is idle.
Rates (the group's and a tenant's, ``(interval, burst)``) are granted in the same step, on the
store's clock: the bound per step, the wait the store reports, no reservation for a tenant
over its own rate, group tokens reserved for a tenant further behind, and rate state and
abandoned groups that leave the store once expired.
"""

from __future__ import annotations

import time
import uuid

import pytest
from support.waiting import wait_until

from rxcoord.leases import LeaseProvider
from rxcoord.leases._permits import PermitReply, RateArgs, hub_name

from .conftest import Backend

LONG = 60.0  # seconds: a permit or demand that must not expire during a test


def acquire(
    provider: LeaseProvider,
    group: str,
    tenant: str,
    want: int = 1,
    *,
    weight: float = 1.0,
    tenant_limit: int = 10,
    limit: int = 10,
    most: float = LONG,
    demand_for: float = LONG,
    more: bool = False,
    rate: RateArgs | None = None,
    tenant_rate: RateArgs | None = None,
) -> PermitReply:
    return provider._permits_acquire(
        group,
        tenant,
        want,
        weight,
        tenant_limit,
        limit,
        most,
        demand_for,
        more,
        rate=rate,
        tenant_rate=tenant_rate,
    )


def _sequence_record(backend: Backend) -> int:
    """The records the group's first token may add: its sequence's (bookkeeping, not state).

    Each test has a fresh namespace, so the sequence's row or key (SQLite's row, Redis's
    ``seq`` key, on a cluster the one of the group's hash slot) may be created by the test's
    first grant; it stays, as it does for leases. Anything more is the group left behind.
    """
    return min(1, backend.bookkeeping)


@pytest.fixture
def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def settled(backend: Backend, provider: LeaseProvider, group: str) -> int:
    """The store's records once the provider has set it up (SQLite's sequence row is created
    with the schema, on first use): the baseline an idle group must return to."""
    acquire(provider, group, "nobody", 0)  # wants nothing: changes nothing
    return backend.records()


def test_uncontended_grant_and_release(backend: Backend, group: str) -> None:
    provider = backend.new()
    before = settled(backend, provider, group)
    reply = acquire(provider, group, "a")
    assert len(reply.tokens) == 1
    assert reply.tokens[0] > 0
    assert (reply.running, reply.tenant_running) == (1, 1)
    assert provider._permits_release(group, [(reply.tokens[0], "a")]) == 1
    assert backend.records() <= before + _sequence_record(backend), (
        "an idle group must leave nothing in the store"
    )


def test_tokens_come_from_the_store_wide_sequence(backend: Backend, group: str) -> None:
    # A Redis Cluster has a sequence per hash slot instead, and one script reaches one slot:
    # there the order holds among grants of one slot (the group's permits, and leases whose
    # keys share it), which tests/leases/test_permits_redis.py checks.
    store_wide = backend.id != "redis-cluster"
    provider = backend.new()
    lease = provider.try_acquire(f"lease-{group}", 30.0)
    assert lease is not None
    first = acquire(provider, group, "a", 2).tokens
    assert len(first) == 2
    if store_wide:
        assert min(first) > lease.token, "a permit's token must exceed every earlier grant's"
    assert first[1] > first[0]
    lease.release()
    later = provider.try_acquire(f"lease-{group}", 30.0)
    assert later is not None
    if store_wide:
        assert later.token > max(first)
    later.release()
    again = acquire(provider, group, "a", 1).tokens
    assert again[0] > max(first), "a group's tokens increase from call to call"
    provider._permits_release(group, [(t, "a") for t in (*first, *again)])


def test_global_limit_holds_across_tenants(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 2, limit=3)
    b = acquire(provider, group, "b", 5, limit=3)
    assert len(a.tokens) == 2
    assert len(b.tokens) == 1, "only one of the three permits was left"
    assert b.running == 3
    assert b.wake_in is not None
    assert 0 < b.wake_in <= LONG
    c = acquire(provider, group, "c", 1, limit=3)
    assert c.tokens == ()
    provider._permits_release(group, [(t, "a") for t in a.tokens])
    provider._permits_release(group, [(t, "b") for t in b.tokens])
    acquire(provider, group, "b", 0)  # withdraw the demand left behind
    acquire(provider, group, "c", 0)


def test_tenant_limit_holds(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 5, tenant_limit=2, limit=10)
    assert len(a.tokens) == 2
    assert a.tenant_running == 2
    again = acquire(provider, group, "a", 1, tenant_limit=2, limit=10)
    assert again.tokens == ()
    b = acquire(provider, group, "b", 1, tenant_limit=2, limit=10)
    assert len(b.tokens) == 1, "another tenant is not held back by a's limit"
    assert b.running == 3
    provider._permits_release(group, [(t, "a") for t in a.tokens] + [(b.tokens[0], "b")])
    acquire(provider, group, "a", 0)


def test_a_freed_permit_is_reserved_for_the_tenant_furthest_behind(
    backend: Backend, group: str
) -> None:
    provider = backend.new()
    # a takes the only permit and wants more: its pass is ahead of b, who then waits too.
    a = acquire(provider, group, "a", 1, limit=1, more=True)
    assert len(a.tokens) == 1
    assert acquire(provider, group, "b", 1, limit=1).tokens == ()
    assert provider._permits_release(group, [(a.tokens[0], "a")]) == 1
    # a asks first, but b is behind its share: the free permit is b's.
    assert acquire(provider, group, "a", 1, limit=1).tokens == ()
    b = acquire(provider, group, "b", 1, limit=1)
    assert len(b.tokens) == 1
    provider._permits_release(group, [(b.tokens[0], "b")])
    # b has no demand left: a gets the next one.
    a2 = acquire(provider, group, "a", 1, limit=1)
    assert len(a2.tokens) == 1
    provider._permits_release(group, [(a2.tokens[0], "a")])


def test_weights_give_proportional_starts(backend: Backend, group: str) -> None:
    provider = backend.new()
    starts = {"heavy": 0, "light": 0}
    held: dict[str, list[int]] = {"heavy": [], "light": []}
    weights = {"heavy": 3.0, "light": 1.0}
    # Both tenants always want one more; one permit; each round, release and let both ask.
    for _ in range(40):
        for tenant in ("light", "heavy"):
            reply = acquire(provider, group, tenant, 1, weight=weights[tenant], limit=1, more=True)
            if reply.tokens:
                starts[tenant] += 1
                held[tenant].extend(reply.tokens)
        for tenant in held:
            provider._permits_release(group, [(t, tenant) for t in held[tenant]])
            held[tenant] = []
    assert starts["heavy"] + starts["light"] >= 35
    ratio = starts["heavy"] / max(1, starts["light"])
    assert 2.0 <= ratio <= 4.5, starts
    acquire(provider, group, "heavy", 0)
    acquire(provider, group, "light", 0)


def test_a_reservation_ends_when_the_demand_is_withdrawn(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 1, limit=1, more=True)
    assert acquire(provider, group, "b", 1, limit=1).tokens == ()
    provider._permits_release(group, [(a.tokens[0], "a")])
    acquire(provider, group, "b", 0)  # b's job left: it wants nothing any more
    again = acquire(provider, group, "a", 1, limit=1)
    assert len(again.tokens) == 1
    provider._permits_release(group, [(again.tokens[0], "a")])


def test_a_reservation_ends_when_the_demand_expires(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 1, limit=1, more=True)
    # b waits with a short-lived demand: it crashed and stops refreshing it.
    blocked = acquire(provider, group, "b", 1, limit=1, demand_for=0.3)
    assert blocked.tokens == ()
    provider._permits_release(group, [(a.tokens[0], "a")])
    assert acquire(provider, group, "a", 1, limit=1, more=True).tokens == ()
    granted: list[int] = []

    def a_gets_it() -> bool:
        granted.extend(acquire(provider, group, "a", 1, limit=1).tokens)
        return bool(granted)

    wait_until(a_gets_it, 5.0, "b's expired demand to stop reserving the permit")
    provider._permits_release(group, [(granted[0], "a")])


def test_a_waiter_below_its_own_limit_only_reserves(backend: Backend, group: str) -> None:
    provider = backend.new()
    # b is at its tenant limit: its demand must not hold a global permit back from a.
    b = acquire(provider, group, "b", 2, tenant_limit=1, limit=3)
    assert len(b.tokens) == 1
    a = acquire(provider, group, "a", 2, tenant_limit=5, limit=3)
    assert len(a.tokens) == 2
    provider._permits_release(group, [(b.tokens[0], "b")] + [(t, "a") for t in a.tokens])
    acquire(provider, group, "b", 0)


def test_permits_expire_by_the_store_clock(backend: Backend, group: str) -> None:
    provider = backend.new()
    short = acquire(provider, group, "a", 1, limit=1, most=0.3)
    assert len(short.tokens) == 1
    blocked = acquire(provider, group, "b", 1, limit=1)
    assert blocked.tokens == ()
    assert blocked.wake_in is not None
    assert blocked.wake_in <= 0.3
    granted: list[int] = []

    def b_gets_it() -> bool:
        granted.extend(acquire(provider, group, "b", 1, limit=1).tokens)
        return bool(granted)

    wait_until(b_gets_it, 5.0, "the expired permit to be reclaimed")
    assert granted[0] > short.tokens[0]
    assert provider._permits_release(group, [(short.tokens[0], "a")]) == 0, "it had expired"
    assert provider._permits_extend(group, [(short.tokens[0], "a")], LONG) == [short.tokens[0]]
    provider._permits_release(group, [(granted[0], "b")])


def test_extend_keeps_a_permit_alive(backend: Backend, group: str) -> None:
    provider = backend.new()
    reply = acquire(provider, group, "a", 1, most=0.5)
    token = reply.tokens[0]
    for _ in range(4):
        time.sleep(0.2)
        assert provider._permits_extend(group, [(token, "a")], 0.5) == []
    assert provider._permits_release(group, [(token, "a")]) == 1, "extended past 0.5 s"
    assert provider._permits_extend(group, [(token, "a")], 0.5) == [token]


def test_release_checks_the_tenant_too(backend: Backend, group: str) -> None:
    provider = backend.new()
    reply = acquire(provider, group, "a")
    assert provider._permits_release(group, [(reply.tokens[0], "b")]) == 0
    assert provider._permits_release(group, [(reply.tokens[0], "a")]) == 1
    assert provider._permits_release(group, [(reply.tokens[0], "a")]) == 0, "released twice"


def test_a_release_notifies_the_groups_waiters(backend: Backend, group: str) -> None:
    provider = backend.new()
    other = backend.new()
    watch = other._hub.watch(hub_name(group))
    try:
        if backend.notifies:
            wait_until(lambda: watch.confirmed, 10.0, "the subscription")
        reply = acquire(provider, group, "a")
        provider._permits_release(group, [(reply.tokens[0], "a")])
        if backend.notifies:
            assert watch.wait(5.0), "the release did not reach the other provider's waiters"
    finally:
        watch.close()


def test_idle_tenants_leave_nothing_behind(backend: Backend, group: str) -> None:
    provider = backend.new()
    before = settled(backend, provider, group)
    held = [(acquire(provider, group, f"t{i}", limit=3).tokens, f"t{i}") for i in range(3)]
    for i in range(3, 8):
        assert acquire(provider, group, f"t{i}", limit=3).tokens == ()
    for tokens, tenant in held:
        provider._permits_release(group, [(t, tenant) for t in tokens])
    for i in range(3, 8):
        acquire(provider, group, f"t{i}", 0)  # every waiter left
    assert backend.records() <= before + _sequence_record(backend)


# -- rates ------------------------------------------------------------------------------------

SLOW: RateArgs = (1000.0, 3)  # a start per 1000 s, 3 back to back: no token comes back in a test


def release_all(provider: LeaseProvider, group: str, *replies: tuple[str, PermitReply]) -> None:
    provider._permits_release(
        group, [(token, tenant) for tenant, reply in replies for token in reply.tokens]
    )


def test_a_group_rate_bounds_the_grants_of_one_step(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 5, rate=SLOW)
    assert len(a.tokens) == 3, "the burst, and no more, in one step"
    assert a.rate_wait == a.group_rate_wait
    assert 990 <= a.rate_wait <= 1000 + 1e-6, "the store says when the next token comes"
    b = acquire(provider, group, "b", 1, rate=SLOW)
    assert b.tokens == (), "the group's rate counts every tenant's starts"
    assert 990 <= b.group_rate_wait <= 1000 + 1e-6  # (floating point: the clock is large)
    release_all(provider, group, ("a", a))
    again = acquire(provider, group, "a", 1, rate=SLOW)
    assert again.tokens == (), "a rate counts starts, not jobs running: a release gives none"
    assert a.at <= b.at <= again.at, "each reply carries the store's clock"
    acquire(provider, group, "a", 0)
    acquire(provider, group, "b", 0)


def test_a_tenant_rate_bounds_its_tenant_only(backend: Backend, group: str) -> None:
    provider = backend.new()
    a = acquire(provider, group, "a", 3, tenant_rate=(1000.0, 2))
    assert len(a.tokens) == 2
    assert a.group_rate_wait == 0.0
    assert 990 <= a.rate_wait <= 1000 + 1e-6
    b = acquire(provider, group, "b", 3, tenant_rate=(1000.0, 2))
    assert len(b.tokens) == 2, "another tenant has a bucket of its own"
    release_all(provider, group, ("a", a), ("b", b))
    assert acquire(provider, group, "a", 1, tenant_rate=(1000.0, 2)).tokens == ()
    assert len(acquire(provider, group, "c", 1, tenant_rate=(1000.0, 2)).tokens) == 1
    acquire(provider, group, "a", 0)


def test_a_waiter_asking_when_the_store_said_gets_its_start(backend: Backend, group: str) -> None:
    provider = backend.new()
    rate: RateArgs = (0.3, 1)
    first = acquire(provider, group, "a", 1, rate=rate)
    assert len(first.tokens) == 1
    second = acquire(provider, group, "a", 1, rate=rate)
    assert second.tokens == ()
    assert 0.0 < second.rate_wait <= 0.3
    # The store's wait is enough: asking after it (plus the 1 ms resolution of SQLite's
    # clock) gets the start, in one round trip, never earlier than the rate allows.
    time.sleep(second.rate_wait + 0.002)
    third = acquire(provider, group, "a", 1, rate=rate)
    assert len(third.tokens) == 1
    assert third.at - first.at >= 0.3 - 1e-6
    release_all(provider, group, ("a", first), ("a", third))
    acquire(provider, group, "a", 0)


def test_a_tenant_over_its_own_rate_reserves_nothing(backend: Backend, group: str) -> None:
    """No head-of-line blocking in the store: 'a' is further behind its share than 'b' and
    waits, but for its own rate: the free permit is b's. Once a is within its rate again, its
    demand reserves the permit as any tenant's does. (Both always have more jobs waiting, so
    both keep their passes.)"""
    provider = backend.new()
    own: RateArgs = (0.4, 1)

    def a_asks() -> PermitReply:
        return acquire(provider, group, "a", 1, weight=100.0, limit=1, more=True, tenant_rate=own)

    def b_asks() -> PermitReply:
        return acquire(provider, group, "b", 1, limit=1, more=True)

    b = b_asks()
    assert len(b.tokens) == 1
    release_all(provider, group, ("b", b))
    a = a_asks()
    assert len(a.tokens) == 1, "a is not behind b yet"
    release_all(provider, group, ("a", a))
    blocked = a_asks()
    assert blocked.tokens == ()
    assert blocked.rate_wait > 0
    b = b_asks()
    assert len(b.tokens) == 1, "a is behind b but waits for its own rate: b must not wait for it"
    release_all(provider, group, ("b", b))
    time.sleep(blocked.rate_wait + 0.01)
    assert b_asks().tokens == (), "a is within its rate again: the permit is reserved for it"
    a = a_asks()
    assert len(a.tokens) == 1
    release_all(provider, group, ("a", a))
    acquire(provider, group, "a", 0)
    acquire(provider, group, "b", 0)


def test_group_tokens_are_reserved_for_a_tenant_further_behind(
    backend: Backend, group: str
) -> None:
    provider = backend.new()
    rate: RateArgs = (0.3, 1)
    b = acquire(provider, group, "b", 1, rate=rate)
    assert len(b.tokens) == 1
    a = acquire(provider, group, "a", 1, weight=100.0, rate=rate)
    assert a.tokens == ()
    assert 0 < a.group_rate_wait <= 0.3
    time.sleep(a.group_rate_wait + 0.01)
    refused = acquire(provider, group, "b", 1, rate=rate)
    assert refused.tokens == (), "the group's next token is a's: it is further behind"
    assert refused.wake_in is not None
    assert refused.wake_in <= 0.3 + 1e-3, "b is told to look again at the token after it"
    a2 = acquire(provider, group, "a", 1, weight=100.0, rate=rate)
    assert len(a2.tokens) == 1
    release_all(provider, group, ("b", b), ("a", a2))
    acquire(provider, group, "b", 0)


def primed(backend: Backend, provider: LeaseProvider, group: str) -> int:
    """The store's records once the group's token sequence exists (a grant made it, and it
    stays: bookkeeping, as for leases) and the group itself is idle again."""
    reply = acquire(provider, group, "prime")
    release_all(provider, group, ("prime", reply))
    return backend.records()


def test_rate_state_leaves_the_store_once_full_again(backend: Backend, group: str) -> None:
    provider = backend.new()
    before = primed(backend, provider, group)
    rate: RateArgs = (1.5, 1)
    reply = acquire(provider, group, "a", 1, rate=rate, tenant_rate=rate)
    release_all(provider, group, ("a", reply))
    assert backend.records() > before, "the buckets outlive the permit: a release keeps a rate"
    time.sleep(1.55)
    if backend.name == "redis":  # expired by Redis itself (the key's TTL), no call needed
        assert backend.records() == before
    acquire(provider, group, "a", 0, rate=rate, tenant_rate=rate)  # the next call passing by
    assert backend.records() == before


def test_abandoned_groups_leave_the_store(backend: Backend, group: str) -> None:
    """A member crashed holding a permit, with demand and rate state, and nobody calls the
    group again: once everything in it expired it goes (Redis: key expiry; the others: swept
    by a later call on any group, at most every second)."""
    provider = backend.new()
    before = primed(backend, provider, group)
    crashed = acquire(provider, group, "a", 2, limit=1, most=0.4, demand_for=0.4, rate=(0.4, 1))
    assert len(crashed.tokens) == 1
    assert backend.records() > before
    other = f"{group}-other"

    def gone() -> bool:
        acquire(provider, other, "z", 0)  # some call on another group
        return backend.records() == before

    time.sleep(0.5)
    wait_until(gone, 10.0, "the abandoned group to be swept")
