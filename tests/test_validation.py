"""Bad input is refused at the call, with a message that says what to pass instead; and the one
duration policy (``rxcoord._core.checks``) means the same thing in every layer."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rxcoord import KeyedLocks, TenantScheduler, TenantTaskCoordinator
from rxcoord._core.checks import (
    check_deadline,
    check_delay,
    check_interval,
    check_length,
    check_wait,
)
from rxcoord.leases import MemoryLeases


def test_constructor_parameters_are_keyword_only() -> None:
    coordinator: Any = TenantTaskCoordinator  # untyped on purpose: a caller's mistake
    scheduler: Any = TenantScheduler
    with pytest.raises(TypeError, match="positional"):
        coordinator(4)
    with pytest.raises(TypeError, match="positional"):
        scheduler(16, 2)
    with TenantScheduler(16) as s:  # the first obvious one stays positional
        assert s.stats().max_concurrency == 16


@pytest.mark.parametrize(
    ("weight", "error", "message"),
    [
        (math.inf, ValueError, "would starve every other tenant"),
        (0, ValueError, "finite number > 0"),
        (-1, ValueError, "finite number > 0"),
        (math.nan, ValueError, "finite number > 0"),
        ("3", TypeError, "positive number"),
        (True, TypeError, "positive number"),
    ],
)
def test_bad_mapping_weights_are_refused_at_construction(
    weight: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        TenantScheduler(weights={"a": weight})
    assert "'a'" in str(raised.value)  # names the tenant


def test_a_callable_weight_is_checked_on_the_tenant_s_first_job() -> None:
    with TenantScheduler(weights=lambda tenant: math.inf) as s:
        with pytest.raises(ValueError, match="tenant 't'"):
            s.execute("t", lambda: 1).run()
        assert s.stats().tenants == 0


def test_leases_must_be_a_provider_not_a_url() -> None:
    with pytest.raises(TypeError, match=r"leases_from_url\(url\)"):
        TenantTaskCoordinator(leases="redis://x")  # type: ignore[arg-type]
    with MemoryLeases() as leases, TenantTaskCoordinator(name="n", leases=leases):
        pass


@pytest.mark.parametrize(
    ("value", "error"),
    [(math.nan, ValueError), (-1, ValueError), ("5", TypeError), (None, TypeError)],
)
def test_bad_idle_timeouts(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="idle_timeout"):
        TenantScheduler(idle_timeout=value)


def test_idle_timeout_inf_never_evicts() -> None:
    with TenantScheduler(idle_timeout=math.inf) as s:
        assert s.execute("t", lambda: 1).run() == 1
        assert s.tenant_count == 1


@pytest.mark.parametrize("cls", [TenantTaskCoordinator, TenantScheduler])
def test_name_must_be_a_str(cls: Any) -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        cls(name=None)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (0, ValueError, "given no time"),
        (-1, ValueError, ">= 0"),
        (math.nan, ValueError, "NaN"),
        (True, TypeError, "number of seconds"),
        ("1", TypeError, "number of seconds"),
    ],
)
def test_bad_job_timeouts_at_the_constructor_and_the_call(
    timeout: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TenantTaskCoordinator(timeout=timeout)
    with TenantTaskCoordinator() as c, pytest.raises(error, match=message):
        c.execute(lambda: 1, timeout=timeout)


def test_a_job_timeout_of_inf_is_no_limit() -> None:
    with TenantTaskCoordinator(timeout=math.inf) as c:
        assert c.execute(lambda: 1).run() == 1
        assert c.execute(lambda: 2, timeout=math.inf).run() == 2


def test_a_wait_of_inf_waits_and_0_tries_once_in_locks_and_leases() -> None:
    locks = KeyedLocks()
    with (
        locks.hold("k", timeout=math.inf),
        pytest.raises(TimeoutError),
        locks.hold("k", timeout=0),
    ):
        pass
    with MemoryLeases() as leases:
        with leases.lock("n", timeout=math.inf), pytest.raises(TimeoutError):
            leases.acquire("n", timeout=0)
        with pytest.raises(ValueError, match="finite"):
            leases.acquire("n", at_most_for=math.inf)


def test_the_policy_table() -> None:
    # wait: None/inf forever, 0 try once
    assert check_wait(None) is None
    assert check_wait(math.inf) is None
    assert check_wait(0) == 0.0
    # deadline: None/inf no limit, 0 refused
    assert check_deadline(math.inf) is None
    with pytest.raises(ValueError, match="given no time"):
        check_deadline(0)
    # length: finite only; 0 only where allowed
    with pytest.raises(ValueError, match="must end"):
        check_length(math.inf, "at_most_for")
    assert check_length(0, "at_least_for", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="> 0"):
        check_length(0, "at_most_for")
    with pytest.raises(TypeError):
        check_length(None, "at_most_for")
    # delay: 0 at once, inf never
    assert check_delay(0, "idle_timeout") == 0.0
    assert check_delay(math.inf, "idle_timeout") == math.inf
    # interval: finite and > 0, the name and the fix in the message
    assert check_interval(2, "commit_interval") == 2.0
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="commit_interval must be a positive number"):
            check_interval(bad, "commit_interval")
    with pytest.raises(ValueError, match="finite bound"):
        check_interval(math.inf, "drain_timeout")
    for wrong in (None, True, "5"):
        with pytest.raises(TypeError, match=r"e\.g\. stall_after=5\.0"):
            check_interval(wrong, "stall_after")
    # everywhere: NaN, negatives and bools
    for check in (check_wait, check_deadline):
        with pytest.raises(ValueError, match="NaN"):
            check(math.nan)
        with pytest.raises(ValueError, match=">= 0"):
            check(-0.5)
        with pytest.raises(TypeError):
            check(False)


def test_stats_is_typed_by_its_argument() -> None:
    # mypy --strict checks this file: no isinstance needed on either result
    with TenantScheduler() as s:
        s.execute("t", lambda: 1).run()
        assert s.stats().tenants >= 0
        assert s.stats("t").name == "t"
