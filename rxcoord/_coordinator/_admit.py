"""Order -> admit: a task whose turn came asks its admission for a permit, then runs.

An :class:`~rxcoord.Admission` (a tenant scheduler's fair-share gate, a fleet, a rate) grants a
ticket from any thread; the ticket is a one-shot grant that may be cancelled
(``rxcoord._core.waiter``), so a permit granted to a task that left goes straight back. A rate
alone lets most jobs pass without a ticket (``RateAdmission.try_pass``). A permit with a life of
its own (:class:`~rxcoord.Permit`) is kept on the task, entered around the job and checked at
its end. Each function takes the coordinator first; the facade binds them as its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._admission import AdmissionTicket, Permit
from .._core.waiter import GRANTED, PENDING
from ._table import GATED
from ._task import Task

if TYPE_CHECKING:
    from ._facade import TenantTaskCoordinator

__all__: list[str] = []


def turn(c: TenantTaskCoordinator, task: Task) -> None:
    """``task``'s turn came (it holds its key and a slot): admit it, then run it."""
    if task.state is GATED:
        rate = c._rate
        if rate is not None and rate.try_pass():  # its token is there: no ticket needed
            with c._lock:
                passed = not task.settled
                if passed:
                    c._table.admitted(task)
            if not passed:  # cancelled meanwhile: it leaves (its token is spent)
                c._end(task, None, None)
                return
            c._go(task)
            return
        ask(c, task)
    else:
        c._go(task)


def ask(c: TenantTaskCoordinator, task: Task) -> None:
    """Ask the admission for a permit; the task runs once granted (``_admitted``)."""
    admission = c._admission
    assert admission is not None
    ticket = AdmissionTicket(admission.release, task.key)
    task.ticket = ticket
    ticket._waiter.bind(lambda: admitted(c, task))
    admission.request(ticket)  # counted as queued until the permit comes
    # A cancel before the ticket existed could not withdraw it: take it back now, or it
    # would wait for a permit nobody wants.
    with c._lock:
        stranded = task.settled and task.state is GATED
    if stranded:
        c._withdraw(task)


def admitted(c: TenantTaskCoordinator, task: Task) -> None:
    """The admission granted (or refused) the ticket, on the granting thread."""
    ticket = task.ticket
    assert ticket is not None
    if ticket._waiter.take() is None:
        return  # the task left first: the ticket gave the permit back, _withdraw ended it
    with c._lock:
        left = task.settled  # settled after the take: _withdraw found it taken
        if not left:
            c._table.admitted(task)
    if left:
        c._end(task, None, None)
        return
    if ticket.error is not None:  # refused (its store is down): the job fails unrun
        task.ticket = None
        c._end(task, None, ticket.error)
        return
    permit = ticket.permit
    if isinstance(permit, Permit):
        task.permit = permit
    c._go(task)


def withdraw(c: TenantTaskCoordinator, task: Task) -> None:
    """Take a settled ``GATED`` task back from the admission, if it holds no permit yet.

    The ticket decides: exactly one of this and ``_admitted`` ends the task, and a permit
    granted to it meanwhile goes back to the admission.
    """
    ticket = task.ticket
    if ticket is None:
        return  # not at the admission yet: _ask's stranded check comes after
    state = ticket._waiter.cancel()
    if state is PENDING:
        assert c._admission is not None
        c._admission.withdraw(ticket)  # False: a grant is in flight, it will go back
    elif state is not GRANTED:
        return  # taken (_admitted ends it) or withdrawn before
    task.ticket = None
    c._end(task, None, None)


# -- guard -> run --------------------------------------------------------------------------
