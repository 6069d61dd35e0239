"""An attempt's time: its timeout, the retry after a failure, and the stall watch.

A timeout counts from an attempt's start. With a retry policy (``rxcoord._core.retry``), a job
that fails with a retried exception (a timed-out attempt included, when ``TimeoutError`` is in
``on``) gives its slot and permit back but keeps its key (``TaskTable.suspend``), waits on the
coordinator's clock (virtual with a virtual scheduler) and queues for a slot again
(``TaskTable.resume``). A job in progress longer than ``stall_after`` (attempts and waits
together) is reported once. Each function takes the coordinator first; the facade binds them as
its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core.workers import hand_off
from ._table import DONE, RETRYING, RUNNING, TIMED_OUT
from ._task import Task

if TYPE_CHECKING:
    from ._facade import TenantTaskCoordinator

__all__: list[str] = []


def retried(c: TenantTaskCoordinator, task: Task, error: BaseException) -> bool:
    """Decide another attempt after ``error``: if there is one, the task gives its slot and
    permit back but keeps its key, and queues again once its wait is over."""
    policy = task.retry
    assert policy is not None
    wait = policy.next_wait(error, task.attempt, elapsed(c, task))
    if wait is None:
        return False
    with c._lock:
        if task.settled or task.state is not RUNNING:
            return False  # cancelled, or closed, meanwhile: it ends
        starts = c._table.suspend(task)
    timer = task.timer
    if timer is not None:  # this attempt's timeout
        task.timer = None
        timer()
    task.begun = False
    task.inside = None
    task.work = None
    task.permit = None
    ticket = task.ticket
    if ticket is not None:  # no permit is held while it waits
        task.ticket = None
        ticket._give_back()
    c._log.warning(
        "job of key {!r} on {!r}: attempt {} of {} failed ({!r}), retrying in {:.3f} s",
        task.key,
        c._name,
        task.attempt,
        policy.attempts,
        error,
        wait,
    )
    task.attempt += 1
    if task.tel is not None:
        task.tel.retrying(error)
    cancel = c._clock.call_later(wait, lambda: resume(c, task))
    with c._lock:
        state: int = task.state  # (suspended above; cancelled or closed since, maybe)
        armed = state is RETRYING and task.timer is None
        if armed:
            task.timer = cancel
    if not armed:
        cancel()  # cancelled (or closed) meanwhile: no next attempt
    for started in starts:
        c._turn(started)
    return True


def resume(c: TenantTaskCoordinator, task: Task) -> None:
    """A retrying task's wait is over: it queues for a slot again (ahead of its key)."""
    with c._lock:
        if task.state is not RETRYING:
            return  # cancelled or closed while it waited
        task.timer = None
        turn = c._table.resume(task)
    if turn:
        c._turn(task)


def first_start(c: TenantTaskCoordinator, task: Task) -> None:
    """A job's first attempt starts: the clock of its deadline and its stall watch."""
    task.first_start = c._clock.now()
    stall_after = c._stall_after
    if stall_after is not None:
        task.stall = c._clock.call_later(stall_after, lambda: stalled(c, task))


def stalled(c: TenantTaskCoordinator, task: Task) -> None:
    """A job has been in progress for ``stall_after`` seconds (on the timer's thread)."""
    if task.state is DONE:
        return
    seconds = elapsed(c, task)
    c._log.warning(
        "job of key {!r} on {!r} stalled: in progress for {:.3f} s (attempt {})",
        task.key,
        c._name,
        seconds,
        task.attempt,
    )
    on_stall = c._on_stall
    if on_stall is not None:
        hand_off(lambda: on_stall(task.key, seconds), "on_stall")


def elapsed(c: TenantTaskCoordinator, task: Task) -> float:
    """Seconds since the task's first attempt started (0 if it has not)."""
    first = task.first_start
    return 0.0 if first is None else c._clock.now() - first


def timeout_error(c: TenantTaskCoordinator, task: Task) -> TimeoutError:
    return TimeoutError(f"job timed out after {task.timeout} s on coordinator {c._name!r}")


def arm_timeout(c: TenantTaskCoordinator, task: Task) -> None:
    timeout = task.timeout
    assert timeout is not None
    cancel = c._clock.call_later(timeout, lambda: time_out(c, task))
    with c._lock:
        if task.state is RUNNING and task.timer is None and not task.settled:
            task.timer = cancel
            return
    cancel()  # the job finished (or was cancelled) before the timer was armed


def time_out(c: TenantTaskCoordinator, task: Task) -> None:
    error = c._timeout_error(task)
    policy = task.retry
    retry = policy is not None and (
        policy.next_wait(error, task.attempt, elapsed(c, task)) is not None
    )
    with c._lock:
        if task.settled or task.state is not RUNNING:
            return
        task.timer = None
        if retry:  # stop this attempt; its end retries it (see _end)
            task.expired = True
        else:
            c._table.settle(task, TIMED_OUT)
    c._log.info(
        "a job on {!r} timed out after {} s (attempt {})",
        c._name,
        task.timeout,
        task.attempt,
    )
    c._stop(task)
    if retry:
        return
    if c._virtual is not None or task.loop is not None:
        c._deliver(task, None, error)  # virtual time, or hopping onto the caller's loop
    else:
        # This runs on the process-wide timer thread: subscriber code there would delay
        # every other timeout, lease renewal and eviction (or kill the thread). Hand off.
        hand_off(lambda: c._deliver_now(task, None, error))


# -- close ---------------------------------------------------------------------------------
