"""One validation policy for every layer: what a duration, a count or a name may be.

Bad input fails at the call, before anything is queued, counted or sent, with a message that
says what was wrong and what to pass instead. Types first (``TypeError``), then ranges
(``ValueError``). ``bool`` is refused wherever a number is expected (``True`` is an ``int`` to
Python, but ``timeout=True`` is always a mistake).

Durations come in three kinds, because they mean three different things:

============  =========================  ==============================================  ======
kind          where                      0                                               inf
============  =========================  ==============================================  ======
wait          ``timeout=`` of a lock or  try once, never wait (a try-lock)               wait as
              lease wait                                                                 long as
                                                                                         it takes
deadline      ``timeout=`` of a job      refused: a job with no time at all could only   no limit
              (coordinator, scheduler)   ever fail; a try-run has no meaning
length        ``at_most_for``,           refused for ``at_most_for`` (a lease must       refused:
              ``at_least_for``,          exist), allowed for ``at_least_for``            a lease
              ``permit_at_most_for``                                                     must end
delay         ``idle_timeout``           at once                                         never
============  =========================  ==============================================  ======

``None`` means "no bound" for waits and deadlines (the same as ``inf``), and is refused for
lengths and delays (they have defaults). NaN and negative values are refused everywhere. Waits
and deadlines are capped at :data:`MAX_SECONDS` (what threads and the timer can wait for).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Hashable
from typing import Final

__all__ = [
    "MAX_SECONDS",
    "check_cap",
    "check_count",
    "check_deadline",
    "check_delay",
    "check_hashable",
    "check_length",
    "check_name",
    "check_overflow",
    "check_rate_count",
    "check_rate_per",
    "check_wait",
    "check_weight",
]

MAX_SECONDS: Final = float(threading.TIMEOUT_MAX)


def _seconds(value: object, what: str, none_ok: bool) -> float | None:
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        accepted = "a number of seconds or None" if none_ok else "a number of seconds"
        raise TypeError(f"{what} must be {accepted}, not {value!r}")
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number of seconds, got NaN")
    if seconds < 0:
        raise ValueError(f"{what} must be >= 0 seconds, got {value!r}")
    return seconds


def check_wait(value: object, what: str = "timeout") -> float | None:
    """A bound on waiting: None (or inf) waits as long as it takes, 0 tries once, else seconds.

    Raises:
        TypeError: Not a number (or a bool).
        ValueError: NaN, negative, or finite but beyond :data:`MAX_SECONDS`.
    """
    seconds = _seconds(value, what, True)
    if seconds is None or seconds == math.inf:
        return None
    if seconds > MAX_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_SECONDS:g} s (or None), got {value!r}")
    return seconds


def check_deadline(value: object, what: str = "timeout") -> float | None:
    """How long a job may run: None (or inf) for no limit, else seconds > 0.

    Raises:
        TypeError: Not a number (or a bool).
        ValueError: 0, NaN, negative, or finite but beyond :data:`MAX_SECONDS`.
    """
    seconds = _seconds(value, what, True)
    if seconds is None or seconds == math.inf:
        return None
    if seconds == 0:
        raise ValueError(
            f"{what} must be > 0 seconds (a job given no time at all can only fail); "
            "pass None for no limit"
        )
    if seconds > MAX_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_SECONDS:g} s (or None), got {value!r}")
    return seconds


def check_length(value: object, what: str, *, allow_zero: bool = False) -> float:
    """How long a grant lives (a lease, a permit): finite seconds, > 0 unless ``allow_zero``.

    Raises:
        TypeError: Not a number (None and bools included).
        ValueError: NaN, negative, infinite (a lease must end, or a crashed holder would block
            its name forever), or 0 without ``allow_zero``.
    """
    seconds = _seconds(value, what, False)
    assert seconds is not None
    if seconds == math.inf:
        raise ValueError(
            f"{what} must be finite: a lease must end, or a crashed holder would keep it forever"
        )
    if seconds == 0 and not allow_zero:
        raise ValueError(f"{what} must be > 0 seconds, got {value!r}")
    return seconds


def check_delay(value: object, what: str) -> float:
    """A delay before something happens on its own: 0 at once, inf never, else seconds.

    Raises:
        TypeError: Not a number (None and bools included).
        ValueError: NaN or negative.
    """
    seconds = _seconds(value, what, False)
    assert seconds is not None
    return seconds


def check_count(value: object, what: str, minimum: int) -> int:
    """An ``int`` (not a bool) of at least ``minimum``.

    Raises:
        TypeError: Not an int.
        ValueError: Below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return value


def check_cap(value: object, what: str) -> int:
    """A cap on things at once: an ``int`` of at least 1, or None for no cap (``sys.maxsize``).

    Raises:
        TypeError: Neither an int nor None.
        ValueError: Below 1.
    """
    if value is None:
        return sys.maxsize
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int or None, not {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1 (or None for no limit), got {value}")
    return value


def check_weight(value: object, what: str) -> float:
    """A fair-share weight: a finite number > 0.

    Raises:
        TypeError: Not a number (strings and bools included).
        ValueError: 0, negative, NaN or infinite (an infinite weight would starve every other
            tenant).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a positive number, not {value!r}")
    weight = float(value)
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(
            f"{what} must be a finite number > 0, got {value!r}"
            + ("; an infinite weight would starve every other tenant" if weight > 0 else "")
        )
    return weight


def check_rate_count(value: object, what: str = "count") -> float:
    """How many starts a rate allows per period: a finite number > 0 (fractions allowed).

    Raises:
        TypeError: Not a number (strings and bools included).
        ValueError: 0, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{what} must be a number of starts per period, e.g. Rate(100, per=1.0), not {value!r}"
        )
    count = float(value)
    if math.isnan(count) or count <= 0:
        raise ValueError(
            f"{what} must be a finite number > 0 of starts per period, got {value!r} (to run "
            "nothing, do not submit; for no rate limit, pass rate=None)"
        )
    if math.isinf(count):
        raise ValueError(
            f"{what} must be finite, got {value!r}: for no rate limit pass rate=None instead"
        )
    return count


def check_rate_per(value: object, what: str = "per") -> float:
    """The period of a rate: finite seconds > 0.

    Raises:
        TypeError: Not a number (None, strings and bools included).
        ValueError: 0, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, e.g. per=1.0, not {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{what} must be a finite number of seconds > 0, got {value!r} (Rate(10, per=60.0) "
            "is 10 starts a minute)"
        )
    if math.isinf(seconds):
        raise ValueError(
            f"{what} must be finite, got {value!r}: an infinite period allows nothing; for no "
            "rate limit pass rate=None instead"
        )
    return seconds


def check_overflow(value: object, what: str = "overflow") -> bool:
    """What to do with a submission beyond the limits: ``"reject"`` (False) or ``"wait"`` (True).

    Raises:
        ValueError: Anything but those two strings.
    """
    if value == "reject" and isinstance(value, str):
        return False
    if value == "wait" and isinstance(value, str):
        return True
    raise ValueError(
        f'{what} must be "reject" (TooManyTasks beyond the limits) or "wait" (wait for room), '
        f"not {value!r}"
    )


def check_name(value: object, what: str = "name") -> str:
    """A name for errors, logs and thread names: a ``str`` (may be empty).

    Raises:
        TypeError: Not a str (``None`` included).
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {value!r}")
    return value


def check_hashable(value: object, what: str) -> Hashable:
    """Anything usable as a dict key.

    Raises:
        TypeError: Unhashable.
    """
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{what} must be hashable, not {type(value).__name__} {value!r}") from None
    return value
