"""An admission the test grants by hand: it stands for any policy behind the Admission seam (a
gate shared by tenants, a fleet lane, the admission behind a rate)."""

from __future__ import annotations

import threading

from rxcoord import AdmissionTicket

__all__ = ["ManualAdmission"]


class ManualAdmission:
    """Queues tickets; the test grants them. Records every withdrawal and release."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[AdmissionTicket] = []
        self.withdrawn: list[AdmissionTicket] = []
        self.released: list[object] = []
        self.out = 0  # permits granted and not released yet

    def request(self, ticket: AdmissionTicket) -> None:
        with self.lock:
            self.waiting.append(ticket)

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        with self.lock:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                self.withdrawn.append(ticket)
                return True
            return False

    def release(self, permit: object) -> None:
        with self.lock:
            self.released.append(permit)
            self.out -= 1

    def grant_next(self, permit: object) -> bool | None:
        """Grant the oldest waiting ticket; None if none waits (it was withdrawn first)."""
        with self.lock:
            if not self.waiting:
                return None
            ticket = self.waiting.pop(0)
            self.out += 1
        return ticket.grant(permit)

    def grant_all(self, permit: object = "p") -> None:
        """Grant every waiting ticket at once."""
        with self.lock:
            tickets, self.waiting = self.waiting, []
            self.out += len(tickets)
        for ticket in tickets:
            ticket.grant(permit)
