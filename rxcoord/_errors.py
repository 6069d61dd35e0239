"""The rxcoord exception tree.

Every error rxcoord raises on purpose derives from :class:`RxcoordError`, so a caller can catch
"anything rxcoord refused" in one clause, or one precise case::

    RxcoordError
     ├── TooManyTasks            a coordinator's work-in-progress limit was reached
     ├── CoordinatorClosed       the coordinator (or scheduler) was closed
     ├── LockTimeout             a lock or lease was not granted in time   (also a TimeoutError)
     └── LeaseError              a lease (in-process or distributed) went wrong
          ├── LeaseNotHeld       this lease object no longer holds its name
          │    ├── LeaseReleasedError   it was released already: a second release, or use after
          │    │                        release, of a KeyedLocks or a distributed lease
          │    │                                                          (also a RuntimeError)
          │    └── LeaseLost     it expired or was taken over: work may overlap a newer holder's
          │         └── StaleToken    a fenced resource refused an older holder's write
          ├── LeaseStoreUnavailable   the store cannot be reached: retrying makes sense
          │                                                            (also a ConnectionError)
          ├── LeaseStoreMisconfigured the store refused for good (credentials, missing
          │                           database, permissions, bad configuration): fix, then retry
          └── LeaseProviderClosed     the lease provider was closed        (also a RuntimeError)

Why ``LeaseNotHeld``: "my lease is gone" has two causes a caller must tell apart. A release the
holder did itself (``LeaseReleasedError``) is a bug in the caller's bookkeeping and harmless to
the data; a loss (``LeaseLost``) means another holder may have run at the same time. Both mean
"this object holds nothing", which is what cleanup code catches. A double release raises
``LeaseReleasedError`` for both kinds of lease (:class:`rxcoord.Lease` and
:class:`rxcoord.leases.DistributedLease`), never a false ``LeaseLost``.

Why two store errors: ``LeaseStoreUnavailable`` is an outage (connection refused or reset, a
timeout, a server restarting) and retry loops should keep going; ``LeaseStoreMisconfigured``
will fail the same way on every retry until a human fixes the cause its message names.

Bad arguments raise the built-in ``ValueError``/``TypeError``, at the call, before any round
trip; a job's own exception reaches its subscriber unchanged; a job that runs out of time fails
with the built-in ``TimeoutError``. Driver errors (redis, psycopg, sqlite3) are mapped to these
at the boundary with ``raise ... from exc`` so the original stays visible in ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "CoordinatorClosed",
    "LeaseError",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseProviderClosed",
    "LeaseReleasedError",
    "LeaseStoreMisconfigured",
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


class LeaseError(RxcoordError):
    """Base class of lease failures, in-process (:class:`rxcoord.Lease`) and distributed."""


class LeaseNotHeld(LeaseError):
    """This lease object no longer holds its name: it was released, or it was lost.

    Catch this in cleanup code that only needs to know the lease is gone; catch the subclasses
    to tell a release by the holder itself from a loss to expiry or takeover.
    """


class LeaseReleasedError(LeaseNotHeld, RuntimeError):
    """A lease was used after its holder had released it (for example released twice).

    Raised the same way by in-process :class:`rxcoord.Lease` objects and by distributed leases,
    including for a second release while the first one is still in flight. Nothing was lost:
    the first release is the one that counts.
    """


class LeaseLost(LeaseNotHeld):
    """The distributed lease is no longer held by this holder.

    It expired and may have been granted to someone else, or the store no longer has this grant
    as the current one. Work done under it may overlap with a newer holder's: use the fencing
    token to reject stale writes.
    """


class LeaseStoreUnavailable(LeaseError, ConnectionError):
    """The lease store (SQLite file, PostgreSQL or Redis server) could not be reached or failed.

    A transient failure: connection refused or reset, a timeout, a server restarting or busy.
    The provider reconnects on the next call once the store is back, so retrying makes sense.
    """


class LeaseStoreMisconfigured(LeaseError):
    """The lease store refused the request for a reason that retrying will not fix.

    Wrong credentials, a database, schema or permission that does not exist, a server that is
    not what the provider was configured for (a Redis Cluster node given to a plain client),
    a read-only file. The message names the cause and the fix; the driver's error is the
    ``__cause__``. Not a ``ConnectionError``: retry loops written for outages do not spin on it.
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
