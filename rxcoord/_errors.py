"""The rxcoord exception tree.

Every error rxcoord raises on purpose derives from :class:`RxcoordError`, so a caller can catch
"anything rxcoord refused" in one clause, or one precise case::

    RxcoordError
     ├── TooManyTasks            a coordinator's work-in-progress limit was reached
     ├── CoordinatorClosed       the coordinator (or scheduler) was closed
     ├── LockTimeout             a lock or lease was not granted in time   (also a TimeoutError)
     ├── LeaseReleasedError      a KeyedLocks lease was released twice     (also a RuntimeError)
     └── LeaseError              a distributed lease went wrong
          ├── LeaseLost          the lease is no longer ours (expired, taken over, released)
          │    └── StaleToken    a fenced resource refused an older holder's write
          ├── LeaseStoreUnavailable   the lease store cannot be reached    (also a ConnectionError)
          └── LeaseProviderClosed     the lease provider was closed        (also a RuntimeError)

Bad arguments raise the built-in ``ValueError``/``TypeError``; a job's own exception reaches its
subscriber unchanged; a job that runs out of time fails with the built-in ``TimeoutError``.
Driver errors (redis, psycopg, sqlite3) are mapped to these at the boundary with
``raise ... from exc`` so the original stays visible in ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "CoordinatorClosed",
    "LeaseError",
    "LeaseLost",
    "LeaseProviderClosed",
    "LeaseReleasedError",
    "LeaseStoreUnavailable",
    "LockTimeout",
    "RxcoordError",
    "StaleToken",
    "TooManyTasks",
]


class RxcoordError(Exception):
    """Base class of every error rxcoord raises on purpose."""


class TooManyTasks(RxcoordError):
    """A job was rejected because its coordinator already holds the most work it may.

    Raised (as an ``on_error``) to the subscriber of ``execute`` when the work in progress would
    exceed ``max_concurrency + max_queue_size``. Retry later, or raise the limits.
    """


class CoordinatorClosed(RxcoordError):
    """The coordinator or scheduler was closed: it accepts no jobs and its queued jobs fail."""


class LockTimeout(RxcoordError, TimeoutError):
    """A lock or lease was not granted within the requested timeout.

    Also a built-in ``TimeoutError``, so generic timeout handling catches it.
    """


class LeaseReleasedError(RxcoordError, RuntimeError):
    """An in-process lease was used after it had been released (for example released twice)."""


class LeaseError(RxcoordError):
    """Base class of distributed lease failures."""


class LeaseLost(LeaseError):
    """The distributed lease is no longer held by this holder.

    It expired and may have been granted to someone else, or it was already released. Work done
    under it may overlap with a newer holder's: use the fencing token to reject stale writes.
    """


class LeaseStoreUnavailable(LeaseError, ConnectionError):
    """The lease store (SQLite file, PostgreSQL or Redis server) could not be reached or failed.

    The provider reconnects on the next call once the store is back.
    """


class LeaseProviderClosed(LeaseError, RuntimeError):
    """The lease provider was closed: it grants, extends and releases nothing any more.

    ``close()`` released the leases the provider still held, so other holders do not have to wait
    for them to expire. Open a new provider to take leases again.
    """


class StaleToken(LeaseLost):
    """A fenced resource refused a write whose fencing token is older than one it already saw.

    The writer's lease expired (a pause, a slow network) and a newer holder has written since:
    the write must be dropped, not retried. Being a :class:`LeaseLost`, it is handled wherever a
    lost lease is.

    Attributes:
        name: The fenced name (usually the lease name).
        token: The refused token.
        highest: The highest token the resource had accepted for ``name``.
    """

    def __init__(self, name: str, token: int, highest: int) -> None:
        super().__init__(
            f"stale fencing token {token} for {name!r}: the resource already accepted token "
            f"{highest} from a newer holder; this holder's lease has expired, drop the write"
        )
        self.name = name
        self.token = token
        self.highest = highest
