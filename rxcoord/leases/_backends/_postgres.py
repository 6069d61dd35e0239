"""Leases in PostgreSQL: one statement per operation, LISTEN/NOTIFY for waiters.

Table (created if missing, under an advisory lock so concurrent first starts do not race)::

    name text PRIMARY KEY, token bigint, locked_until timestamptz, least_until timestamptz,
    released boolean, locked_at timestamptz, locked_by text, waited boolean

and a sequence ``<table>_token_seq``. A row exists only while its name is taken: release
deletes it (or, inside ``at_least_for``, marks it released until then), and rows that expired
are swept in the background at most once a second, so names nobody holds leave nothing
behind. Tokens come from the store-wide sequence, not from the row, so deleting a row cannot
reset a name's tokens: they increase across releases, expiries, client restarts and (committed
with ``synchronous_commit=on``) server restarts and crashes. The sequence's WAL record is
flushed with the commit of the grant that used it, and after a crash a sequence resumes above
every value it logged, so a token reported by a durable grant is never handed out again.
(A table written by a version that kept a counter per row: the sequence, created on first use,
starts above the largest token in it; do not mix versions on one table.)

* grant: ``INSERT ... VALUES (name, nextval(seq), ...) ON CONFLICT (name) DO UPDATE SET token =
  excluded.token ... WHERE locked_until <= clock_timestamp() RETURNING token``. The row lock
  serializes competing grants; a loser re-checks the winner's row and gets nothing (its
  ``nextval`` is a gap in the sequence, which nobody minds: tokens only need to increase).
  The same statement reads the current holder's remaining time for the waiter's deadline.
* extend: ``UPDATE ... WHERE name AND token AND NOT released AND locked_until >
  clock_timestamp()``;
* release: ``DELETE`` the owned row (``UPDATE`` it to released inside ``at_least_for``) and,
  if a waiter marked it, ``pg_notify`` the name's channel, in one statement (delivered at
  commit, i.e. exactly when the release is visible). Its commit is asynchronous in every mode:
  a release a crash undoes only keeps the name taken until it expires (the next durable
  commit, a grant, flushes it).

Notifications only when someone waits: a ``NOTIFY`` costs the server a lock on the database's
notification queue and a queue entry at every commit (about a tenth of an uncontended
acquire+release pair), so a release notifies only if its row says ``waited``. A waiter's attempt
(one for a name this provider's listener is subscribed to) marks: a grant it wins is inserted
``waited`` (the rest of its queue sleeps until that lease is released), and if it gets nothing it
sets ``waited`` on the row it found, in the same statement, under the row lock the grant's
``INSERT ... ON CONFLICT`` took. Any other grant clears it. Why no wake-up is lost: a waiter's
attempts after its subscription is confirmed (the waiting machinery always makes one) are all
marking ones, so a waiter sleeps only after a marking attempt, after its ``LISTEN`` took
effect, and until the remaining time that attempt read: the grant it lost to, or its queue's
head won, is marked. That grant's release deletes (or updates) that very row, so it either
waited for the mark's row lock and sees it (and notifies, at a commit after the ``LISTEN``), or
went first, and then the waiter's ``INSERT`` found the name free (or a later grant, which it
marked). A row the mark's ``UPDATE`` cannot see (granted after the statement's snapshot) marks
nothing, and the waiter retries at once instead of sleeping. Expiry needs no notification:
the waiter's timer is due then, and its attempt marks whatever grant it finds.

The server's ``clock_timestamp()`` decides expiry; clients only ever send durations.

Connections come from a psycopg-pool; one more, owned by the listener thread, LISTENs on one
channel per name being waited for (``rxl_`` + a hash of the table and the name: channel names
are identifiers limited to 63 bytes). The table is the one the server resolved, schema and
all, read once with the schema setup: providers that spell it differently (``leases``,
``public.leases``) share it, so they must share its channels too. Before reusing an idle pooled
connection its socket is checked for unexpected input (the server closing it on restart), which
costs no round trip and spares the caller a spurious error right after the server comes back.

No call waits for the server longer than ``timeout`` (see ``_pg_deadline``): a server that
stops answering fails calls with ``LeaseStoreUnavailable``, and keep-alive renewals wait no
longer than their lease has left.

Fleet permits (``_permits.py``) live beside the lease table, in its schema and persistence: a
table ``<table>_permits`` with one row per busy group holding its ``PermitGroup`` in typed
columns (``clock``; the permits as parallel arrays ``tokens``, ``holders``, ``untils``; the
tenants holding or wanting permits as ``tenants``, ``passes``, ``limits``, ``demand``,
``readies`` (from when a waiting tenant is within its own rate), a NULL limit, demand or
readiness meaning none; the rate buckets as ``rtenants``, ``rtats`` and ``gtat``, kept until
full again), deleted once the group holds neither permits, demand nor a bucket still filling.
Its ``expires`` column says when everything in the row will have expired, and the background
sweep (after grants and permit steps, at most every ``sweep_every``) deletes rows past it:
groups a crashed fleet left behind.
Each step is one PL/pgSQL function, ``<table>_permits_acquire``/``_release``/``_extend``
(created with the schema, under the same advisory lock, and replaced only when their source
differs), so each is one statement and one round trip; times are ``clock_timestamp()`` in
epoch seconds, tokens are ``nextval`` of the lease sequence, wake-ups are ``pg_notify`` on
the channel of the group's wait hub, delivered at commit. Why this layout:

* one row lock per group (``SELECT ... FOR UPDATE``): every step on a group reads its whole
  state (the limit counts every tenant's permits, the stride rule compares every waiting
  tenant's pass), so steps on one group must serialize, and a row lock does that without
  blocking other groups; a step that finds no row has nothing to serialize with but an
  insert, which ``ON CONFLICT DO NOTHING`` settles (the loser then locks the winner's row);
* one row rather than a row per permit and tenant: a step then writes one row, as a lease
  grant or release does (an uncontended job inserts it and deletes it, one statement each
  inside the functions), where a normalized layout wrote three tables per step and cost
  about twice the time; the arrays are bounded by the group's limit and waiting tenants;
* typed arrays rather than jsonb: float8 round-trips exactly, and passes and the clock are
  compared with ``<``, so the functions compute exactly what ``PermitGroup`` does.

Durability as for leases: a grant commits with the provider's ``synchronous_commit`` (its
token must not be handed out twice), releases and steps that granted nothing commit
asynchronously (undone by a crash, they keep permits out or demand registered until it
expires, no longer), extensions synchronously.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any, Final, TypeVar

from rxcoord._errors import LeaseStoreMisconfigured, LeaseStoreUnavailable

from ..._core.checks import check_identifier, check_length
from .._base import LeaseProvider
from .._listing import LeaseEntry, StoreListing, group_entry
from .._notify import Listener, WaitHub
from .._permits import PermitReply, RateArgs, hub_name
from ._drivers import require, route_driver_logs

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

    from ._pg_deadline import DeadlineConnection, Prepared

__all__ = ["PostgresLeases"]

_T = TypeVar("_T")

_SCHEMA_LOCK: Final = 0x7278636F6F7264  # advisory lock key for table creation ("rxcoord")
_IDLE: Final = 0  # psycopg.pq.TransactionStatus.IDLE, without importing psycopg at import time
_SWEEP_EVERY: Final = 1.0  # seconds between sweeps of expired rows (per provider)
_MAX_IDENTIFIER: Final = 63  # bytes; PostgreSQL truncates longer identifiers
# SQLSTATE classes no retry can fix: authorization (28), catalog and schema names (3D, 3F),
# syntax and access rules (42: a missing privilege, a table that is not ours), data exceptions
# (22), program limits (54), features (0A). Everything else (connection failures 08,
# resources 53, operator intervention 57 such as a server shutting down, lock and
# serialization failures 40 and 55, our own statement timeout) is an outage.
_PERMANENT_SQLSTATE_CLASSES: Final = ("28", "3D", "3F", "42", "22", "54", "0A")
# libpq reports connection-time refusals without an SQLSTATE: recognise them by their text.
_PERMANENT_CONNECT_ERRORS: Final = (
    "password authentication failed",
    "does not exist",  # role "x" / database "x" does not exist
    "no pg_hba.conf entry",
    "authentication failed",  # peer, ident, SCRAM...
    "no password supplied",
    "permission denied",
    "not permitted to log in",
    "server does not support ssl",
    "certificate",
    "invalid connection option",
    "invalid sslmode",
    "invalid integer value",
    'missing "=" after',
)


def channel_for(table: tuple[str, str], name: str) -> str:
    """The LISTEN/NOTIFY channel for waiters of ``name`` in ``table`` (schema, table name)."""
    schema, relation = table
    key = f"{schema}\0{relation}\0{name}"
    return f"rxl_{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}"


class PostgresLeases(LeaseProvider):
    """Leases in a PostgreSQL table; waiters are woken by LISTEN/NOTIFY.

    Args:
        conninfo: A libpq connection string or URL (``postgresql://user@host:5432/db``).
        table: Table name (identifier, optionally ``schema.table``); created if missing.
        min_size: The fewest connections the pool keeps open.
        max_size: The most connections the pool opens.
        timeout: Seconds one call may take (getting a pooled connection, connecting, and
            waiting for the server's answer) before failing with ``LeaseStoreUnavailable``;
            also the most ``close()`` waits for a server that does not answer.
        durable: ``True`` (default): a logged table, grants and extensions committed with
            ``synchronous_commit=on``: after a server crash every lease reported granted is
            still held and no token is handed out twice (releases commit asynchronously in
            both modes: one undone by a crash keeps its name taken until it expires).
            ``False``: the table is created ``UNLOGGED`` and commits are asynchronous,
            several times faster, but a server *crash* (not a clean restart) empties the
            table, so every lease held then is
            forgotten and its name can be granted to a second holder, and the last tokens
            handed out before it (those of the last ~0.2 s, the WAL writer's delay) may be
            handed out again. A table is created in one mode: a durable provider refuses an
            unlogged table (``LeaseStoreMisconfigured``), a non-durable one uses a logged table
            it finds, with asynchronous commits.
        configure: Called with each new pooled connection (e.g. to ``SET application_name``).
        sweep_every: Seconds between sweeps of expired rows, run in the background after a
            grant (one ``DELETE``, skipping rows being granted). None: never sweep (an expired
            row then stays until its name is granted again).

    Limits: names of at most 2,048 bytes of UTF-8 (the primary key's B-tree takes entries of at
    most 2,704 bytes, row header included; longer names would be refused by the server),
    durations of at most 1e9 seconds.

    Errors: an outage (connection refused or reset, a server that does not answer, shuts down
    or restarts) raises ``LeaseStoreUnavailable``; a refusal no retry can fix (wrong password,
    unknown role or database, a missing privilege, a malformed connection string) raises
    ``LeaseStoreMisconfigured`` at the first call, after one connection attempt. psycopg's and
    psycopg-pool's log records go to loguru under ``rxcoord`` (silent unless enabled).

    Raises:
        ImportError: psycopg is missing (``pip install rxcoord[postgres]``).
        ValueError: Invalid table name or sizes.
    """

    backend = "postgres"
    max_name_bytes = 2048

    def __init__(
        self,
        conninfo: str = "",
        *,
        table: str = "rxcoord_leases",
        min_size: int = 1,
        max_size: int = 8,
        timeout: float = 5.0,
        durable: bool = True,
        configure: Callable[[psycopg.Connection[Any]], None] | None = None,
        sweep_every: float | None = _SWEEP_EVERY,
    ) -> None:
        parts = check_identifier(table)
        self._timeout = check_length(timeout, "timeout")
        self._sweep_every = (
            None if sweep_every is None else check_length(sweep_every, "sweep_every")
        )
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ValueError(
                f"need 0 <= min_size <= max_size and max_size >= 1, got {min_size}, {max_size}"
            )
        psycopg_mod = require("psycopg", "postgres")
        pool_mod = require("psycopg_pool", "postgres")
        route_driver_logs("psycopg")
        from psycopg import sql

        from ._pg_deadline import DeadlineConnection, Prepared, keepalive_kwargs

        self._psycopg = psycopg_mod
        self.table = table
        self.conninfo = conninfo
        self._max_size = max_size
        self._holder = f"{socket.gethostname()}:{os.getpid()}"
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        self._resolved: tuple[str, str] | None = None  # (schema, table) as the server sees it
        self._permit_sql: _PermitSql | None = None  # rendered with the resolved names
        self._op_timeout = self._timeout
        connect_timeout = max(2, math.ceil(self._timeout))  # libpq's minimum is 2 seconds
        t = sql.Identifier(*parts)
        self._table_literal = t.as_string(None)  # '"schema"."table"', for ::regclass

        seq_name = _truncate_identifier(parts[-1], "_token_seq")
        seq = sql.Identifier(*parts[:-1], seq_name)
        self._seq_name_literal = seq.as_string(None)
        seqlit = sql.Literal(self._seq_name_literal)  # for ::regclass

        def render(query: str) -> str:
            return sql.SQL(query).format(t=t, seq=seq, seqlit=seqlit).as_string(None)

        self._durable = durable
        self._sql_create = render(
            f"CREATE {'' if durable else 'UNLOGGED '}TABLE IF NOT EXISTS {{t}} "
            "(name text PRIMARY KEY, token bigint NOT NULL, "
            "locked_until timestamptz NOT NULL, least_until timestamptz NOT NULL, "
            "released boolean NOT NULL, locked_at timestamptz NOT NULL, locked_by text NOT NULL, "
            "waited boolean NOT NULL DEFAULT false)"
        )
        # A table created by a version without the column (see _set_up_schema): a constant
        # default makes this a catalog change, no rewrite.
        self._sql_add_waited = render(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS waited boolean NOT NULL DEFAULT false"
        )
        self._sql_create_seq = render("CREATE SEQUENCE {seq}")
        # Only for a sequence this transaction created: nobody else uses it before the commit.
        self._sql_start_seq = render(
            "SELECT setval({seqlit}::regclass, m) FROM (SELECT max(token) AS m FROM {t}) AS x "
            "WHERE m IS NOT NULL"
        )

        def granted(waited: str) -> str:
            return (
                "WITH granted AS (INSERT INTO {t} AS l "
                "(name, token, locked_until, least_until, released, locked_at, locked_by, "
                "waited) VALUES (%(name)s, nextval({seqlit}::regclass), "
                "clock_timestamp() + make_interval(secs => %(most)s), "
                "clock_timestamp() + make_interval(secs => %(least)s), false, clock_timestamp(), "
                f"%(by)s, {waited}) ON CONFLICT (name) DO UPDATE SET token = excluded.token, "
                "locked_until = excluded.locked_until, least_until = excluded.least_until, "
                "released = false, locked_at = excluded.locked_at, locked_by = excluded.locked_by, "
                "waited = excluded.waited WHERE l.locked_until <= clock_timestamp() "
                "RETURNING l.token) "
            )

        self._grant = Prepared(
            render(
                granted("false")
                # The holder's remaining time only when taken: CASE evaluates the subquery lazily.
                + "SELECT g.token, CASE WHEN g.token IS NULL THEN (SELECT extract(epoch FROM "
                "c.locked_until - clock_timestamp())::float8 FROM {t} AS c "
                "WHERE c.name = %(name)s) END "
                "FROM (SELECT (SELECT token FROM granted) AS token) AS g"
            )
        )
        # An attempt for a name this provider's waiters wait for (see "Notifications" in the
        # module docstring). A grant is marked: the other waiters of its queue sleep until it
        # is released. Getting nothing, it marks the grant it found, under the row lock the
        # INSERT took, and reads that grant's remaining time. No row marked (the holder's row
        # is not in this statement's snapshot: granted after it began) reads as "free": the
        # waiter retries.
        self._grant_waiting = Prepared(
            render(
                granted("true")
                + ", marked AS (UPDATE {t} AS c SET waited = true WHERE c.name = %(name)s "
                "AND c.locked_until > clock_timestamp() AND NOT EXISTS (SELECT FROM granted) "
                "RETURNING extract(epoch FROM c.locked_until - clock_timestamp())::float8 AS secs) "
                "SELECT (SELECT token FROM granted), (SELECT secs FROM marked)"
            )
        )
        self._sql_holder = render(
            "SELECT token, extract(epoch FROM locked_until - clock_timestamp())::float8, "
            "released FROM {t} WHERE name = %(name)s AND locked_until > clock_timestamp()"
        )
        owned = (
            "name = %(name)s AND token = %(token)s AND NOT released "
            "AND locked_until > clock_timestamp()"
        )
        self._sql_extend = render(
            "UPDATE {t} SET locked_until = greatest(least_until, "
            f"clock_timestamp() + make_interval(secs => %(most)s)) WHERE {owned}"
        )
        # One instant for both branches, so a row is either deleted or kept, never neither.
        # The release commits asynchronously, even in durable mode (set_config(..., true) lasts
        # for this statement's transaction; the commit reads it): a release undone by a crash
        # only keeps the name taken until its expiry, it can never let two holders in, so it
        # need not wait for the WAL flush. Grants and extensions do wait: an undone grant
        # could hand its token out twice, an undone extension end a lease its holder trusts.
        # (durable=False: every connection commits asynchronously already.)
        # It notifies only when a waiter marked the row (CASE evaluates pg_notify lazily).
        asynchronous = ", set_config('synchronous_commit', 'off', true)" if durable else ""
        notify = "CASE WHEN w THEN pg_notify(%(channel)s, '') END" + asynchronous
        self._release = Prepared(
            render(
                "WITH now AS (SELECT clock_timestamp() AS t), "
                f"gone AS (DELETE FROM {{t}} WHERE {owned} "
                "AND least_until <= (SELECT t FROM now) RETURNING waited), "
                "kept AS (UPDATE {t} SET locked_until = least_until, released = true "
                f"WHERE {owned} AND least_until > (SELECT t FROM now) RETURNING waited) "
                f"SELECT {notify} FROM (SELECT waited AS w FROM gone "
                "UNION ALL SELECT waited FROM kept) AS released"
            )
        )
        # A grant without at_least_for is never kept after its release: one DELETE.
        self._release_simple = Prepared(
            render(
                f"WITH gone AS (DELETE FROM {{t}} WHERE {owned} RETURNING waited AS w) "
                f"SELECT {notify} FROM gone"
            )
        )
        for statement, keys in (
            (self._grant, ("name", "most", "least", "by")),
            (self._grant_waiting, ("name", "most", "least", "by")),
            (self._release, ("name", "token", "channel")),
            (self._release_simple, ("name", "token", "channel")),
        ):
            assert statement.keys == keys, statement.keys  # the order the callers pass
        # SKIP LOCKED: a row being granted right now is not expired any more; never wait for it.
        self._sql_sweep = render(
            "DELETE FROM {t} WHERE name IN (SELECT name FROM {t} "
            "WHERE locked_until <= clock_timestamp() FOR UPDATE SKIP LOCKED)"
        )
        self._next_sweep = 0.0
        self._sweeping = False

        def configure_connection(conn: DeadlineConnection) -> None:
            conn.default_timeout = self._timeout
            if not durable:
                conn.execute("SET synchronous_commit = off")
            if configure is not None:
                configure(conn)

        connect_kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": connect_timeout,
            **keepalive_kwargs(conninfo, self._timeout),
        }
        self._pool: psycopg_pool.ConnectionPool[DeadlineConnection] = pool_mod.ConnectionPool(
            conninfo,
            connection_class=DeadlineConnection,
            kwargs=connect_kwargs,
            min_size=min_size,
            max_size=max_size,
            timeout=self._timeout,
            configure=configure_connection,
            name=f"rxcoord-leases-{table}",
            num_workers=1,
            # psycopg-pool retries a failed connection with a backoff that doubles for up to
            # reconnect_timeout (5 minutes by default), so after a long outage its next try
            # could come minutes after the server is back. Giving up after `timeout` instead
            # makes the next caller start a fresh attempt at once.
            reconnect_timeout=max(self._timeout, 1.0),
            open=True,
        )
        self._connect_kwargs = connect_kwargs
        self._idle: deque[DeadlineConnection] = deque()
        self._draining = False
        self._pool_waiters = 0  # callers blocked in the pool's getconn (see _checkout)
        self._waiters_lock = threading.Lock()
        self._configure_connection = configure_connection
        self._listener = _PgListener(
            lambda: self._hub, conninfo, connect_kwargs, self._timeout, self._channel
        )
        super().__init__(WaitHub(self._listener), poll=(0.01, 0.25))

    def _describe(self) -> str:
        return f"table={self.table}"

    def _listener_counts(self) -> tuple[int, int]:
        return self._listener.notifications, self._listener.reconnects

    # -- connections --------------------------------------------------------------------------

    def _unavailable(self, exc: Exception, action: str) -> LeaseStoreUnavailable:
        return LeaseStoreUnavailable(
            f"PostgreSQL lease store failed to {action}: {type(exc).__name__}: {exc}".rstrip()
            + " (the provider reconnects once the server is reachable again)"
        )

    def _error(
        self, exc: Exception, action: str
    ) -> LeaseStoreUnavailable | LeaseStoreMisconfigured:
        """Map a driver error: an outage, or a refusal that no retry will fix."""
        sqlstate = getattr(exc, "sqlstate", None)
        text = str(exc)
        if isinstance(exc, self._psycopg.ProgrammingError) and sqlstate is None:
            permanent = True  # a malformed connection string, say
        elif sqlstate:
            permanent = sqlstate[:2] in _PERMANENT_SQLSTATE_CLASSES
        else:
            lowered = text.lower()
            permanent = any(marker in lowered for marker in _PERMANENT_CONNECT_ERRORS)
        if not permanent:
            return self._unavailable(exc, action)
        return LeaseStoreMisconfigured(
            f"PostgreSQL lease store refused to {action}: {type(exc).__name__}: "
            f"{text.strip()} [{_fix_for(sqlstate, text)}]"
        )

    def _channel(self, name: str) -> str:
        resolved = self._resolved
        if resolved is None:  # not before the first call; the listener comes later
            self._ensure_schema(monotonic() + self._timeout)
            resolved = self._resolved
            assert resolved is not None
        return channel_for(resolved, name)

    def _getconn(self, deadline: float) -> DeadlineConnection:
        # Idle connections wait in a deque of our own first: deque.pop/append are atomic, so
        # the common case takes no lock, while psycopg-pool's getconn/putconn (locks, stats,
        # its checks) cost about as much client time as a lease's own work. The pool still
        # opens, counts (max_size) and closes every connection.
        # A few attempts: every idle connection may have been closed by a server restart.
        for _ in range(self._max_size + 1):
            conn = self._checkout(deadline)
            if not conn.has_unexpected_input():
                conn.deadline = deadline
                return conn
            conn.close()  # the pool discards closed connections and opens a new one
            self._pool.putconn(conn)
        conn = self._checkout(deadline)
        conn.deadline = deadline
        return conn

    def _checkout(self, deadline: float) -> DeadlineConnection:
        try:
            return self._idle.pop()
        except IndexError:
            pass
        # Every connection may be out, some on their way back to the deque: announce that we
        # wait in the pool, so that _putconn hands them to the pool (and so to us) instead.
        with self._waiters_lock:
            self._pool_waiters += 1
        try:
            try:
                return self._idle.pop()  # returned between the first look and the announcement
            except IndexError:
                return self._pool.getconn(timeout=max(0.001, deadline - monotonic()))
        finally:
            with self._waiters_lock:
                self._pool_waiters -= 1

    def _putconn(self, conn: DeadlineConnection) -> None:
        conn.deadline = None
        if (
            conn.closed
            or conn.pgconn.transaction_status != _IDLE
            or self._draining
            or self._pool_waiters
        ):
            self._pool.putconn(conn)  # discarded, reset, or handed to a waiter by the pool
            return
        self._idle.append(conn)
        # A caller may have announced itself after the check above and missed this connection
        # in the deque (or the provider closed meanwhile): give one back to the pool then.
        if self._pool_waiters or self._draining:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            self._pool.putconn(conn)
            if self._draining:
                self._drain_idle()

    def _drain_idle(self) -> None:
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            with contextlib.suppress(Exception):
                self._pool.putconn(conn)

    def _ensure_schema(self, deadline: float) -> None:
        if not self._schema_lock.acquire(timeout=max(0.0, deadline - monotonic())):
            raise self._unavailable(
                TimeoutError("another thread is setting it up"), "set up the lease table"
            )
        try:
            if self._schema_ready:
                return
            try:
                row = self._set_up_schema(deadline)
            except self._psycopg.Error as exc:
                raise self._error(exc, "set up the lease table") from exc
            assert row is not None
            self._resolved = (str(row[0]), str(row[1]))
            self._schema_ready = True
        finally:
            self._schema_lock.release()

    def _set_up_schema(self, deadline: float) -> Any:
        # A connection of its own rather than the pool's: the pool retries a refused
        # connection until its timeout, so a wrong password or an unknown database would be
        # reported only after `timeout` seconds, as a PoolTimeout that reads like an outage.
        # One direct attempt reports the server's own reason at once.
        from ._pg_deadline import DeadlineConnection

        conn = DeadlineConnection.connect(self.conninfo, **self._connect_kwargs)
        try:
            conn.deadline = deadline
            self._configure_connection(conn)
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(self._sql_create)
                # Added only when missing: ALTER TABLE needs the table's owner, which a second
                # role sharing the table is not.
                has_waited = conn.execute(
                    "SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = "
                    "%s::regclass AND attname = 'waited' AND NOT attisdropped)",
                    (self._table_literal,),
                ).fetchone()
                if not (has_waited and has_waited[0]):
                    conn.execute(self._sql_add_waited)
                exists = conn.execute(
                    "SELECT to_regclass(%s) IS NOT NULL", (self._seq_name_literal,)
                ).fetchone()
                if not (exists and exists[0]):
                    conn.execute(self._sql_create_seq)
                    conn.execute(self._sql_start_seq)
                row = conn.execute(
                    "SELECT n.nspname, c.relname, c.relpersistence, sn.nspname, s.relname "
                    "FROM pg_catalog.pg_class c "
                    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace, "
                    "pg_catalog.pg_class s JOIN pg_catalog.pg_namespace sn "
                    "ON sn.oid = s.relnamespace "
                    "WHERE c.oid = %s::regclass AND s.oid = %s::regclass",
                    (self._table_literal, self._seq_name_literal),
                ).fetchone()
                assert row is not None
                # The permit table lives beside the lease table, in its persistence, and takes
                # its tokens from the very sequence the lease grants use (resolved here, so
                # that providers spelling the table differently share one set of functions).
                permit_sql = _permit_statements(
                    (str(row[0]), str(row[1])), (str(row[3]), str(row[4])), row[2] == "u"
                )
                for statement in permit_sql.create:
                    conn.execute(statement)
                # A permit table made before rates: add their columns (only then: ALTER TABLE
                # needs the owner, which a second role sharing the table is not).
                has_rates = conn.execute(
                    "SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = "
                    "%s::regclass AND attname = 'expires' AND NOT attisdropped)",
                    (permit_sql.table,),
                ).fetchone()
                if not (has_rates and has_rates[0]):
                    for statement in permit_sql.upgrade:
                        conn.execute(statement)
                for signature, source, create in permit_sql.functions:
                    # Replaced only when it differs: CREATE OR REPLACE rewrites the catalog
                    # and needs the function's owner, which a second role sharing the table
                    # is not.
                    found = conn.execute(
                        "SELECT p.prosrc FROM pg_catalog.pg_proc p "
                        "WHERE p.oid = to_regprocedure(%s)",
                        (signature,),
                    ).fetchone()
                    if found is None or found[0] != source:
                        conn.execute(create)
        finally:
            conn.close()
        self._permit_sql = permit_sql
        if row is not None and self._durable and row[2] == "u":
            raise LeaseStoreMisconfigured(
                f"PostgreSQL lease table {self.table!r} is UNLOGGED (created by a provider with "
                "durable=False): a server crash would empty it, which a durable provider must "
                "not allow [use another table, pass durable=False, or run ALTER TABLE ... SET "
                "LOGGED]"
            )
        return row

    def _run(
        self,
        query: str,
        params: dict[str, object],
        action: str,
        timeout: float | None = None,
        *,
        rows: bool = True,
    ) -> tuple[Any, int]:
        """Execute one statement within ``timeout`` (at most the provider's); (row, rowcount).

        ``rows``: the statement returns rows (read the first). Said by the caller rather than
        read from ``cursor.description``, which builds column objects on every call.
        """

        def execute(conn: DeadlineConnection) -> tuple[Any, int]:
            cursor = conn.execute(query, params, prepare=True)
            row = cursor.fetchone() if rows else None
            return row, cursor.rowcount

        return self._on_connection(execute, action, timeout)

    def _run_prepared(
        self,
        statement: Prepared,
        values: Sequence[str | int | float],
        action: str,
        timeout: float | None = None,
    ) -> Any:
        """:meth:`_run` for the hot path (grants, releases): the ``psycopg.pq`` result of
        ``statement`` (see ``DeadlineConnection.run_prepared``), values in its keys' order."""
        return self._on_connection(
            lambda conn: conn.run_prepared(statement, values), action, timeout
        )

    def _on_connection(
        self, fn: Callable[[DeadlineConnection], _T], action: str, timeout: float | None
    ) -> _T:
        """``fn`` on a pooled connection within ``timeout``, driver errors mapped."""
        errors = self._psycopg.Error
        budget = self._timeout if timeout is None else min(timeout, self._timeout)
        deadline = monotonic() + budget
        for attempt in (1, 2):
            try:
                if not self._schema_ready:
                    self._ensure_schema(deadline)
                conn = self._getconn(deadline)
                try:
                    return fn(conn)
                finally:
                    self._putconn(conn)
            except (
                self._psycopg.errors.UndefinedTable,
                self._psycopg.errors.UndefinedFunction,
            ) as exc:
                # Dropped behind our back: the statement failed as a whole, nothing of it was
                # committed, so recreating and retrying once is safe.
                self._schema_ready = False
                if attempt == 2:
                    raise self._error(exc, action) from exc
            except errors as exc:
                raise self._error(exc, action) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # -- primitives ---------------------------------------------------------------------------

    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        result = self._run_prepared(
            # A name this provider's waiters listen for: mark the row if it is taken.
            self._grant_waiting if self._listener.watching(name) else self._grant,
            (name, at_most_for, at_least_for, self._holder),
            "grant a lease",
        )
        self._maybe_sweep()
        token = result.get_value(0, 0)
        if token is not None:
            return int(token), 0.0
        remaining = result.get_value(0, 1)
        return 0, max(0.0, float(remaining)) if remaining is not None else 0.0

    def _maybe_sweep(self) -> None:
        """Delete expired rows in the background, at most every ``sweep_every`` seconds.

        An expired row is a free name: deleting it changes nothing for anyone (the sequence,
        not the row, carries the tokens), so any provider may sweep any row. The same goes for
        a fleet group's row whose permits, demand and rate buckets have all expired. Run after
        lease grants and permit steps.
        """
        every = self._sweep_every
        if every is None:
            return
        now = monotonic()
        if now < self._next_sweep or self._sweeping:
            return
        self._next_sweep = now + every
        self._sweeping = True
        self._background.submit(self._sweep)

    def _sweep(self) -> None:
        try:
            self._run(self._sql_sweep, {}, "sweep expired leases", rows=False)
            # Fleet groups nobody calls any more (a crashed fleet): their rows, once all
            # their permits, demand and rate buckets have expired.
            self._run(self._permit_statements().sweep, {}, "sweep idle fleet groups", rows=False)
        except (LeaseStoreUnavailable, LeaseStoreMisconfigured):
            pass  # the next grant tries again; nothing depends on it
        finally:
            self._sweeping = False

    def _store_holder(self, name: str) -> tuple[int, float, bool] | None:
        row, _ = self._run(self._sql_holder, {"name": name}, "read a lease")
        if row is None:
            return None
        return int(row[0]), max(0.0, float(row[1])), bool(row[2])

    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        _, count = self._run(
            self._sql_extend,
            {"name": name, "token": token, "most": at_most_for},
            "extend a lease",
            timeout,
            rows=False,
        )
        return count == 1

    def _store_release(
        self, name: str, token: int, *, timeout: float | None = None, kept: bool = True
    ) -> bool:
        result = self._run_prepared(
            self._release if kept else self._release_simple,
            (name, token, self._channel(name)),
            "release a lease",
            timeout,
        )
        return bool(result.ntuples)

    # -- fleet permits: one function call each (see _permit_statements) ----------------------

    def _permit_statements(self) -> _PermitSql:
        permit_sql = self._permit_sql
        if permit_sql is None:  # not before the first call
            self._ensure_schema(monotonic() + self._timeout)
            permit_sql = self._permit_sql
            assert permit_sql is not None
        return permit_sql

    def _permits_acquire(
        self,
        group: str,
        tenant: str,
        want: int,
        weight: float,
        tenant_limit: int,
        limit: int,
        most: float,
        demand_for: float,
        more: bool,
        *,
        rate: RateArgs | None = None,
        tenant_rate: RateArgs | None = None,
    ) -> PermitReply:
        channel = self._channel(hub_name(group))
        self._maybe_sweep()
        row, _ = self._run(
            self._permit_statements().acquire,
            {
                "group": group,
                "tenant": tenant,
                "want": want,
                "weight": weight,
                "tenant_limit": tenant_limit,
                "limit": limit,
                "most": most,
                "demand_for": demand_for,
                "more": more,
                "channel": channel,
                "rate_iv": 0.0 if rate is None else rate[0],
                "rate_burst": 0 if rate is None else rate[1],
                "trate_iv": 0.0 if tenant_rate is None else tenant_rate[0],
                "trate_burst": 0 if tenant_rate is None else tenant_rate[1],
            },
            "acquire fleet permits",
        )
        tokens, wake_in, running, tenant_running, rate_wait, group_wait, at = row
        return PermitReply(
            tuple(tokens),
            None if wake_in is None else float(wake_in),
            int(running),
            int(tenant_running),
            float(rate_wait),
            float(group_wait),
            float(at),
        )

    def _permits_release(
        self, group: str, permits: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> int:
        channel = self._channel(hub_name(group))
        row, _ = self._run(
            self._permit_statements().release,
            {
                "group": group,
                "tokens": _bigint_array(token for token, _ in permits),
                "tenants": _text_array(tenant for _, tenant in permits),
                "channel": channel,
            },
            "release fleet permits",
            timeout,
        )
        return int(row[0])

    def _permits_extend(
        self,
        group: str,
        permits: Sequence[tuple[int, str]],
        most: float,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        row, _ = self._run(
            self._permit_statements().extend,
            {
                "group": group,
                "tokens": _bigint_array(token for token, _ in permits),
                "tenants": _text_array(tenant for _, tenant in permits),
                "most": most,
            },
            "extend fleet permits",
            timeout,
        )
        return [int(token) for token in row[0]]

    def _store_list(self) -> StoreListing:
        """Read-only, on a connection of its own in a read-only transaction: no schema set-up
        (a table nobody created lists nothing), no sweep."""
        from ._pg_deadline import DeadlineConnection

        deadline = monotonic() + self._timeout
        try:
            conn = DeadlineConnection.connect(self.conninfo, **self._connect_kwargs)
        except self._psycopg.Error as exc:
            raise self._error(exc, "list the leases") from exc
        try:
            conn.deadline = deadline
            self._configure_connection(conn)
            conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            with conn.transaction():
                found = conn.execute(
                    "SELECT n.nspname, c.relname, EXISTS (SELECT FROM pg_catalog.pg_attribute "
                    "WHERE attrelid = c.oid AND attname = 'waited' AND NOT attisdropped) "
                    "FROM pg_catalog.pg_class c "
                    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.oid = to_regclass(%s)",
                    (self._table_literal,),
                ).fetchone()
                if found is None:
                    return StoreListing("postgres", (), (), holders=True, waiter_marks=True)
                schema, relation, has_waited = str(found[0]), str(found[1]), bool(found[2])
                from psycopg import sql

                table = sql.Identifier(schema, relation).as_string(None)
                waited = "waited" if has_waited else "NULL::boolean"
                leases = tuple(
                    LeaseEntry(str(n), int(tok), float(left), bool(rel), str(by), w)
                    for n, tok, left, rel, by, w in conn.execute(
                        "SELECT name, token, "
                        "extract(epoch FROM locked_until - clock_timestamp())::float8, "
                        f"released, locked_by, {waited} FROM {table} "
                        "WHERE locked_until > clock_timestamp() ORDER BY name"
                    ).fetchall()
                )
                permits = sql.Identifier(
                    schema, _derived_identifier(relation, "_permits")
                ).as_string(None)
                exists = conn.execute("SELECT to_regclass(%s)", (permits,)).fetchone()
                groups = []
                if exists is not None and exists[0] is not None:
                    for name, now, holders, untils, tenants, limits, demand in conn.execute(
                        "SELECT name, date_part('epoch', clock_timestamp()), holders, untils, "
                        f"tenants, limits, demand FROM {permits} ORDER BY name"
                    ).fetchall():
                        entry = group_entry(
                            str(name),
                            float(now),
                            zip(holders, untils, strict=True),
                            {
                                t: int(lim)
                                for t, lim in zip(tenants, limits, strict=True)
                                if lim is not None
                            },
                            {
                                t: float(d)
                                for t, d in zip(tenants, demand, strict=True)
                                if d is not None
                            },
                        )
                        if entry is not None:
                            groups.append(entry)
        except self._psycopg.Error as exc:
            raise self._error(exc, "list the leases") from exc
        finally:
            conn.close()
        return StoreListing("postgres", leases, tuple(groups), holders=True, waiter_marks=True)

    def _store_close(self) -> None:
        self._draining = True
        self._drain_idle()
        # Waits for the pool's worker, which may be connecting to a server that does not
        # answer, at most this long.
        self._pool.close(timeout=self._timeout)


@dataclass(frozen=True, slots=True)
class _PermitSql:
    """The permit table's schema statements, its functions and the calls of them."""

    create: tuple[str, ...]
    upgrade: tuple[str, ...]  # the columns a table made before rates lacks (ALTER TABLE)
    table: str
    functions: tuple[tuple[str, str, str], ...]  # (signature, body, CREATE OR REPLACE ...)
    acquire: str
    release: str
    extend: str
    sweep: str


# The permit table: one row per busy group, its PermitGroup (_permits.py) in typed columns.
# Parallel arrays rather than a jsonb document: float8 round-trips exactly (passes and the clock
# are compared with <), and a step reads and writes one row, as a lease grant or release does.
_PERMIT_COLUMNS: Final = (
    "clock, tokens, holders, untils, tenants, passes, limits, demand, readies, rtenants, rtats, "
    "gtat, expires"
)
# Columns added for rates (ALTER TABLE ... ADD COLUMN on a table made before them).
_PERMIT_RATE_COLUMNS: Final = (
    ("readies", "float8[] NOT NULL DEFAULT '{}'"),  # per tenant, parallel to tenants: the time
    # from which a waiting tenant is within its own rate (NULL: no rate), written with demand
    ("rtenants", "text[] NOT NULL DEFAULT '{}'"),  # rate buckets: a tenant's name and its tat,
    ("rtats", "float8[] NOT NULL DEFAULT '{}'"),  # kept until full again (tat <= now)
    ("gtat", "float8"),  # the group's bucket (NULL: none, or full)
    ("expires", "float8"),  # when everything in the row has expired: the sweep deletes it then
)
_PERMIT_TABLE: Final = (
    "(name text PRIMARY KEY, "
    "clock float8 NOT NULL, "  # the pass of the latest grant
    "tokens bigint[] NOT NULL, "  # permits: token, tenant, until (parallel arrays)
    "holders text[] NOT NULL, "
    "untils float8[] NOT NULL, "
    "tenants text[] NOT NULL, "  # tenants with permits or demand, each with its pass,
    "passes float8[] NOT NULL, "
    "limits bigint[] NOT NULL, "  # the tenant limit recorded with its demand (or NULL),
    "demand float8[] NOT NULL, "  # and its demand's until (NULL: wants nothing)
    + ", ".join(f"{column} {kind}" for column, kind in _PERMIT_RATE_COLUMNS)
    + ")"
)

# Every function's variables: the group's row, and the clock.
_DECLARE_GROUP: Final = """
    v_found boolean;
    v_now float8;
    v_clock float8;
    v_tokens bigint[];
    v_holders text[];
    v_untils float8[];
    v_tenants text[];
    v_passes float8[];
    v_limits bigint[];
    v_demand float8[];
    v_readies float8[];
    v_rtenants text[];
    v_rtats float8[];
    v_gtat float8;
    v_changed boolean := false;
    k int;
    m int;"""

# Locks the group's row (every step on a group holds it, so steps on one group serialize) and
# reads it; then the clock, read under the lock. (A row written before rates has no readies:
# padded to its tenants.)
_LOCK: Final = """SELECT g.clock, g.tokens, g.holders, g.untils, g.tenants, g.passes, g.limits,
        g.demand, g.readies, g.rtenants, g.rtats, g.gtat
    INTO v_clock, v_tokens, v_holders, v_untils, v_tenants, v_passes, v_limits, v_demand,
        v_readies, v_rtenants, v_rtats, v_gtat
    FROM {permits} AS g WHERE g.name = p_group FOR UPDATE;
v_found := FOUND;
v_now := date_part('epoch', clock_timestamp());
IF v_found AND cardinality(v_readies) < cardinality(v_tenants) THEN
    v_readies := v_readies
        || array_fill(NULL::float8, ARRAY[cardinality(v_tenants) - cardinality(v_readies)]);
END IF;"""

# PermitGroup.expire: permits and demand that ran out go; tenants left with neither are
# forgotten (every other tenant has one or the other: each step keeps it so); rate buckets
# full again go.
_EXPIRE: Final = """IF {expired} THEN
    v_changed := true;
    SELECT coalesce(array_agg(x.t ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.h ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.u ORDER BY x.o), '{{}}')
        INTO v_tokens, v_holders, v_untils
        FROM unnest(v_tokens, v_holders, v_untils) WITH ORDINALITY AS x(t, h, u, o)
        WHERE x.u > v_now;
    SELECT coalesce(array_agg(x.n ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.p ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.l ORDER BY x.o), '{{}}'),
           coalesce(array_agg(CASE WHEN x.d > v_now THEN x.d END ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.r ORDER BY x.o), '{{}}')
        INTO v_tenants, v_passes, v_limits, v_demand, v_readies
        FROM unnest(v_tenants, v_passes, v_limits, v_demand, v_readies)
            WITH ORDINALITY AS x(n, p, l, d, r, o)
        WHERE x.d > v_now OR x.n = ANY (v_holders);
    SELECT coalesce(array_agg(x.n ORDER BY x.o), '{{}}'),
           coalesce(array_agg(x.t ORDER BY x.o), '{{}}')
        INTO v_rtenants, v_rtats
        FROM unnest(v_rtenants, v_rtats) WITH ORDINALITY AS x(n, t, o)
        WHERE x.t > v_now;
    IF v_gtat <= v_now THEN
        v_gtat := NULL;
    END IF;
END IF;"""

# Whether a permit, a demand or a rate bucket ran out (never NULL: demand has NULLs).
_EXPIRED: Final = (
    "(v_now >= ANY (v_untils) OR coalesce(v_now >= ANY (v_demand), false)\n"
    "    OR v_now >= ANY (v_rtats) OR coalesce(v_gtat <= v_now, false))"
)

# The tenant at index m, forgotten (its pass, limit, demand and readiness; not its bucket).
_FORGET: Final = """v_tenants := v_tenants[:m - 1] || v_tenants[m + 1:];
v_passes := v_passes[:m - 1] || v_passes[m + 1:];
v_limits := v_limits[:m - 1] || v_limits[m + 1:];
v_demand := v_demand[:m - 1] || v_demand[m + 1:];
v_readies := v_readies[:m - 1] || v_readies[m + 1:];"""

# True when the group holds neither permits, demand nor a bucket still filling: its row goes.
_IDLE_GROUP: Final = (
    "(cardinality(v_tokens) = 0\n"
    "    AND cardinality(v_demand) = cardinality(array_positions(v_demand, NULL))\n"
    "    AND cardinality(v_rtats) = 0 AND v_gtat IS NULL)"
)

# When everything in the row will have expired (max skips NULLs): the sweep's column.
_EXPIRES: Final = "(SELECT max(e) FROM unnest(v_untils || v_demand || v_rtats || v_gtat) AS e)"

# Writes the row back (release and extend: it exists), or deletes it once idle.
_STORE: Final = """IF {idle} THEN
    DELETE FROM {permits} WHERE name = p_group;
ELSE
    UPDATE {permits}
        SET clock = v_clock, tokens = v_tokens, holders = v_holders, untils = v_untils,
            tenants = v_tenants, passes = v_passes, limits = v_limits, demand = v_demand,
            readies = v_readies, rtenants = v_rtenants, rtats = v_rtats, gtat = v_gtat,
            expires = {expires}
        WHERE name = p_group;
END IF;"""


def _gcra(result: str, tat: str, iv: str, burst: str) -> str:
    """PL/pgSQL setting ``result`` to the starts a rate allows back to back at ``v_now``:
    ``rxcoord._core.rate.available`` (the same arithmetic, the same rounding fix-up)."""
    late = f"greatest({tat}, v_now) + ({result} {{}}) * {iv} - ({burst} - 1) * {iv} - v_now"
    return f"""IF {tat} <= v_now THEN
    {result} := {burst};
ELSIF ({burst} - 1) * {iv} + 1e-9 - ({tat} - v_now) < 0 THEN
    {result} := 0;
ELSE
    {result} := least({burst},
        floor((({burst} - 1) * {iv} + 1e-9 - ({tat} - v_now)) / {iv})::bigint + 1);
    WHILE {result} < {burst} AND {late.format("")} <= 1e-9 LOOP
        {result} := {result} + 1;
    END LOOP;
    WHILE {result} > 0 AND {late.format("- 1")} > 1e-9 LOOP
        {result} := {result} - 1;
    END LOOP;
END IF;"""


def _gcra_wait(tat: str, iv: str, burst: str, n: str) -> str:
    """An expression: seconds until ``n`` starts may pass back to back (``rate.wait``)."""
    late = f"(greatest({tat}, v_now) + ({n} - 1) * {iv} - ({burst} - 1) * {iv} - v_now)"
    return f"CASE WHEN {late} > 1e-9 THEN {late} ELSE 0.0::float8 END"


# PermitGroup.acquire. A group without a row (every uncontended job finds one) is computed
# from the empty state and inserted in one statement, whose NOT EXISTS draws no token when the
# row is there. Two transactions inserting at once: the second waits for the first's commit,
# finds the conflict (DO NOTHING; its tokens are a gap in the sequence, as a lease grant that
# loses its race leaves) and goes on to the row, locked. A row that exists is locked, updated
# or deleted once idle; one deleted by the transaction we waited for is not found once we get
# the lock: start over. Rates (p_*_iv > 0, in seconds; the burst beside) are taken with the
# permits: the grant is the start they count.
_ACQUIRE_BODY: Final = """
DECLARE{declare}
    v_mine bigint;
    v_me int;
    v_ri int;
    v_pass float8;
    v_grant bigint;
    v_free bigint;
    v_avail bigint;
    v_better bigint := 0;
    v_token bigint;
    v_soonest float8;
    v_notify boolean := false;
    v_wants boolean;
    v_ttat float8 := 0;
    v_beyond float8;
BEGIN
    rate_wait := 0;
    group_rate_wait := 0;
    LOOP
        IF p_want > 0 OR p_more THEN  -- else there is nothing to insert
            -- The empty state: no permits, no demand (nothing reserved), clock and pass 0,
            -- full buckets.
            v_now := date_part('epoch', clock_timestamp());
            v_grant := greatest(0, least(p_want, p_tenant_limit, p_limit));
            IF p_rate_iv > 0 THEN
                v_grant := least(v_grant, p_rate_burst);
            END IF;
            IF p_trate_iv > 0 THEN
                v_grant := least(v_grant, p_trate_burst);
            END IF;
            v_wants := v_grant < p_want OR p_more;
            v_gtat := CASE WHEN p_rate_iv > 0 AND v_grant > 0
                THEN v_now + v_grant * p_rate_iv END;
            v_ttat := CASE WHEN p_trate_iv > 0 AND v_grant > 0
                THEN v_now + v_grant * p_trate_iv ELSE 0 END;
            v_untils := CASE WHEN v_grant > 0 THEN ARRAY[v_now + p_most] ELSE '{{}}' END;
            v_demand := ARRAY[CASE WHEN v_wants THEN greatest(v_now, v_now + p_demand_for) END];
            v_rtats := CASE WHEN p_trate_iv > 0 AND v_grant > 0 THEN ARRAY[v_ttat]
                ELSE '{{}}' END;
            v_readies := ARRAY[CASE WHEN v_wants AND p_trate_iv > 0
                THEN v_ttat - (p_trate_burst - 1) * p_trate_iv END];
            IF v_grant <= 1 THEN
                -- One permit or none (every uncontended job): its token drawn by the
                -- statement itself, once it found no row. (A statement of one shape: its
                -- plan is cached, where a token count would have it planned every time.)
                INSERT INTO {permits} (name, {columns})
                    SELECT p_group, 0,
                        CASE WHEN v_grant = 1 THEN ARRAY[nextval({seq}::regclass)]
                            ELSE '{{}}' END,
                        CASE WHEN v_grant = 1 THEN ARRAY[p_tenant] ELSE '{{}}' END,
                        v_untils,
                        ARRAY[p_tenant],
                        ARRAY[CASE WHEN v_grant = 1 THEN 0.0::float8 + 1.0::float8 / p_weight
                            ELSE 0.0::float8 END],
                        ARRAY[CASE WHEN v_wants THEN p_tenant_limit END],
                        v_demand, v_readies,
                        CASE WHEN p_trate_iv > 0 AND v_grant = 1 THEN ARRAY[p_tenant]
                            ELSE '{{}}' END,
                        v_rtats, v_gtat,
                        (SELECT max(e) FROM unnest(v_untils || v_demand || v_rtats || v_gtat)
                            AS e)
                    WHERE NOT EXISTS (SELECT FROM {permits} AS g WHERE g.name = p_group)
                    ON CONFLICT (name) DO NOTHING
                    RETURNING {permits}.tokens INTO tokens;
            ELSE
                v_clock := 0;
                v_pass := 0;
                FOR i IN 1..v_grant LOOP
                    v_clock := v_pass;
                    v_pass := v_pass + 1.0::float8 / p_weight;
                END LOOP;
                v_untils := array_fill(v_now + p_most, ARRAY[v_grant::int]);
                INSERT INTO {permits} (name, {columns})
                    SELECT p_group, v_clock,
                        ARRAY(SELECT nextval({seq}::regclass)
                              FROM generate_series(1, v_grant) ORDER BY 1),
                        array_fill(p_tenant, ARRAY[v_grant::int]),
                        v_untils,
                        ARRAY[p_tenant], ARRAY[v_pass],
                        ARRAY[CASE WHEN v_wants THEN p_tenant_limit END],
                        v_demand, v_readies,
                        CASE WHEN p_trate_iv > 0 THEN ARRAY[p_tenant] ELSE '{{}}' END,
                        v_rtats, v_gtat,
                        (SELECT max(e) FROM unnest(v_untils || v_demand || v_rtats || v_gtat)
                            AS e)
                    WHERE NOT EXISTS (SELECT FROM {permits} AS g WHERE g.name = p_group)
                    ON CONFLICT (name) DO NOTHING
                    RETURNING {permits}.tokens INTO tokens;
            END IF;
            IF FOUND THEN
                running := v_grant;
                tenant_running := v_grant;
                IF v_grant < p_want AND v_grant > 0 THEN  -- the soonest expiry: its permits'
                    wake_in := greatest(0.0::float8, (v_now + p_most) - v_now);
                END IF;
                EXIT;
            END IF;
        END IF;
        {lock}
        IF NOT v_found THEN
            CONTINUE WHEN p_want > 0 OR p_more;  -- deleted meanwhile: insert it
            tokens := '{{}}';  -- an idle group, and it stays so
            running := 0;
            tenant_running := 0;
            v_gtat := NULL;
            v_ttat := 0;
            EXIT;
        END IF;
        {expire}
        running := cardinality(v_tokens);
        v_mine := cardinality(array_positions(v_holders, p_tenant));
        v_me := array_position(v_tenants, p_tenant);
        v_ri := array_position(v_rtenants, p_tenant);
        v_ttat := coalesce(v_rtats[v_ri], 0);
        -- An idle tenant earns no credit; a new one starts at the clock.
        v_pass := greatest(coalesce(v_passes[v_me], v_clock), v_clock);
        v_free := p_limit - running;
        IF p_rate_iv > 0 THEN
            {group_avail}
            v_free := least(v_free, v_avail);
        END IF;
        v_grant := least(p_want, p_tenant_limit - v_mine, v_free);
        IF p_trate_iv > 0 THEN
            {tenant_avail}
            v_grant := least(v_grant, v_avail);
        END IF;
        IF v_grant > 0
            AND cardinality(v_demand) > cardinality(array_positions(v_demand, NULL))
        THEN
            -- Leave a permit (and a group token) for every other waiting tenant further
            -- behind (a smaller pass) that is below its own tenant limit and within its own
            -- rate now.
            FOR i IN 1..cardinality(v_tenants) LOOP
                IF v_demand[i] IS NOT NULL AND v_tenants[i] <> p_tenant
                    AND greatest(v_passes[i], v_clock) < v_pass
                    AND cardinality(array_positions(v_holders, v_tenants[i]))
                        < coalesce(v_limits[i], 0)
                    AND (v_readies[i] IS NULL OR v_readies[i] <= v_now + 1e-9)
                THEN
                    v_better := v_better + 1;
                END IF;
            END LOOP;
            v_grant := least(v_grant, v_free - v_better);
        END IF;
        tokens := '{{}}';
        FOR i IN 1..v_grant LOOP
            v_token := nextval({seq}::regclass);
            tokens := array_append(tokens, v_token);
            v_tokens := array_append(v_tokens, v_token);
            v_holders := array_append(v_holders, p_tenant);
            v_untils := array_append(v_untils, v_now + p_most);
            v_clock := v_pass;
            v_pass := v_pass + 1.0::float8 / p_weight;
        END LOOP;
        IF cardinality(tokens) > 0 THEN  -- the starts the rates count: now, with the permits
            IF p_rate_iv > 0 THEN
                v_gtat := greatest(coalesce(v_gtat, 0), v_now) + cardinality(tokens) * p_rate_iv;
            END IF;
            IF p_trate_iv > 0 THEN
                v_ttat := greatest(v_ttat, v_now) + cardinality(tokens) * p_trate_iv;
                IF v_ri IS NULL THEN
                    v_rtenants := array_append(v_rtenants, p_tenant);
                    v_rtats := array_append(v_rtats, v_ttat);
                ELSE
                    v_rtats[v_ri] := v_ttat;
                END IF;
            END IF;
        END IF;
        running := cardinality(v_tokens);
        tenant_running := v_mine + cardinality(tokens);
        IF cardinality(tokens) < p_want OR p_more THEN
            IF v_me IS NULL THEN
                v_tenants := array_append(v_tenants, p_tenant);
                v_passes := array_append(v_passes, v_pass);
                v_limits := array_append(v_limits, p_tenant_limit);
                v_demand := array_append(v_demand, greatest(v_now, v_now + p_demand_for));
                v_readies := array_append(v_readies, CASE WHEN p_trate_iv > 0
                    THEN v_ttat - (p_trate_burst - 1) * p_trate_iv END);
            ELSE
                v_passes[v_me] := v_pass;
                v_limits[v_me] := p_tenant_limit;
                v_demand[v_me] := greatest(coalesce(v_demand[v_me], v_now), v_now + p_demand_for);
                v_readies[v_me] := CASE WHEN p_trate_iv > 0
                    THEN v_ttat - (p_trate_burst - 1) * p_trate_iv END;
            END IF;
        ELSE
            -- A pure withdrawal with permits free: a waiter may have yielded to it.
            v_notify := v_me IS NOT NULL AND v_demand[v_me] IS NOT NULL AND p_want = 0
                AND running < p_limit;
            IF tenant_running > 0 THEN
                IF v_me IS NULL THEN
                    v_tenants := array_append(v_tenants, p_tenant);
                    v_passes := array_append(v_passes, v_pass);
                    v_limits := array_append(v_limits, NULL::bigint);
                    v_demand := array_append(v_demand, NULL::float8);
                    v_readies := array_append(v_readies, NULL::float8);
                ELSE
                    v_passes[v_me] := v_pass;
                    v_demand[v_me] := NULL;
                END IF;
            ELSIF v_me IS NOT NULL THEN  -- neither permits nor demand: forgotten
                m := v_me;
                {forget}
            END IF;
        END IF;
        IF cardinality(tokens) < p_want THEN
            v_soonest := NULL;  -- least() skips NULLs
            FOR i IN 1..cardinality(v_untils) LOOP
                v_soonest := least(v_soonest, v_untils[i]);
            END LOOP;
            FOR i IN 1..cardinality(v_tenants) LOOP
                IF v_tenants[i] <> p_tenant THEN
                    v_soonest := least(v_soonest, v_demand[i]);
                END IF;
            END LOOP;
            IF v_soonest IS NOT NULL THEN
                wake_in := greatest(0.0::float8, v_soonest - v_now);
            END IF;
        END IF;
        {store}
        EXIT;
    END LOOP;
    at := v_now;
    IF cardinality(tokens) < p_want THEN
        IF p_rate_iv > 0 THEN
            group_rate_wait := {group_wait};
            -- The next group token nobody further behind has a claim on.
            v_beyond := {group_beyond};
            IF v_beyond > 0 AND (wake_in IS NULL OR v_beyond < wake_in) THEN
                wake_in := v_beyond;
            END IF;
        END IF;
        rate_wait := group_rate_wait;
        IF p_trate_iv > 0 THEN
            rate_wait := greatest(rate_wait, {tenant_wait});
        END IF;
    END IF;
    IF v_notify THEN
        PERFORM pg_notify(p_channel, '');  -- delivered at commit
    END IF;
    IF cardinality(tokens) = 0 THEN
        -- Nothing granted, no token used: a crash undoing this costs a wait at most (as a
        -- lease release), so it need not wait for the WAL flush.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END
"""

# PermitGroup.release.
_RELEASE_BODY: Final = """
DECLARE{declare}
    v_held bigint := 0;
BEGIN
    -- Every permit released, nobody waiting and no bucket still filling (every uncontended
    -- job without a rate): the steps below, in one statement. All were held, every tenant is
    -- forgotten, the group goes. (The clock is read when the row is, after any wait for its
    -- lock.)
    DELETE FROM {permits} AS g
        WHERE g.name = p_group AND g.tokens = p_tokens AND g.holders = p_tenants
            AND date_part('epoch', clock_timestamp()) < ALL (g.untils)
            AND cardinality(array_positions(g.demand, NULL)) = cardinality(g.demand)
            AND NOT date_part('epoch', clock_timestamp()) < ANY (g.rtats)
            AND NOT coalesce(date_part('epoch', clock_timestamp()) < g.gtat, false);
    IF FOUND THEN
        PERFORM pg_notify(p_channel, '');
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN cardinality(p_tokens);
    END IF;
    {lock}
    IF NOT v_found THEN  -- an idle group: nothing is held
        RETURN 0;
    END IF;
    {expire}
    FOR j IN 1..cardinality(p_tokens) LOOP
        k := array_position(v_tokens, p_tokens[j]);
        IF k IS NOT NULL AND v_holders[k] = p_tenants[j] THEN
            v_tokens := v_tokens[:k - 1] || v_tokens[k + 1:];
            v_holders := v_holders[:k - 1] || v_holders[k + 1:];
            v_untils := v_untils[:k - 1] || v_untils[k + 1:];
            v_held := v_held + 1;
            m := array_position(v_tenants, p_tenants[j]);
            IF m IS NOT NULL AND v_demand[m] IS NULL
                AND array_position(v_holders, p_tenants[j]) IS NULL
            THEN
                {forget}
            END IF;
        END IF;
    END LOOP;
    IF v_held > 0 OR v_changed THEN
        {store}
    END IF;
    IF v_held > 0 THEN
        PERFORM pg_notify(p_channel, '');  -- delivered at commit
    END IF;
    -- Asynchronous, as a lease release: one undone by a crash keeps permits out until they
    -- expire, no longer.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN v_held;
END
"""

# PermitGroup.extend.
_EXTEND_BODY: Final = """
DECLARE{declare}
    v_lost bigint[] := '{{}}';
BEGIN
    {lock}
    IF NOT v_found THEN  -- an idle group: nothing is held
        RETURN p_tokens;
    END IF;
    {expire}
    FOR j IN 1..cardinality(p_tokens) LOOP
        k := array_position(v_tokens, p_tokens[j]);
        IF k IS NULL OR v_holders[k] <> p_tenants[j] THEN
            v_lost := array_append(v_lost, p_tokens[j]);
        ELSE
            v_untils[k] := v_now + p_most;
            v_changed := true;
        END IF;
    END LOOP;
    IF v_changed THEN
        {store}
    END IF;
    RETURN v_lost;
END
"""


def _permit_statements(table: tuple[str, str], seq: tuple[str, str], unlogged: bool) -> _PermitSql:
    """The permit table and its functions beside the lease table ``table`` (schema and name as
    the server resolved them) whose token sequence is ``seq``, and the calls of them."""
    from psycopg import sql

    schema, relation = table

    def ident(suffix: str) -> str:
        return sql.Identifier(schema, _derived_identifier(relation, suffix)).as_string(None)

    permits = ident("_permits")
    names = {
        "permits": permits,
        "columns": _PERMIT_COLUMNS,
        "seq": sql.Literal(sql.Identifier(*seq).as_string(None)).as_string(None),
        "idle": _IDLE_GROUP,
        "expired": _EXPIRED,
        "expires": _EXPIRES,
    }

    def placed(fragment: str, spaces: int) -> str:
        # A fragment's first line goes where the template puts it, the others under it.
        return fragment.replace("\n", "\n" + " " * spaces)

    def body(template: str, lock: int, expire: int, store: int, forget: int) -> str:
        parts = {
            "declare": _DECLARE_GROUP,
            "lock": placed(_LOCK.format(**names), lock),
            "expire": placed(_EXPIRE.format(**names), expire),
            "store": placed(_STORE.format(**names), store),
            "forget": placed(_FORGET, forget),
            "group_avail": placed(
                _gcra("v_avail", "coalesce(v_gtat, 0)", "p_rate_iv", "p_rate_burst"), 12
            ),
            "tenant_avail": placed(_gcra("v_avail", "v_ttat", "p_trate_iv", "p_trate_burst"), 12),
            "group_wait": _gcra_wait("coalesce(v_gtat, 0)", "p_rate_iv", "p_rate_burst", "1"),
            "group_beyond": _gcra_wait(
                "coalesce(v_gtat, 0)", "p_rate_iv", "p_rate_burst", "v_better + 1"
            ),
            "tenant_wait": _gcra_wait("v_ttat", "p_trate_iv", "p_trate_burst", "1"),
        }
        return template.format(**parts, **{**names, "idle": placed(_IDLE_GROUP, 8)})

    acquire_fn = ident("_permits_acquire")
    release_fn = ident("_permits_release")
    extend_fn = ident("_permits_extend")
    functions = (
        (
            acquire_fn,
            "p_group text, p_tenant text, p_want bigint, p_weight float8, "
            "p_tenant_limit bigint, p_limit bigint, p_most float8, p_demand_for float8, "
            "p_more boolean, p_channel text, p_rate_iv float8, p_rate_burst bigint, "
            "p_trate_iv float8, p_trate_burst bigint, OUT tokens bigint[], OUT wake_in float8, "
            "OUT running bigint, OUT tenant_running bigint, OUT rate_wait float8, "
            "OUT group_rate_wait float8, OUT at float8",
            "(text, text, bigint, float8, bigint, bigint, float8, float8, boolean, text, float8, "
            "bigint, float8, bigint)",
            "",
            body(_ACQUIRE_BODY, lock=8, expire=8, store=8, forget=16),
        ),
        (
            release_fn,
            "p_group text, p_tokens bigint[], p_tenants text[], p_channel text",
            "(text, bigint[], text[], text)",
            " RETURNS bigint",
            body(_RELEASE_BODY, lock=4, expire=4, store=8, forget=16),
        ),
        (
            extend_fn,
            "p_group text, p_tokens bigint[], p_tenants text[], p_most float8",
            "(text, bigint[], text[], float8)",
            " RETURNS bigint[]",
            body(_EXTEND_BODY, lock=4, expire=4, store=8, forget=0),
        ),
    )
    kind = "UNLOGGED TABLE" if unlogged else "TABLE"
    return _PermitSql(
        create=(f"CREATE {kind} IF NOT EXISTS {permits} {_PERMIT_TABLE}",),
        upgrade=tuple(
            f"ALTER TABLE {permits} ADD COLUMN IF NOT EXISTS {column} {definition}"
            for column, definition in _PERMIT_RATE_COLUMNS
        ),
        table=permits,
        functions=tuple(
            (
                name + types,
                source,
                f"CREATE OR REPLACE FUNCTION {name}({args}){returns} LANGUAGE plpgsql "
                f"AS $rxcoord${source}$rxcoord$",
            )
            for name, args, types, returns, source in functions
        ),
        acquire=(
            "SELECT tokens, wake_in, running, tenant_running, rate_wait, group_rate_wait, at "
            f"FROM {acquire_fn}("
            "%(group)s::text, %(tenant)s::text, %(want)s::bigint, %(weight)s::float8, "
            "%(tenant_limit)s::bigint, %(limit)s::bigint, %(most)s::float8, "
            "%(demand_for)s::float8, %(more)s::boolean, %(channel)s::text, "
            "%(rate_iv)s::float8, %(rate_burst)s::bigint, %(trate_iv)s::float8, "
            "%(trate_burst)s::bigint)"
        ),
        release=(
            f"SELECT {release_fn}(%(group)s::text, %(tokens)s::bigint[], "
            "%(tenants)s::text[], %(channel)s::text)"
        ),
        extend=(
            f"SELECT {extend_fn}(%(group)s::text, %(tokens)s::bigint[], "
            "%(tenants)s::text[], %(most)s::float8)"
        ),
        # Groups nobody calls any more (a crashed fleet): everything in them expired.
        # SKIP LOCKED: a row a step holds is being written; never wait for it.
        sweep=(
            f"DELETE FROM {permits} WHERE name IN (SELECT name FROM {permits} "
            "WHERE expires <= date_part('epoch', clock_timestamp()) FOR UPDATE SKIP LOCKED)"
        ),
    )


# Arrays sent as their text form: psycopg's list adaptation (it inspects the elements to pick
# a type) costs the client more than the rest of a release; the statement casts them.


def _bigint_array(values: Iterable[int]) -> str:
    return "{" + ",".join(str(int(value)) for value in values) + "}"


def _text_array(values: Iterable[str]) -> str:
    quoted = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return "{" + ",".join(quoted) + "}"


def _derived_identifier(base: str, suffix: str) -> str:
    """``base + suffix`` within the identifier limit; where it must be shortened, with a hash of
    ``base`` too: two lease tables whose names share a prefix must not share permit tables
    (their groups would be one), unlike a sequence, which they may share."""
    if len((base + suffix).encode()) <= _MAX_IDENTIFIER:
        return base + suffix
    digest = hashlib.blake2b(base.encode(), digest_size=4).hexdigest()
    return _truncate_identifier(base, f"_{digest}{suffix}")


def _truncate_identifier(base: str, suffix: str) -> str:
    """``base + suffix`` within PostgreSQL's identifier limit (a shared prefix is harmless:
    two tables sharing one sequence still get increasing tokens)."""
    room = _MAX_IDENTIFIER - len(suffix.encode())
    return base.encode()[:room].decode(errors="ignore") + suffix


def _fix_for(sqlstate: str | None, text: str) -> str:
    """What to do about a permanent PostgreSQL error, for the message."""
    lowered = text.lower()
    if (sqlstate or "").startswith("28") or "authentication" in lowered or "password" in lowered:
        return (
            "fix the user name or password in the connection string (or the server's "
            "pg_hba.conf); retrying with the same settings fails the same way"
        )
    if sqlstate == "3D000" or ("database" in lowered and "does not exist" in lowered):
        return "create the database, or name an existing one in the connection string"
    if "role" in lowered and "does not exist" in lowered:
        return "create the role, or name an existing one in the connection string"
    if sqlstate == "42501" or "permission denied" in lowered:
        return (
            "grant the role CREATE on the schema (or create the lease table, its sequence and "
            "its permit table and functions beforehand) and SELECT, INSERT, UPDATE, DELETE on "
            "the tables, USAGE on the sequence"
        )
    if (sqlstate or "").startswith(("3F", "42")):
        return "check the table name and schema given to PostgresLeases(table=...)"
    return "check the provider's configuration and the values passed"


class _PgListener(Listener):
    """LISTENs on the channels of the names being waited for, on a connection of its own."""

    def __init__(
        self,
        hub_ref: Callable[[], WaitHub | None],
        conninfo: str,
        connect_kwargs: dict[str, Any],
        timeout: float,
        channel_of: Callable[[str], str],
    ) -> None:
        super().__init__(hub_ref, "rxcoord-postgres-lease-listener")
        self._conninfo = conninfo
        self._connect_kwargs = connect_kwargs
        self._idle: deque[DeadlineConnection] = deque()
        self._draining = False
        self._pool_waiters = 0  # callers blocked in the pool's getconn (see _checkout)
        self._waiters_lock = threading.Lock()
        self._timeout = timeout
        self._channel_of = channel_of
        self._channels: dict[str, str] = {}  # channel -> name
        self._conn: DeadlineConnection | None = None

    def _connect(self) -> None:
        from ._pg_deadline import DeadlineConnection

        conn = DeadlineConnection.connect(self._conninfo, **self._connect_kwargs)
        conn.default_timeout = self._timeout  # LISTEN to a frozen server fails, then retries
        self._conn = conn

    def _fileno(self) -> int:
        assert self._conn is not None
        return self._conn.fileno()

    def _apply(self, subscribe: list[str], unsubscribe: list[str]) -> None:
        from psycopg import sql

        assert self._conn is not None
        statements: list[sql.Composable] = []
        for name in subscribe:
            channel = self._channel_of(name)
            self._channels[channel] = name
            statements.append(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        for name in unsubscribe:
            channel = self._channel_of(name)
            self._channels.pop(channel, None)
            statements.append(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
        self._conn.execute(sql.SQL("; ").join(statements))
        for name in subscribe + unsubscribe:
            self._acked(name)  # LISTEN takes effect when the command completes
        self._drain()  # notifications that arrived during the command sit in psycopg's backlog

    def _drain(self) -> None:
        assert self._conn is not None
        for notify in self._conn.notifies(timeout=0):
            name = self._channels.get(notify.channel)
            if name is not None:
                self._released(name)

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        self._channels.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


# -- registry entry (see rxcoord/leases/_registry.py) ------------------------------------------
# Kept in one block with its imports, so that a backend's registration reads as one unit.

from typing import Any as _Any  # noqa: E402
from typing import Final as _Final  # noqa: E402

from .._registry import LeaseBackend  # noqa: E402


def _from_url(url: str, rest: str, **options: _Any) -> PostgresLeases:
    """``postgresql://...`` or ``postgres://...``: the URL is psycopg's conninfo."""
    return PostgresLeases(url, **options)


BACKEND: _Final = LeaseBackend(
    name="postgres",
    provider=PostgresLeases,
    schemes=("postgresql", "postgres"),
    from_url=_from_url,
    server=True,
)
