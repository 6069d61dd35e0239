"""The retry policy: one class for every layer, and its pure logic (no clock, no threads).

A coordinator, a tenant scheduler and the Kafka consumer all retry the same way: a job that
failed with a retried exception waits, holding its key (later jobs of the key stay behind it)
but no slot, permit or thread, and then queues for a slot like any ready job. This module only
decides *whether* another attempt starts and *when*; the owners do the waiting (a timer, or the
virtual clock of a test scheduler).

The wait before attempt n+1 is ``min(backoff * multiplier ** (n - 1), max_backoff)``, randomised
by +/- ``jitter`` of itself (so a burst of failures does not come back as a burst).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from .._errors import CoordinatorClosed, TooManyTasks
from .checks import check_count, check_deadline, check_delay

__all__ = ["NEVER_RETRIED", "Retry"]

# Exceptions that are never retried, whatever ``on`` says: a cancellation is the caller's wish,
# and a refusal by a coordinator is not the job's failure.
NEVER_RETRIED: Final = (asyncio.CancelledError, TooManyTasks, CoordinatorClosed)


@dataclass(frozen=True, slots=True)
class Retry:
    """How a failed job is tried again.

    Attributes:
        attempts: Attempts in all, the first included (``1``: no retry).
        backoff: Seconds before the second attempt.
        multiplier: Each later wait is the previous one times this (``1``: a constant wait).
        max_backoff: The most one wait lasts, in seconds (default: 30, or ``backoff`` if that
            is longer).
        jitter: Each wait is randomised by +/- this fraction of itself, in ``[0, 1)``.
        on: Exception types that are retried (a type or a tuple of them; always a tuple once
            built); any other fails at once.
            ``asyncio.CancelledError``, ``TooManyTasks`` and ``CoordinatorClosed`` never are.
        deadline: Seconds from the first attempt's start after which no new attempt starts
            (``None``: no limit).

    Raises:
        TypeError: A count or duration is not a number, ``on`` holds something that is not an
            exception type.
        ValueError: ``attempts < 1``, a wait negative, NaN or infinite, ``multiplier < 1``,
            ``max_backoff < backoff``, ``jitter`` outside ``[0, 1)``, ``deadline <= 0``.
    """

    attempts: int = 3
    backoff: float = 0.1
    multiplier: float = 2.0
    max_backoff: float | None = None
    jitter: float = 0.1
    on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,)
    deadline: float | None = None
    # Where the jitter's randomness comes from (a seeded ``random.Random().random`` in tests).
    random: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_count(self.attempts, "Retry(attempts=...)", 1)
        backoff = _finite(self.backoff, "backoff")
        multiplier = _finite(self.multiplier, "multiplier")
        if multiplier < 1:
            raise ValueError(
                f"Retry(multiplier=...) must be >= 1 (each wait at least as long as the one "
                f"before; 1 for a constant wait), got {self.multiplier!r}"
            )
        most = (
            max(30.0, backoff)
            if self.max_backoff is None
            else _finite(self.max_backoff, "max_backoff")
        )
        if most < backoff:
            raise ValueError(
                f"Retry(max_backoff=...) must be >= backoff ({self.backoff!r}), got "
                f"{self.max_backoff!r}"
            )
        if isinstance(self.jitter, bool) or not isinstance(self.jitter, int | float):
            raise TypeError(f"Retry(jitter=...) must be a number in [0, 1), not {self.jitter!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(
                f"Retry(jitter=...) must be in [0, 1) (a fraction of each wait), got "
                f"{self.jitter!r}"
            )
        on = self.on if isinstance(self.on, tuple) else (self.on,)
        if not on or not all(isinstance(t, type) and issubclass(t, BaseException) for t in on):
            raise TypeError(
                f"Retry(on=...) must be an exception type or a tuple of them, e.g. "
                f"(ConnectionError, TimeoutError), not {self.on!r}"
            )
        object.__setattr__(self, "on", on)  # a single type becomes a one-tuple
        object.__setattr__(self, "backoff", backoff)
        object.__setattr__(self, "multiplier", multiplier)
        object.__setattr__(self, "max_backoff", most)
        check_deadline(self.deadline, "Retry(deadline=...)")
        if not callable(self.random):
            raise TypeError(f"Retry(random=...) must be callable, not {self.random!r}")

    def retries(self, error: BaseException) -> bool:
        """Whether ``error`` is of a retried type (attempts and deadline aside)."""
        return isinstance(error, self.on) and not isinstance(error, NEVER_RETRIED)

    def wait(self, attempt: int) -> float:
        """Seconds to wait after the failure of attempt ``attempt`` (1-based), jitter included."""
        most = self.max_backoff
        assert most is not None  # (set in __post_init__)
        base = min(self.backoff * self.multiplier ** (attempt - 1), most)
        if self.jitter:
            base *= 1 + self.jitter * (2 * self.random() - 1)
        return base

    def next_wait(self, error: BaseException, attempt: int, elapsed: float) -> float | None:
        """After attempt ``attempt`` failed with ``error``, ``elapsed`` seconds after the first
        attempt started: the wait before the next attempt, or None if there is none."""
        if attempt >= self.attempts or not self.retries(error):
            return None
        wait = self.wait(attempt)
        if self.deadline is not None and elapsed + wait > self.deadline:
            return None  # the next attempt would start past the deadline
        return wait


def _finite(value: object, what: str) -> float:
    seconds = check_delay(value, f"Retry({what}=...)")
    if math.isinf(seconds):
        raise ValueError(f"Retry({what}=...) must be finite, got {value!r}")
    return seconds


def gave_up(error: BaseException, attempts: int, name: str) -> None:
    """Note on ``error`` that it ends a job after ``attempts`` attempts (``add_note``)."""
    if attempts > 1:
        error.add_note(f"rxcoord: gave up after {attempts} attempts ({name})")
