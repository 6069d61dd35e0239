"""Optional database drivers, imported when a backend is first constructed."""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

from loguru import logger

__all__ = ["require", "route_driver_logs"]

_routed: set[str] = set()
_routed_lock = threading.Lock()


class _ToLoguru(logging.Handler):
    """Forwards a driver's standard-library log records to loguru, under ``rxcoord``.

    psycopg-pool logs every failed connection attempt (``error connecting in 'pool'``) and
    redis-py a few events through :mod:`logging`; with no handler configured anywhere, Python
    prints warnings through its last-resort handler on stderr. A handler here (records still
    propagate to the application's own handlers, if it has any) sends them to loguru from this
    module, so they are silent until ``logger.enable("rxcoord")``, like all of rxcoord's logs.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        try:
            message = record.getMessage()
        except Exception:  # a driver's malformed format string must not break the caller
            message = str(record.msg)
        logger.log(level, "{}: {}", record.name, message)


def route_driver_logs(name: str) -> None:
    """Send the standard-library logger ``name`` (and its children) to loguru; idempotent."""
    with _routed_lock:
        if name in _routed:
            return
        _routed.add(name)
    logging.getLogger(name).addHandler(_ToLoguru())


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or explain which extra installs it.

    Raises:
        ImportError: The driver is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {extra} lease backend needs {module!r}; install it with: "
            f"pip install 'rxcoord[{extra}]'"
        ) from exc
