"""The lease: a request of the grant table that its holder carries around, and its hot path.

An uncontended ``with locks.hold(key)`` is what most programs do most of the time, so it is
inlined in ``Lease.__enter__``/``__exit__``: no global request present and the key absent means
one dict insert, and a lease alone on its key with no global request means one dict delete - no
waiter object, no Rx subscription, no function calls in between. The lease *is* the request
(one allocation: :class:`Lease` extends the table's ``Request``), and the mutex is taken with
explicit ``acquire()``/``release()``, which costs half of a ``with`` block in CPython 3.11.
These two methods read the table's fields directly (``_queues``, ``_first``, ``_tail``): they
are the one place outside ``_table.py`` that does, and they only take the two transitions that
grant or release nothing else.
"""

from __future__ import annotations

from collections.abc import Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Final

from loguru import logger

from .._core.waiter import Waiter
from .._errors import LeaseReleasedError, LockTimeout
from ._table import DONE, HELD, NEW, Request

if TYPE_CHECKING:
    from ._facade import KeyedLocks

__all__ = ["MANY", "Lease"]

MANY: Final[Hashable] = object()  # Lease._key of a bulk or global lease


class Lease(Request):
    """Exclusive hold on some keys of a :class:`KeyedLocks` (or on all of them).

    A lease is a token, not a thread: it may be released on any thread, exactly once. It is
    also a context manager that releases it on exit (if it is still held)::

        def on_next(lease: Lease) -> None:  # from acquire(): already granted
            with lease:
                update(lease.keys)

    ``hold*`` return a lease that is not granted yet: entering it waits for the grant.
    Leases are created only by :class:`KeyedLocks`.
    """

    __slots__ = ("_entered", "_key", "_owner", "_timeout", "_waiter")

    # Only the owning KeyedLocks touches these, under its lock.
    _owner: KeyedLocks
    _key: Hashable  # the key of a single-key lease, else MANY (for the inlined hot paths)
    # Who is told when the pending request is granted (set by the waiting side, dropped with
    # the request): the one waiter primitive, whose rule is that a grant to a waiter that is
    # gone is released, never lost.
    _waiter: Waiter[Lease] | None
    _timeout: float | None  # hold* only: how long __enter__ waits
    # A ``with`` block owns the lease: hold* leases from the start (entering one is what
    # requests it), granted leases (acquire*, hold*_async) once entered. A second entry is a
    # lease shared as if it were a lock: refused loudly instead of letting two users in.
    # (Left unset by hold(), meaning True; read only on the cold path.)
    _entered: bool

    def __init__(self, owner: KeyedLocks, keys: tuple[Hashable, ...]) -> None:
        # Request.__init__ inlined (one frame less for every acquire).
        self._owner = owner
        self._keys = keys
        self._key = keys[0] if len(keys) == 1 else MANY
        self._state = NEW
        self._timeout = None
        self._entered = False

    @property
    def keys(self) -> frozenset[Hashable]:
        """The keys this lease covers; empty for a global lease (which covers every key)."""
        return frozenset(self._keys)

    @property
    def is_global(self) -> bool:
        """True for a lease from ``acquire_all``/``hold_all``: every key, nothing else held."""
        return not self._keys

    @property
    def released(self) -> bool:
        """True once the lease has been released (or its ``hold*`` attempt timed out)."""
        return self._state == DONE

    @property
    def owner(self) -> KeyedLocks:
        """The :class:`KeyedLocks` that granted this lease."""
        return self._owner

    def release(self) -> None:
        """Give the keys back; the next waiting requests are granted. Any thread may call it.

        Raises:
            LeaseReleasedError: The lease was already released.
            RuntimeError: The lease (from ``hold*``) was never entered, so never granted.
        """
        self._owner._release(self)

    def __enter__(self) -> Lease:
        """Wait for a lease from ``hold*`` (blocking); a granted lease is returned as is.

        A lease is entered once: it is a token, not a lock object to share. Each ``with``
        block (each thread, each use) needs its own ``hold()`` call.

        Raises:
            LockTimeout: Not granted within the ``timeout`` given to ``hold*``.
            LeaseReleasedError: The lease was released already (a lease is entered once).
            RuntimeError: The lease is already entered (by this or another thread).
        """
        state = self._state
        if state == NEW:
            locks = self._owner
            key = self._key
            if key is not MANY:
                # The hot path the benchmark measures, inlined: a free key and no global
                # request is one dict insert under the mutex. (Explicit acquire/release: a
                # ``with`` block on a lock costs twice as much in CPython 3.11.) The key being
                # absent also proves that no other thread entered this lease meanwhile.
                mutex = locks._mutex
                mutex.acquire()
                try:
                    queues = locks._queues
                    seg = locks._tail
                    if key not in queues and seg is locks._first and self._state == NEW:
                        queues[key] = self
                        seg.count += 1
                        self._segment = seg
                        self._state = HELD
                        return self
                finally:
                    mutex.release()
            return locks._acquire_blocking(self, self._timeout)
        if state == HELD:
            with self._owner._mutex:
                entered = getattr(self, "_entered", True)  # unset on hold() leases: True
                self._entered = True
            if not entered:
                return self  # a lease granted by acquire*/hold*_async, entered the first time
        elif state == DONE:
            raise LeaseReleasedError(f"{self!r} was already released; call hold() again")
        raise entered_twice(self, "hold()")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release the lease unless it was released already (inside the block)."""
        locks = self._owner
        key = self._key
        if key is not MANY:
            mutex = locks._mutex
            mutex.acquire()
            try:
                # Nobody waits for the key and no global request exists (only then is the
                # lease's segment the tail): nothing to grant, just forget the key.
                if self._state == HELD and self._segment is locks._tail:
                    seg = self._segment
                    queues = locks._queues
                    entry = queues.pop(key)
                    if entry is self:
                        seg.count -= 1
                        self._state = DONE
                        return
                    queues[key] = entry  # waiters: the general path below grants the next
            finally:
                mutex.release()
        locks._release_if_held(self)

    def __repr__(self) -> str:
        state = ("new", "pending", "held", "released")[self._state]
        what = f"keys={list(self._keys)!r}" if self._keys else "all keys"
        return f"<Lease {what} {state}>"


# -- messages ------------------------------------------------------------------------------------


def describe(lease: Lease) -> str:
    """What ``lease`` asks for, for messages: a key, a number of keys, or the global lock."""
    if not lease._keys:
        return "the global lock"
    if len(lease._keys) == 1:
        return f"the lock on key {lease._keys[0]!r}"
    return f"the locks on {len(lease._keys)} keys"


def timeout_error(lease: Lease, timeout: float) -> LockTimeout:
    """The error for a request not granted within ``timeout`` (0: a failed try-lock)."""
    return LockTimeout(
        f"{describe(lease)} was not granted within {timeout:g} s; "
        "raise the timeout or shorten what the holders do under their leases"
    )


def timed_out(lease: Lease, timeout: float) -> LockTimeout:
    """The error for a wait that expired, logged (at INFO, like the coordinator's timeouts)."""
    error = timeout_error(lease, timeout)
    logger.info("rxcoord: {}", error)
    return error


def entered_twice(lease: Lease, call: str) -> RuntimeError:
    """The error for a lease (or ``hold_async`` context manager) entered a second time."""
    example = (
        "'async with locks.hold_async(key):' in each task"
        if call == "hold_async()"
        else "'with locks.hold(key):' in each thread"
    )
    return RuntimeError(
        f"{lease!r} is already entered: a lease is one use, not a lock to share between "
        f"threads or tasks; call {call} per use (e.g. {example})"
    )
