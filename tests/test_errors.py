"""The error tree: one base class, precise leaves, built-in bases where they help callers."""

from __future__ import annotations

import rxcoord
from rxcoord import (
    CoordinatorClosed,
    LeaseError,
    LeaseLost,
    LeaseProviderClosed,
    LeaseReleasedError,
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
    assert not issubclass(TooManyTasks, LeaseError)


def test_the_tree_is_drawn_in_the_module_docstring() -> None:
    doc = rxcoord._errors.__doc__ or ""
    for name in ("TooManyTasks", "CoordinatorClosed", "LockTimeout", "LeaseLost"):
        assert name in doc
