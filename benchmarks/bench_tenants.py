"""Benchmark ``TenantScheduler`` fairness against a FIFO thread pool given the same submissions.

One flooding tenant submits 10,000 jobs of 2 ms; right after, 50 light tenants submit 10 jobs
each. With a global limit of 8, a FIFO pool of 8 threads serves the light jobs only after the
whole flood; the scheduler gives each tenant with work a fair share of the 8 slots. Printed:
light tenants' p50/p99 latency (submission to completion) for both, and the ratio, as medians
over several runs. Usage::

    python benchmarks/bench_tenants.py [--flood N] [--repeat R] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rxcoord import TenantScheduler

SLOTS = 8
LIGHT_TENANTS = 50
LIGHT_JOBS = 10
JOB_SECONDS = 0.002


def job() -> None:
    time.sleep(JOB_SECONDS)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_scheduler(flood: int) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    done = threading.Event()
    light_total = LIGHT_TENANTS * LIGHT_JOBS
    with TenantScheduler(
        max_concurrency=SLOTS, tenant_max_concurrency=2, tenant_max_queue_size=flood
    ) as scheduler:
        for _ in range(flood):
            scheduler.execute("flood", job).subscribe()

        def light(tenant: str) -> None:
            start = time.perf_counter()

            def finished() -> None:
                with lock:
                    latencies.append(time.perf_counter() - start)
                    if len(latencies) == light_total:
                        done.set()

            scheduler.execute(tenant, job).subscribe(on_completed=finished)

        for _ in range(LIGHT_JOBS):
            for t in range(LIGHT_TENANTS):
                light(f"light-{t}")
        done.wait()
        while scheduler.stats().work_in_progress:  # let the flood drain before closing
            time.sleep(0.01)
    return latencies


def run_fifo(flood: int) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=SLOTS) as pool:
        for _ in range(flood):
            pool.submit(job)
        futures = []
        for _ in range(LIGHT_JOBS * LIGHT_TENANTS):
            start = time.perf_counter()

            def timed(start: float = start) -> None:
                job()
                with lock:
                    latencies.append(time.perf_counter() - start)

            futures.append(pool.submit(timed))
    return latencies


def bench_rows(quick: bool, **options: object) -> list[tuple[str, str, str, str, str, str, bool]]:
    """Rows for ``rxcoord bench``.

    The seventh field says whether this run can judge the goal: a FIFO pool makes the light
    tenants wait behind the whole flood, so the ratio grows with the flood's size, and the
    ">= 20x" goal is set for the full 10,000-job flood; a --quick run's 2,000 cannot judge it.
    """
    flood, repeat = (2_000, 1) if quick else (10_000, 3)
    ours: dict[str, list[float]] = {"p50": [], "p99": []}
    fifo: dict[str, list[float]] = {"p50": [], "p99": []}
    for _ in range(repeat):
        for results, run in ((ours, run_scheduler), (fifo, run_fifo)):
            latencies = run(flood)
            results["p50"].append(percentile(latencies, 0.50))
            results["p99"].append(percentile(latencies, 0.99))
    rows = []
    for q in ("p50", "p99"):
        a, b = statistics.median(ours[q]), statistics.median(fifo[q])
        rows.append(
            (
                f"tenants, light-tenant {q} latency ({flood:,}-job flood)",
                f"{a * 1000:.1f} ms",
                "FIFO pool of 8",
                f"{b * 1000:.0f} ms",
                f"{b / a:.1f}x lower",
                ">= 20x lower" if q == "p99" else "",
                not quick,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=10_000, help="jobs of the flooding tenant")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (medians printed)")
    parser.add_argument("--quick", action="store_true", help="2,000-job flood, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.flood, args.repeat = 2_000, 2
    ours: dict[str, list[float]] = {"p50": [], "p99": []}
    fifo: dict[str, list[float]] = {"p50": [], "p99": []}
    for _ in range(args.repeat):
        for results, run in ((ours, run_scheduler), (fifo, run_fifo)):
            latencies = run(args.flood)
            results["p50"].append(percentile(latencies, 0.50))
            results["p99"].append(percentile(latencies, 0.99))
    print(
        f"\n{args.flood:,} flood jobs + {LIGHT_TENANTS} light tenants x {LIGHT_JOBS} jobs, "
        f"{JOB_SECONDS * 1000:.0f} ms each, {SLOTS} slots, median of {args.repeat} runs"
    )
    print(
        f"{'light-tenant latency':<22} {'TenantScheduler':>16} {'FIFO pool':>10} {'FIFO/ours':>10}"
    )
    for q in ("p50", "p99"):
        a, b = statistics.median(ours[q]), statistics.median(fifo[q])
        print(f"{q:<22} {a * 1000:>13.1f} ms {b * 1000:>7.0f} ms {b / a:>9.1f}x")


if __name__ == "__main__":
    main()
