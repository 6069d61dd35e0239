"""``KeyedConsumer(offsets=PostgresOffsets(...))``: exactly once into PostgreSQL, in one process.

On the suite's real broker and a real PostgreSQL. Handlers insert into an effects table without
a unique constraint (``effects.py``), so a record applied twice is two rows; the checker asserts
every produced (key, seq) applied exactly once, per key in seq order. The multi-process runs
(``kill -9``, scaling, ``SIGSTOP``, a database restart) are in ``test_kafka_offsets_processes.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from support.servers import ThrowawayPostgres, start_postgres

from rxcoord.kafka import (
    KeyedConsumer,
    OffsetStoreError,
    OffsetStoreMisconfigured,
    OffsetStoreUnavailable,
    PostgresOffsets,
    Record,
)

from .effects import Effects, check_exactly_once, parse
from .support import Cluster, Produced, Running, keyed_items, wait_for

IDLE = 2.0  # seconds: idle_in_transaction_timeout of the tests that freeze a transaction


@pytest.fixture
def effects(cluster: Cluster, postgres_url: str) -> Iterator[Effects]:
    table = Effects(postgres_url, cluster.tag)
    try:
        yield table
    finally:
        table.drop()


def _offsets(effects: Effects, **options: Any) -> PostgresOffsets:
    return PostgresOffsets(effects.url, table=effects.offsets_table, **options)


def _consumer(
    cluster: Cluster,
    topic: str,
    group: str,
    handle: Any,
    offsets: PostgresOffsets,
    **options: Any,
) -> KeyedConsumer:
    options = {"max_concurrency": 8, "commit_interval": 0.1, **options}
    return KeyedConsumer(cluster.config(group), [topic], handle, offsets=offsets, **options)


def _outcomes(offsets: PostgresOffsets) -> int:
    """Record transactions that ended for good: committed with their mark, or fenced."""
    stats = offsets.stats()
    return stats.committed + stats.fenced


def _applied(effects: Effects, produced: Produced) -> bool:
    return {(r.key, r.seq) for r in effects.rows()} >= set(produced.where)


def test_each_record_applied_once_in_key_order_and_the_table_folded(
    cluster: Cluster, effects: Effects
) -> None:
    topic = cluster.topic(4)
    produced = cluster.produce(topic, keyed_items(2000, 50))
    group = cluster.group()
    offsets = _offsets(effects)
    running = Running(_consumer(cluster, topic, group, effects.handler("w0"), offsets))
    wait_for(lambda: _applied(effects, produced), 60, "every record applied")
    # Bounded storage: the prefix reaches the end and the done rows are folded away, so the
    # table keeps one row per partition, whose done_below is the partition's end.
    wanted = {(group, topic, p, -1, produced.end[p]) for p in produced.end}
    wait_for(
        lambda: {(g, t, p, o, below) for g, t, p, o, _, below in effects.stored()} == wanted,
        30,
        "the stored prefixes at the ends, done rows folded",
    )
    # Bounded: the partition row, its 16 lock rows, no done row.
    assert set(effects.rows_per_partition().values()) == {17}
    # Kafka stays informed: the committed offsets follow (behind the database).
    wait_for(lambda: cluster.committed(topic, group, 4) == produced.end, 30, "Kafka commits")
    assert running.stop() is None
    check_exactly_once(produced, effects.rows())
    stats = offsets.stats()
    assert stats.committed == 2000
    assert stats.claims == 4
    assert stats.fenced == 0


def test_a_restart_resumes_from_the_table_not_from_kafka(
    cluster: Cluster, effects: Effects
) -> None:
    """Done rows beyond the prefix are skipped, and Kafka's committed offset is not trusted.

    The first run applies everything but key k0, whose first record blocks: the stored prefix
    of its partition stays before it, with the partition's later records of other keys done
    beyond it. The run ends without waiting for it, Kafka's committed offsets are reset to 0,
    and a second consumer must apply exactly k0's records. The first run's blocked transaction,
    released at the end, is fenced: its late INSERT rolls back.
    """
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(600, 20))
    group = cluster.group()
    release = threading.Event()
    blocked = produced.where[("k0", 0)]

    def hook(record: Record, tx: Any) -> None:
        if (record.partition, record.offset) == blocked:
            release.wait(60)

    offsets_first = _offsets(effects, idle_in_transaction_timeout=120)
    first = Running(
        _consumer(
            cluster, topic, group, effects.handler("w0", hook), offsets_first, drain_timeout=1
        )
    )
    k0 = {ks for ks in produced.where if ks[0] == "k0"}
    others = set(produced.where) - k0
    try:
        wait_for(lambda: {(r.key, r.seq) for r in effects.rows()} >= others, 60, "other keys")
        assert first.stop(drain=False) is None  # k0's first record still blocked
        # Kafka's committed offsets back to the start: only the table says what is done.
        reset = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": group})
        reset.commit(offsets=[TopicPartition(topic, p, 0) for p in range(2)], asynchronous=False)
        reset.close()
        offsets = _offsets(effects)
        calls: list[tuple[str, int]] = []
        second = Running(
            _consumer(
                cluster, topic, group,
                effects.handler("w1", lambda record, tx: calls.append(parse(record))), offsets,
            )
        )  # fmt: skip
        wait_for(lambda: _applied(effects, produced), 60, "k0 applied by the second run")
        assert second.stop() is None
        before = _outcomes(offsets_first)
    finally:
        release.set()
    # The first run's blocked transaction ends now (committed or fenced: the checker tells).
    wait_for(lambda: _outcomes(offsets_first) > before, 30, "the blocked transaction ending")
    check_exactly_once(produced, effects.rows())
    assert offsets_first.stats().fenced == 1
    # The second run started at the blocked record and skipped the records done beyond it:
    # its handler ran for k0's records only.
    assert sorted(calls) == sorted(k0)
    assert offsets.stats().skipped > 0


def test_a_failing_handler_applies_nothing_and_skip_marks_it_done(
    cluster: Cluster, effects: Effects
) -> None:
    """The poison record's INSERT rolls back; ``on_error="skip"`` marks it done in the table at
    once, not only when the prefix passes it: here a blocked record before it keeps the prefix
    back, the run ends, and the next run (whose handler would not fail) must not run it."""
    topic = cluster.topic(1)
    produced = cluster.produce(topic, keyed_items(200, 10))
    group = cluster.group()
    blocker, poison = produced.where[("k0", 0)], produced.where[("k3", 5)]
    assert blocker[1] < poison[1]
    release = threading.Event()

    def hook(record: Record, tx: Any) -> None:
        where = (record.partition, record.offset)
        if where == poison:
            raise ValueError("poison")  # after its INSERT: the transaction rolls it back
        if where == blocker:
            release.wait(60)

    offsets = _offsets(effects)
    first = Running(
        _consumer(
            cluster, topic, group, effects.handler("w0", hook), offsets, on_error="skip",
            drain_timeout=1,
        )
    )  # fmt: skip
    try:
        wait_for(lambda: offsets.stats().marked_failed == 1, 60, "the poison record marked")
        assert ("k3", 5) not in {(r.key, r.seq) for r in effects.rows()}
        assert first.stop(drain=False) is None
        again = Running(_consumer(cluster, topic, group, effects.handler("w1"), _offsets(effects)))
        wait_for(lambda: ("k0", 0) in {(r.key, r.seq) for r in effects.rows()}, 60, "k0 again")
        expected = Produced(topic, {ks: w for ks, w in produced.where.items() if ks != ("k3", 5)})
        wait_for(lambda: _applied(effects, expected), 60, "every other record")
        assert again.stop() is None
    finally:
        release.set()
    check_exactly_once(expected, effects.rows())  # the poison record: never applied


def test_stop_leaves_the_failed_record_for_the_next_run(cluster: Cluster, effects: Effects) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(200, 10))
    group = cluster.group()
    poison = produced.where[("k3", 5)]

    def hook(record: Record, tx: Any) -> None:
        if (record.partition, record.offset) == poison:
            raise ValueError("poison")

    consumer = _consumer(cluster, topic, group, effects.handler("w0", hook), _offsets(effects))
    with pytest.raises(ValueError, match="poison"):
        consumer.run()
    assert ("k3", 5) not in {(r.key, r.seq) for r in effects.rows()}
    running = Running(_consumer(cluster, topic, group, effects.handler("w1"), _offsets(effects)))
    wait_for(lambda: _applied(effects, produced), 60, "the rest, poison record included")
    assert running.stop() is None
    check_exactly_once(produced, effects.rows())


def test_a_run_past_its_assignment_rolls_back(cluster: Cluster, effects: Effects) -> None:
    """A handler still running when its partition moved on (past ``revoke_timeout``) is fenced:
    its transaction rolls back when it ends, and the new owner applies the record once.

    A alone blocks in the first record of each of two partitions; B joins, A's revoke gives up
    after ``revoke_timeout`` and one partition moves to B, which claims it (A's open
    transaction holds no lock on the partition row) and applies its records. A's blocked run of
    that partition's first record then ends, and its mark finds B's epoch.
    """
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(200, 10))
    group = cluster.group()
    blocked: set[int] = set()
    release = threading.Event()

    def hook(record: Record, tx: Any) -> None:
        if record.offset == 0 and record.partition not in blocked:
            blocked.add(record.partition)
            release.wait(60)

    offsets_a = _offsets(effects)
    member_a = Running(
        _consumer(cluster, topic, group, effects.handler("A", hook), offsets_a, revoke_timeout=1)
    )
    offsets_b = _offsets(effects)
    try:
        wait_for(lambda: blocked == {0, 1}, 60, "A blocked in both partitions")
        member_b = Running(_consumer(cluster, topic, group, effects.handler("B"), offsets_b))
        wait_for(lambda: offsets_b.stats().claims >= 1, 60, "B claiming a partition from A")
        moved: set[int] = set()

        def b_done() -> bool:
            # B took a partition and applied what A had left of it, the blocked record first
            # (A applied the records of the partition's other keys before the move).
            rows = effects.rows()
            moved.update(r.partition for r in rows if r.worker == "B")
            wanted = {ks for ks, (p, _) in produced.where.items() if p in moved}
            return bool(moved) and {(r.key, r.seq) for r in rows} >= wanted

        wait_for(b_done, 60, "B applying every record of the partition it took")
        before = _outcomes(offsets_a)
    finally:
        release.set()
    # A's blocked runs end now: the one of the moved partition is fenced (its INSERT rolls
    # back), the other one's partition was claimed again by A, so it is fenced too.
    wait_for(lambda: _outcomes(offsets_a) >= before + 2, 30, "A's late transactions ending")
    wait_for(lambda: _applied(effects, produced), 60, "every record")
    assert member_b.stop() is None
    assert member_a.stop() is None
    check_exactly_once(produced, effects.rows())
    assert offsets_a.stats().fenced == 2
    assert {r.worker for r in effects.rows() if r.partition in moved and r.offset == 0} == {"B"}


def test_a_frozen_transaction_holds_a_claim_up_for_at_most_the_idle_timeout(
    cluster: Cluster, effects: Effects
) -> None:
    """A's handler updates an account row, takes the share lock a member frozen between its
    mark and its COMMIT holds on a lock row of the partition, and stops answering (PostgreSQL sees a
    session idle in its transaction, as with a ``SIGSTOP``). A new owner's claim waits for that
    lock; the server ends A's session ``idle_in_transaction_timeout`` after its last statement,
    which releases the locks: the claim returns then, not later. A's record, tried again on a
    new connection when it wakes up, is fenced by the new epoch."""
    topic = cluster.topic(1)
    produced = cluster.produce(topic, keyed_items(10, 1))
    group = cluster.group()
    account = f"{effects.table}_acc"
    with psycopg.connect(effects.url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {account} (id int PRIMARY KEY, n int)")
        conn.execute(f"INSERT INTO {account} VALUES (1, 0)")
    frozen_at: list[float] = []
    release = threading.Event()

    def hook(record: Record, tx: Any) -> None:
        tx.execute(f"UPDATE {account} SET n = n + 1 WHERE id = 1")
        if not frozen_at:
            # A lock row of the partition: a frozen mark holds one.
            tx.execute(f"SELECT 1 FROM {effects.offsets_table} WHERE kafka_offset = -2 FOR SHARE")
            frozen_at.append(time.monotonic())
            release.wait(60)

    offsets_a = _offsets(effects, idle_in_transaction_timeout=IDLE)
    member_a = Running(_consumer(cluster, topic, group, effects.handler("A", hook), offsets_a))
    try:
        wait_for(lambda: bool(frozen_at), 60, "A frozen in its first record")
        new_owner = _offsets(effects, idle_in_transaction_timeout=IDLE)
        new_owner.bind(_nothing, group=group, max_concurrency=1, on_error=_stop)
        claims = new_owner.claim([(topic, 0)])
        waited = time.monotonic() - frozen_at[0]
        assert IDLE - 0.5 <= waited <= IDLE + 3, waited  # held up by A, then freed by the server
        assert claims[(topic, 0)].epoch == 2
        with psycopg.connect(effects.url, autocommit=True) as conn:
            # A's session is gone and its update rolled back.
            row = conn.execute(f"SELECT n FROM {account}").fetchone()
            assert row is not None
            assert row[0] == 0
            gone = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' "
                "AND application_name = 'rxcoord-kafka-offsets'"
            ).fetchone()
            assert gone is not None
            assert gone[0] == 0
        new_owner.close()
    finally:
        release.set()
    # A wakes up: its connection was closed by the server; the retry finds the new epoch.
    wait_for(lambda: offsets_a.stats().fenced >= 1, 30, "A's record fenced")
    member_a.stop()
    assert ("k0", 0) not in {(r.key, r.seq) for r in effects.rows()}
    assert offsets_a.stats().retried >= 1
    with psycopg.connect(effects.url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {account}")
    del produced


def test_connections_at_most_one_per_running_handler(cluster: Cluster, effects: Effects) -> None:
    topic = cluster.topic(4)
    produced = cluster.produce(topic, keyed_items(400, 100))
    group = cluster.group()
    offsets = _offsets(effects)

    def hook(record: Record, tx: Any) -> None:
        time.sleep(0.005)

    running = Running(
        _consumer(cluster, topic, group, effects.handler("w0", hook), offsets, max_concurrency=3)
    )
    seen: list[int] = []
    pooled: list[int] = []
    with psycopg.connect(effects.url, autocommit=True) as conn:
        while not _applied(effects, produced):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = 'rxcoord-kafka-offsets'"
            ).fetchone()
            seen.append(int(row[0]) if row else 0)
            pooled.append(offsets.stats().connections)
            time.sleep(0.01)
    assert running.stop() is None
    check_exactly_once(produced, effects.rows())
    # Three handlers at most, each on one connection, plus the store's bookkeeping connection.
    assert max(seen) <= 3 + 1
    assert max(seen) >= 2  # the handlers did run on the pool
    assert 1 <= max(pooled) <= 3
    assert offsets.stats().connections == 0  # closed with the run


def test_async_handlers_run_in_the_transaction_on_the_loop(
    cluster: Cluster, effects: Effects
) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(300, 20))
    group = cluster.group()
    sql = (
        f"INSERT INTO {effects.table} (key, seq, worker, part, kafka_offset) "
        "VALUES (%s, %s, %s, %s, %s)"
    )

    async def handle(record: Record, tx: Any) -> None:
        assert isinstance(tx, psycopg.AsyncConnection)
        key, seq = parse(record)
        await tx.execute(sql, (key, seq, "async", record.partition, record.offset))
        await asyncio.sleep(0)

    offsets = _offsets(effects)
    consumer = _consumer(cluster, topic, group, handle, offsets)

    async def main() -> None:
        task = asyncio.create_task(consumer.run_async())
        await asyncio.to_thread(wait_for, lambda: _applied(effects, produced), 60, "all applied")
        await consumer.aclose()
        await task

    asyncio.run(main())
    check_exactly_once(produced, effects.rows())
    assert offsets.stats().committed == 300


def test_a_pool_of_your_own(cluster: Cluster, effects: Effects) -> None:
    """The store takes one connection per running handler from the application's pool, with
    the pool's transaction settings, sets the idle timeout for its transactions only (the
    application's sessions keep theirs), and leaves the pool open."""
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(200, 20))
    group = cluster.group()
    seen: set[tuple[str, str]] = set()

    def hook(record: Record, tx: Any) -> None:
        idle = tx.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0]
        isolation = tx.execute("SHOW transaction_isolation").fetchone()[0]
        seen.add((idle, isolation))

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ

    with ConnectionPool(
        effects.url, min_size=1, max_size=4, configure=configure, open=True
    ) as pool:
        offsets = PostgresOffsets(pool, table=effects.offsets_table, idle_in_transaction_timeout=7)
        running = Running(_consumer(cluster, topic, group, effects.handler("w0", hook), offsets))
        wait_for(lambda: _applied(effects, produced), 60, "every record")
        assert running.stop() is None
        assert not pool.closed  # the application's pool stays open
        assert pool.get_stats()["pool_available"] == pool.get_stats()["pool_size"]  # all back
        with pool.connection() as conn:
            assert not conn.autocommit  # lent in autocommit mode, given back as it was
            setting = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
        assert setting is not None
        assert setting[0] == "0"  # the session's own setting, untouched
    assert seen == {("7s", "repeatable read")}
    check_exactly_once(produced, effects.rows())


def test_a_role_that_may_only_use_the_table(
    cluster: Cluster, postgres_server: ThrowawayPostgres
) -> None:
    """The table exists (created by its owner); a role with SELECT, INSERT, UPDATE, DELETE on
    it and the effects table, and no CREATE anywhere, runs the consumer. A role without them
    is refused with the grant to make, whatever on_error says."""
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(100, 10))
    group = cluster.group()
    admin_url = postgres_server.url
    owner = Effects(admin_url, f"own{cluster.tag}")
    role = f"app_{uuid.uuid4().hex[:8]}"
    stranger = f"no_{uuid.uuid4().hex[:8]}"
    try:
        owner_store = PostgresOffsets(admin_url, table=owner.offsets_table)
        owner_store.bind(_nothing, group="setup", max_concurrency=1, on_error=_stop)
        owner_store.claim([(topic, 0)])  # creates the table
        owner_store.close()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            for name in (role, stranger):
                conn.execute(f"CREATE ROLE {name} LOGIN")
            conn.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON {owner.offsets_table}, {owner.table} "
                f"TO {role}"
            )
            conn.execute(f"GRANT USAGE ON SEQUENCE {owner.table}_id_seq TO {role}")
        url = f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
        offsets = PostgresOffsets(url, table=owner.offsets_table)
        running = Running(_consumer(cluster, topic, group, owner.handler("w0"), offsets))
        wait_for(lambda: _applied(owner, produced), 60, "every record, as the restricted role")
        assert running.stop() is None
        check_exactly_once(produced, owner.rows())
        url = f"postgresql://{stranger}@127.0.0.1:{postgres_server.port}/postgres"
        refused = _consumer(
            cluster, topic, cluster.group("other"), owner.handler("w1"),
            PostgresOffsets(url, table=owner.offsets_table), on_error="skip",
        )  # fmt: skip
        with pytest.raises(OffsetStoreMisconfigured, match="grant the role SELECT, INSERT"):
            refused.run()
    finally:
        owner.drop()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
            for name in (role, stranger):
                conn.execute(f"DROP OWNED BY {name}")
                conn.execute(f"DROP ROLE {name}")


def _nothing(record: Record, tx: Any) -> None:
    pass


def _stop(record: Record, exc: Exception) -> Exception:
    return exc


@pytest.fixture
def own_postgres() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL server of this test's own, to stop and start."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


def test_a_database_that_is_down_fails_records_never_marks_them_done(
    cluster: Cluster, own_postgres: ThrowawayPostgres
) -> None:
    """With the database stopped mid-run, records fail as an outage: retried for
    ``outage_timeout``, then the consumer stops with ``OffsetStoreUnavailable`` even with
    ``on_error="skip"`` (skipping would mark them done). After the restart, every record is
    applied exactly once."""
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(400, 20))
    group = cluster.group()
    effects = Effects(own_postgres.url, cluster.tag)

    def hook(record: Record, tx: Any) -> None:
        time.sleep(0.01)

    offsets = PostgresOffsets(
        own_postgres.url, table=effects.offsets_table, outage_timeout=1.0, timeout=2.0
    )
    running = Running(
        _consumer(
            cluster, topic, group, effects.handler("w0", hook), offsets, on_error="skip",
            max_concurrency=4,
        )
    )  # fmt: skip
    wait_for(lambda: effects.count() >= 50, 60, "progress before the outage")
    own_postgres.stop("fast")
    error = running.join(60)
    assert isinstance(error, OffsetStoreUnavailable), error
    assert offsets.stats().retried > 0
    own_postgres.start()
    done_before = {(r.key, r.seq) for r in effects.rows()}
    assert len(done_before) < len(produced.where)
    again = Running(_consumer(cluster, topic, group, effects.handler("w1"), PostgresOffsets(
        own_postgres.url, table=effects.offsets_table)))  # fmt: skip
    wait_for(lambda: _applied(effects, produced), 60, "the rest after the restart")
    assert again.stop() is None
    check_exactly_once(produced, effects.rows())


@pytest.mark.parametrize(
    "ending",
    [
        "commit",
        "commit, then a statement",
        "COMMIT, then a statement",
        "rollback, then a statement",
    ],
)
def test_a_handler_that_ends_tx_itself_stops_the_consumer(
    cluster: Cluster, effects: Effects, ending: str
) -> None:
    """Also when the handler goes on after ending the transaction: its later statements must
    not open a transaction of their own for the record's mark to commit with."""
    topic = cluster.topic(1)
    cluster.produce(topic, keyed_items(5, 1))
    group = cluster.group()

    def handle(record: Record, tx: Any) -> None:
        if ending.startswith("commit"):
            tx.commit()
        elif ending.startswith("COMMIT"):
            tx.execute("COMMIT")
        else:
            tx.rollback()
        if ending.endswith("statement"):
            tx.execute("SELECT 1")

    offsets = _offsets(effects)
    consumer = _consumer(cluster, topic, group, handle, offsets, on_error="skip")
    with pytest.raises(OffsetStoreError, match=r"ended tx's transaction itself"):
        consumer.run()
    assert offsets.stats().committed == 0  # the record's mark never committed


async def test_an_async_pool_of_your_own_lends_its_connections_unchanged(
    cluster: Cluster, effects: Effects
) -> None:
    """An async handler on the application's ``AsyncConnectionPool``: each record applied
    once, and the connections go back with the pool's own settings; a handler that commits
    and goes on stops the consumer, its record not marked."""
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(100, 10))
    sql = (
        f"INSERT INTO {effects.table} (key, seq, worker, part, kafka_offset) "
        "VALUES (%s, %s, %s, %s, %s)"
    )

    async def handle(record: Record, tx: Any) -> None:
        key, seq = parse(record)
        await tx.execute(sql, (key, seq, "async", record.partition, record.offset))

    async with AsyncConnectionPool(effects.url, min_size=1, max_size=4, open=False) as pool:
        offsets = PostgresOffsets(pool, table=effects.offsets_table)
        consumer = _consumer(cluster, topic, cluster.group(), handle, offsets)
        task = asyncio.create_task(consumer.run_async())
        await asyncio.to_thread(wait_for, lambda: _applied(effects, produced), 60, "all applied")
        await consumer.aclose()
        await task
        assert offsets.stats().committed == 100
        async with pool.connection() as conn:
            assert not conn.autocommit  # lent in autocommit mode, given back as it was

        async def commits(record: Record, tx: Any) -> None:
            await tx.commit()
            await tx.execute("SELECT 1")

        again = PostgresOffsets(pool, table=effects.offsets_table)
        late = cluster.topic(1)
        cluster.produce(late, keyed_items(1, 1))
        stopping = _consumer(cluster, late, cluster.group(), commits, again, on_error="skip")
        with pytest.raises(OffsetStoreError, match=r"ended tx's transaction itself"):
            await stopping.run_async()
        assert again.stats().committed == 0
    check_exactly_once(produced, effects.rows())


def test_bad_input_fails_at_the_call(effects: Effects) -> None:
    config = {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}

    def one_arg(record: Record) -> None:
        pass

    with pytest.raises(TypeError, match=r"handle must take \(record, tx\)"):
        KeyedConsumer(config, ["t"], one_arg, offsets=_offsets(effects))
    with pytest.raises(ValueError, match="invalid table name"):
        PostgresOffsets(effects.url, table="offsets; DROP TABLE x")
    with pytest.raises(ValueError, match=r"enable\.auto\.commit"):
        KeyedConsumer(
            {**config, "enable.auto.commit": "true"}, ["t"], _nothing,
            offsets=_offsets(effects),
        )  # fmt: skip
    with pytest.raises(TypeError, match="offsets must be a PostgresOffsets"):
        KeyedConsumer(config, ["t"], _nothing, offsets=effects.url)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="url_or_pool must be"):
        PostgresOffsets(42)  # type: ignore[arg-type]
    for value, error in ((0, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="idle_in_transaction_timeout"):
            PostgresOffsets(effects.url, idle_in_transaction_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outage_timeout"):
        PostgresOffsets(effects.url, outage_timeout=-1)
    shared = _offsets(effects)
    KeyedConsumer(config, ["t"], _nothing, offsets=shared).close()
    with pytest.raises(ValueError, match="used by another KeyedConsumer"):
        KeyedConsumer(config, ["t"], _nothing, offsets=shared)

    async def async_handle(record: Record, tx: Any) -> None:
        pass

    pool = ConnectionPool(effects.url, open=False)
    with pytest.raises(TypeError, match="needs an AsyncConnectionPool"):
        KeyedConsumer(config, ["t"], async_handle, offsets=PostgresOffsets(pool))
    apool = AsyncConnectionPool(effects.url, open=False)
    with pytest.raises(TypeError, match="a sync handler needs a ConnectionPool"):
        KeyedConsumer(config, ["t"], _nothing, offsets=PostgresOffsets(apool))
