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
  ``rxcoord.jobs.*``);
* a trace: the workload runs under a span, and ``LeaseProvider.run`` jobs see it as their
  current span (the caller's context travels with every job).

Then it prints the page's address and serves it for ``--serve-for`` seconds (Ctrl-C stops).
Run: ``python examples/observability.py [--port 9464] [--serve-for 60]``, then
``curl http://127.0.0.1:9464/metrics | grep rxcoord``. Needs ``pip install 'rxcoord[otel]'
opentelemetry-sdk opentelemetry-exporter-prometheus``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import start_http_server
from reactivex import operators as ops

from rxcoord import TenantTaskCoordinator
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


def job_workload() -> int:
    """10 jobs through a coordinator named ``orders``, 3 of them failing."""
    failed = 0
    with TenantTaskCoordinator(max_concurrency=2, name="orders") as coordinator:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=9464, help="HTTP port (0: any free one)")
    parser.add_argument("--serve-for", type=float, default=60.0, help="seconds to serve")
    args = parser.parse_args()
    port = configure(args.port)
    with (
        tempfile.TemporaryDirectory() as directory,
        SqliteLeases(Path(directory) / "leases.db") as leases,
        SqliteLeases(Path(directory) / "leases.db") as other,
    ):
        counts, _kept = lease_workload(leases, other)  # a lease dropped is a lease released
        failed = job_workload()
        print(
            f"leases: {counts['acquired']} acquired, {counts['timed_out']} timed out, "
            f"{counts['taken']} taken, {counts['lost']} lost, {counts['held']} held"
        )
        print(f"jobs: 10 run, {failed} failed")
        print(f"serving http://127.0.0.1:{port}/metrics", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.serve_for)


if __name__ == "__main__":
    main()
