"""Benchmark ``TenantTaskCoordinator`` against the executors a Python engineer would otherwise use.

Two workloads, each run several times with contenders alternating, medians and ratios printed
(the asyncio workloads live in ``bench_asyncio.py``):

1. trivial sync jobs/s through ``execute(...)`` on the coordinator's own 4 workers vs
   ``ThreadPoolExecutor(4).submit`` (goal >= 1.0x);
2. the makespan of 2,000 jobs that each sleep 10 ms with ``max_concurrency=32``, as a ratio to
   the ideal (total work / 32).

``--against DIR`` also runs workload 1 against rxcoord from another source tree, as
``bench_asyncio.py --against`` does (fresh processes alternating; medians and new/old).

Usage::

    python benchmarks/bench_coordinator.py [--jobs N] [--workers W] [--repeat R] [--quick]
        [--against DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from rxcoord import TenantTaskCoordinator


def trivial() -> int:
    return 1


def run_all(job: Callable[[], object], jobs: int, concurrency: int) -> float:
    """Seconds for ``jobs`` subscriptions to ``execute(job)`` to complete, all submitted at once."""
    with TenantTaskCoordinator(max_concurrency=concurrency, max_queue_size=jobs) as coordinator:
        done = threading.Event()
        remaining = jobs
        lock = threading.Lock()

        def on_completed() -> None:
            nonlocal remaining
            with lock:
                remaining -= 1
                if remaining == 0:
                    done.set()

        execution = coordinator.execute(job)
        start = time.perf_counter()
        for _ in range(jobs):
            execution.subscribe(on_completed=on_completed)
        done.wait()
        return time.perf_counter() - start


def rxcoord_sync(jobs: int, workers: int) -> float:
    return jobs / run_all(trivial, jobs, workers)


def executor_sync(jobs: int, workers: int) -> float:
    with ThreadPoolExecutor(max_workers=workers) as executor:
        start = time.perf_counter()
        futures = [executor.submit(trivial) for _ in range(jobs)]
        wait(futures)
        return jobs / (time.perf_counter() - start)


def makespan(jobs: int, concurrency: int, duration: float) -> float:
    """Seconds to run ``jobs`` sleeping jobs, divided by the ideal ``jobs * duration / cap``."""
    elapsed = run_all(lambda: time.sleep(duration), jobs, concurrency)
    return elapsed / (jobs * duration / concurrency)


def medians(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, run in contenders.items():  # alternate: machine drift hits all alike
            results[name].append(run())
    return {name: statistics.median(values) for name, values in results.items()}


def bench_rows(quick: bool, **options: object) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``."""
    jobs, workers, repeat = (5_000, 4, 3) if quick else (20_000, 4, 5)
    sync = medians(
        {
            "ours": lambda: rxcoord_sync(jobs, workers),
            "pool": lambda: executor_sync(jobs, workers),
        },
        repeat,
    )
    count = 500 if quick else 2000
    span = statistics.median(makespan(count, 32, 0.010) for _ in range(repeat))
    return [
        (
            f"coordinator, trivial sync jobs ({workers} workers)",
            f"{sync['ours']:,.0f} jobs/s",
            "ThreadPoolExecutor.submit",
            f"{sync['pool']:,.0f} jobs/s",
            f"{sync['ours'] / sync['pool']:.2f}x",
            ">= 1.0x",
        ),
        (
            f"coordinator, makespan {count:,} x 10 ms, cap 32",
            f"{span:.3f} x ideal",
            "ideal (work / 32)",
            "1.000",
            f"{span:.3f}",
            "<= 1.15",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="trivial jobs per run")
    parser.add_argument("--workers", type=int, default=4, help="worker count / concurrency")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions (medians printed)")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument(
        "--against", type=Path, metavar="DIR", help="also compare with rxcoord from DIR"
    )
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.repeat = 5_000, 3
    jobs, workers = args.jobs, args.workers

    sync = medians(
        {
            "execute (sync)": lambda: rxcoord_sync(jobs, workers),
            "ThreadPoolExecutor": lambda: executor_sync(jobs, workers),
        },
        args.repeat,
    )
    print(f"\ntrivial sync jobs, {jobs:,} per run, {workers} workers, median of {args.repeat}")
    print(f"{'contender':<22} {'jobs/s':>10} {'ratio':>7}")
    for name, value in sync.items():
        print(f"{name:<22} {value:>10,.0f} {value / sync['ThreadPoolExecutor']:>6.2f}x")

    count = 500 if args.quick else 2000
    ratios = [makespan(count, 32, 0.010) for _ in range(args.repeat)]
    print(f"\nmakespan of {count:,} jobs x 10 ms, max_concurrency=32, median of {args.repeat}")
    print(f"makespan / ideal: {statistics.median(ratios):.3f} (goal <= 1.15)")

    if args.against is not None:
        from bench_asyncio import PAIRS, against, print_against

        PAIRS.clear()
        PAIRS["sync"] = (
            "bench_coordinator",
            f"rxcoord_sync({{n}}, {workers})",
            f"executor_sync({{n}}, {workers})",
        )
        print_against(against(args.against, list(PAIRS), jobs, args.repeat), args.against)


if __name__ == "__main__":
    main()
