"""The one awaited path: ``await execute(...)``, done by the awaiting task itself.

Same contract as a subscription (counting, ``TooManyTasks`` or waiting for room, per-key order,
the cap, admission, timeouts from the start, retries, close), without an Observable or a task
per job: the awaiting task submits, waits for its turn on one future (none if its turn comes at
once), runs an async job inline (``_run.run_async`` in its own task) and takes the outcome from
its task object. Everything on the awaiter's side happens on its loop's thread: the coordinator
hands turns and outcomes over through the loop, so a turn that reaches an awaiter that left is
given back there (``_run.hand``), never lost. Each function takes the coordinator first; the
facade binds them as its methods.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import TYPE_CHECKING, Any

from .._core.futures import running_loop
from ._execution import Execution, remembered
from ._run import NO_TOKEN
from ._table import CANCELLED, DONE, GATED, RUNNING
from ._task import Task

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._facade import TenantTaskCoordinator

__all__: list[str] = []


async def await_job(
    c: TenantTaskCoordinator, execution: Execution[Any], entered: Callable[[], object] | None = None
) -> Any:
    """``await execute(...)``: the whole submission, done by the awaiting task itself.

    Same contract as a subscription (counting, ``TooManyTasks`` or waiting for room,
    per-key order, the cap, admission, timeouts from the start, close), without an
    Observable or a task per job: the awaiting task submits, waits for its turn on one
    future (none if its turn comes at once), runs an async job inline and takes the
    outcome from its task object. A timeout, a close or a dispose cancels the awaiting task
    while the job runs inside it (the awaiter then gets ``TimeoutError`` /
    ``CoordinatorClosed``); cancelling the awaiting task cancels the job, or withdraws it
    if it has not started (a turn that comes meanwhile is given back, never lost).
    ``entered`` is called once the submission is counted (a scheduler unpins its tenant).
    """
    loop = running_loop()
    assert loop is not None  # a coroutine runs on a loop
    is_async = execution.is_async or remembered(execution.job)
    # Inline in this task: an async job whose loop is this one (not a scheduler's other).
    inline = is_async and c._scheduler_loop in (None, loop)
    task = Task(
        c,
        execution.job,
        execution.args,
        execution.key,
        execution.deadline,
        is_async,
        None,
        loop,
        (c._scheduler_loop or loop) if is_async else None,
        None if inline else contextvars.copy_context(),
        c._retry if execution.retry_policy is None else execution.retry_policy,
    )
    wait = c._wait if execution.wait is None else execution.wait
    lock = c._lock
    lock.acquire()  # explicit acquire/release: half a ``with`` block (bench_asyncio's rows)
    try:
        state = c._table.accept(task, wait)
    finally:
        lock.release()
    if entered is not None:
        entered()
    if state < 0:
        raise c._refusal(state)
    task.tel = c._tel.accepted()
    if state is GATED and inline and c._rate is not None and c._rate.try_pass():
        # A rate alone, and its token is there: the job starts now, inline, no ticket
        # (what _turn's fast path does, without the hand-over; bench_rates' overhead row).
        lock.acquire()
        try:
            if not task.settled:
                c._table.admitted(task)
                state = RUNNING
        finally:
            lock.release()
    if state is not RUNNING or not inline:  # not its turn at once (the common case is)
        if state is RUNNING or state is GATED:
            c._turn(task)
        # (_next_turn inlined for the first wait: a coroutine less per queued job,
        # bench_asyncio's rows)
        if not task.turn and not task.ended:
            task.future = future = loop.create_future()
            try:
                await future
            except BaseException:  # cancelled, or closed (GeneratorExit): it leaves
                task.future = None
                leave(c, task)
                raise
            task.future = None
        if task.turn:
            task.turn = False
        else:  # it runs elsewhere, or it ended before its turn (closed): a turn still on
            task.gone = True  # its way to this awaiter is given back when it arrives
            return await task.outcome()
    # Its turn: the async job runs inside this task (inlined, not a coroutine of its own:
    # one frame less per job, bench_asyncio's rows).
    current = asyncio.current_task(loop)
    assert current is not None
    while True:
        await c._run_async(task, None, NO_TOKEN, current)
        # Our cancellation (a timeout, close or dispose) was a means, not the awaiter's
        # wish: take it back, unless the awaiter was cancelled as well, which then wins.
        if task.ours and current.uncancel():
            raise asyncio.CancelledError
        if task.state is DONE or task.settled:  # its outcome is here, or on its way
            return task.result() if task.ended else await task.outcome()
        # It waits for its next attempt (it keeps its key, holds no slot): its turn again.
        if not await next_turn(c, task, loop):
            return await task.outcome()


async def next_turn(c: TenantTaskCoordinator, task: Task, loop: asyncio.AbstractEventLoop) -> bool:
    """Wait until the awaiting task may run its job (True), or its outcome arrived first
    (False: closed, cancelled while waiting for room, or it runs elsewhere)."""
    if not task.turn and not task.ended:
        task.future = future = loop.create_future()
        try:
            await future
        except BaseException:  # cancelled, or closed (GeneratorExit): it leaves
            task.future = None
            leave(c, task)
            raise
        task.future = None
    if task.turn:
        task.turn = False
        return True
    # A turn still on its way to this awaiter is given back when it arrives (_hand).
    task.gone = True
    return False


def leave(c: TenantTaskCoordinator, task: Task) -> None:
    """The awaiting task was cancelled (or its coroutine closed) while it waited.

    The outcome is decided as cancelled; what the task holds goes back: a queued task is
    withdrawn, a permit request too, a turn handed to it (or on its way) is given back.
    """
    task.gone = True
    with c._lock:
        state = task.state
        starts = c._table.settle(task, CANCELLED)
    if starts is not None:
        c._settled(task, state, starts, None)
    if task.turn:  # handed over, never used: give it back
        task.turn = False
        c._end(task, None, None)


# -- order -> admit ------------------------------------------------------------------------
