"""Resolving asyncio futures with the outcome of work that ran elsewhere."""

from __future__ import annotations

import asyncio
from typing import Any

from reactivex import abc
from reactivex.internal.exceptions import SequenceContainsNoElementsError

__all__ = ["FutureObserver", "set_exception"]


def set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    """``future.set_exception(error)``, for any exception a job can raise.

    asyncio refuses ``StopIteration`` (it would end the awaiting generator instead of raising),
    and the ``TypeError`` it raises instead, inside a loop callback, would leave the awaiter
    waiting forever. It arrives as a ``RuntimeError`` caused by it, as from a coroutine that
    raised ``StopIteration``.
    """
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"the job raised {error!r}")
        wrapped.__cause__ = error
        error = wrapped
    future.set_exception(error)


class FutureObserver(abc.ObserverBase[Any]):
    """Resolves an asyncio future with an Observable's last value, or its error.

    What ``await observable`` does in reactivex (``to_future``), for notifications that arrive on
    the future's loop; a ``StopIteration`` error is passed on as :func:`set_exception` does, and
    notifications after the future is done (cancelled) are dropped.
    """

    __slots__ = ("_future", "_has_value", "_value")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self._future = future
        self._value: Any = None
        self._has_value = False

    def on_next(self, value: Any) -> None:
        self._value = value
        self._has_value = True

    def on_error(self, error: Exception) -> None:
        if not self._future.done():
            set_exception(self._future, error)

    def on_completed(self) -> None:
        if self._future.done():
            return
        if self._has_value:
            self._future.set_result(self._value)
        else:
            self._future.set_exception(SequenceContainsNoElementsError())
