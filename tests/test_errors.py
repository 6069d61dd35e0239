"""The error tree: one base class, precise leaves, built-in bases where they help callers."""

from __future__ import annotations

import rxcoord
from rxcoord import (
    CoordinatorClosed,
    KeyedLocks,
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


def test_every_error_is_an_rxcoord_error() -> None:
    for error in (
        TooManyTasks,
        CoordinatorClosed,
        LockTimeout,
        LeaseReleasedError,
        LeaseError,
        LeaseLost,
        LeaseStoreUnavailable,
        LeaseProviderClosed,
        StaleToken,
        LeaseNotHeld,
        LeaseStoreMisconfigured,
    ):
        assert issubclass(error, RxcoordError)


def test_built_in_bases_let_generic_handlers_catch_them() -> None:
    assert issubclass(LockTimeout, TimeoutError)
    assert issubclass(LeaseStoreUnavailable, ConnectionError)
    assert issubclass(LeaseReleasedError, RuntimeError)
    assert issubclass(LeaseProviderClosed, RuntimeError)
    assert issubclass(StaleToken, LeaseLost)


def test_lease_failures_share_a_base() -> None:
    assert issubclass(LeaseLost, LeaseError)
    assert issubclass(LeaseStoreUnavailable, LeaseError)
    assert issubclass(LeaseStoreMisconfigured, LeaseError)
    assert not issubclass(TooManyTasks, LeaseError)


def test_released_and_lost_share_the_not_held_base() -> None:
    """Issue 11 (5): one base for "this lease object holds nothing", two precise causes."""
    assert issubclass(LeaseReleasedError, LeaseNotHeld)
    assert issubclass(LeaseLost, LeaseNotHeld)
    assert issubclass(LeaseReleasedError, LeaseError)  # was only an RxcoordError before
    assert not issubclass(LeaseReleasedError, LeaseLost)  # a double release loses nothing
    assert not issubclass(LeaseLost, LeaseReleasedError)


def test_a_permanent_store_error_is_not_an_outage() -> None:
    """Retry loops written for ConnectionError must not spin on a wrong password."""
    assert not issubclass(LeaseStoreMisconfigured, ConnectionError)
    assert not issubclass(LeaseStoreMisconfigured, LeaseStoreUnavailable)


def test_a_double_release_raises_the_same_type_in_process_and_distributed() -> None:
    from rxcoord.leases import MemoryLeases

    errors: list[type[BaseException]] = []
    locks = KeyedLocks()
    lease = locks.hold("k")
    with lease:
        pass
    try:
        lease.release()
    except LeaseError as exc:
        errors.append(type(exc))
    with MemoryLeases() as leases:
        distributed = leases.acquire("k")
        distributed.release()
        try:
            distributed.release()
        except LeaseError as exc:
            errors.append(type(exc))
    assert errors == [LeaseReleasedError, LeaseReleasedError]


def test_the_tree_is_drawn_in_the_module_docstring() -> None:
    doc = rxcoord._errors.__doc__ or ""
    for name in (
        "TooManyTasks",
        "CoordinatorClosed",
        "LockTimeout",
        "LeaseLost",
        "LeaseNotHeld",
        "LeaseReleasedError",
        "LeaseStoreMisconfigured",
    ):
        assert name in doc
