"""Waiting for what a test cannot be told about: one bound, one polling helper.

``WAIT`` bounds events that must happen; it is never reached when the code is right, and only
turns a bug into a failure instead of a hang. ``wait_until`` polls a state no event announces
(a counter another thread moves, an idle-timeout eviction on the real timer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["WAIT", "wait_until"]

WAIT = 10.0


def wait_until(predicate: Callable[[], bool], what: str = "", timeout: float = WAIT) -> None:
    """Return as soon as ``predicate()`` holds; fail (naming ``what``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
