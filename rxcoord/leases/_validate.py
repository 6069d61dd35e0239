"""Argument checks shared by every lease provider (cheap: they run on every try_acquire)."""

from __future__ import annotations

import math
import re
from typing import Final

__all__ = [
    "MAX_NAME_LENGTH",
    "check_duration",
    "check_lease_args",
    "check_name",
    "check_table",
    "check_timeout",
]

MAX_NAME_LENGTH: Final = 1024
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_name(name: object) -> str:
    """A lease name: a non-empty str of at most MAX_NAME_LENGTH characters, without NUL."""
    if type(name) is not str and not isinstance(name, str):
        raise TypeError(f"a lease name is a str, not {type(name).__name__}")
    if not name:
        raise ValueError("a lease name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"a lease name has at most {MAX_NAME_LENGTH} characters, got {len(name)}")
    if "\x00" in name:
        raise ValueError("a lease name must not contain NUL characters")
    return name


def check_duration(what: str, value: object, *, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} is a number of seconds, not {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {value!r}")
    return seconds


def check_lease_args(
    name: object, at_most_for: object, at_least_for: object
) -> tuple[float, float]:
    """Validate a grant request; returns (at_most_for, at_least_for) as floats.

    Raises:
        TypeError: A value has the wrong type.
        ValueError: Empty or too long name, ``at_most_for <= 0``, ``at_least_for < 0`` or
            ``at_least_for > at_most_for``.
    """
    check_name(name)
    most = check_duration("at_most_for", at_most_for)
    least = check_duration("at_least_for", at_least_for, allow_zero=True)
    if least > most:
        raise ValueError(
            f"at_least_for ({least}s) must not exceed at_most_for ({most}s): a lease cannot be "
            "kept longer than it may live"
        )
    return most, least


def check_timeout(timeout: object) -> float | None:
    """None (wait as long as it takes) or a finite number of seconds >= 0."""
    if timeout is None:
        return None
    return check_duration("timeout", timeout, allow_zero=True)


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
