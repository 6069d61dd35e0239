"""Guard -> run: a job runs where its shape says, in its submitter's context, to its real end.

* a sync job on the coordinator's runner (``_runners``: worker threads, a loop, a scheduler),
  in a copy of its submitter's ``contextvars`` context, inside its key guard (``leases=``);
* an async job (or the awaitable a sync job returned, the code then remembered) on its asyncio
  loop: inside the awaiting task, or in a task of its own (``run_async``);
* what else a job returns (an Observable, a ``concurrent.futures.Future``) runs to its end
  through the shared job-shape runner (``rxcoord._core.jobs``, as ``Work``).

Stopping a job (a dispose, a timeout, a close): an async job is cancelled on its loop inside
the asyncio task it runs in (``task.ours`` tells that cancellation from the awaiter's own); a
sync job's thread cannot be stopped, so it keeps its slot until it returns. Each function takes
the coordinator first; the facade binds them as its methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Final

from reactivex import abc

from .._core.futures import running_loop
from .._core.workers import hand_off
from ._execution import forget, remember, remembered
from ._runners import spawn
from ._task import Task, Work

if TYPE_CHECKING:
    from ._facade import TenantTaskCoordinator

__all__: list[str] = []

NO_TOKEN: Final = object()  # a job that entered no key guard
NO_LOOP: Final = (
    "an async job (or a job that returns an awaitable) needs a running asyncio loop: "
    "subscribe from asyncio code (e.g. `await coordinator.execute(job)`) or pass "
    "scheduler=AsyncIOScheduler(loop)"
)
# Exact types of values that are a job's result as they are (not work to run to its end).
_PLAIN: Final = frozenset({type(None), bool, int, float, str, bytes, tuple, list, dict})


def go(c: TenantTaskCoordinator, task: Task) -> None:
    """``task`` may run now: in its awaiting task, on its loop, or on the runner."""
    job = task.job
    if not task.is_async and job is not None and remembered(job):
        # Its code returned an awaitable since it was submitted: the loop, no thread hop.
        loop = c._scheduler_loop or task.loop
        if loop is not None:
            task.is_async = True
            task.job_loop = loop
    if task.observer is None and task.is_async and task.job_loop is task.loop:
        loop = task.loop
        assert loop is not None
        if running_loop() is loop:
            hand(c, task)
        else:
            try:
                loop.call_soon_threadsafe(hand, c, task)
            except RuntimeError:  # the awaiter's loop is closed: nobody will take the turn
                c._cancel(task)
                c._end(task, None, None)
        return
    try:
        if task.is_async:
            spawn_job(c, task, None, NO_TOKEN)
        else:
            if task.timeout is not None:
                c._arm_timeout(task)
            c._runner.run(task.run_sync)
    except Exception as exc:  # the scheduler or the loop itself failed: tell the caller
        c._log.opt(exception=True).error("could not start a job on {!r}", c._name)
        c._end(task, None, exc)


def hand(c: TenantTaskCoordinator, task: Task) -> None:
    """On the awaiter's loop: its turn (or one it left behind, given back)."""
    if task.gone:
        c._end(task, None, None)
        return
    task.turn = True
    task.wake()


def spawn_job(c: TenantTaskCoordinator, task: Task, awaitable: Any, token: Any) -> None:
    """Run async work in a task of its own on the job's loop."""
    loop = task.job_loop
    assert loop is not None
    spawn(loop, lambda: c._run_async(task, awaitable, token, None), task.context)


async def run_async(
    c: TenantTaskCoordinator,
    task: Task,
    awaitable: Any,
    token: Any,
    current: asyncio.Task[Any] | None,
) -> None:
    """Run an async job (or ``awaitable``, which a sync job returned) to its end, in the
    current asyncio task; then end the task.

    ``current`` is the awaiting task when the job runs inline, None in a task of its own.
    A timeout, close or dispose cancels the asyncio task while the job runs in it
    (``task.ours``); any other cancellation (the awaiter's own) cancels the job too.
    """
    if current is None:
        current = asyncio.current_task()
        assert current is not None
    if awaitable is None and task.timeout is not None:  # (a sync job's was armed at its go)
        c._arm_timeout(task)
    task.begun = True  # then look: see _settled
    if task.settled:  # cancelled, timed out or closed between its turn and now
        _discard(awaitable)
        end_guarded(c, task, None, None, token)
        return
    task.ours = False  # (an earlier attempt's, taken back by its awaiter)
    if (
        awaitable is None  # (a sync job that returned an awaitable started already)
        and task.attempt == 1
        and (task.retry is not None or c._stall_after is not None)
    ):
        c._first_start(task)
    guard = c._guard
    permit = task.permit
    entered: object = None
    value: Any = None
    error: BaseException | None = None
    task.inside = current
    tel = task.tel
    scope = None
    if tel is not None:  # its span opens around the job, in this task's context
        tel.started()
        scope = tel.scope()
        scope.__enter__()
    try:
        if token is NO_TOKEN and guard is not None and task.key is not None:
            token = await guard.enter_async(task.key)
        if awaitable is None:
            job = task.job
            assert job is not None
            if permit is not None:
                entered = permit.enter()
            value = job(*task.args)
            if type(value) is CoroutineType:  # (the common case, before the ABC checks)
                value = await value
            elif isinstance(value, abc.ObservableBase) or not inspect.isawaitable(value):
                # A remembered code returned something else: worker threads again.
                forget(job)
                if isinstance(value, abc.ObservableBase) or _is_concurrent_future(value):
                    task.inside = None
                    returned(c, task, value, token)  # runs to its end from there
                    return
            else:
                value = await value
        else:
            value = await awaitable
    except asyncio.CancelledError as exc:
        if not task.ours:  # not ours: the awaiting task itself was cancelled, so is the job
            task.inside = None
            c._cancel(task)
            if token is not NO_TOKEN:
                assert guard is not None
                with contextlib.suppress(Exception):
                    await guard.exit_async(token)
            c._end(task, None, None)
            raise
        value, error = None, exc
    except BaseException as exc:
        value, error = None, exc
    finally:
        task.inside = None
        if entered is not None:
            assert permit is not None
            permit.exit(entered)
        if scope is not None:
            scope.__exit__(None, None, None)
    if token is not NO_TOKEN:
        assert guard is not None
        try:
            await guard.exit_async(token)  # LeaseLost if exclusion was lost meanwhile
        except Exception as exc:
            if error is None:
                value, error = None, exc
    c._end(task, value, error)


def run_sync(c: TenantTaskCoordinator, task: Task) -> None:
    """Run a sync job on the runner's thread: guard, call, and what it returned."""
    task.begun = True  # then look: see _settled
    if task.settled:  # cancelled (or closed) between its hand-off and now
        c._end(task, None, None)
        return
    if task.attempt == 1 and (task.retry is not None or c._stall_after is not None):
        c._first_start(task)
    guard = c._guard
    token: Any = NO_TOKEN
    try:
        if guard is not None and task.key is not None:
            # Keyed: enter the key guard too (blocking here is fine: this thread is the
            # job's), so the key is exclusive beyond this coordinator as well.
            token = guard.enter(task.key)
        context = task.context
        assert context is not None
        if task.tel is not None:
            task.tel.started(context)  # its span opens in the job's context, around it
        result = context.run(call, task)
    except BaseException as exc:  # the job's error goes to its subscriber
        end_guarded(c, task, None, exc, token)
        return
    returned(c, task, result, token)


def call(task: Task) -> Any:
    """The job's call (in its context), with its permit entered around it."""
    job = task.job
    assert job is not None
    permit = task.permit
    if permit is None:
        return job(*task.args)
    entered = permit.enter()
    try:
        return job(*task.args)
    finally:
        permit.exit(entered)


def returned(c: TenantTaskCoordinator, task: Task, result: Any, token: Any) -> None:
    """What a job returned: its value, or work to run to its end (``rxcoord._core.jobs``).

    An Observable (itself awaitable, but a stream) or a future runs to its end; another
    awaitable (``lambda: handle(m)`` is an async job in disguise) is awaited on the loop,
    and the job's code remembered so that its later jobs start there at once.
    """
    if type(result) in _PLAIN:
        end_guarded(c, task, result, None, token)
    elif isinstance(result, abc.ObservableBase) or _is_concurrent_future(result):
        work = Work(c, task, token)
        with c._lock:
            cancelled = task.settled
            if not cancelled:
                task.work = work
        if cancelled:
            work.done = True
            _cancel_concurrent(result)
            end_guarded(c, task, None, None, token)
            return
        # A future's done-callback ends the task: say so before it can run (or be cancelled).
        work.pending = _is_concurrent_future(result)
        try:
            work.start(result)
        except Exception as exc:
            if work._release():
                end_guarded(c, task, None, exc, token)
    elif inspect.isawaitable(result):
        job = task.job
        assert job is not None
        remember(job)
        loop = c._scheduler_loop or task.loop
        if loop is None:
            _discard(result)
            end_guarded(c, task, None, RuntimeError(NO_LOOP), token)
            return
        if task.settled:  # cancelled (or timed out) while the sync part ran
            _discard(result)
            end_guarded(c, task, None, None, token)
            return
        task.job_loop = loop
        try:
            spawn(loop, lambda: c._run_async(task, result, token, None), task.context)
        except Exception as exc:  # the loop was closed meanwhile: tell the caller
            _discard(result)
            end_guarded(c, task, None, exc, token)
    else:
        end_guarded(c, task, result, None, token)


def work_ended(
    c: TenantTaskCoordinator, work: Work, value: Any, error: BaseException | None
) -> None:
    """An Observable or future a job returned has ended (or was stopped)."""
    task = work.task
    task.work = None
    if work.token is NO_TOKEN:
        c._end(task, value, error)
    else:  # leaving the key guard is a round trip: never on the thread that ended the work
        hand_off(lambda: end_guarded(c, task, value, error, work.token), "a key guard")


def end_guarded(
    c: TenantTaskCoordinator, task: Task, value: Any, error: BaseException | None, token: Any
) -> None:
    """``_end``, after leaving the key guard (blocking) if the job entered it."""
    if token is not NO_TOKEN:
        assert c._guard is not None
        try:
            c._guard.exit(token)  # LeaseLost if it expired: the work may overlap another's
        except Exception as exc:
            if error is None:
                value, error = None, exc
            else:
                c._log.opt(exception=True).warning("leaving the key guard failed")
    c._end(task, value, error)


# -- end -> deliver --------------------------------------------------------------------------


def stop(c: TenantTaskCoordinator, task: Task) -> None:
    """Stop a running job's work: an async job is cancelled on its loop, an Observable
    disposed, a future cancelled; a sync job's thread cannot be stopped."""
    timer = task.timer
    if timer is not None:
        task.timer = None
        timer()
    work = task.work
    if work is not None:
        work.cancel()
    loop = task.job_loop
    if loop is not None:
        if running_loop() is loop:
            cancel_inside(task)
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: the job cannot run any more
                loop.call_soon_threadsafe(cancel_inside, task)


def cancel_inside(task: Task) -> None:
    """On the job's loop: cancel the asyncio task the job runs in, if it runs now."""
    inside = task.inside
    if inside is not None:
        task.inside = None
        task.ours = True
        inside.cancel()


def _discard(awaitable: Any) -> None:
    if inspect.iscoroutine(awaitable):
        awaitable.close()  # never awaited: say so, not with a RuntimeWarning


def _is_concurrent_future(value: Any) -> bool:
    import concurrent.futures

    return isinstance(value, concurrent.futures.Future)


def _cancel_concurrent(value: Any) -> None:
    if _is_concurrent_future(value):
        value.cancel()
