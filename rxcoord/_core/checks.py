"""One validation policy for every layer: what a duration, a count, a name or a table may be.

Bad input fails at the call, before anything is queued, counted or sent, with a message that
says what was wrong and what to pass instead. Types first (``TypeError``), then ranges
(``ValueError``). ``bool`` is refused wherever a number is expected (``True`` is an ``int`` to
Python, but ``timeout=True`` is always a mistake).

Durations come in several kinds, because they mean different things:

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
interval      ``commit_interval``,       refused: a period or bound of rxcoord's own     refused
              ``drain_timeout``,         machinery must let time pass
              ``stall_after``
============  =========================  ==============================================  ======

``None`` means "no bound" for waits and deadlines (the same as ``inf``), and is refused for
lengths and delays (they have defaults). NaN and negative values are refused everywhere. Waits
and deadlines are capped at :data:`MAX_SECONDS` (what threads and the timer can wait for);
lengths at a store's own range (``maximum``). A lease name is a non-empty str within a store's
byte limit; a table an SQL identifier. Every layer (the coordinator, the operator, the locks,
the leases, the Kafka consumer, the policies ``Retry`` and ``Rate``) checks through here.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from collections.abc import Hashable
from typing import Final

__all__ = [
    "MAX_DURATION",
    "MAX_NAME_BYTES",
    "MAX_NAME_LENGTH",
    "MAX_SECONDS",
    "check_cap",
    "check_count",
    "check_deadline",
    "check_delay",
    "check_hashable",
    "check_identifier",
    "check_interval",
    "check_lease_args",
    "check_lease_name",
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


def check_length(
    value: object, what: str, *, allow_zero: bool = False, maximum: float = math.inf
) -> float:
    """How long a grant lives (a lease, a permit): finite seconds, > 0 unless ``allow_zero``,
    and at most ``maximum`` (a store's range: where it keeps an expiry, in a column or a key
    TTL of limited range, a value beyond it must be refused at the call, not reported by the
    store as an outage).

    Raises:
        TypeError: Not a number (None and bools included).
        ValueError: NaN, negative, infinite (a lease must end, or a crashed holder would block
            its name forever), 0 without ``allow_zero``, or above ``maximum``.
    """
    seconds = _seconds(value, what, False)
    assert seconds is not None
    if seconds == math.inf:
        raise ValueError(
            f"{what} must be finite: a lease must end, or a crashed holder would keep it forever"
        )
    if seconds == 0 and not allow_zero:
        raise ValueError(f"{what} must be > 0 seconds, got {value!r}")
    if seconds > maximum:
        raise ValueError(
            f"{what} must be at most {maximum:g} seconds (about {maximum / 31_557_600:.3g} "
            f"years), got {value!r}"
        )
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


def check_interval(value: object, what: str) -> float:
    """A period or bound of rxcoord's own machinery (a commit interval, a drain or startup
    bound, a stall threshold): seconds > 0 and at most :data:`MAX_SECONDS`.

    Raises:
        TypeError: Not a number (None and bools included).
        ValueError: 0, negative, NaN, or beyond :data:`MAX_SECONDS` (infinite included).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, e.g. {what}=5.0, not {value!r}")
    seconds = float(value)
    if not seconds > 0:  # (NaN too)
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    if seconds > MAX_SECONDS:
        raise ValueError(
            f"{what} must be at most {MAX_SECONDS:g} seconds (a finite bound), got {value!r}"
        )
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


# -- leases and SQL tables -------------------------------------------------------------------------
# A store refuses what it cannot represent with a driver error that looks like an outage (and
# retry loops would spin on it forever): so everything a backend cannot represent is refused
# here, at the call and before any round trip, with the limit in the message. Each lease
# provider states its limits as class attributes (``max_name_bytes``, ``max_duration``).

MAX_NAME_LENGTH: Final = 1024  # kept for importers; the limit is now in bytes, per backend
# The default limits. Names: 4 KiB of UTF-8 keeps keys, rows and channel names of every store
# reasonable (PostgreSQL lowers it, see PostgresLeases). Durations: waiters sleep until a
# holder's expiry with threading primitives, which refuse timeouts above threading.TIMEOUT_MAX
# (about 292 years on 64-bit Linux); a billion seconds (about 31.7 years) stays well inside it
# and inside every store's range (PostgreSQL timestamps reach the year 294276, Redis takes
# 64-bit milliseconds, SQLite a double).
MAX_NAME_BYTES: Final = 4096
MAX_DURATION: Final = 1e9
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_lease_name(name: object, max_bytes: int = MAX_NAME_BYTES, backend: str = "") -> str:
    """A lease name: a non-empty str of at most ``max_bytes`` bytes of UTF-8, without NUL.

    Raises:
        TypeError: Not a str.
        ValueError: Empty, too long for the backend, a NUL character, or not encodable as
            UTF-8 (a lone surrogate).
    """
    if type(name) is not str and not isinstance(name, str):
        raise TypeError(f"a lease name is a str, not {type(name).__name__}")
    if not name:
        raise ValueError("a lease name must not be empty")
    # len() is a cheap lower bound of the UTF-8 size: only long names pay for encoding.
    if len(name) * 4 > max_bytes:
        try:
            size = len(name.encode())
        except UnicodeEncodeError:
            raise ValueError(
                "a lease name must be encodable as UTF-8 (it contains a lone surrogate)"
            ) from None
        if size > max_bytes:
            where = f" on {backend}" if backend else ""
            raise ValueError(
                f"a lease name has at most {max_bytes} bytes of UTF-8{where}, got {size} "
                f"({len(name)} characters): use a shorter name, or a hash of the long one"
            )
    elif not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError:
            raise ValueError(
                "a lease name must be encodable as UTF-8 (it contains a lone surrogate)"
            ) from None
    if "\x00" in name:
        raise ValueError("a lease name must not contain NUL characters")
    return name


def check_lease_args(
    name: object,
    at_most_for: object,
    at_least_for: object,
    *,
    max_name_bytes: int = MAX_NAME_BYTES,
    max_duration: float = MAX_DURATION,
    backend: str = "",
) -> tuple[float, float]:
    """Validate a grant request; returns (at_most_for, at_least_for) as floats.

    Raises:
        TypeError: A value has the wrong type.
        ValueError: Empty or too long name, ``at_most_for <= 0`` or above ``max_duration``,
            ``at_least_for < 0`` or ``at_least_for > at_most_for``.
    """
    check_lease_name(name, max_name_bytes, backend)
    most = check_length(at_most_for, "at_most_for", maximum=max_duration)
    least = check_length(at_least_for, "at_least_for", allow_zero=True, maximum=max_duration)
    if least > most:
        raise ValueError(
            f"at_least_for ({least}s) must not exceed at_most_for ({most}s): a lease cannot be "
            "kept longer than it may live"
        )
    return most, least


def check_identifier(table: object) -> tuple[str, ...]:
    """A table name: an SQL identifier, optionally schema-qualified (``schema.table``).

    Letters, digits and underscores, not starting with a digit, at most 63 characters per
    part (PostgreSQL's limit). Returns the parts.
    """
    if not isinstance(table, str):
        raise TypeError(f"a table name is a str, not {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise ValueError(
            f"invalid table name {table!r}: use an identifier such as 'rxcoord_leases' or "
            "'myschema.rxcoord_leases' (letters, digits, underscores; at most 63 characters)"
        )
    return parts
