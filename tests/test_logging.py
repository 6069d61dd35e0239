"""rxcoord logs with loguru and, as a library, stays silent until the application enables it."""

from __future__ import annotations

import threading

from loguru import logger

from rxcoord._core.timer import Timers


def _log_from_rxcoord() -> None:
    """Make rxcoord's own code log an error (a timer callback that raises)."""
    timers = Timers()
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("callback bug")

    timers.call_later(0.0, boom)
    timers.call_later(0.0, done.set)
    assert done.wait(5)


def test_silent_by_default_and_shown_after_enable() -> None:
    messages: list[str] = []
    sink = logger.add(messages.append, level="DEBUG", format="{name}: {message}")
    try:
        _log_from_rxcoord()
        assert messages == []
        logger.enable("rxcoord")
        try:
            _log_from_rxcoord()
        finally:
            logger.disable("rxcoord")
        assert any("rxcoord._core.timer: rxcoord timer callback failed" in m for m in messages)
    finally:
        logger.remove(sink)
