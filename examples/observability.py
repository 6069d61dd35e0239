"""rxcoord's metrics on a Prometheus ``/metrics`` page, through OpenTelemetry.

rxcoord instruments against the OpenTelemetry API only; the application chooses what to do
with the data. Here it configures the SDK with the Prometheus exporter
(``opentelemetry-exporter-prometheus``), which serves ``/metrics`` over HTTP, and runs a small
workload:

* distributed leases in an SQLite file: grants at once, waits for a holder's release, a wait
  that times out, a ``wait=False`` run that finds its name taken, and a lease lost because
  its holder let it expire (``rxcoord.lease.wait``, ``rxcoord.leases.held``,
  ``rxcoord.leases.lost``);
* jobs through a ``TenantTaskCoordinator`` named ``orders`` (``rxcoord.job.*`` and
  ``rxcoord.jobs.*``), and a burst that a full one named ``burst`` rejects
  (``rxcoord.jobs.rejected``);
* jobs of a ``TenantScheduler`` named ``reports`` whose limits are the fleet's, in the same
  SQLite file (``rxcoord.fleet.permit.wait``);
* with ``--kafka HOST:PORT``: 20 records produced under a span (their ``traceparent`` header
  carries it), consumed by a ``KeyedConsumer`` whose handler fails on 4 of them
  (``rxcoord.kafka.records``, ``rxcoord.kafka.commit.wait``; each record's span continues the
  producer's trace);
* a trace: the workload runs under a span, and ``LeaseProvider.run`` jobs see it as their
  current span (the caller's context travels with every job).

Then it prints the page's address and serves it for ``--serve-for`` seconds (Ctrl-C stops).
Run: ``python examples/observability.py [--port 9464] [--serve-for 60] [--kafka HOST:PORT]``, then
``curl http://127.0.0.1:9464/metrics | grep rxcoord``. Needs ``pip install 'rxcoord[otel]'
opentelemetry-sdk opentelemetry-exporter-prometheus`` (and ``rxcoord[kafka]`` for ``--kafka``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
import uuid
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import start_http_server
from reactivex import operators as ops

from rxcoord import TenantScheduler, TenantTaskCoordinator, TooManyTasks
from rxcoord.leases import DistributedLease, LeaseLost, LockTimeout, SqliteLeases


def configure(port: int) -> int:
    """The application's part: the SDK, the Prometheus reader, the HTTP server. Returns the port."""
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    trace.set_tracer_provider(TracerProvider())  # spans go nowhere here; add an exporter
    server, _ = start_http_server(port, addr="127.0.0.1")
    return int(server.server_port)


def lease_workload(
    leases: SqliteLeases, other: SqliteLeases
) -> tuple[dict[str, int], DistributedLease]:
    """Known lease outcomes: 5 acquired, 1 timed out, 1 taken, 1 lost, and the one still held."""
    counts = {"acquired": 0, "timed_out": 0, "taken": 0, "lost": 0, "held": 0}
    tracer = trace.get_tracer("example")
    with tracer.start_as_current_span("nightly-report") as report:
        # The job runs on a thread of its own, in the caller's context: under the span.
        same_span = leases.run("report", lambda: trace.get_current_span() is report).run()
    assert same_span, "the job did not run in its caller's context"
    counts["acquired"] += 1
    holder = other.acquire("ledger")
    counts["acquired"] += 1
    try:
        leases.acquire("ledger", timeout=0.2)
    except LockTimeout:
        counts["timed_out"] += 1
    # wait=False (the default): the name is taken, so the job is skipped (completes empty).
    if leases.run("ledger", lambda: "ran").pipe(ops.to_list()).run() == []:
        counts["taken"] += 1
    threading.Timer(0.1, holder.release).start()
    with leases.lock("ledger", timeout=10):  # waits for the release
        counts["acquired"] += 1
    short = leases.acquire("short-lived", at_most_for=0.2)
    counts["acquired"] += 1
    while leases.holder("short-lived") is not None:  # the store lets it expire
        time.sleep(0.02)
    try:
        short.release()
    except LeaseLost:
        counts["lost"] += 1
    kept = leases.acquire("kept")  # held while /metrics is served: rxcoord.leases.held
    counts["acquired"] += 1
    counts["held"] += 1
    return counts, kept


def job_workload(coordinator: TenantTaskCoordinator) -> int:
    """10 jobs through ``coordinator``, 3 of them failing."""
    failed = 0
    for index in range(10):

        def job(index: int = index) -> int:
            if index % 3 == 2:
                raise ValueError(f"order {index} failed")
            return index

        try:
            coordinator.execute(job).run()
        except ValueError:
            failed += 1
    return failed


def burst_workload() -> int:
    """A coordinator with room for 2 jobs (1 running, 1 queued) offered 4 at once: 2 rejected."""
    gate = threading.Event()
    refused: list[Exception] = []
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=1, name="burst") as burst:
        for _ in range(4):
            # A full coordinator refuses at the subscription: TooManyTasks to on_error.
            burst.execute(gate.wait).subscribe(on_error=refused.append)
        gate.set()
    return sum(isinstance(error, TooManyTasks) for error in refused)


def fleet_workload(leases: SqliteLeases) -> int:
    """4 jobs of one tenant through a scheduler whose limits live in the lease store."""
    with TenantScheduler(2, name="reports", fleet=leases) as scheduler:
        return len([scheduler.execute("acme", lambda n=n: n).run() for n in range(4)])


def kafka_workload(bootstrap: str) -> tuple[int, int]:
    """20 records produced under a span, consumed with 4 handler failures (skipped)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic
    from opentelemetry import propagate

    from rxcoord.kafka import KeyedConsumer, Record

    topic = f"observed-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        future.result(15)
    producer = Producer({"bootstrap.servers": bootstrap})
    with trace.get_tracer("example").start_as_current_span("place-orders"):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the current span's traceparent: record spans continue it
        headers: list[tuple[str, str | bytes | None]] = list(carrier.items())
        for n in range(20):
            producer.produce(
                topic, key=f"c{n % 5}".encode(), value=str(n).encode(), headers=headers
            )
    producer.flush(15)

    handled = 0
    failed = 0
    lock = threading.Lock()
    done = threading.Event()

    def handle(record: Record) -> None:
        nonlocal handled, failed
        with lock:
            handled += 1
            if handled == 20:
                done.set()
            if int(record.value or b"0") % 5 == 4:
                failed += 1
                raise ValueError(f"record {record.offset} failed")

    consumer = KeyedConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"observed-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
        },
        [topic],
        handle,
        on_error="skip",
    )

    def close_when_done() -> None:
        done.wait(60)
        consumer.close()

    threading.Thread(target=close_when_done, daemon=True).start()
    consumer.run()
    return handled, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=9464, help="HTTP port (0: any free one)")
    parser.add_argument("--serve-for", type=float, default=60.0, help="seconds to serve")
    parser.add_argument("--kafka", metavar="HOST:PORT", help="also run the Kafka workload")
    args = parser.parse_args()
    port = configure(args.port)
    with (
        tempfile.TemporaryDirectory() as directory,
        SqliteLeases(Path(directory) / "leases.db") as leases,
        SqliteLeases(Path(directory) / "leases.db") as other,
        # Open while the page is served: its gauges (rxcoord.jobs.active, ...) are reported
        # for as long as it lives.
        TenantTaskCoordinator(max_concurrency=2, name="orders") as orders,
    ):
        counts, _kept = lease_workload(leases, other)  # a lease dropped is a lease released
        failed = job_workload(orders)
        rejected = burst_workload()
        fleet_jobs = fleet_workload(leases)
        if args.kafka:
            records, record_failures = kafka_workload(args.kafka)
            print(f"kafka: {records} records, {record_failures} failed")
        print(
            f"leases: {counts['acquired']} acquired, {counts['timed_out']} timed out, "
            f"{counts['taken']} taken, {counts['lost']} lost, {counts['held']} held"
        )
        print(f"jobs: 10 run, {failed} failed; {rejected} rejected; {fleet_jobs} fleet jobs")
        print(f"serving http://127.0.0.1:{port}/metrics", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.serve_for)


if __name__ == "__main__":
    main()
