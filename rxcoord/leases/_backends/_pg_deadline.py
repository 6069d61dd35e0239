"""PostgreSQL connections on which no statement waits longer than its deadline.

psycopg waits for the server without a time limit: the provider's ``timeout`` bounds getting a
pooled connection and connecting, but a statement sent to a server that then freezes (a
``SIGSTOP``, a VM paused, a network partition that drops packets without resetting the
connection) would wait forever, and so would every caller behind it, keep-alive and
``close()``. TCP does not help quickly: the kernel keeps retransmitting for minutes.

:class:`DeadlineConnection` replaces psycopg's wait loop (the one place every statement
blocks) with one that gives up at a deadline: the provider's ``timeout`` by default, or a
shorter one per call (keep-alive passes the time its lease has left). On expiry the connection
is closed (the pool then discards it), the server is asked to cancel the statement (in the
background, so a frozen server cannot block the caller through the cancellation either) and
the caller gets :class:`StatementTimeout`, which the provider reports as
``LeaseStoreUnavailable``.

libpq's TCP keepalives and ``tcp_user_timeout`` (see :func:`keepalive_kwargs`) complement it:
they let the kernel notice a dead peer on idle connections too, such as the listener's.

:meth:`DeadlineConnection.run_prepared` is the lease's hot path (a grant, a release): a statement
prepared once per connection under a name of ours and then executed with text parameters
through libpq's own calls (``psycopg.pq``, ``psycopg.generators``: C code with psycopg-binary),
the same wait and deadline as above. psycopg's cursor layer (a cursor per call, query and
parameter adaptation, its prepared-statement cache, result loaders) costs more client CPU per
statement than all the rest of an acquire+release pair, which on a loopback connection is a
large share of its time; the statements of the hot path need none of it (a few text values in,
one or two values out).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import re
import select
import threading
from collections.abc import Sequence
from time import monotonic
from typing import Any, Final

import psycopg
import psycopg.errors
import psycopg.generators
import psycopg.waiting
from psycopg import pq
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict

__all__ = ["DeadlineConnection", "Prepared", "StatementTimeout", "keepalive_kwargs"]

# psycopg's generator protocol: it yields what it waits for (R=1, W=2, RW=3) and is sent what
# is ready (R=1, W=2), the values of selectors.EVENT_READ / EVENT_WRITE in every psycopg 3.
_EVENTS: Final = {1: select.POLLIN, 2: select.POLLOUT, 3: select.POLLIN | select.POLLOUT}
_READY_R: Final = 1
_READY_W: Final = 2
_BAD: Final = select.POLLERR | select.POLLHUP | select.POLLNVAL


def _fast_wait() -> Any:
    """psycopg's C wait loop, when it takes a deadline (psycopg >= 3.3 with psycopg-binary).

    Driving the protocol from Python (``_wait`` below) costs about as much client CPU as the
    rest of a lease operation; the C loop with ``timeout`` has the same semantics: it gives up
    with ``_WaitTimeout`` once ``timeout`` seconds have passed.
    """
    wait_c = getattr(psycopg.waiting, "wait_c", None)
    timeout_error = getattr(psycopg.errors, "_WaitTimeout", None)
    if wait_c is None or timeout_error is None:
        return None
    try:
        if "timeout" not in inspect.signature(wait_c).parameters:
            return None
    except (TypeError, ValueError):
        return None

    def wait(gen: PQGen[Any], fileno: int, interval: float, timeout: float) -> Any:
        try:
            return wait_c(gen, fileno, interval, timeout)
        except timeout_error:
            raise _Expired from None

    return wait


class Prepared:
    """A statement for :meth:`DeadlineConnection.run_prepared`, from psycopg-style SQL.

    ``%(key)s`` placeholders become ``$1``, ``$2``... in order of first appearance (a key used
    twice is one parameter); the server infers every parameter's type from its use.

    Attributes:
        name: The prepared statement's name on each connection (``rxl_`` + a hash of the SQL).
        query: The SQL with numbered placeholders, encoded.
        keys: The parameter keys, in ``$n`` order.
    """

    __slots__ = ("keys", "name", "query")

    def __init__(self, sql: str) -> None:
        keys: list[str] = []

        def number(match: re.Match[str]) -> str:
            key = match.group(1)
            if key not in keys:
                keys.append(key)
            return f"${keys.index(key) + 1}"

        numbered = _PLACEHOLDER.sub(number, sql)
        if "%" in numbered.replace("%%", ""):
            raise ValueError(f"only %(key)s placeholders are supported: {sql!r}")
        self.query = numbered.replace("%%", "%").encode()
        self.keys = tuple(keys)
        self.name = b"rxl_" + hashlib.blake2b(self.query, digest_size=8).hexdigest().encode()


_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK


class StatementTimeout(psycopg.OperationalError):
    """The server did not answer in time; the connection was closed."""


class _Expired(Exception):
    pass


class DeadlineConnection(psycopg.Connection[Any]):
    """A psycopg connection whose statements give up at a deadline (see the module docstring).

    Attributes:
        deadline: ``time.monotonic()`` value at which the current call gives up; None: each
            wait may take ``default_timeout`` seconds.
        default_timeout: Seconds a wait may take when no deadline is set.
    """

    deadline: float | None = None
    default_timeout: float = 5.0
    _rx_prepared: set[bytes] | None = None  # names of the Prepared statements on this session
    _rx_encoding: str = "utf-8"
    _rx_poller: tuple[int, select.poll] | None = None  # (socket, poller) for the idle check

    def run_prepared(self, statement: Prepared, values: Sequence[str | int | float]) -> Any:
        """Execute ``statement`` with ``values`` (in ``statement.keys`` order); its result.

        Sent in text format: ``str`` in the connection's encoding, ``int`` and ``float`` as
        their ``str``/``repr`` (which round-trips a float8 exactly). Prepared on this
        connection at its first use. One round trip; for autocommit connections (the pool's),
        used by one thread at a time.

        Returns:
            The ``psycopg.pq`` result (``ntuples``, ``get_value(row, column)`` as bytes).

        Raises:
            psycopg.Error: As psycopg would raise for the statement (the server's error mapped
                by SQLSTATE, a broken connection, :class:`StatementTimeout`).
        """
        pgconn = self.pgconn
        prepared = self._rx_prepared
        if prepared is None:
            prepared = self._rx_prepared = set()
            self._rx_encoding = self.info.encoding
        encoding = self._rx_encoding
        params = [
            value.encode(encoding) if type(value) is str else repr(value).encode()
            for value in values
        ]
        if statement.name not in prepared:
            pgconn.send_prepare(statement.name, statement.query)
            self._check(self.wait(psycopg.generators.execute(pgconn)), _COMMAND_OK)
            prepared.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        return self._check(self.wait(psycopg.generators.execute(pgconn)), _TUPLES_OK)

    def _check(self, results: list[Any], wanted: pq.ExecStatus) -> Any:
        result = results[-1]
        if result.status != wanted:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=self._rx_encoding)
            raise psycopg.InterfaceError(f"unexpected result status: {result.status!r}")
        return result

    def has_unexpected_input(self) -> bool:
        """True if this idle connection is closed or has input pending (the server hung up).

        No round trip: one ``poll`` of the socket, with a poller kept for the connection.
        """
        if self.closed or self.broken:
            return True
        fileno = self.pgconn.socket
        cached = self._rx_poller
        if cached is None or cached[0] != fileno:
            poller = select.poll()
            poller.register(fileno, select.POLLIN)
            cached = self._rx_poller = (fileno, poller)
        return bool(cached[1].poll(0))

    def wait(self, gen: PQGen[Any], *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            # psycopg's own bounded waits (notifies(timeout=...)) keep psycopg's loop.
            return super().wait(gen, *args, **kwargs)
        deadline = self.deadline
        if deadline is None:
            deadline = monotonic() + self.default_timeout
        try:
            if _FAST_WAIT is not None:
                left = max(0.0, deadline - monotonic())
                return _FAST_WAIT(gen, self.pgconn.socket, left, left)
            return _wait(gen, self.pgconn.socket, deadline)
        except _Expired:
            self._abandon()
            raise StatementTimeout(
                "PostgreSQL did not answer in time (server frozen, overloaded or unreachable); "
                "the connection was closed"
            ) from None

    def _abandon(self) -> None:
        """Close the connection; ask the server (in the background) to cancel the statement."""
        cancel = None
        if self.pgconn.transaction_status == pq.TransactionStatus.ACTIVE and _has_cancel_conn():
            try:
                cancel = self.pgconn.cancel_conn()
                cancel.start()
            except psycopg.Error:
                cancel = None
        self.close()
        if cancel is not None:
            # A grant still queued on the server (behind a row lock, say) would otherwise
            # commit later and block the name until it expires, granted to nobody.
            threading.Thread(
                target=_finish_cancel,
                args=(cancel, monotonic() + self.default_timeout),
                name="rxcoord-postgres-cancel",
                daemon=True,
            ).start()


_FAST_WAIT: Final = _fast_wait()


def keepalive_kwargs(conninfo: str, timeout: float) -> dict[str, Any]:
    """libpq settings that let the kernel drop a connection to a dead peer within ~``timeout``.

    Settings given in ``conninfo`` win.
    """
    try:
        given = conninfo_to_dict(conninfo) if conninfo else {}
    except psycopg.Error:
        given = {}  # the connection attempt reports it
    wanted = {
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout)),
        "keepalives_interval": max(1, math.ceil(timeout / 3)),
        "keepalives_count": 3,
        "tcp_user_timeout": max(1000, math.ceil(timeout * 1000)),  # milliseconds
    }
    return {key: value for key, value in wanted.items() if key not in given}


def _wait(gen: PQGen[Any], fileno: int, deadline: float) -> Any:
    """Drive a psycopg generator on ``fileno`` until it returns or ``deadline`` passes."""
    try:
        waiting = next(gen)
        poller = select.poll()
        poller.register(fileno, _EVENTS[waiting])
        while True:
            left = deadline - monotonic()
            if left <= 0:
                raise _Expired
            events = poller.poll(math.ceil(left * 1000))
            if not events:
                continue
            mask = events[0][1]
            ready = (_READY_R if mask & select.POLLIN else 0) | (
                _READY_W if mask & select.POLLOUT else 0
            )
            if not ready:
                raise psycopg.OperationalError("connection socket closed")
            waiting = gen.send(ready)
            poller.modify(fileno, _EVENTS[waiting])
    except StopIteration as stop:
        return stop.value


def _has_cancel_conn() -> bool:
    capabilities = getattr(psycopg, "capabilities", None)  # psycopg >= 3.2
    return capabilities is not None and bool(capabilities.has_cancel_safe())


def _finish_cancel(cancel: pq.abc.PGcancelConn, deadline: float) -> None:
    """Drive libpq's non-blocking cancellation until done, failed, or ``deadline``."""
    try:
        while True:
            status = cancel.poll()
            if status != pq.PollingStatus.READING and status != pq.PollingStatus.WRITING:
                return  # OK, FAILED: nothing more to do
            left = deadline - monotonic()
            if left <= 0:
                return
            poller = select.poll()
            mask = select.POLLIN if status == pq.PollingStatus.READING else select.POLLOUT
            poller.register(cancel.socket, mask)
            poller.poll(math.ceil(left * 1000))
    except psycopg.Error:
        pass
    finally:
        with contextlib.suppress(psycopg.Error):
            cancel.finish()
