"""Distributed leases: named locks in a shared store, with fencing tokens and keep-alive.

The ShedLock model: a lease is a named record with a "locked until" time on the *store's*
clock. ``at_most_for`` bounds how long a crashed holder blocks the name, ``at_least_for`` keeps
short jobs from running twice across nodes. On top of it:

* **fencing tokens** - every grant of a name carries a larger token than any earlier grant,
  minted in the same atomic step; resources reject stale holders with :class:`FencingGuard`;
* **ownership is the grant** - only the lease object (name + token) can extend or release it;
  using a lost lease raises :class:`LeaseLost`, never silently succeeds;
* **keep-alive** - renewal every ``at_most_for / 3`` in the background, with loss reported;
* **waiting without polling** - PostgreSQL ``LISTEN/NOTIFY`` and Redis pub/sub wake waiters on
  release; every waiter also wakes when the holder's lease expires;
* **nothing left behind** - a name has a record in the store only while it is taken;
* **the store's view** - ``provider.holder(name)`` and ``lease.verify()`` ask the store, where
  ``lease.held`` is this process's view.

Backends: :class:`MemoryLeases` (one process), :class:`SqliteLeases` (processes on one machine,
the embedded default), :class:`PostgresLeases` and :class:`RedisLeases` (distributed; a Redis
Cluster with ``cluster=True``)::

    from rxcoord.leases import SqliteLeases

    with SqliteLeases("leases.db") as leases:
        with leases.lock("nightly-report", at_most_for=60, keep_alive=True) as lease:
            build_report(fencing_token=lease.token)
"""

from rxcoord._errors import (
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeaseProviderClosed,
    LeaseReleasedError,
    LeaseStoreMisconfigured,
    LeaseStoreUnavailable,
    LockTimeout,
    StaleToken,
)

from ._backends._memory import MemoryLeases, MemoryLeaseStore, MemoryLeaseStoreStats
from ._backends._postgres import PostgresLeases
from ._backends._redis import RedisLeases
from ._backends._sqlite import SqliteLeases
from ._base import LeaseProvider, LeaseProviderStats
from ._fencing import FencingGuard, FencingGuardStats
from ._lease import DistributedLease, LeaseHolder, LeaseStats
from ._url import leases_from_url

__all__ = [
    "DistributedLease",
    "FencingGuard",
    "FencingGuardStats",
    "LeaseError",
    "LeaseHolder",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseProvider",
    "LeaseProviderClosed",
    "LeaseProviderStats",
    "LeaseReleasedError",
    "LeaseStats",
    "LeaseStoreMisconfigured",
    "LeaseStoreUnavailable",
    "LockTimeout",
    "MemoryLeaseStore",
    "MemoryLeaseStoreStats",
    "MemoryLeases",
    "PostgresLeases",
    "RedisLeases",
    "SqliteLeases",
    "StaleToken",
    "leases_from_url",
]
