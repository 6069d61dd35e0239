"""``is_work``: which job results the one job-shape runner runs to their end."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest
import reactivex

from rxcoord._core.jobs import is_work


class _Awaitable:
    def __await__(self) -> Any:
        yield from ()


async def _coroutine() -> None:
    return None


@pytest.mark.parametrize("value", [None, 0, "done", b"", (), [], {}, object(), _coroutine])
def test_a_plain_value_is_not_work(value: object) -> None:
    assert not is_work(value)


def test_observables_awaitables_and_futures_are_work() -> None:
    coroutine = _coroutine()
    try:
        assert is_work(coroutine)
    finally:
        coroutine.close()
    assert is_work(reactivex.of(1))
    assert is_work(concurrent.futures.Future())
    assert is_work(_Awaitable())
    loop = asyncio.new_event_loop()
    try:
        assert is_work(loop.create_future())
    finally:
        loop.close()
