"""rxcoord._core.telemetry against the real OpenTelemetry SDK (and without it, in subprocesses).

The coordinator's and the Kafka consumer's own tests drive these handles through their
layers; here each handle is checked on its own: names, units and attributes as exported, span
parentage across a worker thread and within an awaiting task, a Kafka record's span under
its producer's ``traceparent``, bounded labels, and nothing at all without an SDK or the API.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from support.otel import Telemetry

from rxcoord._core import telemetry

ROOT = Path(__file__).resolve().parent.parent


def bench_otel() -> ModuleType:
    """benchmarks/bench_otel.py, which owns the meta-path blocker of opentelemetry."""
    spec = importlib.util.spec_from_file_location("bench_otel", ROOT / "benchmarks/bench_otel.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- without an SDK, without the API -------------------------------------------------------------

WITHOUT_SDK = """
import json
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from rxcoord._core import telemetry
from rxcoord.leases import MemoryLeases

out = {"metrics_on": telemetry.metrics_on(), "traces_on": telemetry.traces_on()}
jobs = telemetry.coordinator("early")
out["accepted"] = jobs.accepted() is not None
leases = MemoryLeases()                     # made before the application sets its SDK
leases.acquire("a").release()
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
out["before"] = [m.name for rm in reader.get_metrics_data().resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics]
out["metrics_on_after"] = telemetry.metrics_on()
out["traces_on_after"] = telemetry.traces_on()
leases.acquire("b").release()               # instruments made through the proxy now record
job = jobs.accepted()
job.started()
job.ended("completed")
out["after"] = sorted(m.name for rm in reader.get_metrics_data().resource_metrics
                      for sm in rm.scope_metrics for m in sm.metrics)
print(json.dumps(out))
"""


def test_nothing_is_recorded_until_the_application_sets_a_provider() -> None:
    out = json.loads(run_python(WITHOUT_SDK))
    assert out["metrics_on"] is False
    assert out["traces_on"] is False
    assert out["accepted"] is False  # no Job object at all: the hot path took one branch
    # The lease acquired before the SDK left nothing behind (held is read live: 0 now).
    assert out["before"] == ["rxcoord.leases.held"]
    assert out["metrics_on_after"] is True
    assert out["traces_on_after"] is False
    # Instruments created through the proxy before the SDK was set record after it.
    assert out["after"] == [
        "rxcoord.job.duration",
        "rxcoord.job.wait",
        "rxcoord.lease.wait",
        "rxcoord.leases.held",
    ]


WITHOUT_API = """
import asyncio, contextvars
from rxcoord import KeyedLocks
from rxcoord._core import telemetry
from rxcoord.leases import MemoryLeases
assert not telemetry.AVAILABLE
assert not telemetry.metrics_on() and not telemetry.traces_on()
assert telemetry.coordinator("x").accepted() is None
assert telemetry.inject_headers() == []
rid = contextvars.ContextVar("rid", default=None)
rid.set("r1")
record = telemetry.kafka("c", "g").record_span(
    contextvars.copy_context(), topic="t", partition=0, offset=1, headers=None
)
assert record.span is None and record.context.run(rid.get) == "r1"
record.ended("completed")
with MemoryLeases() as leases:
    lease = leases.acquire("a")
    assert leases.try_acquire("a") is None
    lease.release()
    assert leases.run("b", rid.get).run() == "r1"
assert KeyedLocks().run("k", rid.get).run() == "r1"
print("ok")
"""


def test_everything_works_without_the_api_installed() -> None:
    assert run_python(bench_otel().BLOCK_OPENTELEMETRY + WITHOUT_API).strip() == "ok"


# -- the instruments as exported ----------------------------------------------------------------


class Owner:
    """Something whose counts are observed (held weakly by telemetry)."""

    def __init__(self, counts: tuple[int, int, int]) -> None:
        self.counts = counts


def test_every_instrument_is_exported_with_its_name_and_unit(otel: Telemetry) -> None:
    jobs = telemetry.coordinator("units")
    owner = Owner((1, 2, 3))
    jobs.observe(owner, lambda o: o.counts)
    job = jobs.accepted()
    assert job is not None
    job.started()
    job.ended("completed")
    jobs.rejected("too_many_tasks")
    leases = telemetry.leases("units-backend")
    leases.waited(leases.begin(), "acquired")
    leases.lost()
    leases.observe_held(owner, lambda o: 1)
    permits = telemetry.fleet("units")
    permits.waited(permits.begin(), "acquired")
    kafka = telemetry.kafka("units", "g")
    kafka.record("t", "completed")
    kafka.commit_waited(0.01)
    kafka.observe(owner, lambda o: [("t", 0, 5, 2, True)])
    metrics = otel.collect()
    expected = {name: unit for name, _, unit, _ in telemetry.INSTRUMENTS}
    assert len(expected) == 15
    assert {name: metrics.units[name] for name in expected} == expected
    assert metrics.value("rxcoord.jobs.queued", {"rxcoord.name": "units"}) == 2
    assert metrics.value("rxcoord.kafka.lag", {"messaging.destination.partition.id": "0"}) == 5
    assert metrics.value("rxcoord.kafka.paused", {"messaging.destination.name": "t"}) == 1


def test_observed_owners_are_held_weakly(otel: Telemetry) -> None:
    jobs = telemetry.coordinator("weak")
    owner = Owner((4, 0, 0))
    jobs.observe(owner, lambda o: o.counts)
    assert otel.collect().value("rxcoord.jobs.active", {"rxcoord.name": "weak"}) == 4
    del owner
    gc.collect()
    assert otel.collect().select("rxcoord.jobs.active", {"rxcoord.name": "weak"}) == []


def test_a_known_job_workload(otel: Telemetry) -> None:
    # 10 jobs: 6 completed, 3 failed, 1 timed out; 2 rejections.
    jobs = telemetry.coordinator("known")
    for index in range(10):
        job = jobs.accepted()
        assert job is not None
        job.started()
        if index < 6:
            job.ended("completed")
        elif index < 9:
            job.ended("failed", ValueError(f"bad {index}"))
        else:
            job.ended("timed_out", TimeoutError("too slow"))
    jobs.rejected("too_many_tasks")
    jobs.rejected("closed")
    metrics = otel.collect()
    name = {"rxcoord.name": "known"}
    assert metrics.count("rxcoord.job.wait", name) == 10
    outcomes = {
        outcome: metrics.count("rxcoord.job.duration", {**name, "rxcoord.outcome": outcome})
        for outcome in ("completed", "failed", "timed_out")
    }
    assert outcomes == {"completed": 6, "failed": 3, "timed_out": 1}
    assert metrics.value("rxcoord.jobs.rejected", {**name, "rxcoord.reason": "closed"}) == 1
    assert metrics.value("rxcoord.jobs.rejected", name) == 2
    spans = otel.spans("rxcoord.job known")
    assert len(spans) == 10
    errors = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert len(errors) == 4
    assert all(s.kind is SpanKind.INTERNAL for s in spans)
    assert sorted(e.name for s in errors for e in s.events) == ["exception"] * 4
    assert {s.attributes["rxcoord.outcome"] for s in errors} == {"failed", "timed_out"}  # type: ignore[index]


def test_job_span_is_under_the_submitters_span_on_a_worker_thread(otel: Telemetry) -> None:
    tracer = trace.get_tracer("test")
    jobs = telemetry.coordinator("threads")
    with tracer.start_as_current_span("request") as request:
        context = telemetry.capture()  # what the coordinator does when a job is submitted
        job = jobs.accepted()
    assert job is not None

    def worker() -> None:  # a worker thread: its own context has no span
        assert trace.get_current_span() is trace.INVALID_SPAN
        job.started(context)

        def user_code() -> None:
            with tracer.start_as_current_span("user-work"):
                pass

        context.run(user_code)
        job.ended("completed")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    (user,) = otel.spans("user-work")
    (span,) = otel.spans("rxcoord.job threads")
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id
    assert user.parent is not None
    assert user.parent.span_id == span.context.span_id
    assert span.attributes is not None
    wait = span.attributes["rxcoord.job.wait"]
    assert isinstance(wait, float)
    assert wait >= 0


async def test_job_span_on_the_awaited_path(otel: Telemetry) -> None:
    tracer = trace.get_tracer("test")
    jobs = telemetry.coordinator("awaited")

    async def user_job() -> None:
        await asyncio.sleep(0)
        with tracer.start_as_current_span("user-async"):
            await asyncio.sleep(0)

    with tracer.start_as_current_span("handler") as handler:
        job = jobs.accepted()
        assert job is not None
        job.started()  # in the awaiting task itself: no copy
        with job.scope():
            await user_job()
        assert trace.get_current_span() is handler  # the scope gave the caller's span back
        job.ended("completed")
    (user,) = otel.spans("user-async")
    (span,) = otel.spans("rxcoord.job awaited")
    assert span.parent is not None
    assert span.parent.span_id == handler.get_span_context().span_id
    assert user.parent is not None
    assert user.parent.span_id == span.context.span_id


def test_retries_record_each_wait_and_one_span(otel: Telemetry) -> None:
    jobs = telemetry.coordinator("retried")
    job = jobs.accepted()
    assert job is not None
    job.started()
    job.retrying(ConnectionError("flaky"))
    job.started()
    job.ended("completed")
    metrics = otel.collect()
    assert metrics.count("rxcoord.job.wait", {"rxcoord.name": "retried"}) == 2
    assert metrics.count("rxcoord.job.duration", {"rxcoord.name": "retried"}) == 1
    (span,) = otel.spans("rxcoord.job retried")
    assert [e.name for e in span.events] == ["rxcoord.job.retry", "rxcoord.job.start"]


def test_tenant_labels_are_bounded(otel: Telemetry) -> None:
    base = telemetry.coordinator("tenants")
    for index in range(telemetry.MAX_LABELS + 5):
        base.labelled(f"tier-{index}").rejected("too_many_tasks")
    base.rejected("too_many_tasks")
    metrics = otel.collect()
    labels = {
        attributes.get("rxcoord.tenant")
        for attributes in metrics.attribute_sets("rxcoord.jobs.rejected")
        if attributes["rxcoord.name"] == "tenants"
    }
    assert len(labels) == telemetry.MAX_LABELS + 2  # the labels, "other", and no label
    assert "other" in labels
    assert None in labels
    assert metrics.value("rxcoord.jobs.rejected", {"rxcoord.tenant": "other"}) == 5


# -- Kafka records -------------------------------------------------------------------------------


def test_record_span_is_parented_to_the_producers_traceparent(otel: Telemetry) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("produce") as producer:
        headers = telemetry.inject_headers([("other", b"x")])
    assert any(key == "traceparent" for key, _ in headers)
    consumer = telemetry.kafka("orders-consumer", "orders-group")
    with tracer.start_as_current_span("poll-loop"):  # the consumer's own span: not the parent
        base = telemetry.capture()
    record = consumer.record_span(
        base, topic="orders", partition=3, offset=42, headers=headers, key=b"customer-7"
    )

    def handler() -> None:
        with tracer.start_as_current_span("handle"):
            pass

    record.context.run(handler)
    record.ended("failed", ValueError("bad record"))
    (span,) = otel.spans("orders process")
    (handle,) = otel.spans("handle")
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is not None
    assert span.parent.span_id == producer.get_span_context().span_id
    assert span.context.trace_id == producer.get_span_context().trace_id
    assert handle.parent is not None
    assert handle.parent.span_id == span.context.span_id
    assert dict(span.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "3",
        "messaging.kafka.offset": 42,
        "messaging.consumer.group.name": "orders-group",
        "rxcoord.outcome": "failed",
        "error.type": "ValueError",
    }
    assert span.status.status_code is StatusCode.ERROR


def test_record_span_key_only_on_opt_in_and_consumer_parent_without_headers(
    otel: Telemetry,
) -> None:
    tracer = trace.get_tracer("test")
    consumer = telemetry.kafka("keys", "g", record_keys=True)
    with tracer.start_as_current_span("consumer-loop") as loop_span:
        base = telemetry.capture()
    record = consumer.record_span(
        base, topic="payments", partition=0, offset=1, headers=None, key=b"customer-7"
    )
    record.ended("completed")
    (span,) = otel.spans("payments process")
    assert span.attributes is not None
    assert span.attributes["messaging.kafka.message.key"] == "customer-7"
    assert span.parent is not None
    assert span.parent.span_id == loop_span.get_span_context().span_id


def test_kafka_records_and_commit_waits(otel: Telemetry) -> None:
    consumer = telemetry.kafka("counted", "g")
    outcomes: list[telemetry.JobOutcome] = ["completed", "completed", "failed", "rejected"]
    for outcome in outcomes:
        consumer.record("orders", outcome)
    consumer.commit_waited(0.25)
    metrics = otel.collect()
    name = {"rxcoord.name": "counted"}
    assert metrics.value("rxcoord.kafka.records", {**name, "rxcoord.outcome": "completed"}) == 2
    assert metrics.value("rxcoord.kafka.records", {**name, "rxcoord.outcome": "rejected"}) == 1
    assert metrics.max("rxcoord.kafka.commit.wait", name) == pytest.approx(0.25)


def test_kafka_gauges_leave_out_an_unknown_lag_and_stop_on_forget(otel: Telemetry) -> None:
    consumer = telemetry.kafka("forgotten", "g")
    owner = Owner((0, 0, 0))
    consumer.observe(owner, lambda o: [("t", 0, None, 3, False), ("t", 1, 7, 1, True)])
    name = {"rxcoord.name": "forgotten"}
    metrics = otel.collect()
    assert metrics.attribute_sets("rxcoord.kafka.lag") == [
        {**name, "messaging.consumer.group.name": "g", "messaging.destination.name": "t",
         "messaging.destination.partition.id": "1"},
    ]  # fmt: skip
    assert metrics.value("rxcoord.kafka.in_flight", name) == 4
    assert metrics.value("rxcoord.kafka.paused", name) == 1
    consumer.forget(owner)  # the owner closed; it is still alive
    metrics = otel.collect()
    for instrument in ("rxcoord.kafka.lag", "rxcoord.kafka.in_flight", "rxcoord.kafka.paused"):
        assert metrics.select(instrument, name) == [], instrument
