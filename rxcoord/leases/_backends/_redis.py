"""Leases in Redis: one Lua script per operation, pub/sub for waiters.

Keys per name (the ``{name}`` hash tag keeps them in one cluster slot):

* ``<prefix>{name}`` - the lease: value ``token`` (or ``token:least_until_ms`` when
  ``at_least_for`` > 0), expiring after ``at_most_for`` (``PX``): Redis's clock decides expiry;
* ``<prefix>{name}:token`` - the fencing counter, never expiring, so tokens keep growing across
  grants, expiries and client restarts (and server restarts only with persistence: with
  ``appendonly yes`` + ``appendfsync always``; without it a restarted Redis forgets them).

Each operation is one ``EVALSHA`` (falling back to ``EVAL`` once after a script-cache flush),
so the check, the grant and ``INCR`` of the token are one atomic step:

* grant: ``PTTL`` the lease; if it exists return its remaining time; else ``INCR`` the counter
  and ``SET ... PX``;
* extend / release: compare the stored token; release ``DEL``s the key (or, inside
  ``at_least_for``, replaces it with a ``released`` marker expiring then) and ``PUBLISH``es on
  the name's channel, which wakes waiters in every process.

Connections: redis-py's ``Connection`` objects, in a pool of this module's own (a deque of idle
connections). redis-py's client and pool wrap every command in machinery a lease does not need
(a retry wrapper, observability hooks, pool bookkeeping) that costs the client more time than
the Lua scripts cost the server: through it a try_acquire + release pair ran at about 0.8x the
raw ``SET NX PX`` + ``DEL`` pair on loopback; with plain connections it runs well above it.
Retries would be wrong anyway: retrying a release whose reply was lost finds the lease already
released and reports a false loss. A failed call raises ``LeaseStoreUnavailable``; an idle
connection the server has closed (a restart) is noticed before reuse and replaced, so the first
call after a restart succeeds.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from time import monotonic
from typing import TYPE_CHECKING, Any, Final

from rxcoord._errors import LeaseStoreUnavailable

from .._base import LeaseProvider
from .._notify import Listener, WaitHub
from .._validate import check_duration
from ._drivers import require

if TYPE_CHECKING:
    import redis

__all__ = ["RedisLeases"]

# KEYS: lease, counter. ARGV: at_most_for ms, at_least_for ms.
# Returns the new token (> 0), or -1 - remaining_ms when the name is taken.
_GRANT: Final = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 then return -1 - ttl end
if ttl == -1 then return -1001 end
local token = redis.call('INCR', KEYS[2])
local value = token
if ARGV[2] ~= '0' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  value = token .. ':' .. string.format('%d', now + tonumber(ARGV[2]))
end
redis.call('SET', KEYS[1], value, 'PX', ARGV[1])
return token
"""

# KEYS: lease. ARGV: token, at_most_for ms. Returns 1 if extended, 0 if not ours.
_EXTEND: Final = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not v then return 0 end
local token, least = string.match(v, '^(%d+):(%d+)$')
if token ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local left = tonumber(least) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local ms = tonumber(ARGV[2])
if left > ms then ms = left end
redis.call('PEXPIRE', KEYS[1], ms)
return 1
"""

# KEYS: lease. ARGV: token, channel. Returns 1 if released, 0 if not ours.
_RELEASE: Final = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
else
  if not v then return 0 end
  local token, least = string.match(v, '^(%d+):(%d+)$')
  if token ~= ARGV[1] then return 0 end
  local t = redis.call('TIME')
  local left = tonumber(least) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  if left > 0 then
    redis.call('SET', KEYS[1], 'released', 'PX', string.format('%d', left))
  else
    redis.call('DEL', KEYS[1])
  end
end
redis.call('PUBLISH', ARGV[2], '')
return 1
"""


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisLeases(LeaseProvider):
    """Leases in Redis; waiters are woken by pub/sub.

    Args:
        url: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        prefix: Prefix of every key and channel this provider uses.
        client: Take the connection settings (address, credentials, TLS, connection class)
            from this redis-py client instead of ``url``. Its pool, retry policy, socket
            timeouts and ``decode_responses`` are not used, and ``close()`` leaves it open.
        timeout: Socket connect and read timeout in seconds: a hung server fails with
            ``LeaseStoreUnavailable`` instead of blocking forever. Keep-alive renewals wait at
            most as long as their lease has left, so a loss is reported by its expiry.

    Raises:
        ImportError: redis-py is missing (``pip install rxcoord[redis]``).
        ValueError: Empty prefix or bad timeout.
    """

    backend = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "rxcoord:lease:",
        client: redis.Redis | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str")
        seconds = check_duration("timeout", timeout)
        redis_mod = require("redis", "redis")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: type[Exception] = redis_mod.RedisError
        self._no_script: type[Exception] = redis_mod.exceptions.NoScriptError
        self.prefix = prefix
        if client is None:
            # Only a holder of connection settings: connections are made by _Connections.
            pool = redis_mod.ConnectionPool.from_url(url)
            self.url = url
        else:
            pool = client.connection_pool
            self.url = repr(client)
        connection_class: Callable[..., Any] = pool.connection_class
        settings = {
            **pool.connection_kwargs,
            "socket_timeout": seconds,
            "socket_connect_timeout": seconds,
            "retry": Retry(NoBackoff(), 0),  # see the module docstring: retries would be wrong
            "health_check_interval": 0,
            # Replies are compared as bytes (pub/sub kinds and channels); a client configured
            # with decode_responses=True would turn them into str that never match.
            "decode_responses": False,
        }
        self._op_timeout = seconds

        def connect() -> Any:
            return connection_class(**settings)

        self._connections = _Connections(
            connect, redis_mod.ResponseError, redis_mod.RedisError, seconds
        )

        def connect_listener() -> Any:
            return connection_class(**{**settings, "protocol": 2})  # pub/sub replies as arrays

        self._listener = _RedisListener(lambda: self._hub, connect_listener, self._channel)
        super().__init__(WaitHub(self._listener), poll=(0.01, 0.25))

    def _describe(self) -> str:
        return f"prefix={self.prefix!r}"

    def _listener_counts(self) -> tuple[int, int]:
        return self._listener.notifications, self._listener.reconnects

    def _channel(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}:released"

    def _eval(
        self,
        script: str,
        sha: str,
        numkeys: int,
        *args: object,
        action: str,
        timeout: float | None = None,
    ) -> Any:
        connections = self._connections
        try:
            if timeout is None:
                try:
                    return connections.call("EVALSHA", sha, numkeys, *args)
                except self._no_script:
                    # The server lost its script cache (restart, SCRIPT FLUSH): EVAL runs and
                    # caches it again. Safe to repeat: EVALSHA did not run anything.
                    return connections.call("EVAL", script, numkeys, *args)
            deadline = monotonic() + timeout
            try:
                return connections.call_within(timeout, "EVALSHA", sha, numkeys, *args)
            except self._no_script:
                return connections.call_within(
                    deadline - monotonic(), "EVAL", script, numkeys, *args
                )
        except self._errors as exc:
            raise LeaseStoreUnavailable(
                f"Redis lease store failed to {action}: {type(exc).__name__}: {exc} "
                "(the provider reconnects once the server is reachable again)"
            ) from exc

    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        key = f"{self.prefix}{{{name}}}"
        least = _ms(at_least_for) if at_least_for > 0 else 0
        value = int(
            self._eval(
                _GRANT,
                _GRANT_SHA,
                2,
                key,
                key + ":token",
                _ms(at_most_for),
                least,
                action="grant a lease",
            )
        )
        if value > 0:
            return value, 0.0
        return 0, (-value - 1) / 1000.0

    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        key = f"{self.prefix}{{{name}}}"
        return bool(
            self._eval(
                _EXTEND,
                _EXTEND_SHA,
                1,
                key,
                token,
                _ms(at_most_for),
                action="extend a lease",
                timeout=timeout,
            )
        )

    def _store_release(self, name: str, token: int, *, timeout: float | None = None) -> bool:
        key = f"{self.prefix}{{{name}}}"
        return bool(
            self._eval(
                _RELEASE,
                _RELEASE_SHA,
                1,
                key,
                token,
                key + ":released",
                action="release a lease",
                timeout=timeout,
            )
        )

    def _store_close(self) -> None:
        self._connections.close()


_GRANT_SHA: Final = _sha(_GRANT)
_EXTEND_SHA: Final = _sha(_EXTEND)
_RELEASE_SHA: Final = _sha(_RELEASE)


class _Connections:
    """A minimal pool of redis-py connections: idle ones wait in a deque.

    ``deque.pop``/``append`` are atomic, so checkout and checkin take no lock. Before reuse, an
    idle connection with something to read has been closed by the server (or is out of step):
    it is reconnected, as redis-py's own pool does.
    """

    __slots__ = ("_closed", "_connect", "_errors", "_idle", "_response_error", "_timeout")

    def __init__(
        self,
        connect: Callable[[], Any],
        response_error: type[Exception],
        errors: type[Exception],
        timeout: float,
    ) -> None:
        self._connect = connect
        self._response_error = response_error
        self._errors = errors
        self._timeout = timeout  # every connection's socket timeout
        self._idle: deque[Any] = deque()
        self._closed = False

    def call(self, *args: object) -> Any:
        """Send one command and read its reply (one round trip)."""
        conn = self._checkout()
        try:
            conn.send_command(*args, check_health=False)
            reply = conn.read_response()
        except self._response_error:
            self._checkin(conn)  # the command failed, the connection is fine
            raise
        except BaseException:
            conn.disconnect()  # a reply may be in flight: never reuse the connection
            raise
        self._checkin(conn)
        return reply

    def call_within(self, timeout: float, *args: object) -> Any:
        """:meth:`call`, waiting at most ``timeout`` seconds (when shorter than the socket's).

        Raises:
            redis.TimeoutError: No reply in time (the connection is discarded).
        """
        if timeout >= self._timeout:
            return self.call(*args)
        cap = max(0.001, timeout)
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = None
        fresh = True
        if conn is not None:
            try:
                conn.connect()  # no-op when connected
                fresh = bool(conn.can_read())  # unexpected input: the server closed it
            except (self._errors, OSError):
                pass
            if fresh:
                conn.disconnect()
            else:
                conn._sock.settimeout(cap)  # redis-py has no per-call read timeout
        if fresh:
            # Connecting (and the handshake) within the cap too. Its parser remembers the short
            # timeout, so this connection is closed afterwards, not pooled.
            conn = self._connect()
            conn.socket_timeout = cap
            conn.socket_connect_timeout = cap
        try:
            if fresh:
                conn.connect()
            conn.send_command(*args, check_health=False)
            reply = conn.read_response()
        except self._response_error:
            self._checkin_capped(conn, fresh)
            raise
        except BaseException:
            conn.disconnect()
            raise
        self._checkin_capped(conn, fresh)
        return reply

    def _checkin_capped(self, conn: Any, fresh: bool) -> None:
        if fresh:
            conn.disconnect()
            return
        conn._sock.settimeout(self._timeout)
        self._checkin(conn)

    def _checkout(self) -> Any:
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._connect()
        try:
            conn.connect()  # no-op when connected
            if conn.can_read():
                raise ConnectionError("an idle connection has unexpected input")
        except (self._errors, OSError):
            conn.disconnect()
            conn.connect()  # raises if the server is still away
        return conn

    def _checkin(self, conn: Any) -> None:
        if self._closed:
            conn.disconnect()
        else:
            self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            with suppress(Exception):
                self._idle.pop().disconnect()


class _RedisListener(Listener):
    """SUBSCRIBEs to the channels of the names being waited for, on a connection of its own."""

    def __init__(
        self,
        hub_ref: Callable[[], WaitHub | None],
        connect: Callable[[], Any],
        channel_of: Callable[[str], str],
    ) -> None:
        super().__init__(hub_ref, "rxcoord-redis-lease-listener")
        self._new_connection = connect
        self._channel_of = channel_of
        self._names: dict[bytes, str] = {}  # channel -> name
        self._conn: Any = None

    def _connect(self) -> None:
        conn = self._new_connection()
        conn.connect()
        self._conn = conn

    def _fileno(self) -> int:
        # redis-py has no public accessor for the socket; poll() needs its descriptor.
        return int(self._conn._sock.fileno())

    def _apply(self, subscribe: list[str], unsubscribe: list[str]) -> None:
        for command, names in (("SUBSCRIBE", subscribe), ("UNSUBSCRIBE", unsubscribe)):
            if not names:
                continue
            channels = []
            for name in names:
                channel = self._channel_of(name).encode()
                self._names[channel] = name
                channels.append(channel)
            self._conn.send_command(command, *channels, check_health=False)
        # Acknowledged by the server's replies, read by _drain.

    def _drain(self) -> None:
        conn = self._conn
        while conn.can_read(timeout=0):
            reply = conn.read_response()
            if not isinstance(reply, list) or len(reply) < 3:
                continue
            kind, channel = reply[0], reply[1]
            name = self._names.get(channel)
            if name is None:
                continue
            if kind == b"message":
                self._released(name)
            elif kind == b"subscribe":
                self._acked(name)
            elif kind == b"unsubscribe":
                self._acked(name)
                if not self._is_tracked(name):
                    self._names.pop(channel, None)

    def _is_tracked(self, name: str) -> bool:
        with self._lock:
            return name in self._subs

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        self._names.clear()
        if conn is not None:
            with suppress(Exception):
                conn.disconnect()


# -- registry entry (see rxcoord/leases/_registry.py) ------------------------------------------
# Kept in one block with its imports, so that a backend's registration reads as one unit.

from typing import Any as _Any  # noqa: E402
from typing import Final as _Final  # noqa: E402

from .._registry import LeaseBackend  # noqa: E402


def _from_url(url: str, rest: str, **options: _Any) -> RedisLeases:
    """``redis://...``, ``rediss://...`` or ``unix://...``: redis-py's URL forms."""
    return RedisLeases(url, **options)


BACKEND: _Final = LeaseBackend(
    name="redis",
    provider=RedisLeases,
    schemes=("redis", "rediss", "unix"),
    from_url=_from_url,
    server=True,
)
