"""The fleet permit table on Redis: what the contract suite cannot see from outside.

The Lua scripts are checked against the reference implementation (``PermitGroup``) step by
step, down to the bits of every pass; names of any shape stay in one hash slot; each step is
one round trip; tokens on a cluster follow the slot's sequence.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.stores import redis_client
from support.waiting import wait_until

from rxcoord.leases import RedisLeases
from rxcoord.leases._permits import PermitGroup, PermitReply, hub_name

from .conftest import STORES, Backend

LONG = 1e6  # seconds: nothing expires during a test (the reference's clock stands still)


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.backend),
        pytest.param("redis-cluster", marks=pytest.mark.backend),
    ]
)
def redis_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    result = STORES[request.param](request, tmp_path, uuid.uuid4().hex[:12])
    try:
        yield result
    finally:
        for provider in result.providers:
            provider.close()


def _client(backend: Backend) -> Any:
    """A plain redis-py client on the backend's server or cluster (reads the keys directly)."""
    assert backend.url is not None
    return redis_client(backend.url, cluster=backend.id == "redis-cluster")


def _provider(backend: Backend) -> RedisLeases:
    provider = backend.new()
    assert isinstance(provider, RedisLeases)
    return provider


def _stored(client: Any, keys: tuple[str, str, str]) -> dict[str, Any]:
    """One group's table as Redis holds it, in PermitGroup's terms."""
    permits_key, demand_key, state_key = keys
    permits = {}
    for member in client.zrange(permits_key, 0, -1):
        token, _, tenant = member.decode().partition(":")
        permits[int(token)] = tenant
    state = {field.decode(): value.decode() for field, value in client.hgetall(state_key).items()}
    kinds: dict[str, dict[str, str]] = {"n": {}, "p": {}, "l": {}, "q": {}}
    for field, value in state.items():
        if field not in ("c", "r", "d", "x"):  # x: the keys' expiry (test_permits_expiry.py)
            kinds[field[0]][field[1:]] = value
    if state:  # the counters are the sets' sizes
        assert int(state["r"]) == client.zcard(permits_key)
        assert int(state["d"]) == client.zcard(demand_key)
    demand = {member.decode() for member in client.zrange(demand_key, 0, -1)}
    return {
        "permits": permits,
        "counts": {tenant: int(n) for tenant, n in kinds["n"].items()},
        "passes": {tenant: float(p) for tenant, p in kinds["p"].items()},
        "limits": {tenant: int(n) for tenant, n in kinds["l"].items()},
        "demand": demand,
        "clock": float(state.get("c", 0.0)),
        "keys": sum(int(client.exists(key)) for key in keys),
    }


def _expected(table: PermitGroup) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for tenant, _ in table.permits.values():
        counts[tenant] = counts.get(tenant, 0) + 1
    return {
        "permits": {token: tenant for token, (tenant, _) in table.permits.items()},
        "counts": counts,
        "passes": table.passes,
        "limits": table.limits,
        "demand": set(table.demand),
        "clock": table.clock,
        # The state hash exists while the group does (every tenant in it has a pass).
        "keys": bool(table.permits) + bool(table.demand) + (not table.empty),
    }


def test_the_scripts_step_like_the_reference(redis_backend: Backend) -> None:
    """Random steps on Redis and on PermitGroup, compared after each: replies and state.

    The reference takes Redis's tokens as its own, so the tables must match exactly: permits,
    counts, limits, demand, and every pass and the clock to the last bit (weights like 0.7
    make them inexact binary fractions).
    """
    provider = _provider(redis_backend)
    group = f"g:{{{uuid.uuid4().hex[:6]}"  # a ':' and a '{' in the name too
    keys = provider._permit_keys(group)
    rng = random.Random(20261201)
    tenants = ["a", "b:c", "", "\u00fc\0x", "t:1:2"]
    weights = [1.0, 3.0, 0.7, 1 / 3]
    table = PermitGroup()
    held: list[tuple[int, str]] = []
    client = _client(redis_backend)
    try:
        for step in range(300):
            kind = rng.choices(["acquire", "release", "extend"], [6, 3, 1])[0]
            if kind == "acquire":
                args = (
                    rng.choice(tenants),
                    rng.choice([0, 1, 1, 2, 3]),
                    rng.choice(weights),
                    rng.choice([1, 2, 3]),
                    rng.choice([3, 4, 4, 6]),
                    LONG,
                    LONG,
                    rng.random() < 0.4,
                )
                reply = provider._permits_acquire(group, *args)
                expected, _ = table.acquire(0.0, iter(reply.tokens).__next__, *args)
                assert reply.tokens == expected.tokens, step
                assert (reply.running, reply.tenant_running) == (
                    expected.running,
                    expected.tenant_running,
                ), step
                assert (reply.wake_in is None) == (expected.wake_in is None), step
                if reply.wake_in is not None:
                    assert 0 < reply.wake_in <= LONG
                held += [(token, args[0]) for token in reply.tokens]
            else:
                chosen = rng.sample(held, min(len(held), rng.choice([1, 1, 2])))
                if rng.random() < 0.3:  # a pair whose tenant is wrong, or one gone already
                    chosen.append((rng.randrange(1, 10_000), rng.choice(tenants)))
                if kind == "release":
                    count = provider._permits_release(group, chosen)
                    assert count == table.release(0.0, chosen), step
                    held = [pair for pair in held if pair not in chosen]
                else:
                    lost = provider._permits_extend(group, chosen, LONG)
                    assert lost == table.extend(0.0, chosen, LONG), step
            if table.empty:
                table = PermitGroup()  # as the memory store drops an idle group
            assert _stored(client, keys) == _expected(table), step
    finally:
        client.close()


@pytest.mark.parametrize("step", ["acquire", "release", "extend"])
def test_every_step_expires_like_the_reference(redis_backend: Backend, step: str) -> None:
    """Expired permits and demand are dropped, and tenants left idle forgotten, by any step."""
    provider = _provider(redis_backend)
    group = f"g-{uuid.uuid4().hex[:8]}"
    table = PermitGroup()
    short = 0.5
    setup = [  # tenant, want, weight, tenant limit, limit, most, demand_for, more
        ("a", 2, 1.0, 5, 4, short, LONG, False),  # short permits: a is forgotten after
        ("b", 3, 0.7, 5, 4, LONG, short, False),  # long permits, short demand: b keeps its pass
        ("c", 1, 3.0, 5, 4, LONG, LONG, False),  # long demand: c still waits
        ("d", 1, 1.0, 5, 4, LONG, short, False),  # short demand only: d is forgotten after
    ]
    held = []
    for args in setup:
        reply = provider._permits_acquire(group, *args)
        table.acquire(0.0, iter(reply.tokens).__next__, *args)
        held += [(token, args[0]) for token in reply.tokens]
    assert len(table.permits) == 4
    assert set(table.demand) == {"b", "c", "d"}
    time.sleep(2 * short)
    later = 100.0  # the reference's clock: past the short ones, far before the long ones
    if step == "acquire":
        args = ("e", 1, 1.0, 5, 4, LONG, LONG, False)
        reply = provider._permits_acquire(group, *args)
        expected, _ = table.acquire(later, iter(reply.tokens).__next__, *args)
        assert len(reply.tokens) == len(expected.tokens) == 1
    elif step == "release":
        freed = held[:3]  # a's two (expired) and one of b's
        assert provider._permits_release(group, freed) == table.release(later, freed) == 1
    else:
        lost = provider._permits_extend(group, held, LONG)
        assert lost == table.extend(later, held, LONG) == [token for token, _ in held[:2]]
    assert set(table.passes) >= {"b", "c"}
    assert "a" not in table.passes
    assert "d" not in table.passes
    client = _client(redis_backend)
    try:
        assert _stored(client, provider._permit_keys(group)) == _expected(table)
    finally:
        client.close()


@pytest.mark.parametrize("group", ["", "}x", "{a}b", "a}b{c", "x:y", "\0fleet"])
def test_group_and_tenant_names_of_any_shape(redis_backend: Backend, group: str) -> None:
    provider = _provider(redis_backend)
    before = redis_backend.records()
    tenants = ["", ":", "9:9", "{t}", "\0"]
    replies = {
        tenant: provider._permits_acquire(group, tenant, 2, 1.0, 2, 20, LONG, LONG, False)
        for tenant in tenants
    }
    assert all(len(reply.tokens) == 2 for reply in replies.values())
    pairs = [(token, tenant) for tenant, reply in replies.items() for token in reply.tokens]
    assert provider._permits_extend(group, pairs, LONG) == []
    waiting = provider._permits_acquire(group, "late", 1, 1.0, 1, 10, LONG, LONG, False)
    assert waiting.tokens == ()
    assert waiting.running == 10
    assert provider._permits_release(group, pairs) == 10
    provider._permits_acquire(group, "late", 0, 1.0, 1, 10, LONG, LONG, False)
    assert redis_backend.records() <= before + 1  # the token sequence (the group's slot's)


def test_a_groups_keys_share_one_slot_with_its_tokens(redis_backend: Backend) -> None:
    from redis.crc import key_slot

    provider = _provider(redis_backend)
    for group in ["", "}", "{}", "a}b", "payments"]:
        keys: tuple[str, ...] = provider._permit_keys(group)
        if provider.cluster:  # else the sequence is the one store-wide key, on the one server
            keys += (provider._sequence_key(keys[0]),)
        assert len({key_slot(key.encode()) for key in keys}) == 1, (group, keys)


def test_on_a_cluster_tokens_follow_the_slots_sequence(redis_backend: Backend) -> None:
    """A permit's token exceeds every earlier grant's in its slot, leases included."""
    from redis.crc import key_slot

    provider = _provider(redis_backend)
    group = f"g-{uuid.uuid4().hex[:8]}"
    name = "#" + group  # a lease whose key shares the group's hash tag, hence its slot
    assert key_slot(f"{provider.prefix}{{{name}}}".encode()) == key_slot(
        provider._permit_keys(group)[0].encode()
    )
    lease = provider.try_acquire(name, 30.0)
    assert lease is not None
    reply = provider._permits_acquire(group, "a", 2, 1.0, 5, 5, LONG, LONG, False)
    assert min(reply.tokens) > lease.token
    lease.release()
    later = provider.try_acquire(name, 30.0)
    assert later is not None
    assert later.token > max(reply.tokens)
    later.release()
    assert provider._permits_release(group, [(t, "a") for t in reply.tokens]) == 2


def test_a_withdrawal_with_free_permits_notifies(redis_backend: Backend) -> None:
    provider = _provider(redis_backend)
    other = _provider(redis_backend)
    group = f"g-{uuid.uuid4().hex[:8]}"
    first = provider._permits_acquire(group, "a", 1, 1.0, 5, 2, LONG, LONG, True)
    assert len(first.tokens) == 1  # a holds one, one is free, and a's demand is registered
    watch = other._hub.watch(hub_name(group))
    try:
        wait_until(lambda: watch.confirmed, 10.0, "the subscription")
        provider._permits_acquire(group, "a", 0, 1.0, 5, 2, LONG, LONG, False)
        assert watch.wait(5.0), "a waiter that yielded to a may take the free permit now"
    finally:
        watch.close()
    assert provider._permits_release(group, [(first.tokens[0], "a")]) == 1


def test_each_step_is_one_round_trip(redis_url: str) -> None:
    """Counted by the server (MONITOR): one EVALSHA per step, whatever the step does."""
    import redis

    prefix = f"rt:{uuid.uuid4().hex[:8]}:"
    with (
        RedisLeases(redis_url, prefix=prefix) as leases,
        redis.Redis.from_url(redis_url) as monitor_client,
        redis.Redis.from_url(redis_url) as marker,
    ):
        # Loads the scripts into the server's cache.
        warm = leases._permits_acquire("g", "a", 1, 1.0, 1, 1, 5.0, 5.0, False)
        leases._permits_extend("g", [(warm.tokens[0], "a")], 5.0)
        leases._permits_release("g", [(warm.tokens[0], "a")])
        seen: list[dict[str, Any]] = []
        ready = threading.Event()

        def collect() -> None:
            with monitor_client.monitor() as monitor:
                ready.set()
                while True:
                    command = monitor.next_command()
                    if command["command"] == "ECHO rxcoord-end":
                        return
                    seen.append(command)

        thread = threading.Thread(target=collect)
        thread.start()
        assert ready.wait(5)
        marker.echo("rxcoord-start")
        got: PermitReply = leases._permits_acquire("g", "a", 1, 1.0, 1, 1, 5.0, 5.0, False)  # 1
        blocked = leases._permits_acquire("g", "b", 1, 1.0, 1, 1, 5.0, 5.0, False)  # 2
        assert blocked.tokens == ()
        assert leases._permits_extend("g", [(got.tokens[0], "a")], 5.0) == []  # 3
        assert leases._permits_release("g", [(got.tokens[0], "a")]) == 1  # 4
        leases._permits_acquire("g", "b", 0, 1.0, 1, 1, 5.0, 5.0, False)  # 5: withdraws
        marker.echo("rxcoord-end")
        thread.join(10)
    started = [i for i, c in enumerate(seen) if c["command"] == "ECHO rxcoord-start"]
    sent = [c for c in seen[started[0] + 1 :] if c["client_type"] != "lua"]
    assert [c["command"].split()[0] for c in sent] == ["EVALSHA"] * 5, sent


def test_the_scripts_survive_a_script_cache_flush(redis_url: str) -> None:
    import redis

    with (
        RedisLeases(redis_url, prefix=f"flush:{uuid.uuid4().hex[:8]}:") as leases,
        redis.Redis.from_url(redis_url) as client,
    ):
        reply = leases._permits_acquire("g", "a", 1, 1.0, 1, 1, 5.0, 5.0, False)
        client.script_flush()
        assert leases._permits_extend("g", [(reply.tokens[0], "a")], 5.0) == []
        client.script_flush()
        assert leases._permits_release("g", [(reply.tokens[0], "a")]) == 1
        client.script_flush()
        assert len(leases._permits_acquire("g", "a", 1, 1.0, 1, 1, 5.0, 5.0, False).tokens) == 1


def test_many_permits_in_one_step(redis_backend: Backend) -> None:
    """Thousands of permits in one acquire, extend and release (Lua's stack is not the limit)."""
    provider = _provider(redis_backend)
    group = f"g-{uuid.uuid4().hex[:8]}"
    before = redis_backend.records()
    reply = provider._permits_acquire(group, "a", 3000, 1.0, 5000, 5000, LONG, LONG, False)
    assert len(reply.tokens) == reply.running == 3000
    pairs = [(token, "a") for token in reply.tokens]
    unknown = [(-1, "a"), (max(reply.tokens) + 10, "a"), (reply.tokens[0], "b")]
    lost = provider._permits_extend(group, [*pairs, *unknown], LONG)
    assert lost == [token for token, _ in unknown]
    assert provider._permits_release(group, [*pairs, *unknown]) == 3000
    assert redis_backend.records() <= before + 1  # the token sequence


def test_the_groups_keys_expire_no_earlier_than_what_they_hold(redis_backend: Backend) -> None:
    """Every key of a busy group carries a TTL (so a group a crashed fleet left goes by itself)
    that is never earlier than its latest permit or demand: a key expiring first would drop a
    live permit. A group written before keys had TTLs gets them at its next step."""
    provider = _provider(redis_backend)
    group = f"ttl-{uuid.uuid4().hex[:6]}"
    permits, demand, state = provider._permit_keys(group)
    client = _client(redis_backend)

    def ttl(key: str) -> float:
        return float(client.pttl(key)) / 1000.0

    try:
        a = provider._permits_acquire(group, "a", 1, 1.0, 5, 1, 5.0, 3.0, False)
        assert len(a.tokens) == 1
        assert 5.0 - 0.5 <= ttl(permits) <= 11.0
        assert ttl(state) == pytest.approx(ttl(permits), abs=0.01)
        b = provider._permits_acquire(group, "b", 1, 1.0, 5, 1, 5.0, 3.0, False)  # waits
        assert b.tokens == ()
        assert ttl(demand) >= 3.0 - 0.5
        assert provider._permits_extend(group, [(a.tokens[0], "a")], 20.0) == []
        for key in (permits, demand, state):
            assert ttl(key) >= 20.0 - 0.5, key
        # As a group written by a version without TTLs: no x, no expiry.
        client.hdel(state, "x")
        for key in (permits, demand, state):
            client.persist(key)
        provider._permits_acquire(group, "c", 0, 1.0, 5, 1, 5.0, 3.0, False)  # writes nothing
        for key in (permits, demand, state):
            assert ttl(key) >= 20.0 - 0.5, key
    finally:
        client.close()
