"""What is specific to one backend: round trips, schema, configuration, URLs, wake-ups."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.stores import FakeClock
from support.waiting import wait_until

from rxcoord.leases import (
    DistributedLease,
    LeaseProvider,
    LeaseStoreMisconfigured,
    MemoryLeases,
    MemoryLeaseStore,
    MemoryLeaseStoreStats,
    PostgresLeases,
    RedisLeases,
    SqliteLeases,
    leases_from_url,
)
from rxcoord.leases._notify import Listener

from .conftest import drop_table, in_thread, pg_row_waited

# -- round trips ----------------------------------------------------------------------------


@pytest.mark.backend
def test_redis_needs_one_round_trip_per_operation(redis_url: str) -> None:
    """Counted by the server itself: MONITOR shows each command a client sent."""
    import redis

    prefix = f"rt:{uuid.uuid4().hex[:8]}:"
    with (
        RedisLeases(redis_url, prefix=prefix) as leases,
        redis.Redis.from_url(redis_url) as monitor_client,
        redis.Redis.from_url(redis_url) as marker,
    ):
        warm = leases.try_acquire("warm", 5.0)  # loads the scripts into the server's cache
        assert warm is not None
        warm.extend()
        warm.release()
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
        lease = leases.try_acquire("n", 5.0)  # 1
        assert lease is not None
        assert leases.try_acquire("n", 5.0) is None  # 2: taken
        lease.extend()  # 3
        lease.release()  # 4
        marker.echo("rxcoord-end")
        thread.join(10)
    started = [i for i, c in enumerate(seen) if c["command"] == "ECHO rxcoord-start"]
    sent = [c for c in seen[started[0] + 1 :] if c["client_type"] != "lua"]
    assert [c["command"].split()[0] for c in sent] == ["EVALSHA"] * 4, sent


@pytest.mark.backend
def test_postgres_needs_one_round_trip_per_operation(postgres_url: str, tmp_path: Path) -> None:
    """Counted by libpq's protocol trace: one Sync (one round trip) per operation."""
    import psycopg
    from psycopg import pq

    connections: list[psycopg.Connection[Any]] = []
    table = f"rt_{uuid.uuid4().hex[:8]}"
    trace = tmp_path / "trace.txt"
    try:
        with PostgresLeases(
            postgres_url,
            table=table,
            min_size=1,
            max_size=1,
            configure=connections.append,
            sweep_every=None,  # a background sweep would add its own round trip to the trace
        ) as leases:
            warm = leases.try_acquire("warm", 5.0)  # creates the table, prepares statements
            assert warm is not None
            assert leases.try_acquire("warm", 5.0) is None
            warm.extend()
            warm.release()
            # The table is set up on a connection of its own (closed since): trace the pool's.
            (conn,) = [c for c in connections if not c.closed]
            with trace.open("w") as out:
                conn.pgconn.trace(out.fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
                lease = leases.try_acquire("n", 5.0)
                assert lease is not None
                assert leases.try_acquire("n", 5.0) is None
                lease.extend()
                lease.release()
                conn.pgconn.untrace()
    finally:
        drop_table(postgres_url, table)
    # Lines read "F<tab>length<tab>Message ...": F for frontend (us), B for backend.
    lines = trace.read_text().splitlines()
    sent = [line.split("\t")[2].split()[0] for line in lines if line.startswith("F")]
    assert sent.count("Sync") == 4, sent
    assert "Parse" not in sent  # prepared once, then only Bind/Execute


# -- schema and configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "table", ["", "1abc", "bad name", "x;drop", "a.b.c", "t" * 64, 'q"uote'], ids=repr
)
def test_table_names_are_validated_as_identifiers(table: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid table name"):
        SqliteLeases(tmp_path / "x.db", table=table)
    with pytest.raises(ValueError, match="invalid table name"):
        PostgresLeases("postgresql://unused", table=table)


def test_sqlite_uses_the_configured_table_and_creates_it_idempotently(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    with (
        SqliteLeases(path, table="main.custom_leases") as a,
        SqliteLeases(path, table="custom_leases") as b,
    ):
        lease = a.try_acquire("n", 5.0)
        assert lease is not None
        assert b.try_acquire("n", 5.0) is None  # same table, reached by both spellings
        lease.release()
    with sqlite3.connect(path) as conn:
        tables = [
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        ]
    conn.close()
    # the lease rows, the token sequence, the fleet permit groups
    assert tables == ["custom_leases", "custom_leases_seq", "custom_leases_permits"]


@pytest.mark.backend
def test_postgres_creates_its_table_once_even_when_providers_race(postgres_url: str) -> None:
    import psycopg

    table = f"race_{uuid.uuid4().hex[:8]}"
    providers = [PostgresLeases(postgres_url, table=table) for _ in range(4)]
    errors: list[BaseException] = []

    def first_use(provider: LeaseProvider, i: int) -> None:
        try:
            lease = provider.try_acquire(f"n{i}", 5.0)
            assert lease is not None
            lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_use, args=(p, i)) for i, p in enumerate(providers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        with psycopg.connect(postgres_url) as conn:
            row = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename = %s", (table,))
            assert row.fetchone() == (1,)
    finally:
        for provider in providers:
            provider.close()
        drop_table(postgres_url, table)


@pytest.mark.backend
def test_postgres_accepts_a_schema_qualified_table(postgres_url: str) -> None:
    table = f"public.q_{uuid.uuid4().hex[:8]}"
    try:
        with PostgresLeases(postgres_url, table=table) as leases:
            lease = leases.try_acquire("n", 5.0)
            assert lease is not None
            lease.release()
    finally:
        drop_table(postgres_url, table.split(".")[1])


@pytest.mark.backend
def test_postgres_providers_spelling_the_table_differently_wake_each_other(
    monkeypatch: pytest.MonkeyPatch, postgres_url: str, name: str
) -> None:
    # One table, however spelled, one set of notification channels.
    table = f"alias_{uuid.uuid4().hex[:10]}"
    holder = PostgresLeases(postgres_url, table=table, timeout=2.0)
    waiter = PostgresLeases(postgres_url, table=f"public.{table}", timeout=2.0)
    subscribed = threading.Event()
    acked = Listener._acked

    def watch_acks(self: Listener, lease_name: str) -> None:
        acked(self, lease_name)
        if self is waiter._listener:
            subscribed.set()

    monkeypatch.setattr(Listener, "_acked", watch_acks)
    try:
        lease = holder.acquire(name, at_most_for=60.0)
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        assert subscribed.wait(10)  # the waiter listens: from now on it sleeps until notified
        # ...once its attempt after the subscription marked the row (a release before that
        # mark would find nobody waiting, send nothing, and leave the name to that attempt).
        wait_until(lambda: pg_row_waited(postgres_url, table, name), what="the waiter's mark")
        lease.release()
        wait.join(15)
        assert not wait.is_alive(), "the waiter was not woken by the release"
        assert isinstance(outcome[0], DistributedLease), outcome
        assert waiter.stats().notifications >= 1
        outcome[0].release()
    finally:
        holder.close()
        waiter.close()
        drop_table(postgres_url, table)


@pytest.mark.backend
def test_postgres_non_durable_mode_uses_an_unlogged_table_a_durable_provider_refuses(
    postgres_url: str,
) -> None:
    import psycopg

    from rxcoord.leases import LeaseStoreMisconfigured

    table = f"nd_{uuid.uuid4().hex[:8]}"
    try:
        with PostgresLeases(postgres_url, table=table, durable=False) as leases:
            lease = leases.try_acquire("n", 5.0)
            assert lease is not None
            lease.release()
        with psycopg.connect(postgres_url) as conn:
            row = conn.execute(
                "SELECT relpersistence FROM pg_class WHERE oid = %s::regclass", (table,)
            ).fetchone()
        assert row == ("u",)  # what durable=False loses: a crash empties it (see the docs)
        with (
            PostgresLeases(postgres_url, table=table) as durable,
            pytest.raises(LeaseStoreMisconfigured, match="UNLOGGED"),
        ):
            durable.try_acquire("n", 5.0)
    finally:
        drop_table(postgres_url, table)


def test_redis_rejects_an_empty_prefix() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisLeases("redis://127.0.0.1:1/0", prefix="")
    with pytest.raises(ValueError, match="hash tag"):
        RedisLeases("redis://127.0.0.1:1/0", prefix="a{b}:")


def test_postgres_rejects_bad_pool_sizes() -> None:
    with pytest.raises(ValueError, match="min_size"):
        PostgresLeases("postgresql://unused", min_size=3, max_size=2)


# -- the memory store on a fake clock: expiry logic in virtual time --------------------------


def test_memory_store_expiry_and_at_least_for_in_virtual_time() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore(clock)
    with MemoryLeases(store) as a, MemoryLeases(store) as b:
        lease = a.try_acquire("n", at_most_for=10.0, at_least_for=4.0)
        assert lease is not None
        clock.now += 1.0
        lease.release()
        assert b.try_acquire("n", 10.0) is None  # released, but inside at_least_for
        clock.now += 2.9
        assert b.try_acquire("n", 10.0) is None
        clock.now += 0.2  # 4.1 s after the grant
        second = b.try_acquire("n", 10.0)
        assert second is not None
        clock.now += 10.0  # expired, nobody released it
        third = a.try_acquire("n", 10.0)
        assert third is not None
        assert lease.token < second.token < third.token
        clock.now += 3.0
        third.extend(10.0)
        clock.now += 9.0  # 12 s after the grant, 9 s after the extension
        assert b.try_acquire("n", 10.0) is None
        third.release()
        assert store.stats() == MemoryLeaseStoreStats(names=0, held=0, providers=2)
    assert store.stats().providers == 0  # detached on close


# -- URLs -----------------------------------------------------------------------------------


def test_leases_from_url_picks_the_backend(tmp_path: Path) -> None:
    with leases_from_url("memory://") as memory:
        assert isinstance(memory, MemoryLeases)
    with leases_from_url(f"sqlite://{tmp_path / 'x.db'}", table="t") as sqlite:
        assert isinstance(sqlite, SqliteLeases)
        assert sqlite.table == "t"
        assert sqlite.path == str(tmp_path / "x.db")
    with pytest.raises(ValueError, match="unknown lease store scheme"):
        leases_from_url("mongodb://x")
    with pytest.raises(ValueError, match="expected scheme"):
        leases_from_url("leases.db")
    with pytest.raises(ValueError, match="no database path"):
        leases_from_url("sqlite://")


def test_an_sqlite_url_with_a_relative_path_is_refused_with_the_right_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sqlite://rel.db reads as the host "rel.db"; it was opened silently relative to the
    # working directory of whichever process read the configuration (issue 26).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="names no absolute path") as caught:
        leases_from_url("sqlite://rel.db")
    assert f"sqlite://{tmp_path / 'rel.db'} (three slashes)" in str(caught.value)
    assert not (tmp_path / "rel.db").exists()
    with leases_from_url(f"sqlite://{tmp_path / 'rel.db'}") as leases:  # the form it shows
        assert isinstance(leases, SqliteLeases)
        assert leases.path == str(tmp_path / "rel.db")


@pytest.mark.backend
def test_leases_from_url_opens_server_backends(postgres_url: str, redis_url: str) -> None:
    table = f"url_{uuid.uuid4().hex[:8]}"
    try:
        with leases_from_url(postgres_url, table=table) as pg:
            assert isinstance(pg, PostgresLeases)
            assert pg.try_acquire("n", 1.0) is not None
        with leases_from_url(redis_url, prefix=f"url:{table}:") as rd:
            assert isinstance(rd, RedisLeases)
            assert rd.try_acquire("n", 1.0) is not None
    finally:
        drop_table(postgres_url, table)


@pytest.fixture
def unreachable_port() -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]  # bound, never listening: connections are refused


def test_an_unreachable_redis_is_a_clear_error(unreachable_port: int) -> None:
    from rxcoord.leases import LeaseStoreUnavailable

    with RedisLeases(f"redis://127.0.0.1:{unreachable_port}/0", timeout=1.0) as leases:
        with pytest.raises(LeaseStoreUnavailable, match="Redis lease store failed to grant"):
            leases.try_acquire("n", 1.0)
        assert leases.stats().store_errors == 1


def test_an_unreachable_postgres_is_a_clear_error(unreachable_port: int) -> None:
    from rxcoord.leases import LeaseStoreUnavailable

    url = f"postgresql://postgres@127.0.0.1:{unreachable_port}/x"
    with (
        PostgresLeases(url, timeout=0.5) as leases,
        pytest.raises(LeaseStoreUnavailable, match="PostgreSQL lease store failed"),
    ):
        leases.try_acquire("n", 1.0)


def test_an_sqlite_file_whose_directory_is_missing_is_refused_at_construction(
    tmp_path: Path,
) -> None:
    # Refused where the mistake is made, not at the first grant (issue 26).
    with pytest.raises(LeaseStoreMisconfigured, match="does not exist: create it") as caught:
        SqliteLeases(tmp_path / "missing" / "dir" / "x.db")
    assert str(tmp_path / "missing" / "dir") in str(caught.value)
    assert not isinstance(caught.value, ConnectionError)  # retry loops must not spin on it
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LeaseStoreMisconfigured, match="is not a directory"):
        SqliteLeases(tmp_path / "a-file" / "x.db")
    with pytest.raises(LeaseStoreMisconfigured, match="it is a directory"):
        SqliteLeases(tmp_path)
    with SqliteLeases(tmp_path / "x.db") as fine, SqliteLeases(":memory:") as private:
        for leases in (fine, private):
            lease = leases.try_acquire("n", 1.0)
            assert lease is not None
            lease.release()


def _construct_as_nobody(path: Path) -> str:
    """``SqliteLeases(path)`` in a forked child without root's privileges: its error, or ''.

    Root may write anywhere, so the check can only be seen failing as another user. A fork
    (not a new interpreter, which that user could not start from root's home) keeps the
    imported modules; the child does nothing but the constructor's checks and exits.
    """
    import os
    import warnings

    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads running
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)  # nobody
            try:
                SqliteLeases(path).close()
                message = ""
            except LeaseStoreMisconfigured as exc:
                message = str(exc)
            os.write(write, message.encode() or b"-")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return "" if said == "-" else said


def test_an_sqlite_file_in_a_directory_it_may_not_write_is_refused_at_construction(
    tmp_path: Path,
) -> None:
    import os
    import tempfile

    # Not under tmp_path: pytest's temporary root is private to its owner, so another user
    # could not even reach it.
    with tempfile.TemporaryDirectory(prefix="rxcoord-ro-") as top:
        Path(top).chmod(0o755)
        locked = Path(top) / "read-only"
        locked.mkdir()
        locked.chmod(0o555)
        writable = Path(top) / "writable"
        writable.mkdir()
        writable.chmod(0o777)
        try:
            if os.geteuid() == 0:
                refused = _construct_as_nobody(locked / "x.db")
                assert "may not write in its directory" in refused, refused
                assert _construct_as_nobody(writable / "x.db") == ""  # same user, a good path
            else:
                with pytest.raises(LeaseStoreMisconfigured, match="may not write in its dir"):
                    SqliteLeases(locked / "x.db")
        finally:
            locked.chmod(0o755)
    if os.geteuid() == 0:  # a directory on the way it may not enter
        assert "cannot be reached: Permission denied" in _construct_as_nobody(tmp_path / "x.db")


def test_an_sqlite_store_that_disappears_after_construction_is_not_an_outage(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "gone"
    directory.mkdir()
    with SqliteLeases(directory / "x.db") as leases:
        directory.rmdir()
        with pytest.raises(LeaseStoreMisconfigured, match="directory exists") as caught:
            leases.try_acquire("n", 1.0)
        assert not isinstance(caught.value, ConnectionError)  # retry loops must not spin on it
        assert isinstance(caught.value.__cause__, sqlite3.Error)


def test_repr_names_the_backend_and_state(tmp_path: Path) -> None:
    leases = SqliteLeases(tmp_path / "x.db")
    lease = leases.try_acquire("n", 5.0)
    assert "SqliteLeases" in repr(leases)
    assert "open" in repr(leases)
    assert "token=1" in repr(lease)
    leases.close()
    assert "closed" in repr(leases)


@pytest.mark.backend
def test_postgres_callers_waiting_for_a_connection_are_not_starved(postgres_url: str) -> None:
    """Idle connections cycle through a deque in front of the pool: a caller blocked in the
    pool must still get one (it once waited out its timeout while others reused them)."""
    import threading

    table = f"starve_{uuid.uuid4().hex[:8]}"
    errors: list[Exception] = []

    def work(leases: PostgresLeases, worker: int) -> None:
        try:
            for i in range(100):
                lease = leases.try_acquire(f"n{worker}-{i}", 30.0)
                assert lease is not None
                lease.release()
        except Exception as exc:
            errors.append(exc)

    try:
        with PostgresLeases(postgres_url, table=table, max_size=2, timeout=2.0) as leases:
            threads = [threading.Thread(target=work, args=(leases, n)) for n in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
    finally:
        drop_table(postgres_url, table)
    assert errors == []


@pytest.mark.backend
def test_redis_leases_take_a_cluster_client_and_spread_names_over_the_nodes(
    redis_cluster_url: str,
) -> None:
    from redis.cluster import RedisCluster

    prefix = f"client:{uuid.uuid4().hex[:8]}:"
    client = RedisCluster.from_url(redis_cluster_url)
    try:
        with RedisLeases(client=client, prefix=prefix) as leases:
            assert leases.cluster  # implied by the client
            held = [leases.try_acquire(f"n{i}", 5.0) for i in range(30)]
            assert all(lease is not None for lease in held)
            nodes = {
                client.get_node_from_key(f"{prefix}{{n{i}}}").name  # type: ignore[no-untyped-call]
                for i in range(30)
            }
            assert len(nodes) == 3  # the names really live on every master
            for lease in held:
                assert lease is not None
                assert leases.holder(lease.name) is not None
                lease.release()
        assert client.ping()  # close() leaves the caller's client open
    finally:
        client.close()


@pytest.mark.backend
def test_redis_client_with_decode_responses_still_wakes_waiters(redis_url: str, name: str) -> None:
    import redis

    prefix = f"decode:{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    holder = RedisLeases(client=client, prefix=prefix, timeout=2.0)
    waiter = RedisLeases(client=client, prefix=prefix, timeout=2.0)
    try:
        lease = holder.acquire(name, at_most_for=60.0)
        wait, outcome = in_thread(lambda: waiter.acquire(name, 5.0, timeout=30.0))
        channel = f"{prefix}{{{name}}}:released"  # the key scheme in RedisLeases' docstring
        wait_until(
            lambda: dict(client.pubsub_numsub(channel)).get(channel) == 1,
            what="the waiter's subscription",
        )
        lease.release()
        wait.join(15)
        assert isinstance(outcome[0], DistributedLease), outcome
        # The release's message reaches the listener and is understood (with str replies it
        # never matched). Waited for, not asserted at once: under load the waiter's last
        # poll before its subscription was confirmed can take the lease first.
        wait_until(lambda: waiter.stats().notifications >= 1, what="the release notification")
        outcome[0].release()
    finally:
        holder.close()
        waiter.close()
        client.close()
