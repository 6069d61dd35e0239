"""Benchmark what telemetry costs: the same build with and without ``opentelemetry-api``.

Three contenders run the same workloads, each repetition in fresh processes, alternating:

* ``api``: ``opentelemetry-api`` importable and no SDK configured (what most users run);
* ``none``: the API made unimportable by a meta-path blocker (``rxcoord[otel]`` not installed);
* ``sdk``: the SDK configured with an ``InMemoryMetricReader`` and a span processor that keeps
  spans in memory (everything recorded; the figure is quoted, with no goal).

Each child makes a warm-up run and reports the best of five measured runs (on a shared
machine, interference only ever slows a run down); the table shows the median of those over
the repetitions. Workloads: trivial sync jobs through ``TenantTaskCoordinator.execute``
(4 workers), trivial ``async def`` jobs awaited through it, and ``try_acquire`` + ``release``
pairs on ``MemoryLeases`` (the lease layer's metrics). The goal: ``api`` at >= 0.95x of
``none`` (with nobody listening, telemetry costs no more than a branch). Each child process
checks that it runs the configuration it claims (API importable or not, SDK set or not)
before measuring.

Usage::

    python benchmarks/bench_otel.py [--quick] [--repeat R]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Prepended to a ``none`` child: any import of ``opentelemetry`` fails as if not installed.
BLOCK_OPENTELEMETRY = """
import importlib.abc, sys
class _NoOpenTelemetry(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoOpenTelemetry())
"""

MODES = ("none", "api", "sdk")
WORKLOADS = ("sync", "async", "lease")
WORKERS = 4


def configure(mode: str) -> None:
    """In a child: set the process up as ``mode`` says, and check that it took.

    Raises:
        RuntimeError: The process is not in the configuration ``mode`` names.
    """
    from rxcoord._core import telemetry

    if mode == "none":
        if telemetry.AVAILABLE:
            raise RuntimeError("the blocker did not hide opentelemetry")
        return
    if not telemetry.AVAILABLE:
        raise RuntimeError("opentelemetry-api is not installed: pip install 'rxcoord[otel]'")
    if mode == "sdk":
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
    if telemetry.metrics_on() != (mode == "sdk"):
        raise RuntimeError(f"{mode}: metrics_on() is {telemetry.metrics_on()}")


def lease_pairs(pairs: int) -> float:
    """``try_acquire`` + ``release`` pairs per second on ``MemoryLeases``."""
    from rxcoord.leases import MemoryLeases

    with MemoryLeases() as leases:
        start = time.perf_counter()
        for _ in range(pairs):
            lease = leases.try_acquire("bench")
            assert lease is not None
            lease.release()
        return pairs / (time.perf_counter() - start)


RUNS = 5  # measured runs per child: the best one counts (interference only slows a run down)


def measure(workload: str, size: int) -> float:
    """In a child: one warm-up run, then the best of :data:`RUNS`; operations per second."""
    from bench_asyncio import unkeyed_rxcoord
    from bench_coordinator import rxcoord_sync

    run = {
        "sync": lambda n: rxcoord_sync(n, WORKERS),
        "async": lambda n: unkeyed_rxcoord(n, "args"),
        "lease": lease_pairs,
    }[workload]
    run(max(1, size // 5))
    return max(float(run(size)) for _ in range(RUNS))


def child(mode: str, workload: str, size: int) -> None:
    """The body of one child process: configure, measure, print the figure as JSON."""
    configure(mode)
    print(json.dumps(measure(workload, size)))


def run_child(mode: str, workload: str, size: int) -> float:
    """Start a fresh interpreter for one measurement.

    Raises:
        RuntimeError: The child failed (its stderr is in the message).
    """
    here = str(Path(__file__).resolve().parent)
    code = (
        (BLOCK_OPENTELEMETRY if mode == "none" else "")
        + f"import sys\nsys.path.insert(0, {here!r})\n"
        + f"from bench_otel import child\nchild({mode!r}, {workload!r}, {size})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode}/{workload} child failed: {done.stderr.strip()[-500:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def medians(
    workload: str, size: int, repeat: int, modes: tuple[str, ...] = MODES
) -> dict[str, float]:
    """Each contender ``repeat`` times, alternating, in fresh processes; the medians."""
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    for index in range(repeat):
        # Rotate who goes first: start-up and machine drift hit every contender alike.
        order = modes[index % len(modes) :] + modes[: index % len(modes)]
        for mode in order:
            results[mode].append(run_child(mode, workload, size))
    return {mode: statistics.median(values) for mode, values in results.items()}


_LABELS = {
    "sync": f"trivial sync jobs ({WORKERS} workers)",
    "async": "trivial async jobs as execute(h, i), awaited (limit 8)",
    "lease": "MemoryLeases try_acquire + release",
}
_UNITS = {"sync": "jobs/s", "async": "jobs/s", "lease": "pairs/s"}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def bench_rows(
    quick: bool, *, notes: list[str] | None = None, **options: object
) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``: per workload, API without SDK vs no API, and the SDK.

    Without ``opentelemetry-api`` there is nothing to compare: no rows, a note. Without the
    SDK, only the rows without it.
    """
    if not installed("opentelemetry.metrics"):
        if notes is not None:
            notes.append("bench_otel left out: it needs pip install 'rxcoord[otel]'")
        return []
    modes = MODES if installed("opentelemetry.sdk") else ("none", "api")
    if modes != MODES and notes is not None:
        notes.append("bench_otel: no SDK rows (pip install opentelemetry-sdk)")
    repeat = 3 if quick else 5
    sizes = {"sync": 5_000, "async": 5_000, "lease": 20_000}
    if not quick:
        sizes = {key: value * 2 for key, value in sizes.items()}
    rows: list[tuple[str, str, str, str, str, str]] = []
    for workload in WORKLOADS:
        figures = medians(workload, sizes[workload], repeat, modes)
        unit = _UNITS[workload]
        rows.append(
            (
                f"telemetry off (API, no SDK): {_LABELS[workload]}",
                f"{figures['api']:,.0f} {unit}",
                "no opentelemetry-api",
                f"{figures['none']:,.0f} {unit}",
                f"{figures['api'] / figures['none']:.2f}x",
                ">= 0.95x",
            )
        )
        if "sdk" not in figures:
            continue
        rows.append(
            (
                f"telemetry on (SDK, in-memory): {_LABELS[workload]}",
                f"{figures['sdk']:,.0f} {unit}",
                "no opentelemetry-api",
                f"{figures['none']:,.0f} {unit}",
                f"{figures['sdk'] / figures['none']:.2f}x",
                "",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (medians printed)")
    args = parser.parse_args()
    repeat = args.repeat or (3 if args.quick else 5)
    sizes = {"sync": 5_000, "async": 5_000, "lease": 20_000}
    if not args.quick:
        sizes = {key: value * 2 for key, value in sizes.items()}
    for workload in WORKLOADS:
        figures = medians(workload, sizes[workload], repeat)
        print(f"\n{_LABELS[workload]}, {sizes[workload]:,} per run, median of {repeat}")
        for mode in MODES:
            ratio = figures[mode] / figures["none"]
            print(f"  {mode:<5} {figures[mode]:>12,.0f} {_UNITS[workload]:<7} {ratio:.2f}x")


if __name__ == "__main__":
    main()
