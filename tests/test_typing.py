"""The typed call shapes of ``execute``, checked by ``mypy --strict`` (``make lint``).

Each ``assert_type`` below is a claim mypy verifies: the Observable (and the awaited value) of
every way the README writes a job has the job's result type. Each ``# type: ignore[...]`` is a
claim too: the call is wrong, and mypy must say so (``--strict`` warns about an ignore that is
not needed, so a call that stopped being refused fails the check). The test functions also run,
so the shapes are real calls and not just annotations.
"""

from __future__ import annotations

import asyncio
import functools
from typing import assert_type

from rxcoord import Execution, TenantScheduler, TenantTaskCoordinator


async def handle(message: int) -> str:
    await asyncio.sleep(0)
    return str(message)


def compute(a: int, b: str) -> float:
    return float(a) + len(b)


async def test_the_job_shapes_keep_their_result_types() -> None:
    async with TenantTaskCoordinator(max_concurrency=2) as c:
        n = 3
        assert_type(c.execute(handle, n), Execution[str])
        assert_type(c.execute(lambda: handle(n)), Execution[str])
        assert_type(c.execute(functools.partial(handle, n)), Execution[str])
        assert_type(c.execute(compute, 1, "x", key="k"), Execution[float])
        assert_type(await c.execute(handle, n, key=n), str)
        assert_type(await c.execute(compute, 1, "xy"), float)
        # A lambda with a default argument (the loop-variable idiom) is no false alarm.
        assert await c.execute(lambda n=n: handle(n)) == "3"
        assert await c.execute(lambda n=n: n * 2, overflow="wait") == 6
        # An execution is a coroutine: a task of it has the job's result type.
        task = asyncio.create_task(c.execute(handle, n))
        assert_type(task, asyncio.Task[str])
        assert await task == "3"


async def test_a_tenant_scheduler_types_its_jobs_alike() -> None:
    async with TenantScheduler(4) as scheduler:
        assert_type(scheduler.execute("t", handle, 1), Execution[str])
        assert_type(await scheduler.execute("t", compute, 2, "z", key=1), float)


def test_wrong_calls_are_refused_by_the_type_checker_and_at_the_call() -> None:
    import pytest

    with TenantTaskCoordinator() as c:
        with pytest.raises(TypeError, match="cannot be called"):
            c.execute(compute, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cannot be called"):
            c.execute(handle, "one", "two")  # type: ignore[arg-type, call-arg]
        with pytest.raises(ValueError, match="overflow"):
            c.execute(compute, 1, "x", overflow="drop")  # type: ignore[call-arg, call-overload]
