"""librdkafka's log, through loguru at matching levels, with repeated lines folded.

Without a logger, librdkafka prints its log lines to stderr itself: a consumer whose broker is
unreachable printed a ``Connect to ... failed`` line per reconnect attempt (194 lines in 10 s,
tried as a new user would), whatever the application's logging said. The consumer therefore
gives confluent-kafka a standard-library logger (its ``logger`` setting; one the application
passes in the configuration wins), and this module sends that logger's records to loguru from
``rxcoord.kafka``: silent until ``logger.enable("rxcoord")``, like every log of rxcoord, at the
level confluent-kafka mapped librdkafka's syslog level to (3 is ERROR, 4 WARNING, 5 and 6 INFO,
7 DEBUG). confluent-kafka hands the lines over when the client is polled (``consume()``,
``close()``), so they arrive on the poll thread.

Folding: a line whose text, digits aside, was logged less than ``FOLD_WINDOW`` seconds ago is
counted instead of logged (a reconnect loop repeats the same line with a different ``after N
ms``); the next one logged after the window says how many were folded, and :func:`flush` (at
the end of a run) reports what is still counted. The filter sits on the logger, so the
application's own handlers, if it added any to this logger's parents, see the folded stream
too. The table of recent lines is bounded (``_MAX_LINES``, oldest forgotten first).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from loguru import logger

__all__ = ["FOLD_WINDOW", "LOGGER_NAME", "Folding", "flush", "librdkafka_logger"]

LOGGER_NAME: Final = "rxcoord.kafka.librdkafka"
FOLD_WINDOW: Final = 30.0  # seconds during which a repeated line is counted, not logged
_MAX_LINES: Final = 256  # distinct recent lines remembered
_DIGITS: Final = re.compile(r"\d+")
_log = logger.bind(source="librdkafka")


@dataclass(slots=True)
class _Seen:
    at: float  # when the line was last let through
    folded: int  # lines like it counted since
    level: int
    text: str  # the last one's text


class Folding(logging.Filter):
    """Lets a line through once per ``window`` seconds (digits aside); counts the others."""

    def __init__(
        self, window: float = FOLD_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, _Seen] = OrderedDict()  # normalized text -> its line

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = f"{record.levelno}:{_DIGITS.sub('#', text)}"
        now = self._clock()
        with self._lock:
            seen = self._recent.get(key)
            if seen is not None and now - seen.at < self.window:
                seen.folded += 1
                seen.text = text
                return False
            folded = seen.folded if seen is not None else 0
            self._recent[key] = _Seen(now, 0, record.levelno, text)
            self._recent.move_to_end(key)
            while len(self._recent) > _MAX_LINES:
                self._recent.popitem(last=False)
        if folded:
            record.msg = f"{text} ({folded} more like it folded in the last {self.window:g} s)"
            record.args = None
        return True

    def pending(self) -> list[tuple[int, str, int]]:
        """Lines counted since they were last let through: (level, last text, count); resets."""
        with self._lock:
            out = [(s.level, s.text, s.folded) for s in self._recent.values() if s.folded]
            for seen in self._recent.values():
                seen.folded = 0
        return out


class _ToLoguru(logging.Handler):
    """Forwards records to loguru at the matching level."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed format string must not break the poll loop
            message = str(record.msg)
        _log.log(_level(record.levelno), "librdkafka: {}", message)


def _level(levelno: int) -> str:
    if levelno >= logging.CRITICAL:
        return "CRITICAL"
    if levelno >= logging.ERROR:
        return "ERROR"
    if levelno >= logging.WARNING:
        return "WARNING"
    if levelno >= logging.INFO:
        return "INFO"
    return "DEBUG"


_setup_lock = threading.Lock()
_folding: Folding | None = None


def librdkafka_logger() -> logging.Logger:
    """The logger given to confluent-kafka clients: folded, forwarded to loguru (idempotent)."""
    global _folding
    log = logging.getLogger(LOGGER_NAME)
    with _setup_lock:
        if _folding is None:
            _folding = Folding()
            log.addFilter(_folding)
            log.addHandler(_ToLoguru())
            # Every level reaches the filter and loguru, which decide; librdkafka itself only
            # emits debug lines when its ``debug`` setting asks for them.
            log.setLevel(logging.DEBUG)
    return log


def flush() -> None:
    """Log how many lines are still counted as folded (at the end of a run)."""
    folding = _folding
    if folding is None:
        return
    for levelno, text, count in folding.pending():
        _log.log(
            _level(levelno),
            "librdkafka: {} ({} more like it folded in the last {:g} s)",
            text,
            count,
            folding.window,
        )
