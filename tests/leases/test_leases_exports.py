"""The public surface of rxcoord.leases (a change here is a change to the API)."""

from __future__ import annotations

import rxcoord
import rxcoord.leases
from rxcoord import _errors

EXPECTED = {
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
}


def test_exported_names() -> None:
    assert set(rxcoord.leases.__all__) == EXPECTED
    for name in EXPECTED:
        member = getattr(rxcoord.leases, name)
        if isinstance(member, type) or callable(member):
            assert member.__module__.startswith("rxcoord"), name


def test_errors_are_the_packages_own() -> None:
    assert rxcoord.leases.LeaseLost is _errors.LeaseLost
    assert rxcoord.leases.LeaseStoreUnavailable is _errors.LeaseStoreUnavailable
    assert rxcoord.leases.LockTimeout is _errors.LockTimeout
    assert rxcoord.leases.LeaseError is _errors.LeaseError
    assert issubclass(rxcoord.leases.LeaseProviderClosed, rxcoord.RxcoordError)
    assert issubclass(rxcoord.leases.LeaseProviderClosed, RuntimeError)
    assert issubclass(rxcoord.leases.StaleToken, rxcoord.LeaseLost)


def test_every_backend_is_a_provider() -> None:
    for backend in ("MemoryLeases", "SqliteLeases", "PostgresLeases", "RedisLeases"):
        assert issubclass(getattr(rxcoord.leases, backend), rxcoord.leases.LeaseProvider)
