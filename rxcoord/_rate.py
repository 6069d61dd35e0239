"""``Rate``: the one rate-limit policy, for a coordinator, a tenant, a scheduler and a fleet.

The arithmetic (GCRA) is in ``rxcoord/_core/rate.py``; where it is enforced:

* in one process, by an admission (``rxcoord/_admission.py``): :class:`RateAdmission` in front
  of a coordinator's other admission, and the rates inside ``FairShareGate`` for a
  ``TenantScheduler`` (a global rate and one per tenant);
* across a fleet, by the lease store, in the same atomic step that grants a fleet permit
  (``rxcoord/leases/_permits.py``), on the store's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._core.checks import check_count, check_rate_count, check_rate_per

__all__ = ["Rate", "RateStats", "TenantRates", "check_rate", "check_tenant_rates", "rate_of"]


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` job starts per ``per`` seconds; ``burst`` of them back to back.

    A token bucket (GCRA): over any interval of length ``t``, at most
    ``burst + count * t / per`` jobs start. With ``burst=1`` (the default) starts are evenly
    spaced, ``per / count`` seconds apart; a larger burst lets that many start at once after a
    quiet spell (and absorbs the lateness of a waiter's wake-up, which with ``burst=1`` is
    lost time). A job over its rate waits for its time (holding no slot, permit or thread);
    it does not fail.

    Args:
        count: Starts per period: a finite number > 0 (``Rate(0.5)``: one every 2 seconds).
        per: The period in seconds: finite, > 0.
        burst: Starts allowed back to back after idling: an int >= 1.

    Raises:
        TypeError: An argument is not a number (``burst``: not an int).
        ValueError: ``count`` or ``per`` is not a finite number > 0, or ``burst`` < 1.
    """

    count: float
    per: float = 1.0
    burst: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", check_rate_count(self.count, "Rate count"))
        object.__setattr__(self, "per", check_rate_per(self.per, "Rate per"))
        try:
            check_count(self.burst, "Rate burst", 1)
        except ValueError:
            raise ValueError(
                f"Rate burst must be at least 1 (1: starts evenly spaced, no burst), "
                f"got {self.burst}"
            ) from None

    @property
    def interval(self) -> float:
        """Seconds between starts at the full rate (``per / count``)."""
        return self.per / self.count

    def __repr__(self) -> str:
        return f"Rate({self.count:g}, per={self.per:g}, burst={self.burst})"


@dataclass(frozen=True, slots=True)
class RateStats:
    """Waiting for a rate, as seen by one admission (or one tenant of it).

    Attributes:
        waits: Jobs a rate held back before they started.
        waited: Seconds those jobs waited from then until they started, in total, on the
            admission's clock: a ``RateAdmission`` counts from the request, a fair-share
            gate's lane from the moment the job reached the front of its lane, a fleet lane
            from the store's first "not yet".
        waiting: Jobs waiting now: for the rate (``RateAdmission``, a fleet lane), or at the
            lane (a fair-share gate's lane, whatever holds them back).
    """

    waits: int = 0
    waited: float = 0.0
    waiting: int = 0


TenantRates = Rate | Mapping[Hashable, Rate] | Callable[[Hashable], "Rate | None"]


def check_rate(value: object, what: str = "rate") -> Rate | None:
    """A :class:`Rate` or None.

    Raises:
        TypeError: Anything else (with the fix).
    """
    if value is None or isinstance(value, Rate):
        return value
    raise TypeError(
        f"{what} must be an rxcoord.Rate, e.g. Rate(100, per=1.0), or None, not {value!r}"
    )


@dataclass(frozen=True, slots=True)
class _Rates:
    """Tenant rates, checked: one for all, a mapping (checked here), or a callable."""

    every: Rate | None = None
    mapping: Mapping[Hashable, Rate] = field(default_factory=dict)
    call: Callable[[Hashable], Any] | None = None


def check_tenant_rates(value: object, what: str = "tenant_rate") -> _Rates | None:
    """``tenant_rate=``: a :class:`Rate` for every tenant, a mapping tenant -> Rate (tenants
    not in it have none), or a callable tenant -> Rate (or None), checked on first use.

    Raises:
        TypeError: None of those, or a mapping with a value that is not a Rate.
    """
    if value is None:
        return None
    if isinstance(value, Rate):
        return _Rates(every=value)
    if isinstance(value, Mapping):
        for tenant, rate in value.items():
            check_rate(rate, f"{what}[{tenant!r}]")
        return _Rates(mapping=dict(value))
    if callable(value):
        return _Rates(call=value)
    raise TypeError(
        f"{what} must be an rxcoord.Rate (every tenant), a mapping tenant -> Rate, or a "
        f"callable tenant -> Rate, not {value!r}"
    )


def rate_of(rates: _Rates | None, tenant: Hashable, what: str = "tenant_rate") -> Rate | None:
    """The rate of ``tenant`` (None: no rate of its own).

    Raises:
        TypeError: The callable returned something other than a Rate or None.
    """
    if rates is None:
        return None
    if rates.every is not None:
        return rates.every
    if rates.call is None:
        return rates.mapping.get(tenant)
    return check_rate(rates.call(tenant), f"{what}({tenant!r}) returned a value that")
