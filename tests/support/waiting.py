"""Waiting for what a test cannot be told about: one bound, one polling helper (and its asyncio
form).

``WAIT`` bounds events that must happen; it is never reached when the code is right, and only
turns a bug into a failure instead of a hang. ``wait_until`` polls a state no event announces
(a counter another thread moves, an idle-timeout eviction on the real timer); ``until`` does
the same from a coroutine, letting the loop run between polls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["WAIT", "until", "wait_until"]

WAIT = 10.0

_SPINS = 100  # polls that only yield to the loop before ``until`` starts to pause


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT, what: str = "") -> None:
    """Return as soon as ``predicate()`` holds; fail (naming ``what``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


async def until(
    predicate: Callable[[], bool],
    what: str = "",
    timeout: float = WAIT,  # noqa: ASYNC109  (bounds the polling, as in wait_until)
) -> None:
    """:func:`wait_until` for a coroutine: yield to the loop until ``predicate()`` holds.

    The first polls only yield (``asyncio.sleep(0)``), so a state that a task on this loop
    reaches is seen as soon as it is reached, with as little as possible run in between; after
    that the pause grows as in :func:`wait_until`, for a state another thread reaches.
    """
    deadline = time.monotonic() + timeout
    polls = 0
    pause = 0.0005
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        polls += 1
        if polls <= _SPINS:
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.01)
