"""Exactly once into PostgreSQL: a record's effects and its offset in one transaction, fenced.

``KeyedConsumer`` alone is at-least-once: after a crash or a rebalance every record past the
committed prefix runs again. Kafka's own transactions stop at Kafka, so the pattern that holds
for a database sink (Kafka Connect's JDBC sink, Flink) is to keep the consumed position in the
same database transaction as the effects. That is what this store does, with the consumer's
per-key parallelism kept and every assignment fenced.

The table (created if missing; a role that may only use it needs SELECT, INSERT, UPDATE and
DELETE on it, nothing else)::

    group_id text, topic text, partition_id integer, kafka_offset bigint,  -- the primary key
    epoch bigint NOT NULL, done_below bigint

* the *partition row* (``kafka_offset = -1``): ``epoch``, the current assignment's fencing
  token, and ``done_below``, the end of the contiguous done prefix (every offset below it is
  done; NULL until the first fold);
* 16 *lock rows* (``kafka_offset`` -2 to -17), each holding the same ``epoch``;
* a *done row* per record committed beyond the prefix (``kafka_offset >= 0``; ``epoch`` says
  which assignment committed it).

A record's transaction, on one pooled connection (``tx``)::

    BEGIN                                              -- one round trip
    <the handler's statements>
    EXECUTE mark(g, t, p, o, e); COMMIT                -- one round trip

where ``mark`` (prepared once per connection) is ``INSERT INTO t (group_id, topic,
partition_id, kafka_offset, epoch) VALUES (g, t, p, o, (SELECT epoch FROM t WHERE <lock row
-2 - o % 16 of g, t, p> AND epoch = e FOR SHARE))``.

**Fencing.** An assignment *claims* its partitions: one transaction increments each partition
row's ``epoch``, sets its lock rows to it (an ``UPDATE`` that waits for every ``FOR SHARE``
holder), and then, in a later statement, reads the prefix and the done rows. A record's mark
reads its epoch ``FOR SHARE`` from a lock row: while a claim's ``UPDATE`` is pending it waits,
and then re-reads the row (PostgreSQL's READ COMMITTED re-check; REPEATABLE READ and
SERIALIZABLE fail with a serialization error instead, which is retried), finds a newer epoch,
yields NULL and violates ``epoch``'s NOT NULL: the mark fails, the whole transaction rolls back
(the ``COMMIT`` behind it in the same query is never reached) and the record's result is
dropped. So every transaction that marks a record either committed before the claim's read, and
the new owner sees its mark, or rolls back; the new owner seeks to the prefix and skips the
marked offsets, and so each record's effects commit exactly once, in per-key order (the
consumer runs a key's records one at a time, and a member whose epoch moved on commits nothing
more). The primary key adds a second line: a record marked twice violates it, which is also how
a retry after a ``COMMIT`` whose answer was lost learns that its first attempt did commit.
Why 16 lock rows and not the partition row: concurrent share locks on one row make PostgreSQL
create a multixact (a shared lock holders' list) for each new locker; spread over 16 rows (by
offset), concurrent marks of one partition seldom meet, and the folds, which update the
partition row, never wait for marks.

**A frozen member.** A member paused (``SIGSTOP``, a VM freeze) in the middle of a transaction
holds that transaction's locks, and the server cannot tell it from a slow one. Every
transaction of the store runs with ``idle_in_transaction_session_timeout``
(``idle_in_transaction_timeout``, default 10 s): once the frozen member's current statement
ended, the server ends its session after that long, which rolls the transaction back and
releases its row locks, a lock row's share lock included. So a frozen member holds up the claim
of its partitions, and the new owner's statements that wait for rows it locked, for at most
``idle_in_transaction_timeout`` past its last statement's end; the claim waits no longer than
that plus ``timeout`` (its ``lock_timeout``) before it tries again. The same timeout is the
longest a handler may pause between its statements. A killed member's connections close with
it, so its transactions roll back at once.

**Bounded storage.** Each fold (periodically, on revoke, and in every claim) moves
``done_below`` to the consumer's contiguous done prefix and deletes the done rows below it, in
one statement fenced by the epoch. A partition keeps its 17 rows plus the done rows of records
in flight or committed since the last fold.

**Kafka.** The consumer still commits its prefix to Kafka, after the records' transactions
committed, so lag tools keep working; correctness rests on the table alone. A partition the
table has no prefix for yet starts where Kafka's committed offset (or ``auto.offset.reset``)
says, and skips what its done rows already hold.

**Costs.** Per record: the handler's statements plus two round trips of the store's (``BEGIN``;
the mark and the ``COMMIT`` in one query), where an autocommitted handler needs none. The
store's own statements go through libpq's calls (``psycopg.pq``), not psycopg's cursors, and
idle connections of its own pool wait in a deque in front of the pool: psycopg's cursor and
pool layers cost more client time than the statements themselves
(``benchmarks/bench_kafka_offsets.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import inspect
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from loguru import logger
from reactivex import abc as rx_abc

from rxcoord._core.checks import check_delay, check_identifier, check_length

from ._errors import OffsetStoreError, OffsetStoreMisconfigured, OffsetStoreUnavailable

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

    from ._partitions import PartitionState
    from ._record import Record

__all__ = ["Claim", "Dropped", "OffsetStoreStats", "PostgresOffsets", "Stopped"]

_SCHEMA_LOCK: Final = 0x72786B6F6666  # advisory lock key for table creation ("rxkoff")
# Lock rows per partition that marks take their share lock on (offset modulo this), so that
# concurrent marks of one partition seldom share one (see "Fencing" above).
_STRIPES: Final = 16
_OFFSET_STORED: Final = -1000  # librdkafka: start at the group's committed offset
_BACKOFF: Final = 0.05  # seconds before the first retry of a record's transaction
_MAX_BACKOFF: Final = 1.0
_IDLE: Final = 0  # psycopg.pq.TransactionStatus.IDLE, INTRANS and INERROR
_INTRANS: Final = 2
_INERROR: Final = 3
_COMMAND_OK: Final = 1  # psycopg.pq.ExecStatus.COMMAND_OK and TUPLES_OK
_TUPLES_OK: Final = 2
_SQLSTATE: Final = 67  # psycopg.pq.DiagnosticField.SQLSTATE
_DUPLICATE_PREPARED: Final = b"42P05"  # duplicate_prepared_statement
# SQLSTATEs after which a record's transaction is tried again: the connection or the server
# went away (08, 57P01-57P03, too many connections 53300, idle-in-transaction timeout 25P03),
# or PostgreSQL asks for a retry (serialization failure, deadlock).
_TRANSIENT: Final = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "53300", "25P03"})
_MAX_TIMEOUT_MS: Final = 2**31 - 1  # PostgreSQL's integer settings

OnError = Callable[["Record", Exception], "Exception | None"]


@dataclass(frozen=True, slots=True)
class OffsetStoreStats:
    """A snapshot of a :class:`PostgresOffsets`.

    Attributes:
        table: The offsets table.
        claims: Partition assignments claimed (each took a new epoch).
        committed: Records whose transaction committed with their mark.
        skipped: Records not run because the table already had them done when their partition
            was claimed (work of a previous owner past the stored prefix).
        fenced: Records whose transaction rolled back because their partition's epoch moved on
            (another member claimed it): their results were dropped.
        retried: Record transactions tried again after a transient database error.
        marked_failed: Failed records marked done without their effects (``on_error`` said
            so).
        folds: Fold statements run (each for any number of partitions).
        connections: Connections the store's own pool holds open (at most ``max_concurrency``;
            0 with a pool of your own, or before the first record).
    """

    table: str
    claims: int
    committed: int
    skipped: int
    fenced: int
    retried: int
    marked_failed: int
    folds: int
    connections: int


class Claim:
    """One assignment of one partition in the store: its epoch and where it starts."""

    __slots__ = ("done", "epoch", "folded", "mark", "partition", "start", "topic")

    def __init__(
        self,
        topic: str,
        partition: int,
        epoch: int,
        prefix: int | None,
        done: set[int],
        mark: tuple[str, str],
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.epoch = epoch
        # Offsets marked done beyond the prefix when the claim was made: skipped, not run.
        self.done = done
        self.folded = -1 if prefix is None else prefix  # the stored done_below
        self.start = _OFFSET_STORED if prefix is None else prefix  # where fetching begins
        # The end of a record's transaction but its offset: ``EXECUTE <the mark>(group, topic,
        # partition, `` and ``, epoch); COMMIT``, literals quoted.
        self.mark = mark

    def tail(self, offset: int, encoding: str) -> bytes:
        """The mark of ``offset`` and the ``COMMIT``: one query, one round trip."""
        head, end = self.mark
        return f"{head}{offset}{end}".encode(encoding)

    def __repr__(self) -> str:
        return f"Claim({self.topic}[{self.partition}] epoch={self.epoch} start={self.start})"


class Dropped(Exception):
    """The record's transaction rolled back because its partition belongs to another member
    now (fenced), or it was revoked while the transaction was being retried: its result is
    dropped, as a revoked partition's late result is."""


class Stopped(Exception):
    """The consumer must stop with ``error``; ``on_error`` was applied already, or must not be
    (the record is not done: "skip" would lose it)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Retry(Exception):
    """A transient database error: the record's transaction is tried again."""


class _Connections:
    """A pool's connections, idle ones waiting in a deque in front of it.

    ``deque.pop``/``append`` are atomic, so the common case takes no lock, while psycopg-pool's
    ``getconn``/``putconn`` cost more client time than a record's own statements. The pool still
    opens, counts (``max_size``) and closes every connection. A caller that finds the deque
    empty announces itself before it waits in the pool, and a connection returned while someone
    waits goes to the pool (so to that caller) instead of the deque.
    """

    def __init__(self, pool: psycopg_pool.ConnectionPool[Any], timeout: float, cache: bool) -> None:
        self.pool = pool
        self.timeout = timeout
        # Only in front of the store's own pool: idle connections kept here would be out of
        # reach of the rest of an application that shares its pool with the store.
        self.cache = cache
        self.idle: deque[psycopg.Connection[Any]] = deque()
        self.waiting = 0
        self.lock = threading.Lock()
        self.closing = False

    def get(self) -> psycopg.Connection[Any]:
        try:
            conn = self.idle.pop()
        except IndexError:
            with self.lock:
                self.waiting += 1
            try:
                try:
                    conn = self.idle.pop()
                except IndexError:
                    conn = self.pool.getconn(self.timeout)
            finally:
                with self.lock:
                    self.waiting -= 1
        return conn

    def put(self, conn: psycopg.Connection[Any]) -> None:
        if (
            not self.cache
            or conn.closed
            or conn.pgconn.transaction_status != _IDLE
            or self.waiting
            or self.closing
        ):
            self.pool.putconn(conn)  # discarded, reset, or handed to a waiter by the pool
            return
        self.idle.append(conn)
        if self.waiting or self.closing:
            # A caller announced itself after the check above and may have missed it.
            try:
                conn = self.idle.pop()
            except IndexError:
                return
            self.pool.putconn(conn)

    def close(self, own: bool) -> None:
        self.closing = True
        while True:
            try:
                conn = self.idle.pop()
            except IndexError:
                break
            self.pool.putconn(conn)
        if own:
            self.pool.close(timeout=self.timeout)


class PostgresOffsets:
    """Exactly once from Kafka into PostgreSQL: positions kept in the handler's transaction.

    Pass it to :class:`~rxcoord.kafka.KeyedConsumer` as ``offsets=``; the handler then takes
    ``(record, tx)``, where ``tx`` is a psycopg connection inside an open transaction (an
    ``AsyncConnection`` for an ``async def`` handler). The transaction commits when the handler
    returns, together with the record's mark in the offsets table; a handler that raises rolls
    it back and ``on_error`` decides (``"skip"`` and an ``on_error`` that returns mark the
    record done without its effects). Each record's effects commit exactly once, in per-key
    order, across crashes, rebalances, restarts and duplicate deliveries; an assignment that
    lost its partition (a member frozen past the session timeout, a run past
    ``revoke_timeout``) commits nothing more. See ``docs/guides/kafka-exactly-once.md``.

    The handler must not commit or roll back ``tx`` itself, nor return before its work is
    done (no Observable, future or awaitable to finish later). ``tx`` is lent in autocommit
    mode under the store's own ``BEGIN`` (a connection of the application's pool goes back
    as it was): psycopg then never begins a transaction of its own, so a handler that ended
    the transaction is caught even if it ran statements after that (the consumer stops).

    Args:
        url_or_pool: A libpq connection string or URL, or a psycopg-pool pool of your own
            (``ConnectionPool`` for sync handlers, an open ``AsyncConnectionPool`` for async
            ones). With a URL the store opens a pool of at most ``max_concurrency`` connections
            (one per running handler) when the consumer runs, and one more connection for its
            own bookkeeping (claims and folds).
        table: The offsets table (an identifier, optionally ``schema.table``); created if
            missing. One table serves any number of groups and topics.
        idle_in_transaction_timeout: Seconds the server lets a record's transaction sit idle
            (its handler between statements, or its process frozen) before it ends the
            session: the bound on how long a frozen member can hold up the takeover of its
            partitions (see the guide), and the longest pause a handler may take between two
            statements.
        timeout: Seconds to wait for a pooled connection, to connect, and for the store's own
            bookkeeping statements (a claim waits ``idle_in_transaction_timeout`` longer, for a
            frozen member's transaction to end).
        outage_timeout: Seconds a record's transaction is retried through transient database
            errors (a lost connection, a restart, a serialization failure or deadlock) before
            the consumer stops with :class:`~rxcoord.kafka.OffsetStoreUnavailable`. ``0``:
            stop at the first; ``inf``: retry until the database is back.

    Raises:
        ImportError: psycopg or psycopg-pool is missing (``pip install 'rxcoord[postgres]'``).
        TypeError: ``url_or_pool`` is neither a string nor a psycopg-pool pool, or a value has
            the wrong type.
        ValueError: ``table`` is not an identifier, or a duration is out of range.
    """

    def __init__(
        self,
        url_or_pool: str | psycopg_pool.ConnectionPool[Any] | psycopg_pool.AsyncConnectionPool[Any],
        *,
        table: str = "rxcoord_kafka_offsets",
        idle_in_transaction_timeout: float = 10.0,
        timeout: float = 5.0,
        outage_timeout: float = 60.0,
    ) -> None:
        parts = check_identifier(table)
        idle = check_length(idle_in_transaction_timeout, "idle_in_transaction_timeout")
        self._timeout = check_length(timeout, "timeout")
        self._outage_timeout = check_delay(outage_timeout, "outage_timeout")
        try:
            import psycopg
            import psycopg_pool
            from psycopg import sql
        except ImportError as exc:
            raise ImportError(
                "PostgresOffsets needs psycopg 3 and psycopg-pool: install them with: "
                "pip install 'rxcoord[postgres]'"
            ) from exc
        from rxcoord.leases._backends._drivers import route_driver_logs

        route_driver_logs("psycopg")  # psycopg-pool's connection errors: to loguru, not stderr
        self._psycopg = psycopg
        self._pool_mod = psycopg_pool
        if isinstance(url_or_pool, str):
            self._conninfo = url_or_pool
            self._given: Any = None
            given_kwargs: dict[str, Any] = {}
        elif isinstance(
            url_or_pool, psycopg_pool.ConnectionPool | psycopg_pool.AsyncConnectionPool
        ):
            conninfo, kwargs = url_or_pool.conninfo, url_or_pool.kwargs
            if not isinstance(conninfo, str) or not isinstance(kwargs, dict | None):
                raise TypeError(
                    "a pool whose conninfo or kwargs is a callable is not supported: pass the "
                    "connection string (or a pool made with one)"
                )
            self._given = url_or_pool
            self._conninfo = conninfo
            given_kwargs = dict(kwargs or {})
        else:
            raise TypeError(
                "url_or_pool must be a PostgreSQL URL or connection string, or a psycopg_pool "
                f"ConnectionPool or AsyncConnectionPool, not {url_or_pool!r}"
            )
        self.table = table
        self._idle_ms = min(_MAX_TIMEOUT_MS, max(1, round(idle * 1000)))
        self._idle_timeout = idle
        self._log = logger.bind(table=table)
        ident = sql.Identifier(*parts)
        self._table_literal = ident.as_string(None)
        self._relname = parts[-1]  # as the server names it in errors

        def render(query: str) -> str:
            return sql.SQL(query).format(t=ident).as_string(None)

        self._sql_create = render(
            'CREATE TABLE IF NOT EXISTS {t} (group_id text COLLATE "C" NOT NULL, '
            'topic text COLLATE "C" NOT NULL, '
            "partition_id integer NOT NULL, kafka_offset bigint NOT NULL, "
            "epoch bigint NOT NULL, done_below bigint, "
            "PRIMARY KEY (group_id, topic, partition_id, kafka_offset))"
        )
        # The mark (see the module docstring). Prepared once per connection: planned each
        # time, this INSERT cost a third of a record's whole time in the benchmark.
        self._sql_mark = render(
            "INSERT INTO {t} (group_id, topic, partition_id, kafka_offset, epoch) "
            "VALUES ($1, $2, $3, $4, (SELECT h.epoch FROM {t} AS h WHERE h.group_id = $1 "
            "AND h.topic = $2 AND h.partition_id = $3 "
            f"AND h.kafka_offset = -2 - ($4::bigint % {_STRIPES}) AND h.epoch = $5 FOR SHARE))"
        ).encode()
        self._mark_name = (
            b"rxk_" + hashlib.blake2b(self._sql_mark, digest_size=8).hexdigest().encode()
        )
        parts_cte = (
            "WITH x AS (SELECT * FROM unnest(%(topics)s::text[], %(parts)s::integer[]) "
            "AS x(topic, partition_id)) "
        )
        self._sql_add_rows = render(
            parts_cte + "INSERT INTO {t} (group_id, topic, partition_id, kafka_offset, epoch) "
            "SELECT %(group)s, x.topic, x.partition_id, o, 0 "
            f"FROM x, generate_series({-1 - _STRIPES}, -1) AS o ORDER BY 2, 3, 4 "
            "ON CONFLICT DO NOTHING"
        )
        # The partition row first, then its stripes (whose UPDATE waits for every mark
        # holding one): the order every claim takes them in.
        self._sql_bump = render(
            parts_cte + ", head AS (UPDATE {t} AS t SET epoch = t.epoch + 1 FROM x "
            "WHERE t.group_id = %(group)s AND t.topic = x.topic "
            "AND t.partition_id = x.partition_id AND t.kafka_offset = -1 "
            "RETURNING t.topic, t.partition_id, t.epoch, t.done_below), "
            "stripes AS (UPDATE {t} AS t SET epoch = head.epoch FROM head "
            "WHERE t.group_id = %(group)s AND t.topic = head.topic "
            "AND t.partition_id = head.partition_id AND t.kafka_offset < -1 RETURNING 1) "
            "SELECT topic, partition_id, epoch, done_below, (SELECT count(*) FROM stripes) "
            "FROM head"
        )
        self._sql_done = render(
            parts_cte + "SELECT t.topic, t.partition_id, t.kafka_offset FROM {t} AS t JOIN x "
            "ON t.topic = x.topic AND t.partition_id = x.partition_id "
            "WHERE t.group_id = %(group)s AND t.kafka_offset >= 0"
        )
        # One statement for any number of partitions: move each prefix (never backwards, and
        # only under its epoch) and delete the done rows it now covers.
        self._sql_fold = render(
            "WITH x AS (SELECT * FROM unnest(%(topics)s::text[], %(parts)s::integer[], "
            "%(epochs)s::bigint[], %(uptos)s::bigint[]) AS x(topic, partition_id, epoch, upto)), "
            "head AS (UPDATE {t} AS t SET done_below = x.upto FROM x "
            "WHERE t.group_id = %(group)s AND t.topic = x.topic "
            "AND t.partition_id = x.partition_id AND t.kafka_offset = -1 AND t.epoch = x.epoch "
            "AND (t.done_below IS NULL OR t.done_below < x.upto) "
            "RETURNING t.topic, t.partition_id, x.upto) "
            "DELETE FROM {t} AS t USING head WHERE t.group_id = %(group)s "
            "AND t.topic = head.topic AND t.partition_id = head.partition_id "
            "AND t.kafka_offset >= 0 AND t.kafka_offset < head.upto"
        )
        from rxcoord.leases._backends._pg_deadline import keepalive_kwargs

        self._connect_kwargs: dict[str, Any] = {
            **given_kwargs,
            "connect_timeout": max(2, round(self._timeout)),  # libpq's minimum is 2 s
            **keepalive_kwargs(self._conninfo, self._timeout),
        }
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._bound = False
        self._closed = False
        self._group = ""
        self._max_concurrency = 1
        self._is_async = False
        self._handle: Callable[..., Any] = _unbound
        self._on_error: OnError | None = None
        self._conns: _Connections | None = None
        self._apool: psycopg_pool.AsyncConnectionPool[Any] | None = None
        self._aopen: asyncio.Future[None] | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._admin_conn: psycopg.Connection[Any] | None = None
        self._table_ready = False
        # Connections this store has set up (prepared the mark on; set the idle timeout on,
        # for a pool of the application's own)
        # -> (its encoding, its BEGIN).
        self._ready: weakref.WeakKeyDictionary[Any, tuple[str, bytes]] = weakref.WeakKeyDictionary()
        self._fold_after = 0.0  # no fold attempt before (monotonic): after a failed one
        self._outage_logged = False
        self._claims = 0
        self._committed = 0
        self._skipped = 0
        self._fenced = 0
        self._retried = 0
        self._marked_failed = 0
        self._folds = 0

    # -- public -------------------------------------------------------------------------------

    def stats(self) -> OffsetStoreStats:
        """A snapshot of the store's counters."""
        return OffsetStoreStats(
            table=self.table,
            claims=self._claims,
            committed=self._committed,
            skipped=self._skipped,
            fenced=self._fenced,
            retried=self._retried,
            marked_failed=self._marked_failed,
            folds=self._folds,
            connections=self._connections(),
        )

    def _count(self, counter: str) -> None:
        # Worker threads end records at once: "+=" on an attribute could lose increments.
        with self._counts_lock:
            setattr(self, f"_{counter}", getattr(self, f"_{counter}") + 1)

    def _connections(self) -> int:
        pool: Any = self._apool if self._is_async else self._conns and self._conns.pool
        if self._given is None and pool is not None and not self._closed:
            return int(pool.get_stats().get("pool_size", 0))
        return 0

    def close(self) -> None:
        """Close the connections the store opened (a pool of your own stays open). Idempotent.

        The consumer calls it when its run ends.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, apool, aloop, admin = self._conns, self._apool, self._aloop, self._admin_conn
        own = self._given is None
        if conns is not None:
            conns.close(own)
        if apool is not None and own and aloop is not None and not aloop.is_closed():
            future = asyncio.run_coroutine_threadsafe(apool.close(timeout=self._timeout), aloop)
            try:
                future.result(self._timeout + 1)
            except (concurrent.futures.TimeoutError, RuntimeError):
                self._log.warning("the async connection pool did not close in time")
        if admin is not None:
            admin.close()

    def __repr__(self) -> str:
        return f"PostgresOffsets(table={self.table!r})"

    # -- binding to a consumer ----------------------------------------------------------------

    def bind(
        self,
        handle: Callable[..., Any],
        *,
        group: str,
        max_concurrency: int,
        on_error: OnError,
    ) -> Callable[[Record], Any]:
        """Bind the store to its consumer; returns the ``handle(record)`` the consumer runs.

        Raises:
            TypeError: ``handle`` does not take ``(record, tx)``, or its kind (sync or async)
                does not match a pool of your own.
            ValueError: The store is used by another consumer already, or was closed.
        """
        try:
            inspect.signature(handle).bind(None, None)
        except TypeError:
            raise TypeError(
                f"with offsets=, handle must take (record, tx), not {handle!r}: tx is the "
                "psycopg connection whose open transaction also marks the record done"
            ) from None
        except ValueError:  # no signature (a builtin): let the call tell
            pass
        is_async = inspect.iscoroutinefunction(handle)
        given = self._given
        if given is not None:
            if is_async and not isinstance(given, self._pool_mod.AsyncConnectionPool):
                raise TypeError(
                    "an async def handler needs an AsyncConnectionPool (or a URL), not "
                    f"{type(given).__name__}"
                )
            if not is_async and not isinstance(given, self._pool_mod.ConnectionPool):
                raise TypeError(
                    "a sync handler needs a ConnectionPool (or a URL), not "
                    f"{type(given).__name__}: or make the handler async def"
                )
        with self._lock:
            if self._closed:
                raise ValueError(f"{self!r} was closed: create a new one")
            if self._bound:
                raise ValueError(
                    f"{self!r} is used by another KeyedConsumer already: give each consumer "
                    "a PostgresOffsets of its own (they may share the table)"
                )
            self._bound = True
        self._group = group
        self._max_concurrency = max_concurrency
        self._is_async = is_async
        self._handle = handle
        self._on_error = on_error
        return self._run_async if is_async else self._run_sync

    # -- claims and folds (the poll thread) ---------------------------------------------------

    def claim(self, partitions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], Claim]:
        """Take a new epoch for each partition and read where it starts (one transaction).

        Also folds the done rows that continue a stored prefix.

        Raises:
            OffsetStoreUnavailable: The database could not be reached, or a lock was not
                granted in time (a frozen member's transaction beyond the expected time).
            OffsetStoreMisconfigured: The database refused (privileges, credentials).
        """
        if not partitions:
            return {}
        topics = [topic for topic, _ in sorted(partitions)]
        parts = [partition for _, partition in sorted(partitions)]
        args = {"group": self._group, "topics": topics, "parts": parts}
        psycopg = self._psycopg
        try:
            conn = self._admin()
            with conn.transaction():
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), "
                    "set_config('idle_in_transaction_session_timeout', %s, true)",
                    (f"{self._claim_wait_ms()}ms", f"{self._idle_ms}ms"),
                )
                conn.execute(self._sql_add_rows, args)
                rows = conn.execute(self._sql_bump, args).fetchall()
                # A statement of its own, so its snapshot is taken after the UPDATE above got
                # every partition row: each transaction that marked a record under the old
                # epoch has committed (and is seen here) or will roll back.
                done: dict[tuple[str, int], set[int]] = {}
                for topic, partition, offset in conn.execute(self._sql_done, args):
                    done.setdefault((topic, partition), set()).add(int(offset))
                claims: dict[tuple[str, int], Claim] = {}
                folds: list[tuple[str, int, int, int]] = []
                for topic, partition, epoch, prefix, _ in rows:
                    marked = done.get((topic, partition), set())
                    if prefix is not None:
                        upto = int(prefix)
                        while upto in marked:
                            marked.discard(upto)
                            upto += 1
                        if upto > prefix:
                            folds.append((topic, partition, int(epoch), upto))
                        prefix = upto
                    claims[(topic, partition)] = Claim(
                        topic, partition, int(epoch), prefix, marked,
                        self._mark_text(topic, partition, int(epoch)),
                    )  # fmt: skip
                if folds:
                    self._fold_rows(conn, folds)
        except psycopg.Error as exc:
            raise self._bookkeeping_error(exc, "claim partitions") from exc
        self._claims += len(claims)
        return claims

    def fold(self, states: Sequence[PartitionState], *, final: bool = False) -> None:
        """Move the stored prefixes up to the consumer's (poll thread); failures are logged.

        After a failure the periodic folds pause for ``timeout`` (the poll loop must not wait
        for an unreachable database on every turn); a ``final`` fold (on revoke, at the end of
        the run) is tried regardless.
        """
        work = []
        for st in states:
            claim = st.claim
            if claim is not None and st.committable > claim.folded:
                work.append((st, claim, st.committable))
        if not work or (not final and time.monotonic() < self._fold_after):
            return
        try:
            conn = self._admin()
            self._fold_rows(conn, [(c.topic, c.partition, c.epoch, upto) for _, c, upto in work])
        except self._psycopg.Error as exc:
            # Nothing depends on a fold but the table's size: try again a little later, and do
            # not hold the poll loop up on every turn while the database is away.
            self._fold_after = time.monotonic() + self._timeout
            self._log.warning("fold of the stored offsets failed (tried again later): {}", exc)
            return
        for _, claim, upto in work:
            claim.folded = max(claim.folded, upto)

    def _fold_rows(
        self, conn: psycopg.Connection[Any], folds: list[tuple[str, int, int, int]]
    ) -> None:
        conn.execute(
            self._sql_fold,
            {
                "group": self._group,
                "topics": [f[0] for f in folds],
                "parts": [f[1] for f in folds],
                "epochs": [f[2] for f in folds],
                "uptos": [f[3] for f in folds],
            },
        )
        self._folds += 1

    def _mark_text(self, topic: str, partition: int, epoch: int) -> tuple[str, str]:
        # SQL-level EXECUTE of the protocol-level prepared mark: one simple query carries the
        # mark and the COMMIT (a failed mark skips the COMMIT), and the server parses only the
        # EXECUTE; one call into libpq, where two round trips cost a record a fifth of its
        # client time in the benchmark.
        from psycopg import sql

        group, name = sql.Literal(self._group).as_string(None), self._mark_name.decode()
        return (
            f"EXECUTE {name}({group}, {sql.Literal(topic).as_string(None)}, {partition}, ",
            f", {epoch}); COMMIT",
        )

    def _claim_wait_ms(self) -> int:
        return min(_MAX_TIMEOUT_MS, round((self._idle_timeout + self._timeout) * 1000))

    def _admin(self) -> psycopg.Connection[Any]:
        """The bookkeeping connection (autocommit), opened or reopened as needed."""
        conn = self._admin_conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._admin_conn = None
            conn = self._psycopg.Connection.connect(
                self._conninfo,
                **{
                    **self._connect_kwargs,
                    "autocommit": True,
                    "application_name": "rxcoord-kafka-offsets",
                },
            )
            conn.execute(f"SET lock_timeout = '{round(self._timeout * 1000)}ms'")
            self._admin_conn = conn
        if not self._table_ready:
            self._create_table(conn)
        return conn

    def _create_table(self, conn: psycopg.Connection[Any]) -> None:
        # Looked up first: a role that may only use the table (no CREATE on its schema) never
        # runs CREATE TABLE, which PostgreSQL checks against the schema even when the table
        # exists.
        found = conn.execute("SELECT to_regclass(%s)", (self._table_literal,)).fetchone()
        if found is None or found[0] is None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(self._sql_create)
        self._table_ready = True

    def _bookkeeping_error(self, exc: Exception, action: str) -> OffsetStoreError:
        """Map a driver error of the store's own statements: an outage or a refusal."""
        from rxcoord.leases._backends._postgres import (
            _PERMANENT_CONNECT_ERRORS,
            _PERMANENT_SQLSTATE_CLASSES,
        )

        sqlstate = getattr(exc, "sqlstate", None)
        text = str(exc).strip()
        if sqlstate:
            permanent = sqlstate[:2] in _PERMANENT_SQLSTATE_CLASSES
        else:
            lowered = text.lower()
            permanent = any(marker in lowered for marker in _PERMANENT_CONNECT_ERRORS)
        if permanent:
            return OffsetStoreMisconfigured(
                f"PostgreSQL refused to {action} in {self.table!r}: {type(exc).__name__}: "
                f"{text} [{_fix_for(sqlstate, text)}]"
            )
        return OffsetStoreUnavailable(
            f"PostgreSQL offsets store failed to {action}: {type(exc).__name__}: {text}"
        )

    # -- a record's transaction, sync -------------------------------------------------------

    def _run_sync(self, record: Record) -> None:
        """The consumer's ``handle(record)`` for a sync handler (see the module docstring).

        Raises:
            Dropped: Fenced, or revoked while its transaction was being retried.
            Stopped: The consumer must stop (an outage past ``outage_timeout``, a refusal, a
                handler failure ``on_error`` said to stop at).
            Exception: A failure of the handler (which went through ``on_error`` here).
        """
        claim: Claim | None = record._state.claim
        if claim is None:
            raise Dropped  # never claimed (the consumer is stopping)
        done = claim.done
        if done and record.offset in done:
            done.discard(record.offset)
            self._count("skipped")
            return
        failure = self._attempts_sync(record, claim, True)
        if failure is None:
            return
        assert self._on_error is not None
        verdict = self._on_error(record, failure)
        if verdict is not None:
            raise Stopped(verdict)
        self._attempts_sync(record, claim, False)  # on_error said done: mark it, no effects
        self._count("marked_failed")

    def _attempts_sync(self, record: Record, claim: Claim, run: bool) -> Exception | None:
        """Transactions until one ends for good; returns the handler's failure, if any."""
        first_failure: float | None = None
        delay = _BACKOFF
        while True:
            try:
                return self._transaction_sync(record, claim, run)
            except _Retry as retry:
                first_failure = self._before_retry(record, retry, first_failure)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)

    def _transaction_sync(self, record: Record, claim: Claim, run: bool) -> Exception | None:
        conns = self._conns
        if conns is None:
            conns = self._open_pool()
        try:
            conn = conns.get()
        except self._psycopg.Error as exc:  # PoolTimeout: no connection could be made
            raise _Retry(exc) from exc
        lent = not conn.autocommit  # an application's pool: autocommit for this transaction
        try:
            if lent:
                conn.autocommit = True
            pgconn = conn.pgconn
            encoding, begin = self._ready.get(conn) or self._set_up_sync(conn)
            self._own(conn, pgconn.exec_(begin))
            if run:
                try:
                    value = self._handle(record, conn)
                except Exception as exc:
                    self._rollback_sync(conn)
                    if _lost(conn) or _transient(exc):
                        raise _Retry(exc) from exc
                    return exc
                except BaseException:
                    self._rollback_sync(conn)
                    raise
                failure = self._after_handler(conn, value)
                if failure is not None:
                    self._rollback_sync(conn)
                    return failure
            result = pgconn.exec_(claim.tail(record.offset, encoding))
            if result.status == _COMMAND_OK:
                self._count("committed")
                return None
            failed = pgconn.transaction_status == _INERROR  # the mark failed, not the COMMIT
            error = self._error_of(conn, result)
            self._rollback_sync(conn)
            return self._tail_failed(conn, error, failed)
        except self._psycopg.OperationalError as exc:
            # libpq could not even send one of our statements: the connection is gone.
            raise _Retry(exc) from exc
        finally:
            if lent:
                try:
                    conn.autocommit = False
                except self._psycopg.Error:
                    conn.close()  # broken, or not idle: the pool must not lend it out again
            conns.put(conn)

    def _set_up_sync(self, conn: psycopg.Connection[Any]) -> tuple[str, bytes]:
        self._own_prepare(conn, conn.pgconn.prepare(self._mark_name, self._sql_mark))
        ready = self._ready[conn] = (conn.info.encoding, self._begin_for(conn))
        return ready

    def _rollback_sync(self, conn: psycopg.Connection[Any]) -> None:
        if conn.closed or conn.broken:
            return
        if conn.pgconn.transaction_status in (_INTRANS, _INERROR):
            conn.pgconn.exec_(b"ROLLBACK")

    def _open_pool(self) -> _Connections:
        with self._lock:
            if self._closed:
                raise Dropped  # the run ended
            if self._conns is None:
                pool = self._given
                if pool is None:
                    pool = self._pool_mod.ConnectionPool(
                        self._conninfo,
                        kwargs=self._pool_kwargs(),
                        min_size=1,
                        max_size=self._max_concurrency,
                        timeout=self._timeout,
                        name=f"rxcoord-kafka-offsets-{self._group}",
                        # A pool retries a failed connection with a backoff growing for up to
                        # reconnect_timeout (5 minutes by default): after an outage the next
                        # attempt could come long after the server is back.
                        reconnect_timeout=max(self._timeout, 1.0),
                        open=True,
                    )
                self._conns = _Connections(pool, self._timeout, self._given is None)
            return self._conns

    def _pool_kwargs(self) -> dict[str, Any]:
        from psycopg.conninfo import conninfo_to_dict

        try:
            options = str(conninfo_to_dict(self._conninfo).get("options") or "")
        except self._psycopg.Error:
            options = ""  # the connection attempt reports it
        options = f"{options} -c idle_in_transaction_session_timeout={self._idle_ms}".strip()
        return {
            **self._connect_kwargs,
            # The store begins each record's transaction itself; in autocommit mode psycopg
            # never begins one of its own, so a handler that ends tx's transaction is seen
            # (see _after_handler) even if it runs statements after that.
            "autocommit": True,
            "options": options,
            "application_name": "rxcoord-kafka-offsets",
        }

    # -- a record's transaction, async ------------------------------------------------------

    async def _run_async(self, record: Record) -> None:
        """:meth:`_run_sync` for an ``async def`` handler, on the consumer's loop."""
        claim: Claim | None = record._state.claim
        if claim is None:
            raise Dropped
        done = claim.done
        if done and record.offset in done:
            done.discard(record.offset)
            self._count("skipped")
            return
        failure = await self._attempts_async(record, claim, True)
        if failure is None:
            return
        assert self._on_error is not None
        verdict = self._on_error(record, failure)
        if verdict is not None:
            raise Stopped(verdict)
        await self._attempts_async(record, claim, False)
        self._count("marked_failed")

    async def _attempts_async(self, record: Record, claim: Claim, run: bool) -> Exception | None:
        first_failure: float | None = None
        delay = _BACKOFF
        while True:
            try:
                return await self._transaction_async(record, claim, run)
            except _Retry as retry:
                first_failure = self._before_retry(record, retry, first_failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)

    async def _transaction_async(self, record: Record, claim: Claim, run: bool) -> Exception | None:
        from psycopg.generators import execute

        pool = await self._async_pool()
        try:
            conn = await pool.getconn(self._timeout)
        except self._psycopg.Error as exc:
            raise _Retry(exc) from exc
        lent = not conn.autocommit  # as in _transaction_sync
        try:
            if lent:
                await conn.set_autocommit(True)
            pgconn = conn.pgconn
            ready = self._ready.get(conn)
            if ready is None:
                pgconn.send_prepare(self._mark_name, self._sql_mark)
                self._own_prepare(conn, (await conn.wait(execute(pgconn)))[-1])
                ready = self._ready[conn] = (conn.info.encoding, self._begin_for(conn))
            encoding, begin = ready
            pgconn.send_query(begin)
            self._own(conn, (await conn.wait(execute(pgconn)))[-1])
            if run:
                try:
                    value = await self._handle(record, conn)
                except Exception as exc:
                    await self._rollback_async(conn)
                    if _lost(conn) or _transient(exc):
                        raise _Retry(exc) from exc
                    return exc
                except BaseException:
                    await self._rollback_async(conn)
                    raise
                failure = self._after_handler(conn, value)
                if failure is not None:
                    await self._rollback_async(conn)
                    return failure
            pgconn.send_query(claim.tail(record.offset, encoding))
            result = (await conn.wait(execute(pgconn)))[-1]
            if result.status == _COMMAND_OK:
                self._count("committed")
                return None
            failed = pgconn.transaction_status == _INERROR  # the mark failed, not the COMMIT
            error = self._error_of(conn, result)
            await self._rollback_async(conn)
            return self._tail_failed(conn, error, failed)
        except self._psycopg.OperationalError as exc:
            # A lost connection while we waited for one of our own statements.
            raise _Retry(exc) from exc
        finally:
            if lent:
                try:
                    await conn.set_autocommit(False)
                except self._psycopg.Error:
                    await conn.close()  # as in _transaction_sync
            await pool.putconn(conn)

    async def _rollback_async(self, conn: psycopg.AsyncConnection[Any]) -> None:
        from psycopg.generators import execute

        if conn.closed or conn.broken:
            return
        if conn.pgconn.transaction_status in (_INTRANS, _INERROR):
            conn.pgconn.send_query(b"ROLLBACK")
            await conn.wait(execute(conn.pgconn))

    async def _async_pool(self) -> psycopg_pool.AsyncConnectionPool[Any]:
        if self._closed:
            raise Dropped
        given = self._given
        if given is not None:
            return given  # type: ignore[no-any-return]
        pool = self._apool
        if pool is None:
            pool = self._pool_mod.AsyncConnectionPool(
                self._conninfo,
                kwargs=self._pool_kwargs(),
                min_size=1,
                max_size=self._max_concurrency,
                timeout=self._timeout,
                name=f"rxcoord-kafka-offsets-{self._group}",
                reconnect_timeout=max(self._timeout, 1.0),
                open=False,
            )
            self._apool = pool
            self._aloop = asyncio.get_running_loop()
            self._aopen = asyncio.ensure_future(pool.open())
        assert self._aopen is not None
        await asyncio.shield(self._aopen)
        return pool

    # -- outcomes shared by both kinds -----------------------------------------------------

    def _begin_for(self, conn: Any) -> bytes:
        """The ``BEGIN`` of a record's transaction on ``conn``: with the connection's
        transaction characteristics (as psycopg's own BEGIN), and, on a pool of the
        application's (whose sessions the store must not change), the idle timeout as a
        setting of the transaction itself (our own pool sets it for the session)."""
        parts = ["BEGIN"]
        if conn.isolation_level is not None:
            parts.append(f"ISOLATION LEVEL {conn.isolation_level.name.replace('_', ' ')}")
        if conn.read_only is not None:
            parts.append("READ ONLY" if conn.read_only else "READ WRITE")
        if conn.deferrable is not None:
            parts.append("DEFERRABLE" if conn.deferrable else "NOT DEFERRABLE")
        begin = " ".join(parts)
        if self._given is not None:
            begin += f"; SET LOCAL idle_in_transaction_session_timeout = {self._idle_ms}"
        return begin.encode()

    def _own(self, conn: Any, result: Any) -> None:
        """Check the result of a store statement outside the mark (set-up, ``BEGIN``).

        Raises:
            _Retry: A lost connection or another transient error.
            Stopped: A refusal (a missing privilege on the table, say).
        """
        if result.status in (_COMMAND_OK, _TUPLES_OK):
            return
        error = self._error_of(conn, result)
        if _lost(conn) or _transient(error):
            raise _Retry(error) from error
        raise Stopped(self._bookkeeping_error(error, "run a record's transaction"))

    def _own_prepare(self, conn: Any, result: Any) -> None:
        """Check the mark's ``PREPARE`` on ``conn`` (as :meth:`_own`).

        Already prepared is as good: the statement's name is a hash of its SQL, so another
        store on the same table that shares the application's pool (a consumer started again
        in the same process) prepared this very statement on the connection.
        """
        if result.status != _COMMAND_OK and result.error_field(_SQLSTATE) == _DUPLICATE_PREPARED:
            return
        self._own(conn, result)

    def _error_of(self, conn: Any, result: Any) -> Exception:
        from psycopg import errors

        error: Exception = errors.error_from_result(result, encoding=conn.info.encoding)
        return error

    def _after_handler(self, conn: Any, value: object) -> Exception | None:
        """Check what the handler left: its return value and the transaction's state.

        Returns:
            A failure to report through ``on_error`` (the handler swallowed a failed
            statement), or None.

        Raises:
            Stopped: The handler ended the transaction itself, or left work unfinished.
        """
        if value is not None and (
            inspect.isawaitable(value)
            or isinstance(value, rx_abc.ObservableBase | concurrent.futures.Future)
        ):
            if inspect.iscoroutine(value):
                value.close()
            raise Stopped(
                OffsetStoreError(
                    f"with offsets=, a handler's work must be done when it returns (its "
                    f"transaction commits then), but it returned {value!r}: await it inside "
                    "the handler (async def), or do it before returning"
                )
            )
        status = conn.pgconn.transaction_status
        if status == _INTRANS:
            return None
        if status == _INERROR:
            return self._psycopg.errors.InFailedSqlTransaction(
                "a statement of the handler failed and the handler went on (it caught the "
                "error): PostgreSQL has aborted the transaction, so it was rolled back"
            )
        # tx is in autocommit mode under the store's own BEGIN: after a commit or rollback of
        # the handler's, nothing begins another transaction, so the status stays idle here
        # whatever the handler ran next (each later statement committed on its own).
        raise Stopped(
            OffsetStoreError(
                "the handler ended tx's transaction itself (tx.commit() or tx.rollback(), or "
                "a COMMIT statement): its effects (and any statement after that, each "
                "committed on its own) may be committed without the record's mark, so the "
                "consumer stops; let the store commit (return from the handler) or raise to "
                "roll back"
            )
        )

    def _tail_failed(self, conn: Any, error: Exception, marking: bool) -> Exception | None:
        """The end of a record's transaction failed; it is rolled back (or never committed).

        ``marking``: the mark failed (the transaction was left aborted), not the ``COMMIT``.

        Returns:
            None if the record is done after all (an earlier attempt committed it), else the
            failure to report through ``on_error`` (a deferred constraint of the handler's).

        Raises:
            Dropped: Fenced: a newer epoch, another member owns the partition.
            _Retry: A transient error or a lost connection (committed or not, the retry tells:
                its mark finds the first one's, or not).
            Stopped: A refusal of the offsets table (a missing privilege, say).
        """
        errors = self._psycopg.errors
        ours = getattr(getattr(error, "diag", None), "table_name", None) == self._relname
        if marking and ours and isinstance(error, errors.NotNullViolation):
            self._count("fenced")
            raise Dropped from error
        if marking and ours and isinstance(error, errors.UniqueViolation):
            # Marked already: an earlier attempt of this record committed, and the answer to
            # its COMMIT was lost. Its effects are in; this attempt's were rolled back.
            return None
        if isinstance(error, errors.InvalidSqlStatementName):
            self._ready.pop(conn, None)  # DISCARD ALL by a pool's reset: prepare again
            raise _Retry(error) from error
        if _lost(conn) or _transient(error):
            raise _Retry(error) from error
        if marking:
            raise Stopped(self._bookkeeping_error(error, "mark a record done"))
        return error  # the COMMIT: the server ended the transaction, the handler's effects failed

    def _before_retry(self, record: Record, retry: _Retry, first: float | None) -> float:
        """Count a retry; give up when the record is gone or the outage lasted too long.

        Raises:
            Dropped: The record's partition was revoked meanwhile, or the store closed.
            Stopped: Transient errors for longer than ``outage_timeout``.
        """
        now = time.monotonic()
        cause = retry.__cause__ or retry
        if first is None:
            first = now
            if not self._outage_logged:
                self._outage_logged = True
                self._log.warning(
                    "a record's transaction failed with a transient database error, retried "
                    "for up to {}s: {}: {}",
                    self._outage_timeout,
                    type(cause).__name__,
                    str(cause).strip(),
                )
        if not record.current or self._closed:
            raise Dropped from cause
        if now - first >= self._outage_timeout:
            raise Stopped(
                OffsetStoreUnavailable(
                    f"PostgreSQL kept failing {record!r}'s transaction for "
                    f"{self._outage_timeout:g}s (outage_timeout): {type(cause).__name__}: "
                    f"{str(cause).strip()}"
                )
            ) from cause
        self._count("retried")
        return first


def _unbound(record: Record, tx: Any) -> None:
    raise AssertionError("PostgresOffsets used before bind()")  # pragma: no cover


def _lost(conn: Any) -> bool:
    return bool(conn.closed or conn.broken)


def _transient(exc: BaseException) -> bool:
    """Whether a driver error is worth a new transaction (see ``_TRANSIENT``)."""
    import psycopg

    if not isinstance(exc, psycopg.OperationalError):
        return False
    sqlstate = exc.sqlstate
    return sqlstate is None or sqlstate[:2] == "08" or sqlstate in _TRANSIENT


def _fix_for(sqlstate: str | None, text: str) -> str:
    """What to do about a refusal of the offsets store, for the message."""
    lowered = text.lower()
    if (sqlstate or "").startswith("28") or "authentication" in lowered or "password" in lowered:
        return "fix the user name or password in the connection string"
    if sqlstate == "3D000" or ("database" in lowered and "does not exist" in lowered):
        return "create the database, or name an existing one in the connection string"
    if sqlstate == "42501" or "permission denied" in lowered:
        return (
            "grant the role SELECT, INSERT, UPDATE, DELETE on the offsets table (and CREATE on "
            "its schema, or create the table beforehand with a role that may)"
        )
    if (sqlstate or "").startswith(("3F", "42")):
        return "check the table name and schema given to PostgresOffsets(table=...)"
    return "check the store's configuration"
