"""The implementations of the execution contract, built and seen through one API.

``build(kind, ...)`` makes a ``TenantTaskCoordinator`` or a ``TenantScheduler`` seen through one
tenant; ``Executor`` is the adapter the contract tests talk to (``execute(job, key=, timeout=)``,
``stats()``, live counts, ``state``, ``close()``, and ``target``: the object itself).

The kinds cover every path a job can take: the plain coordinator (the job passed as it is),
the coordinator with each job written as ``lambda: job()`` (the README's shape: a sync callable
that may return an awaitable, so the code cache and the loop hand-back are on the path), the
coordinator behind an admission (a fair-share gate too large to matter: every job is gated,
asks for a permit and gives it back), and a scheduler's tenant. The tests themselves subscribe,
await and ``.run()``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

from reactivex import abc

from rxcoord import (
    CoordinatorState,
    CoordinatorStats,
    Execution,
    SchedulerStats,
    TenantScheduler,
    TenantTaskCoordinator,
)
from rxcoord._admission import FairShareGate

IMPLEMENTATIONS = ("coordinator", "coordinator-lambda", "coordinator-admission", "scheduler-tenant")
GLOBAL_LIMIT = 64  # the scheduler's global limit: never the bottleneck in the contract tests


class Executor:
    """One implementation of the contract, seen through the coordinator's API."""

    def __init__(self, kind: str, target: TenantTaskCoordinator | TenantScheduler, name: str):
        self.kind = kind
        self.target = target  # the object itself: a context manager and a Disposable
        self.name = name  # the coordinator's name, or the tenant's: it names errors and logs

    def execute(
        self,
        job: Callable[..., Any],  # "...": lambdas with default arguments (i=i) are jobs too
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Execution[Any]:
        if isinstance(self.target, TenantScheduler):
            return self.target.execute(self.name, job, key=key, timeout=timeout)
        if self.kind == "coordinator-lambda" and callable(job):
            return self.target.execute(lambda: job(), key=key, timeout=timeout)
        return self.target.execute(job, key=key, timeout=timeout)

    def stats(self) -> CoordinatorStats | SchedulerStats:
        """The counters: the coordinator's, or the scheduler's totals (one tenant).

        The totals keep an evicted tenant's counts; read a live count (``running``, ``queued``,
        ``work_in_progress``) from :meth:`live` instead: it is one consistent snapshot.
        """
        return self.target.stats()

    def live(self) -> CoordinatorStats:
        """A consistent snapshot of the coordinator, or of the tenant (zeros once evicted)."""
        if isinstance(self.target, TenantScheduler):
            snapshot = self.target.stats(self.name)
            assert isinstance(snapshot, CoordinatorStats)
            return snapshot
        return self.target.stats()

    @property
    def running(self) -> int:
        return self.live().running

    @property
    def queued(self) -> int:
        return self.live().queued

    @property
    def work_in_progress(self) -> int:
        return self.live().work_in_progress

    @property
    def state(self) -> CoordinatorState:
        return self.target.state

    def close(self, wait: bool = True) -> None:
        self.target.close(wait=wait)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Executor {self.kind} {self.target!r}>"


class MakeExecutor(Protocol):
    def __call__(
        self,
        *,
        max_concurrency: int = 2,
        max_queue_size: int = 3,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
        name: str = "test",
    ) -> Executor: ...


def build(
    kind: str,
    *,
    max_concurrency: int = 2,
    max_queue_size: int = 3,
    timeout: float | None = None,
    scheduler: abc.SchedulerBase | None = None,
    name: str = "test",
) -> Executor:
    """A coordinator, or a scheduler seen through its tenant ``name``, with these limits."""
    if kind.startswith("coordinator"):
        coordinator = TenantTaskCoordinator(
            max_concurrency=max_concurrency,
            max_queue_size=max_queue_size,
            timeout=timeout,
            scheduler=scheduler,
            name=name,
            admission=(
                FairShareGate(GLOBAL_LIMIT).lane(1.0) if kind == "coordinator-admission" else None
            ),
        )
        return Executor(kind, coordinator, name)
    assert kind == "scheduler-tenant", kind
    tenants = TenantScheduler(
        max_concurrency=GLOBAL_LIMIT,
        tenant_max_concurrency=max_concurrency,
        tenant_max_queue_size=max_queue_size,
        timeout=timeout,
        scheduler=scheduler,
        name=name,
    )
    return Executor(kind, tenants, name)
