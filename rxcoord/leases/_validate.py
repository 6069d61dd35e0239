"""Argument checks shared by every lease provider (cheap: they run on every try_acquire).

Everything a backend cannot represent is refused here, at the call and before any round trip,
with a ``ValueError`` naming the limit: a store that refuses a value would otherwise fail with a
driver error that looks like an outage, and retry loops would spin on it forever. Each provider
states its limits as class attributes (``max_name_bytes``, ``max_duration``) that these checks
take as arguments.
"""

from __future__ import annotations

import math
import re
from typing import Final

from rxcoord._core.checks import check_length, check_wait

__all__ = [
    "MAX_DURATION",
    "MAX_NAME_BYTES",
    "MAX_NAME_LENGTH",
    "check_duration",
    "check_lease_args",
    "check_name",
    "check_table",
    "check_timeout",
]

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


def check_name(name: object, max_bytes: int = MAX_NAME_BYTES, backend: str = "") -> str:
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


def check_duration(
    what: str, value: object, *, allow_zero: bool = False, maximum: float = math.inf
) -> float:
    """A lease length: rxcoord's one rule for lengths (``_core.checks.check_length``: finite,
    > 0 or >= 0 with ``allow_zero``), and at most ``maximum``, the store's range.

    The maximum is where leases differ from the other layers: a store represents its expiry
    time in a column or a key TTL of limited range, and a value beyond it must be refused at the
    call, not reported by the store as an outage.

    Raises:
        TypeError: Not an int or float (bools are refused).
        ValueError: Not finite, negative (or zero without ``allow_zero``), above ``maximum``.
    """
    seconds = check_length(value, what, allow_zero=allow_zero)
    if seconds > maximum:
        raise ValueError(
            f"{what} must be at most {maximum:g} seconds (about {maximum / 31_557_600:.3g} "
            f"years), got {value!r}"
        )
    return seconds


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
    check_name(name, max_name_bytes, backend)
    most = check_duration("at_most_for", at_most_for, maximum=max_duration)
    least = check_duration("at_least_for", at_least_for, allow_zero=True, maximum=max_duration)
    if least > most:
        raise ValueError(
            f"at_least_for ({least}s) must not exceed at_most_for ({most}s): a lease cannot be "
            "kept longer than it may live"
        )
    return most, least


def check_timeout(timeout: object) -> float | None:
    """A wait, by rxcoord's one rule (``_core.checks.check_wait``): None or ``inf`` wait as long
    as it takes, 0 tries once, else seconds."""
    return check_wait(timeout, "timeout")


def check_table(table: object) -> tuple[str, ...]:
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
