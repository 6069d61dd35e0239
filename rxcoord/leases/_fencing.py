"""The resource's half of fencing: refuse writes from holders whose lease has been superseded.

A lease alone cannot prevent two holders from writing: a holder that is paused (GC, SIGSTOP, a
swapped-out VM) past its expiry wakes up believing it still holds the lease, while the store has
already granted it to someone else. Kleppmann's fix ("How to do distributed locking", 2016) is a
fencing token: every grant carries a larger number than the one before, every write carries the
writer's token, and the *resource* refuses a token lower than the highest it has accepted. The
lease providers mint the tokens; :class:`FencingGuard` is the check a resource performs.

The guard keeps its high-water marks in memory, so it protects a resource living in this process
(a file written by one service, an in-process cache, a test). A resource in a database does the
same check in its own write, atomically with the write::

    UPDATE accounts SET balance = %(b)s, fence = %(token)s
    WHERE id = %(id)s AND fence <= %(token)s          -- 0 rows updated: stale writer
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from rxcoord._errors import StaleToken

__all__ = ["FencingGuard", "FencingGuardStats"]


@dataclass(frozen=True, slots=True)
class FencingGuardStats:
    """A snapshot of a :class:`FencingGuard`.

    Attributes:
        names: Names with a recorded high-water mark.
        accepted: Tokens accepted so far.
        rejected: Tokens refused as stale so far.
    """

    names: int
    accepted: int
    rejected: int


class FencingGuard:
    """Accepts a fencing token only if no larger token was accepted for the same name before.

    Equal tokens are accepted (one holder writes many times under one grant); a smaller token
    raises :class:`StaleToken`. Thread-safe: the check and the update of the high-water mark are
    one step, so two writers racing with tokens 7 and 8 can never both pass after 8 was seen.

    Example::

        guard = FencingGuard()
        with leases.lock("report") as lease:
            guard.check(lease.name, lease.token)   # raises StaleToken for a superseded holder
            write_report(...)

    Note that the check and the write must be atomic *for the resource*: check under the same
    lock that serializes the writes (``with guard.fenced(name, token): write()`` does that).
    """

    __slots__ = ("_accepted", "_highest", "_lock", "_rejected")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._highest: dict[str, int] = {}
        self._accepted = 0
        self._rejected = 0

    def check(self, name: str, token: int) -> None:
        """Record ``token`` for ``name``, or refuse it if a larger one was accepted before.

        Raises:
            StaleToken: ``token`` is lower than the highest token accepted for ``name``.
            TypeError: ``token`` is not an int, or ``name`` not a str.
            ValueError: ``token`` is negative (providers mint tokens from 1 up: a negative one
                is a bug in the caller, and accepting it would let it pass every later check
                of a fresh name).
        """
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"a fencing token is an int, not {token!r}")
        if token < 0:
            raise ValueError(f"a fencing token is >= 0 (leases mint them from 1), got {token}")
        if not isinstance(name, str):
            raise TypeError(f"a fenced name is a str, not {type(name).__name__}")
        with self._lock:
            highest = self._highest.get(name)
            if highest is not None and token < highest:
                self._rejected += 1
                raise StaleToken(name, token, highest)
            self._highest[name] = token
            self._accepted += 1

    def fenced(self, name: str, token: int) -> _Fenced:
        """A context manager that checks ``token`` and holds the guard while the write runs.

        Holding the guard's (reentrant) lock for the duration of the write makes check-and-write
        atomic against other writers that go through the same guard.

        Raises:
            StaleToken: On entry, as :meth:`check`.
        """
        return _Fenced(self, name, token)

    def highest(self, name: str) -> int | None:
        """The highest token accepted for ``name``, or None if none was."""
        with self._lock:
            return self._highest.get(name)

    def stats(self) -> FencingGuardStats:
        """A consistent snapshot of the guard's counters."""
        with self._lock:
            return FencingGuardStats(len(self._highest), self._accepted, self._rejected)


class _Fenced:
    __slots__ = ("_guard", "_name", "_token")

    def __init__(self, guard: FencingGuard, name: str, token: int) -> None:
        self._guard = guard
        self._name = name
        self._token = token

    def __enter__(self) -> None:
        self._guard._lock.acquire()
        try:
            self._guard.check(self._name, self._token)
        except BaseException:
            self._guard._lock.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._guard._lock.release()
