"""Resolving asyncio futures with the outcome of work that ran elsewhere."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["set_exception"]


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
