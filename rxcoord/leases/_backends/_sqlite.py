"""Leases in an SQLite file: the embedded default for processes on one machine.

One row per *taken* name (``name, token, locked_until, least_until, released``): a release
deletes its row (or, inside ``at_least_for``, marks it released until then), and rows that
expired are swept by the next grant at most once a second, so a name nobody holds leaves
nothing behind. Tokens come from one store-wide sequence, a one-row table ``<table>_seq``
that a trigger advances with every token written: deleting a name's row cannot reset its
tokens, which keep increasing across releases, expiries, client restarts and reopening the
file. (Upgrading from a version that kept a counter per row: the sequence starts at the
largest token in the table; do not mix versions on one file.)

The grant is one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE locked_until <= now RETURNING
token`` whose new token is the sequence's next value: SQLite serializes writers, so the check,
the grant and the sequence's advance (by the trigger, in the same statement) are one atomic
step. Times are the machine's clock as SQLite reads it (``julianday('now')``),
the same for every process on the machine.

SQLite cannot notify other processes, so waiters poll with exponential backoff (bounded by the
holder's expiry); waiters in the same provider are woken directly on release. The database runs
in WAL mode so readers never block the writer; with ``durable=True`` (default) every grant is
fsynced before it is reported, so tokens survive a power cut too.

Fleet permits (``_permits.py``) are a table ``<table>_permits (name, state)``: one row per
busy group whose ``state`` is its :class:`~rxcoord.leases._permits.PermitGroup` as JSON,
deleted once the group holds neither permits nor demand. Each step is one ``BEGIN
IMMEDIATE`` transaction: read the row and the clock, run the reference ``PermitGroup``
method, write the row back; the write lock serializes it with every other writer of the
file, lease grants included, so its tokens come straight from ``<table>_seq`` (read once,
written back once) and interleave with the leases' in one increasing sequence. Releases and
withdrawals wake this provider's waiters directly; other processes' waiters poll. Fleet rates
(``_permits.py``) are part of the same JSON and the same transaction, on the clock SQLite reads
(``julianday('now')``, milliseconds): each process's reading of the machine's clock, which is
the limit here (processes of one machine share it; a step of the clock shifts every bucket). A
group's JSON also records when everything in it expires (``x``), and a step deletes the rows of
groups whose time has passed, at most once a second (groups a crashed fleet left behind).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from pathlib import Path
from time import monotonic
from typing import Any, Final, TypeVar

from rxcoord._errors import LeaseStoreMisconfigured, LeaseStoreUnavailable

from ..._core.checks import check_identifier, check_length
from .._base import LeaseProvider
from .._listing import LeaseEntry, StoreListing, group_entry
from .._notify import WaitHub
from .._permits import PermitGroup, PermitReply, RateArgs, hub_name

__all__ = ["SqliteLeases"]

_R = TypeVar("_R")

# Seconds since the Unix epoch on the machine's clock, millisecond resolution.
_NOW: Final = "((julianday('now') - 2440587.5) * 86400.0)"
_SWEEP_EVERY: Final = 1.0  # seconds between sweeps of expired rows (per provider)
# sqlite3 error texts that retrying cannot fix (the module has no error codes before 3.11's
# sqlite_errorcode, and these are stable across SQLite versions).
_PERMANENT: Final = (
    "unable to open database file",
    "readonly database",
    "file is not a database",
    "not authorized",
    "malformed",
)


def _check_usable(path: str) -> None:
    """Refuse a database path this process can never use (checked once, at construction).

    Raises:
        LeaseStoreMisconfigured: See :class:`SqliteLeases`.
    """
    if path in ("", ":memory:"):  # private databases: nothing on disk
        return
    problem = _unusable(os.path.abspath(path))
    if problem:
        raise LeaseStoreMisconfigured(f"SQLite lease store {path!r} cannot be used: {problem}")


def _unusable(full: str) -> str:
    """Why this process can never use the database file ``full``, or ''."""
    directory = os.path.dirname(full)
    try:
        if not stat.S_ISDIR(os.stat(directory).st_mode):
            return f"{directory!r} is not a directory"
    except FileNotFoundError:
        return f"its directory {directory!r} does not exist: create it, or use another path"
    except OSError as exc:  # a directory on the way this process may not enter, say
        return f"its directory {directory!r} cannot be reached: {exc.strerror}"
    if os.path.isdir(full):
        return "it is a directory: name a database file in it (leases.db)"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"this process may not write in its directory {directory!r} (SQLite creates the "
            "file and its -wal and -shm files beside it): use a directory it can write"
        )
    if os.path.exists(full) and not os.access(full, os.R_OK | os.W_OK):
        return "this process may not read and write the file: use one it can"
    return ""


class SqliteLeases(LeaseProvider):
    """Leases in an SQLite database file, shared by the processes of one machine.

    Args:
        path: The database file (created if missing). ``":memory:"`` works within one provider.
        table: Table name (an identifier, optionally ``schema.table``); created if missing.
        timeout: Seconds to wait for another process's write lock before giving up with
            ``LeaseStoreUnavailable``.
        durable: fsync every grant and release (``synchronous=FULL``). ``False`` trades
            durability across power loss (not process crashes) for speed.
        poll: (first, max) seconds between polls while waiting for another process's lease.

    Limits: names of at most 4,096 bytes of UTF-8 (SQLite itself takes up to a gigabyte; the
    bound keeps the file and the index sane), durations of at most 1e9 seconds.

    Raises:
        ValueError: Invalid table name or durations.
        LeaseStoreMisconfigured: ``path``'s directory does not exist or is not a directory,
            this process may not write in it (SQLite creates the file and its ``-wal`` and
            ``-shm`` files there), or ``path`` names a directory or a file this process may
            not read and write: refused here rather than at the first grant, since no retry
            would fix it.
    """

    backend = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str] = "rxcoord-leases.db",
        *,
        table: str = "rxcoord_leases",
        timeout: float = 5.0,
        durable: bool = True,
        poll: tuple[float, float] = (0.002, 0.05),
    ) -> None:
        parts = check_identifier(table)
        self._timeout = check_length(timeout, "timeout", allow_zero=True)
        first = check_length(poll[0], "poll[0]")
        cap = check_length(poll[1], "poll[1]")
        self.path = os.fspath(path)
        _check_usable(self.path)
        self.table = table
        self._durable = durable
        self._conn: sqlite3.Connection | None = None
        self._conn_lock = threading.Lock()
        self._holder = f"{socket.gethostname()}:{os.getpid()}"
        t = ".".join(f'"{part}"' for part in parts)
        seq_parts = (*parts[:-1], parts[-1] + "_seq")
        q = ".".join(f'"{part}"' for part in seq_parts)
        schema = f'"{parts[0]}".' if len(parts) == 2 else ""
        permits = ".".join(f'"{part}"' for part in (*parts[:-1], parts[-1] + "_permits"))
        seq_local = f'"{parts[-1]}_seq"'  # trigger bodies may not qualify names (same schema)
        advance = f"BEGIN UPDATE {seq_local} SET token = NEW.token WHERE token < NEW.token; END"
        self._sql_create = [
            f"CREATE TABLE IF NOT EXISTS {t} (name TEXT PRIMARY KEY, token INTEGER NOT NULL, "
            "locked_until REAL NOT NULL, least_until REAL NOT NULL, released INTEGER NOT NULL, "
            "locked_at REAL NOT NULL, locked_by TEXT NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {q} (id INTEGER PRIMARY KEY CHECK (id = 1), "
            "token INTEGER NOT NULL)",
            # A table written by an older version keeps a counter per row: start above them.
            f"INSERT OR IGNORE INTO {q} (id, token) SELECT 1, coalesce(max(token), 0) FROM {t}",
            # Inside the granting statement: the sequence advances atomically with the grant.
            f'CREATE TRIGGER IF NOT EXISTS {schema}"{parts[-1]}_seq_on_update" '
            f'AFTER UPDATE OF token ON "{parts[-1]}" {advance}',
            f'CREATE TRIGGER IF NOT EXISTS {schema}"{parts[-1]}_seq_on_insert" '
            f'AFTER INSERT ON "{parts[-1]}" {advance}',
            # Fleet permits: one row per busy group, PermitGroup.dumps() (see _permits.py).
            f"CREATE TABLE IF NOT EXISTS {permits} (name TEXT PRIMARY KEY, state TEXT)",
        ]
        next_token = f"(SELECT token + 1 FROM {q} WHERE id = 1)"
        self._sql_grant = (
            f"INSERT INTO {t} (name, token, locked_until, least_until, released, locked_at, "
            f"locked_by) VALUES (?1, {next_token}, {_NOW} + ?2, {_NOW} + ?3, 0, {_NOW}, ?4) "
            f"ON CONFLICT (name) DO UPDATE SET token = {next_token}, "
            "locked_until = excluded.locked_until, least_until = excluded.least_until, "
            "released = 0, locked_at = excluded.locked_at, locked_by = excluded.locked_by "
            f"WHERE locked_until <= {_NOW} RETURNING token"
        )
        self._sql_remaining = f"SELECT locked_until - {_NOW} FROM {t} WHERE name = ?1"
        self._sql_holder = (
            f"SELECT token, locked_until - {_NOW}, released FROM {t} "
            f"WHERE name = ?1 AND locked_until > {_NOW}"
        )
        owned = f"name = ?1 AND token = ?2 AND released = 0 AND locked_until > {_NOW}"
        self._sql_extend = (
            f"UPDATE {t} SET locked_until = max(least_until, {_NOW} + ?3) WHERE {owned}"
        )
        # Release: delete the row, unless at_least_for keeps the name taken a while longer.
        self._sql_release_delete = f"DELETE FROM {t} WHERE {owned} AND least_until <= {_NOW}"
        self._sql_release = (
            f"UPDATE {t} SET locked_until = max(least_until, {_NOW}), released = 1 WHERE {owned}"
        )
        self._sql_sweep = f"DELETE FROM {t} WHERE locked_until <= {_NOW}"
        self._sql_permits_read = f"SELECT {_NOW}, (SELECT state FROM {permits} WHERE name = ?1)"
        self._sql_permits_write = (
            f"INSERT INTO {permits} (name, state) VALUES (?1, ?2) "
            "ON CONFLICT (name) DO UPDATE SET state = excluded.state"
        )
        self._sql_permits_delete = f"DELETE FROM {permits} WHERE name = ?1"
        # Groups nobody calls any more (a crashed fleet): everything in them expired.
        self._sql_permits_sweep = f"DELETE FROM {permits} WHERE json_extract(state, '$.x') <= ?1"
        # Permits take their tokens from the leases' sequence (read once, written back once).
        self._sql_seq_read = f"SELECT token FROM {q} WHERE id = 1"
        self._sql_seq_write = f"UPDATE {q} SET token = ?1 WHERE id = 1 AND token < ?1"
        # rxcoord inspect: read-only, on a connection of its own (no schema set-up, no sweep).
        self._sql_list = (
            f"SELECT name, token, locked_until - {_NOW}, released, locked_by FROM {t} "
            f"WHERE locked_until > {_NOW} ORDER BY name"
        )
        self._sql_list_groups = f"SELECT name, state, {_NOW} FROM {permits} ORDER BY name"
        self._next_sweep = 0.0
        self._next_permits_sweep = 0.0
        super().__init__(WaitHub(), poll=(first, max(first, cap)))

    def _describe(self) -> str:
        return f"{self.path!r} table={self.table}"

    def _connection(self) -> sqlite3.Connection:
        conn = self._conn
        if conn is None:
            conn = sqlite3.connect(
                self.path, timeout=self._timeout, isolation_level=None, check_same_thread=False
            )
            try:
                # Busy means another process is switching it right now (the mode persists).
                with suppress(sqlite3.OperationalError):
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={'FULL' if self._durable else 'NORMAL'}")
                conn.execute("BEGIN IMMEDIATE")  # create the table, sequence and triggers at once
                try:
                    for statement in self._sql_create:
                        conn.execute(statement)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return conn

    @contextlib.contextmanager
    def _locked(self, timeout: float | None, action: str) -> Iterator[sqlite3.Connection]:
        """The connection, for this thread alone; waits for locks at most ``timeout`` seconds.

        ``timeout`` (keep-alive passes the time its lease has left) caps both the wait for
        another thread of this provider and SQLite's busy wait for another process's write
        lock, when it is shorter than the provider's own ``timeout``.
        """
        if timeout is None or timeout >= self._timeout:
            with self._conn_lock:
                try:
                    conn = self._connection()
                except sqlite3.Error as exc:
                    raise self._fail(exc, action) from exc
                yield conn
            return
        if not self._conn_lock.acquire(timeout=max(0.0, timeout)):
            raise LeaseStoreUnavailable(
                f"SQLite lease store {self.path!r} failed to {action}: another call of this "
                f"provider held the connection for more than {timeout:.3f}s"
            )
        try:
            try:
                conn = self._connection()
                conn.execute(f"PRAGMA busy_timeout = {max(0, int(timeout * 1000))}")
            except sqlite3.Error as exc:
                raise self._fail(exc, action) from exc
            try:
                yield conn
            finally:
                with suppress(sqlite3.Error):
                    conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        finally:
            self._conn_lock.release()

    def _fail(
        self, exc: sqlite3.Error, action: str
    ) -> LeaseStoreUnavailable | LeaseStoreMisconfigured:
        message = str(exc)
        if "locked" not in message and "busy" not in message:
            # Anything but lock contention may mean a broken handle: reopen on the next call.
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        if any(text in message for text in _PERMANENT):
            return LeaseStoreMisconfigured(
                f"SQLite lease store {self.path!r} failed to {action}: {message}; this will not "
                "pass by retrying: check that the directory exists, that this process may read "
                "and write the file and its directory, and that the path names a lease database"
            )
        return LeaseStoreUnavailable(
            f"SQLite lease store {self.path!r} failed to {action}: {message} "
            f"(a lock held longer than timeout={self._timeout}s, or a full disk; the provider "
            "reopens the file on the next call)"
        )

    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        with self._conn_lock:
            try:
                conn = self._connection()
                self._maybe_sweep(conn)
                rows = conn.execute(
                    self._sql_grant, (name, at_most_for, at_least_for, self._holder)
                ).fetchall()  # fetch all: the statement (and its write lock) ends only then
                if rows:
                    return int(rows[0][0]), 0.0
                row = conn.execute(self._sql_remaining, (name,)).fetchone()
            except sqlite3.Error as exc:
                raise self._fail(exc, "grant a lease") from exc
        return 0, max(0.0, float(row[0])) if row else 0.0

    def _maybe_sweep(self, conn: sqlite3.Connection) -> None:
        """Delete expired rows, at most every _SWEEP_EVERY seconds (under the connection lock).

        An expired row is a free name: deleting it changes nothing for anyone (the sequence,
        not the row, carries the tokens), so any provider may sweep any row.
        """
        now = monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_EVERY
        conn.execute(self._sql_sweep)

    def _store_holder(self, name: str) -> tuple[int, float, bool] | None:
        with self._locked(None, "read a lease") as conn:
            try:
                row = conn.execute(self._sql_holder, (name,)).fetchone()
            except sqlite3.Error as exc:
                raise self._fail(exc, "read a lease") from exc
        if row is None:
            return None
        return int(row[0]), max(0.0, float(row[1])), bool(row[2])

    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        with self._locked(timeout, "extend a lease") as conn:
            try:
                cursor = conn.execute(self._sql_extend, (name, token, at_most_for))
            except sqlite3.Error as exc:
                raise self._fail(exc, "extend a lease") from exc
        return cursor.rowcount == 1

    def _store_release(
        self, name: str, token: int, *, timeout: float | None = None, kept: bool = True
    ) -> bool:
        with self._locked(timeout, "release a lease") as conn:
            try:
                cursor = conn.execute(self._sql_release_delete, (name, token))
                if cursor.rowcount != 1:  # inside at_least_for (or not ours): keep the row
                    cursor = conn.execute(self._sql_release, (name, token))
            except sqlite3.Error as exc:
                raise self._fail(exc, "release a lease") from exc
        if cursor.rowcount == 1:
            self._hub.notify(name)  # waiters in this process need not wait for their next poll
            return True
        return False

    # -- fleet permits: one write transaction over the group's PermitGroup (see _permits.py) ---

    def _permits_step(
        self,
        group: str,
        timeout: float | None,
        action: str,
        step: Callable[[PermitGroup, float, Callable[[], int]], _R],
    ) -> _R:
        """Run ``step(table, now, next_token)`` on the group's state in one write transaction.

        ``BEGIN IMMEDIATE`` takes the database's write lock first, so the read, the step and
        the write-back are one atomic step for every process on the file (and the sequence
        cannot move under us: lease grants write too). The group's row is deleted once it is
        empty.
        """
        with self._locked(timeout, action) as conn:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._fail(exc, action) from exc
            try:
                now, state = conn.execute(self._sql_permits_read, (group,)).fetchone()
                if monotonic() >= self._next_permits_sweep:
                    self._next_permits_sweep = monotonic() + _SWEEP_EVERY
                    conn.execute(self._sql_permits_sweep, (now,))
                table = PermitGroup.loads(state)
                tokens = _Tokens(conn, self._sql_seq_read)
                result = step(table, float(now), tokens.next)
                if tokens.last is not None:
                    conn.execute(self._sql_seq_write, (tokens.last,))
                if not table.empty:
                    conn.execute(self._sql_permits_write, (group, table.dumps()))
                elif state is not None:
                    conn.execute(self._sql_permits_delete, (group,))
                conn.execute("COMMIT")
            except BaseException as exc:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise self._fail(exc, action) from exc
                raise
        return result

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
        def step(
            table: PermitGroup, now: float, next_token: Callable[[], int]
        ) -> tuple[PermitReply, bool]:
            return table.acquire(
                now,
                next_token,
                tenant,
                want,
                weight,
                tenant_limit,
                limit,
                most,
                demand_for,
                more,
                rate,
                tenant_rate,
            )

        reply, notify = self._permits_step(group, None, "acquire fleet permits", step)
        if notify:
            self._hub.notify(hub_name(group))  # other processes find out by polling
        return reply

    def _permits_release(
        self, group: str, permits: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> int:
        held = self._permits_step(
            group,
            timeout,
            "release fleet permits",
            lambda table, now, _: table.release(now, permits),
        )
        if held:
            self._hub.notify(hub_name(group))
        return held

    def _permits_extend(
        self,
        group: str,
        permits: Sequence[tuple[int, str]],
        most: float,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        return self._permits_step(
            group,
            timeout,
            "extend fleet permits",
            lambda table, now, _: table.extend(now, permits, most),
        )

    def _store_list(self) -> StoreListing:
        try:
            # Read-only (mode=ro): a missing file is an error, never created; missing tables
            # (a file no provider has set up) list nothing.
            conn = sqlite3.connect(
                f"{Path(self.path).resolve().as_uri()}?mode=ro",
                uri=True,
                timeout=self._timeout,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise self._fail(exc, "list the leases") from exc
        try:
            leases = tuple(
                LeaseEntry(str(name), int(token), float(left), bool(released), str(holder))
                for name, token, left, released, holder in _rows(conn, self._sql_list)
            )
            groups = []
            for name, state, now in _rows(conn, self._sql_list_groups):
                table = PermitGroup.loads(state)
                entry = group_entry(
                    str(name), float(now), table.permits.values(), table.limits, table.demand
                )
                if entry is not None:
                    groups.append(entry)
        except sqlite3.Error as exc:
            raise self._fail(exc, "list the leases") from exc
        finally:
            conn.close()
        return StoreListing("sqlite", leases, tuple(groups), holders=True, waiter_marks=False)

    def _store_close(self) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def _rows(conn: sqlite3.Connection, query: str) -> list[Any]:
    """All rows of a read-only query; none when its table does not exist (yet)."""
    try:
        return conn.execute(query).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise


class _Tokens:
    """The store-wide sequence inside a write transaction: read on first use, then counted
    here; the caller writes ``last`` back before committing."""

    __slots__ = ("_conn", "_read", "last")

    def __init__(self, conn: sqlite3.Connection, read: str) -> None:
        self._conn = conn
        self._read = read
        self.last: int | None = None

    def next(self) -> int:
        if self.last is None:
            row = self._conn.execute(self._read).fetchone()
            if row is None:  # created with the schema: someone deleted it
                raise sqlite3.DatabaseError("the token sequence's row is missing")
            self.last = int(row[0])
        self.last += 1
        return self.last


# -- registry entry (see rxcoord/leases/_registry.py) ------------------------------------------
# Kept in one block with its imports, so that a backend's registration reads as one unit.

from typing import Any as _Any  # noqa: E402
from typing import Final as _Final  # noqa: E402

from .._registry import LeaseBackend  # noqa: E402


def _from_url(url: str, rest: str, **options: _Any) -> SqliteLeases:
    """``sqlite:///abs/path.db``: ``sqlite://`` followed by an absolute path.

    Raises:
        ValueError: No path, or a relative one (``sqlite://rel.db``: in a URL the part after
            ``//`` is a host, and a relative path depends on the working directory of every
            process that reads the configuration).
    """
    if not rest:
        raise ValueError(f"no database path in {url!r}: use sqlite:///path/to/leases.db")
    if not os.path.isabs(rest):
        raise ValueError(
            f"{url!r} names no absolute path: write sqlite:// followed by an absolute path, "
            f"sqlite://{os.path.abspath(rest)} (three slashes), or pass a relative path to "
            "SqliteLeases(path)"
        )
    return SqliteLeases(rest, **options)


BACKEND: _Final = LeaseBackend(
    name="sqlite", provider=SqliteLeases, schemes=("sqlite",), from_url=_from_url, notifies=False
)
