"""Benchmark rxcoord's asyncio path against what an asyncio user writes by hand.

Contenders alternate within one run; medians of the repetitions and ratios are printed:

1. keyed ``async def`` jobs (20,000 messages, 200 customers, at most 8 in flight) through
   ``await coordinator.execute(job, key=customer)`` vs a dict of ``asyncio.Lock`` per customer
   plus an ``asyncio.Semaphore(8)`` (goal >= 1.0x);
2. unkeyed trivial ``async def`` jobs (limit 8) vs a ``Semaphore(8)``-gated ``gather``
   (goal >= 0.8x);
3. ``KeyedLocks.hold_async`` uncontended (1,000 keys, one after another) vs a dict of
   ``asyncio.Lock`` (goal >= 0.5x), and contended (1,000 tasks on 16 keys, goal >= 1.0x).

``--against DIR`` also runs every rxcoord contender against another source tree (a checkout
or ``git archive`` of another commit, holding ``rxcoord/``): each repetition runs the same pair
in two fresh processes, one importing rxcoord from each tree, alternating, and prints both
trees' medians, their ratios to the hand-written baseline and new/old.

Usage::

    python benchmarks/bench_asyncio.py [--quick] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

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


# -- one run against another source tree ------------------------------------------------------

# name -> (module, the call that runs the rxcoord contender, the call that runs its baseline);
# ``{n}`` is the workload size. bench_coordinator.py adds its sync row here.
PAIRS: dict[str, tuple[str, str, str]] = {
    "keyed": ("bench_asyncio", "keyed_rxcoord({n}, 200)", "keyed_by_hand({n}, 200)"),
    "unkeyed": ("bench_asyncio", "unkeyed_rxcoord({n})", "unkeyed_by_hand({n})"),
    "hold uncontended": (
        "bench_asyncio",
        "hold_uncontended_rxcoord(1_000)",
        "hold_uncontended_by_hand(1_000)",
    ),
    "hold contended": (
        "bench_asyncio",
        "hold_contended_rxcoord(1_000, 16)",
        "hold_contended_by_hand(1_000, 16)",
    ),
}

_PAIR_RUN = """
import json, sys
sys.path[:0] = [{tree!r}, {benchmarks!r}]
import rxcoord
assert rxcoord.__file__.startswith({tree!r}), rxcoord.__file__
import {module} as bench
bench.{ours}, bench.{theirs}  # warm up: first calls (imports, caches) are not the measure
print(json.dumps([bench.{ours}, bench.{theirs}]))
"""


def against(
    tree: Path, names: list[str], size: int, repeat: int
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Run each named pair ``repeat`` times in fresh processes, this tree and ``tree``
    alternating; per name and tree, the (rxcoord, baseline) figures of each repetition."""
    here = Path(__file__).resolve().parent
    trees = {"new": here.parent, "old": tree.resolve()}
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {
        name: {which: [] for which in trees} for name in names
    }
    for _ in range(repeat):
        for name in names:
            module, ours, theirs = PAIRS[name]
            for which, root in trees.items():
                code = _PAIR_RUN.format(
                    tree=str(root),
                    benchmarks=str(here),
                    module=module,
                    ours=ours.format(n=size),
                    theirs=theirs.format(n=size),
                )
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                done = subprocess.run(
                    [sys.executable, "-c", code],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                )
                figures = json.loads(done.stdout)
                runs[name][which].append((figures[0], figures[1]))
    return runs


def print_against(runs: dict[str, dict[str, list[tuple[float, float]]]], tree: Path) -> None:
    """Medians per tree (rxcoord, baseline, median of the paired ratios) and new/old."""
    print(f"\nthis tree (new) vs {tree} (old), fresh processes alternating, medians:")
    print(
        f"{'workload':<18} {'old':>10} {'old ratio':>10} {'new':>10} {'new ratio':>10} "
        f"{'new/old':>8}"
    )
    for name, by_tree in runs.items():
        row = []
        for which in ("old", "new"):
            pairs = by_tree[which]
            row.append(
                (
                    statistics.median(o for o, _ in pairs),
                    statistics.median(o / b for o, b in pairs),
                )
            )
        (old, old_ratio), (new, new_ratio) = row
        print(
            f"{name:<18} {old:>10,.0f} {old_ratio:>9.2f}x {new:>10,.0f} {new_ratio:>9.2f}x "
            f"{new / old:>7.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument(
        "--against", type=Path, metavar="DIR", help="also compare with rxcoord from DIR"
    )
    args = parser.parse_args()
    for name, ours, baseline, theirs, ratio, goal in bench_rows(args.quick):
        print(f"{name}: {ours} vs {baseline} {theirs} = {ratio} (goal {goal})")
    if args.against is not None:
        size, repeat = (5_000, 3) if args.quick else (20_000, 5)
        runs = against(args.against, list(PAIRS), size, repeat)
        print_against(runs, args.against)


if __name__ == "__main__":
    main()
