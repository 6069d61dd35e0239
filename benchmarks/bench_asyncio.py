"""Benchmark rxcoord's asyncio path against what an asyncio user writes by hand.

Contenders alternate within one run; medians of the repetitions and ratios are printed:

1. keyed ``async def`` jobs (20,000 messages, 200 customers, at most 8 in flight) through
   ``await coordinator.execute(job, key=customer)`` vs a dict of ``asyncio.Lock`` per customer
   plus an ``asyncio.Semaphore(8)`` (goal >= 1.0x);
2. unkeyed trivial ``async def`` jobs (limit 8) vs a ``Semaphore(8)``-gated ``gather``
   (goal >= 0.8x);
3. ``KeyedLocks.hold_async`` uncontended (1,000 keys, one after another) vs a dict of
   ``asyncio.Lock`` (goal >= 0.5x), and contended (1,000 tasks on 16 keys, goal >= 1.0x).

Usage::

    python benchmarks/bench_asyncio.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from rxcoord import KeyedLocks, TenantTaskCoordinator

LIMIT = 8


async def work(_: int) -> int:
    await asyncio.sleep(0)  # one suspension: a message that does a little I/O
    return 1


def keyed_rxcoord(messages: int, customers: int) -> float:
    async def main() -> float:
        async with TenantTaskCoordinator(max_concurrency=LIMIT, max_queue_size=messages) as c:
            start = time.perf_counter()
            await asyncio.gather(
                *(c.execute(functools.partial(work, i), key=i % customers) for i in range(messages))
            )
            return messages / (time.perf_counter() - start)

    return asyncio.run(main())


def keyed_by_hand(messages: int, customers: int) -> float:
    async def main() -> float:
        locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        semaphore = asyncio.Semaphore(LIMIT)

        async def handle(i: int) -> int:
            async with locks[i % customers], semaphore:
                return await work(i)

        start = time.perf_counter()
        await asyncio.gather(*(handle(i) for i in range(messages)))
        return messages / (time.perf_counter() - start)

    return asyncio.run(main())


def unkeyed_rxcoord(jobs: int) -> float:
    async def main() -> float:
        async with TenantTaskCoordinator(max_concurrency=LIMIT, max_queue_size=jobs) as c:
            start = time.perf_counter()
            await asyncio.gather(*(c.execute(functools.partial(work, i)) for i in range(jobs)))
            return jobs / (time.perf_counter() - start)

    return asyncio.run(main())


def unkeyed_by_hand(jobs: int) -> float:
    async def main() -> float:
        semaphore = asyncio.Semaphore(LIMIT)

        async def handle(i: int) -> int:
            async with semaphore:
                return await work(i)

        start = time.perf_counter()
        await asyncio.gather(*(handle(i) for i in range(jobs)))
        return jobs / (time.perf_counter() - start)

    return asyncio.run(main())


def hold_uncontended_rxcoord(keys: int) -> float:
    async def main() -> float:
        locks = KeyedLocks()
        start = time.perf_counter()
        for k in range(keys):
            async with locks.hold_async(k):
                pass
        return keys / (time.perf_counter() - start)

    return asyncio.run(main())


def hold_uncontended_by_hand(keys: int) -> float:
    async def main() -> float:
        locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        start = time.perf_counter()
        for k in range(keys):
            async with locks[k]:
                pass
        return keys / (time.perf_counter() - start)

    return asyncio.run(main())


def hold_contended_rxcoord(tasks: int, keys: int) -> float:
    async def main() -> float:
        locks = KeyedLocks()

        async def one(i: int) -> None:
            async with locks.hold_async(i % keys):
                await asyncio.sleep(0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(tasks)))
        return tasks / (time.perf_counter() - start)

    return asyncio.run(main())


def hold_contended_by_hand(tasks: int, keys: int) -> float:
    async def main() -> float:
        locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

        async def one(i: int) -> None:
            async with locks[i % keys]:
                await asyncio.sleep(0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(tasks)))
        return tasks / (time.perf_counter() - start)

    return asyncio.run(main())


def medians(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Run the contenders alternately ``repeat`` times; the median of each."""
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, run in contenders.items():
            runs[name].append(run())
    return {name: statistics.median(values) for name, values in runs.items()}


def bench_rows(quick: bool, **options: object) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``."""
    messages, repeat = (5_000, 3) if quick else (20_000, 5)
    keyed = medians(
        {
            "ours": lambda: keyed_rxcoord(messages, 200),
            "hand": lambda: keyed_by_hand(messages, 200),
        },
        repeat,
    )
    unkeyed = medians(
        {"ours": lambda: unkeyed_rxcoord(messages), "hand": lambda: unkeyed_by_hand(messages)},
        repeat,
    )
    uncontended = medians(
        {
            "ours": lambda: hold_uncontended_rxcoord(1_000),
            "hand": lambda: hold_uncontended_by_hand(1_000),
        },
        repeat * 3,
    )
    contended = medians(
        {
            "ours": lambda: hold_contended_rxcoord(1_000, 16),
            "hand": lambda: hold_contended_by_hand(1_000, 16),
        },
        repeat * 3,
    )

    def row(
        name: str, figures: dict[str, float], unit: str, baseline: str, goal: str
    ) -> tuple[str, str, str, str, str, str]:
        return (
            name,
            f"{figures['ours']:,.0f} {unit}",
            baseline,
            f"{figures['hand']:,.0f} {unit}",
            f"{figures['ours'] / figures['hand']:.2f}x",
            goal,
        )

    return [
        row(
            f"asyncio: keyed async jobs ({messages:,} msgs, 200 keys, limit {LIMIT})",
            keyed,
            "msgs/s",
            "dict of asyncio.Lock + Semaphore",
            ">= 1.0x",
        ),
        row(
            f"asyncio: unkeyed async jobs (limit {LIMIT})",
            unkeyed,
            "jobs/s",
            "Semaphore-gated gather",
            ">= 0.8x",
        ),
        row(
            "asyncio: hold_async uncontended (1,000 keys)",
            uncontended,
            "holds/s",
            "dict of asyncio.Lock",
            ">= 0.5x",
        ),
        row(
            "asyncio: hold_async contended (1,000 tasks, 16 keys)",
            contended,
            "holds/s",
            "dict of asyncio.Lock",
            ">= 1.0x",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    args = parser.parse_args()
    for name, ours, baseline, theirs, ratio, goal in bench_rows(args.quick):
        print(f"{name}: {ours} vs {baseline} {theirs} = {ratio} (goal {goal})")


if __name__ == "__main__":
    main()
