"""The fleet permit table on PostgreSQL: what the contract suite cannot see.

The functions must do what the reference ``PermitGroup`` does, step for step (checked against
it on random operations, down to every pass and the clock); the group's row lock must make
each step atomic against other connections (threads of several providers); and the layout
must behave as a schema should: created with the lease table's persistence, shared by
providers spelling the table differently, not rewritten by every provider that starts,
recreated when dropped, and bounded by the caller's timeout.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support.waiting import wait_until

from rxcoord import LeaseStoreUnavailable
from rxcoord.leases import PostgresLeases
from rxcoord.leases._backends._postgres import _derived_identifier
from rxcoord.leases._permits import PermitGroup, PermitReply, hub_name

from .conftest import PG_PERMIT_TABLES, drop_table

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.backend

LONG = 1e6  # seconds: never expires during a test
SHORT = 1e-6  # seconds: expired by the next call (a round trip takes longer)


@pytest.fixture
def table(postgres_url: str) -> Iterator[str]:
    name = f"pp_{uuid.uuid4().hex[:12]}"
    yield name
    drop_table(postgres_url, name)


def new_provider(postgres_url: str, table: str, **kw: Any) -> PostgresLeases:
    options: dict[str, Any] = {"table": table, "timeout": 5.0, **kw}
    return PostgresLeases(postgres_url, **options)


def pg_state(conn: Any, table: str, group: str) -> dict[str, object] | None:
    """The group's row, shaped like a PermitGroup's state (None: no row)."""
    row = conn.execute(
        "SELECT clock, tokens, holders, tenants, passes, limits, demand "
        f'FROM "{table}_permits" WHERE name = %s',
        (group,),
    ).fetchone()
    if row is None:
        return None
    clock, tokens, holders, tenants, passes, limits, demand = row
    return {
        "clock": clock,
        "permits": dict(zip(tokens, holders, strict=True)),
        "passes": dict(zip(tenants, passes, strict=True)),
        "limits": {t: v for t, v in zip(tenants, limits, strict=True) if v is not None},
        "demand": {t for t, v in zip(tenants, demand, strict=True) if v is not None},
    }


class _Tokens:
    """The reference's ``next_token``: the tokens PostgreSQL granted, in order."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.left = list(tokens)

    def __call__(self) -> int:
        assert self.left, "the reference grants more than PostgreSQL did"
        return self.left.pop(0)


def ref_state(group: PermitGroup) -> dict[str, object] | None:
    if group.empty:
        return None
    return {
        "clock": group.clock,
        "permits": {token: tenant for token, (tenant, _) in group.permits.items()},
        "passes": group.passes,
        "limits": group.limits,
        "demand": set(group.demand),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_functions_do_what_the_reference_does(postgres_url: str, table: str, seed: int) -> None:
    """Random steps on one group, each run on PostgreSQL and on PermitGroup.

    The reference runs on a clock of its own (10 s per step), so a SHORT duration expires by
    the next step in both and a LONG one never; it takes the tokens PostgreSQL granted, in
    order, so the two agree on every token. After every step the rows must equal the
    reference's state exactly (floats included), and every notification the reference asks
    for must be sent (and no other).
    """
    rng = random.Random(seed)
    provider = new_provider(postgres_url, table)
    group = f"g{seed}"
    channel = provider._channel(hub_name(group))
    listener = psycopg.connect(postgres_url, autocommit=True)
    reader = psycopg.connect(postgres_url, autocommit=True)
    listener.execute(f'LISTEN "{channel}"')
    ref = PermitGroup()
    clock = 0.0
    expected = received = 0
    tenants = ["a", "b", "c", "d", 'e "q" \\\\,{NULL}']  # one that needs quoting in an array
    weights = [1.0, 2.0, 0.5, 3.0, 0.7]
    try:
        for step in range(250):
            clock += 10.0
            choice = rng.random()
            notify = False
            if choice < 0.55 or not ref.permits:
                tenant = rng.choice(tenants)
                args = (
                    tenant,
                    rng.choice([0, 1, 1, 2, 3]),  # want
                    weights[tenants.index(tenant)] * rng.choice([1.0, 1.0, 1.5]),
                    rng.randint(1, 3),  # tenant limit
                    rng.randint(1, 4),  # limit
                    rng.choice([SHORT, LONG, LONG]),  # most
                    rng.choice([0.0, SHORT, LONG, LONG]),  # demand_for
                    rng.random() < 0.3,  # more
                )
                reply = provider._permits_acquire(group, *args)
                granted = _Tokens(reply.tokens)
                want, notify = ref.acquire(clock, granted, *args)
                assert granted.left == [], f"step {step}: PostgreSQL granted more"
                assert reply.tokens == want.tokens
                assert (reply.running, reply.tenant_running) == (
                    want.running,
                    want.tenant_running,
                ), f"step {step}"
                assert (reply.wake_in is None) == (want.wake_in is None), f"step {step}"
            else:
                held = list(ref.permits.items())
                chosen = rng.sample(held, min(len(held), rng.randint(1, 2)))
                permits = [(token, tenant) for token, (tenant, _) in chosen]
                if rng.random() < 0.3:  # someone else's, or a token nobody holds
                    permits.append((held[0][0], "nobody"))
                    permits.append((10**12 + step, "a"))
                if choice < 0.8:
                    count = provider._permits_release(group, permits)
                    assert count == ref.release(clock, permits), f"step {step}"
                    notify = count > 0
                else:
                    most = rng.choice([SHORT, LONG])
                    lost = provider._permits_extend(group, permits, most)
                    assert lost == ref.extend(clock, permits, most), f"step {step}"
            if ref.empty:
                ref = PermitGroup()  # the store deletes an idle group: it starts afresh
            assert pg_state(reader, table, group) == ref_state(ref), f"step {step}"
            if notify:
                expected += 1
                received += sum(1 for _ in listener.notifies(timeout=5.0, stop_after=1))
        received += sum(1 for _ in listener.notifies(timeout=0.3))
        assert received == expected
    finally:
        listener.close()
        reader.close()
        provider.close()


def test_limits_hold_across_connections_and_providers(postgres_url: str, table: str) -> None:
    """Threads of three providers acquire and release on one group; each step is atomic, so
    the permits out never exceed the limits, and the group row, deleted whenever it goes
    idle and inserted again by the next acquire, never trips anybody up."""
    providers = [new_provider(postgres_url, table, max_size=4) for _ in range(3)]
    limit, tenant_limit = 3, 2
    lock = threading.Lock()
    out: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    worst = {"total": 0, "tenant": 0}
    errors: list[BaseException] = []

    def worker(provider: PostgresLeases, tenant: str) -> None:
        try:
            for _ in range(60):
                reply = provider._permits_acquire(
                    "shared", tenant, 1, 1.0, tenant_limit, limit, 30.0, 30.0, False
                )
                if not reply.tokens:
                    continue
                with lock:  # counted after the grant, uncounted before the release
                    out[tenant] += 1
                    worst["total"] = max(worst["total"], sum(out.values()))
                    worst["tenant"] = max(worst["tenant"], out[tenant])
                with lock:
                    out[tenant] -= 1
                assert provider._permits_release("shared", [(reply.tokens[0], tenant)]) == 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(providers[i % 3], "abc"[i % 3])) for i in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    try:
        assert errors == []
        assert worst["total"] <= limit
        assert worst["tenant"] <= tenant_limit
        for tenant in out:  # withdraw what the busy attempts left behind
            providers[0]._permits_acquire("shared", tenant, 0, 1.0, 1, 1, 1.0, 1.0, False)
        with psycopg.connect(postgres_url) as conn:
            assert pg_state(conn, table, "shared") is None
    finally:
        for provider in providers:
            provider.close()


def test_a_new_group_has_one_first_grant(postgres_url: str, table: str) -> None:
    """Threads racing to create the same group's row: one inserts it, the others lock it."""
    providers = [new_provider(postgres_url, table, max_size=2) for _ in range(2)]
    try:
        for round_ in range(10):
            barrier = threading.Barrier(4)
            replies: list[PermitReply] = []

            def first(
                provider: PostgresLeases,
                tenant: str,
                group: str,
                barrier: threading.Barrier,
                replies: list[PermitReply],
            ) -> None:
                barrier.wait(10)
                replies.append(
                    provider._permits_acquire(group, tenant, 1, 1.0, 1, 1, 30, 30, False)
                )

            group = f"race-{round_}"
            threads = [
                threading.Thread(
                    target=first,
                    args=(providers[i % 2], f"t{i}", group, barrier, replies),
                )
                for i in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert len(replies) == 4
            assert sum(len(reply.tokens) for reply in replies) == 1
    finally:
        for provider in providers:
            provider.close()


def test_a_withdrawal_notifies_other_providers(postgres_url: str, table: str) -> None:
    provider = new_provider(postgres_url, table)
    other = new_provider(postgres_url, table)
    try:
        held = provider._permits_acquire("w", "a", 1, 1.0, 1, 2, 30, 30, True)
        provider._permits_release("w", [(held.tokens[0], "a")])  # a still wants more
        # Watching from here on: the release's notification went to nobody.
        watch = other._hub.watch(hub_name("w"))
        try:
            wait_until(lambda: watch.confirmed, 10.0, "the subscription")
            provider._permits_acquire("w", "a", 0, 1.0, 1, 2, 30, 30, False)  # a's job left
            assert watch.wait(5.0), "a pure withdrawal with permits free must notify"
        finally:
            watch.close()
    finally:
        provider.close()
        other.close()


def test_permit_tables_follow_the_lease_tables_persistence(postgres_url: str) -> None:
    logged, unlogged = f"pl_{uuid.uuid4().hex[:10]}", f"pu_{uuid.uuid4().hex[:10]}"
    try:
        for name, durable in ((logged, True), (unlogged, False)):
            with new_provider(postgres_url, name, durable=durable) as provider:
                provider._permits_acquire("g", "a", 0, 1.0, 1, 1, 1, 1, False)
        with psycopg.connect(postgres_url) as conn:
            for name, kind in ((logged, "p"), (unlogged, "u")):
                for suffix in PG_PERMIT_TABLES:
                    row = conn.execute(
                        "SELECT relpersistence FROM pg_class WHERE oid = %s::regclass",
                        (name + suffix,),
                    ).fetchone()
                    assert row == (kind,), name + suffix
    finally:
        drop_table(postgres_url, logged)
        drop_table(postgres_url, unlogged)


def test_providers_spelling_the_table_differently_share_groups_and_functions(
    postgres_url: str, table: str
) -> None:
    def function_versions() -> list[tuple[str, str]]:
        with psycopg.connect(postgres_url) as conn:
            rows = conn.execute(
                "SELECT proname, xmin::text FROM pg_proc WHERE proname LIKE %s ORDER BY 1",
                (table + "_permits_%",),
            ).fetchall()
        return [(str(name), str(xmin)) for name, xmin in rows]

    plain = new_provider(postgres_url, table)
    try:
        reply = plain._permits_acquire("g", "a", 1, 1.0, 1, 1, 30, 30, False)
        assert reply.tokens
        created = function_versions()
        assert len(created) == 3
        with new_provider(postgres_url, f"public.{table}") as qualified:
            blocked = qualified._permits_acquire("g", "b", 1, 1.0, 1, 1, 30, 30, False)
            assert blocked.tokens == (), "one group, however the table is spelled"
            assert qualified._permits_release("g", [(reply.tokens[0], "a")]) == 1
            qualified._permits_acquire("g", "b", 0, 1.0, 1, 1, 30, 30, False)
        assert function_versions() == created, "a provider starting must not rewrite them"
    finally:
        plain.close()


def test_long_table_names_sharing_a_prefix_keep_their_groups_apart(postgres_url: str) -> None:
    prefix = "long_" + "x" * 47
    first, second = prefix + "_one_" + uuid.uuid4().hex[:4], prefix + "_two_" + uuid.uuid4().hex[:4]
    assert len(first) <= 63
    assert _derived_identifier(first, "_permits") != _derived_identifier(second, "_permits")
    try:
        with new_provider(postgres_url, first) as one, new_provider(postgres_url, second) as two:
            a = one._permits_acquire("g", "a", 1, 1.0, 1, 1, 30, 30, False)
            b = two._permits_acquire("g", "a", 1, 1.0, 1, 1, 30, 30, False)
            assert a.tokens
            assert b.tokens, "another lease table is another namespace"
            assert one._permits_release("g", [(a.tokens[0], "a")]) == 1
            assert two._permits_release("g", [(b.tokens[0], "a")]) == 1
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            for name in (first, second):
                conn.execute(f'DROP TABLE IF EXISTS "{name}"')
                conn.execute(f'DROP SEQUENCE IF EXISTS "{name[:53]}_token_seq"')
                for suffix in PG_PERMIT_TABLES:
                    conn.execute(f'DROP TABLE IF EXISTS "{_derived_identifier(name, suffix)}"')
                for suffix in ("_permits_acquire", "_permits_release", "_permits_extend"):
                    conn.execute(f'DROP FUNCTION IF EXISTS "{_derived_identifier(name, suffix)}"')


@pytest.mark.parametrize("dropped", ["table", "function"])
def test_a_permit_table_or_function_dropped_behind_our_back_is_recreated(
    postgres_url: str, table: str, dropped: str
) -> None:
    provider = new_provider(postgres_url, table)
    try:
        assert provider._permits_acquire("g", "a", 0, 1.0, 1, 1, 30, 30, False).tokens == ()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            if dropped == "table":
                conn.execute(f'DROP TABLE "{table}_permits"')
            else:
                conn.execute(f'DROP FUNCTION "{table}_permits_acquire"')
        reply = provider._permits_acquire("g", "a", 1, 1.0, 1, 1, 30, 30, False)
        assert len(reply.tokens) == 1
        assert provider._permits_release("g", [(reply.tokens[0], "a")]) == 1
    finally:
        provider.close()


def test_release_and_extend_wait_no_longer_than_their_timeout(
    postgres_url: str, table: str
) -> None:
    provider = new_provider(postgres_url, table)
    try:
        reply = provider._permits_acquire("g", "a", 1, 1.0, 1, 1, 30, 30, False)
        blocker = psycopg.connect(postgres_url)
        try:  # another session holds the group's row lock
            blocker.execute(f'SELECT 1 FROM "{table}_permits" WHERE name = %s FOR UPDATE', ("g",))
            for call in (
                lambda: provider._permits_release("g", [(reply.tokens[0], "a")], timeout=0.3),
                lambda: provider._permits_extend("g", [(reply.tokens[0], "a")], 30, timeout=0.3),
            ):
                started = time.monotonic()
                with pytest.raises(LeaseStoreUnavailable):
                    call()
                assert time.monotonic() - started < 3.0
        finally:
            blocker.close()
        assert provider._permits_extend("g", [(reply.tokens[0], "a")], 30) == []
        assert provider._permits_release("g", [(reply.tokens[0], "a")]) == 1
    finally:
        provider.close()
