"""One execution contract, run over every implementation of it.

``TenantTaskCoordinator`` and each tenant of a ``TenantScheduler`` promise the same things about
``execute`` (see the README: a cold Observable, one outcome per subscription, the limits and
``TooManyTasks``, cancellation, timeouts, keyed order, close). The tests in this folder state
those promises once; the ``make_executor`` fixture runs each of them against every
implementation, with readable ids (``coordinator``, ``scheduler-tenant``), like the lease contract
runs over every backend. A behaviour only one implementation has (the scheduler's fairness and
eviction, the coordinator's ``leases=`` and custom schedulers) is tested in its own file.

The scheduler is seen through one tenant: its global limit is made too large to matter, so the
tenant's limits are the ones under test. Its cumulative counters (``stats()``) are the
scheduler's totals, which with one tenant are that tenant's and survive the eviction of an idle
tenant (the default ``idle_timeout=0`` evicts it whenever its work in progress drops to zero);
its live counts (``running``, ``queued``, ``work_in_progress``) are the tenant's own snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reactivex import abc

from .executors import IMPLEMENTATIONS, Executor, MakeExecutor, build


@pytest.fixture(params=IMPLEMENTATIONS)
def make_executor(request: pytest.FixtureRequest) -> Iterator[MakeExecutor]:
    """Builds executors of one implementation; closes them all after the test."""
    built: list[Executor] = []

    def make(
        *,
        max_concurrency: int = 2,
        max_queue_size: int = 3,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
        name: str = "test",
    ) -> Executor:
        executor = build(
            request.param,
            max_concurrency=max_concurrency,
            max_queue_size=max_queue_size,
            timeout=timeout,
            scheduler=scheduler,
            name=name,
        )
        built.append(executor)
        return executor

    yield make
    for executor in built:
        executor.close()


@pytest.fixture
def executor(make_executor: MakeExecutor) -> Executor:
    """``max_concurrency=2, max_queue_size=3``, named ``test``."""
    return make_executor()
