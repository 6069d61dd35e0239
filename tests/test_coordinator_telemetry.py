"""The coordinator and the scheduler seen through OpenTelemetry, and the caller's context in
every job (issue 24): the real SDK (``support.otel``), real threads and a real loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest
import reactivex
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from reactivex import operators as ops
from reactivex.scheduler import ThreadPoolScheduler
from reactivex.scheduler.eventloop import AsyncIOScheduler
from reactivex.testing import TestScheduler
from support.execution import WAIT, Gate, Outcome
from support.otel import Telemetry

from rxcoord import (
    Retry,
    TenantScheduler,
    TenantTaskCoordinator,
    TooManyTasks,
)
from rxcoord._admission import FairShareGate

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def test_a_known_workload_reads_back_by_name_outcome_and_reason(otel: Telemetry) -> None:
    # 10 jobs: 6 complete, 3 fail, 1 times out (virtual time); then 2 refusals.
    clock = TestScheduler()
    c = TenantTaskCoordinator(
        name="known-workload", scheduler=clock, max_concurrency=2, max_queue_size=8
    )

    def job(index: int) -> Any:
        if index == 9:
            return reactivex.timer(10.0, scheduler=clock)  # runs out of its 1 s
        if index >= 6:
            raise ValueError(f"bad {index}")
        return index

    outcomes = [Outcome() for _ in range(10)]
    for index, outcome in enumerate(outcomes):
        outcome.subscribe_to(c.execute(job, index, timeout=1.0 if index == 9 else None))
    refused = Outcome()
    refused.subscribe_to(c.execute(job, 0))  # 2 running + 8 queued: full
    assert isinstance(refused.error, TooManyTasks)
    clock.advance_to(5.0)
    c.close()
    c.execute(job, 0).subscribe(on_error=lambda _: None)  # closed
    metrics = otel.collect()
    name = {"rxcoord.name": "known-workload"}
    assert metrics.count("rxcoord.job.wait", name) == 10
    assert {
        outcome: metrics.count("rxcoord.job.duration", {**name, "rxcoord.outcome": outcome})
        for outcome in ("completed", "failed", "timed_out", "cancelled")
    } == {"completed": 6, "failed": 3, "timed_out": 1, "cancelled": 0}
    assert metrics.value("rxcoord.jobs.rejected", {**name, "rxcoord.reason": "too_many_tasks"}) == 1
    assert metrics.value("rxcoord.jobs.rejected", {**name, "rxcoord.reason": "closed"}) == 1
    spans = otel.spans("rxcoord.job known-workload")
    assert len(spans) == 10
    assert all(s.kind is SpanKind.INTERNAL for s in spans)
    errors = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert sorted(str((s.attributes or {}).get("rxcoord.outcome")) for s in errors) == [
        "failed",
        "failed",
        "failed",
        "timed_out",
    ]


def test_active_queued_and_waiting_are_read_at_collection(otel: Telemetry) -> None:
    gates = [Gate() for _ in range(4)]
    with TenantTaskCoordinator(
        name="counted", max_concurrency=1, max_queue_size=1, overflow="wait"
    ) as c:
        outcomes = [Outcome() for _ in gates]
        for gate, outcome in zip(gates, outcomes, strict=True):
            outcome.subscribe_to(c.execute(gate))
        assert gates[0].started.wait(WAIT)
        metrics = otel.collect()
        name = {"rxcoord.name": "counted"}
        assert metrics.value("rxcoord.jobs.active", name) == 1
        assert metrics.value("rxcoord.jobs.queued", name) == 1
        assert metrics.value("rxcoord.jobs.waiting", name) == 2
        for gate in gates:
            gate.open()
        assert all(o.done.wait(WAIT) for o in outcomes)
    metrics = otel.collect()
    assert metrics.value("rxcoord.jobs.active", {"rxcoord.name": "counted"}) == 0


def test_the_job_span_is_under_the_submitter_s_span_on_a_worker_thread(otel: Telemetry) -> None:
    tracer = trace.get_tracer("test")

    def job() -> str:
        with tracer.start_as_current_span("user-work"):
            return threading.current_thread().name

    with TenantTaskCoordinator(name="threads") as c:
        with tracer.start_as_current_span("request") as request:
            outcome = Outcome()
            outcome.subscribe_to(c.execute(job))
        assert outcome.done.wait(WAIT)
    assert outcome.values != [threading.current_thread().name]  # it ran on a worker
    (user,) = otel.spans("user-work")
    (span,) = otel.spans("rxcoord.job threads")
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id
    assert user.parent is not None
    assert user.parent.span_id == span.context.span_id


@pytest.mark.parametrize("shape", ["async def", "lambda"])
async def test_the_job_span_on_the_awaited_path(otel: Telemetry, shape: str) -> None:
    tracer = trace.get_tracer("test")

    async def handle() -> asyncio.Task[Any] | None:
        with tracer.start_as_current_span("user-async"):
            await asyncio.sleep(0)
        return asyncio.current_task()

    name = f"awaited-{shape.replace(' ', '-')}"
    async with TenantTaskCoordinator(name=name) as c:
        with tracer.start_as_current_span("handler") as handler:
            for _ in range(2):  # a lambda's second job runs inside the awaiting task too
                job = c.execute(handle) if shape == "async def" else c.execute(lambda: handle())
                await job
            assert trace.get_current_span() is handler  # the caller's span is given back
    users = otel.spans("user-async")
    spans = otel.spans(f"rxcoord.job {name}")
    assert len(spans) == len(users) == 2
    for span, user in zip(spans, users, strict=True):
        assert span.parent is not None
        assert span.parent.span_id == handler.get_span_context().span_id
        assert user.parent is not None
        assert user.parent.span_id == span.context.span_id


def test_a_retried_job_has_one_span_and_a_wait_per_attempt(otel: Telemetry) -> None:
    clock = TestScheduler()
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("blinked")
        return "ok"

    c = TenantTaskCoordinator(
        name="retried", scheduler=clock, retry=Retry(attempts=3, backoff=1.0, jitter=0.0)
    )
    c.execute(flaky).subscribe()
    clock.advance_to(10.0)
    c.close()
    metrics = otel.collect()
    assert metrics.count("rxcoord.job.wait", {"rxcoord.name": "retried"}) == 3
    (span,) = otel.spans("rxcoord.job retried")
    assert [e.name for e in span.events].count("rxcoord.job.retry") == 2
    assert span.status.status_code is not StatusCode.ERROR


async def test_a_scheduler_reports_its_name_and_a_mapped_tenant_label(otel: Telemetry) -> None:
    tiers = {"acme": "gold", "globex": "free"}

    async def job() -> None:
        await asyncio.sleep(0)

    async with TenantScheduler(4, name="tiered-scheduler", metrics_tenant=tiers.__getitem__) as s:
        await s.execute("acme", job)
        await s.execute("globex", job)
        await s.execute("acme", job)
    metrics = otel.collect()
    assert metrics.count("rxcoord.job.wait", {"rxcoord.name": "tiered-scheduler"}) == 3
    assert metrics.count("rxcoord.job.wait", {"rxcoord.tenant": "gold"}) == 2
    assert {a.get("rxcoord.tenant") for a in metrics.attribute_sets("rxcoord.job.wait")} >= {
        "gold",
        "free",
    }
    assert all(
        a.get("rxcoord.tenant") not in ("acme", "globex")
        for a in metrics.attribute_sets("rxcoord.job.wait")
    )


# -- the caller's context in every job ---------------------------------------------------------


def read_id() -> str | None:
    return request_id.get()


def test_a_sync_job_on_a_worker_thread_sees_the_submitter_s_context() -> None:
    with TenantTaskCoordinator() as c:
        token = request_id.set("req-1")
        try:
            assert c.execute(read_id).run() == "req-1"
        finally:
            request_id.reset(token)


def test_a_job_on_a_reactivex_scheduler_sees_the_submitter_s_context() -> None:
    pool = ThreadPoolScheduler(2)
    with TenantTaskCoordinator(scheduler=pool) as c:
        token = request_id.set("req-2")
        try:
            assert c.execute(read_id).pipe(ops.to_list()).run() == ["req-2"]
        finally:
            request_id.reset(token)


async def test_jobs_on_the_loop_see_the_context_of_the_code_that_awaited_them() -> None:
    async def read_async() -> str | None:
        await asyncio.sleep(0)
        return request_id.get()

    async with TenantTaskCoordinator(max_concurrency=2) as c:
        request_id.set("req-3")
        assert await c.execute(read_async) == "req-3"  # inline, in the awaiting task
        assert await c.execute(read_id) == "req-3"  # awaited, on a worker thread
        assert await c.execute(lambda: read_async()) == "req-3"  # a lambda, its first job
        done = asyncio.get_running_loop().create_future()
        request_id.set("req-4")
        c.execute(read_async).subscribe(done.set_result)  # subscribed: a task of its own
        assert await done == "req-4"


def test_sync_jobs_on_an_asyncio_scheduler_see_the_submitter_s_context() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with TenantTaskCoordinator(scheduler=AsyncIOScheduler(loop)) as c:
            token = request_id.set("req-5")
            try:
                assert c.execute(read_id).run() == "req-5"
            finally:
                request_id.reset(token)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        loop.close()


def test_the_context_survives_retries_and_admission_waits() -> None:
    seen: list[str | None] = []

    def flaky() -> str | None:
        seen.append(request_id.get())
        if len(seen) == 1:
            raise ConnectionError("blinked")
        return request_id.get()

    with TenantTaskCoordinator(
        admission=FairShareGate(1).lane(1.0), retry=Retry(attempts=2, backoff=0.01)
    ) as c:
        token = request_id.set("req-6")
        try:
            assert c.execute(flaky).run() == "req-6"
        finally:
            request_id.reset(token)
    assert seen == ["req-6", "req-6"]


def test_what_a_job_sets_does_not_leak_into_the_caller() -> None:
    def sets() -> None:
        request_id.set("inside")

    with TenantTaskCoordinator() as c:
        c.execute(sets).run()
    assert request_id.get() is None


def test_fleet_permit_waits_are_recorded_by_outcome(otel: Telemetry) -> None:
    from rxcoord.leases import MemoryLeases

    gate = Gate()
    with (
        MemoryLeases() as leases,
        TenantTaskCoordinator(name="fleet-waits", fleet=leases, max_concurrency=1) as c,
    ):
        first = Outcome()
        first.subscribe_to(c.execute(gate))
        assert gate.started.wait(WAIT)
        second = Outcome()
        second.subscribe_to(c.execute(lambda: "second"))  # waits for the one permit
        gate.open()
        assert first.done.wait(WAIT)
        assert second.done.wait(WAIT)
    metrics = otel.collect()
    name = {"rxcoord.name": "fleet-waits"}
    assert metrics.count("rxcoord.fleet.permit.wait", {**name, "rxcoord.outcome": "acquired"}) == 2
