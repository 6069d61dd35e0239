"""rxcoord: coordinate concurrent work on RxPY (reactivex).

Layers, each built on the ones before it:

1. :func:`serialize_by_key` - per-key ordered processing, keys in parallel, no per-key leak.
2. :class:`TenantTaskCoordinator` - a concurrency limit, a bounded queue (``TooManyTasks``),
   per-key ordering, cancellation and timeouts for sync and async jobs; two seams: an
   :class:`Admission` asked before each job runs, a :class:`KeyGuard` for keyed jobs. Its
   meaning is :class:`ReactorCoordinator`, the Reactor composition in plain Rx operators.
3. :class:`TenantScheduler` - many tenants, one global limit, fair shares, idle tenants evicted;
   with ``fleet=provider`` the limits and shares hold across processes (:class:`FleetAdmission`);
   :class:`Rate` bounds how often jobs start (all tenants, each tenant, the whole fleet).
4. :class:`KeyedLocks` - ownerless per-entity leases, bulk and global, FIFO, no polling, no leaks.
5. :mod:`rxcoord.leases` - distributed leases on SQLite, PostgreSQL and Redis, fencing tokens.

rxcoord logs with loguru and, as a library, is silent until you call
``loguru.logger.enable("rxcoord")``.
"""

from loguru import logger as _logger

from ._admission import Admission, AdmissionTicket, Permit
from ._coordinator import CoordinatorStats, Execution, ReactorCoordinator, TenantTaskCoordinator
from ._core.lifecycle import CoordinatorState
from ._core.retry import Retry
from ._errors import (
    CoordinatorClosed,
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeaseProviderClosed,
    LeaseReleasedError,
    LeaseStoreMisconfigured,
    LeaseStoreUnavailable,
    LockTimeout,
    RxcoordError,
    StaleToken,
    TooManyTasks,
)
from ._fleet import FleetAdmission, FleetPermit, FleetStats, current_permit
from ._key_guard import KeyGuard, LeaseKeyGuard
from ._locks import KeyedLocks, KeyedLocksStats, Lease
from ._rate import Rate, RateStats
from ._tenant_scheduler import SchedulerStats, TenantScheduler
from .operators import serialize_by_key

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "AdmissionTicket",
    "CoordinatorClosed",
    "CoordinatorState",
    "CoordinatorStats",
    "Execution",
    "FleetAdmission",
    "FleetPermit",
    "FleetStats",
    "KeyGuard",
    "KeyedLocks",
    "KeyedLocksStats",
    "Lease",
    "LeaseError",
    "LeaseKeyGuard",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseProviderClosed",
    "LeaseReleasedError",
    "LeaseStoreMisconfigured",
    "LeaseStoreUnavailable",
    "LockTimeout",
    "Permit",
    "Rate",
    "RateStats",
    "ReactorCoordinator",
    "Retry",
    "RxcoordError",
    "SchedulerStats",
    "StaleToken",
    "TenantScheduler",
    "TenantTaskCoordinator",
    "TooManyTasks",
    "__version__",
    "current_permit",
    "serialize_by_key",
]

# A library must not print unless asked to: users opt in with logger.enable("rxcoord").
_logger.disable("rxcoord")
