"""Benchmark rxcoord's asyncio path against hand-written asyncio and the peer libraries.

Jobs are written the way the README writes them: ``lambda: handle(m)``, ``functools.partial``
and ``execute(handle, m)``. Contenders alternate within one run; medians and ratios are printed.

1. keyed ``async def`` jobs (20,000 messages, 200 customers, at most 8 in flight) through
   ``await coordinator.execute(..., key=customer)``, in each of the three shapes, vs a dict of
   ``asyncio.Lock`` per customer plus an ``asyncio.Semaphore(8)`` (the eight lines an asyncio
   user writes by hand; goal >= 0.75x), and vs the peers an asyncio user would otherwise pick:
   anyio (an ``anyio.Lock`` per key + a ``CapacityLimiter`` in a task group) and aiojobs (a
   ``Scheduler(limit=8)`` + a lock per key) (goal >= 2x, for the slowest shape);
2. unkeyed trivial ``async def`` jobs (limit 8) vs a ``Semaphore(8)``-gated ``gather`` (goal
   >= 0.7x) and vs aiojobs, aiometer and anyio (goal >= 2x);
3. ``KeyedLocks.hold_async`` uncontended (1,000 keys, one after another) vs a dict of
   ``asyncio.Lock`` (goal >= 0.5x), and contended (1,000 tasks on 16 keys, goal >= 0.8x).

A peer that is not installed is skipped with a line saying how to get it (they are development
dependencies, not rxcoord's).

``--against DIR`` also runs the rxcoord contenders against another source tree (a checkout or
``git archive`` of another commit, holding ``rxcoord/``): each repetition runs the same pair in
two fresh processes, one importing rxcoord from each tree, alternating, and prints both trees'
medians, their ratios to the hand-written baseline and new/old.

Usage::

    python benchmarks/bench_asyncio.py [--quick] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rxcoord import KeyedLocks, TenantTaskCoordinator

LIMIT = 8
CUSTOMERS = 200
SHAPES = ("lambda", "partial", "args")


async def work(_: int) -> int:
    await asyncio.sleep(0)  # one suspension: a message that does a little I/O
    return 1


def _submit(c: TenantTaskCoordinator, shape: str, i: int, key: int | None) -> Any:
    """One job, written in ``shape`` (the three ways the README writes a job)."""
    if shape == "lambda":
        return c.execute(lambda: work(i), key=key)
    if shape == "partial":
        return c.execute(functools.partial(work, i), key=key)
    return c.execute(work, i, key=key)


def keyed_rxcoord(messages: int, shape: str = "lambda") -> float:
    async def main() -> float:
        async with TenantTaskCoordinator(max_concurrency=LIMIT, max_queue_size=messages) as c:
            start = time.perf_counter()
            await asyncio.gather(*(_submit(c, shape, i, i % CUSTOMERS) for i in range(messages)))
            return messages / (time.perf_counter() - start)

    return asyncio.run(main())


def keyed_by_hand(messages: int) -> float:
    async def main() -> float:
        locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        semaphore = asyncio.Semaphore(LIMIT)

        async def handle(i: int) -> int:
            async with locks[i % CUSTOMERS], semaphore:
                return await work(i)

        start = time.perf_counter()
        await asyncio.gather(*(handle(i) for i in range(messages)))
        return messages / (time.perf_counter() - start)

    return asyncio.run(main())


def keyed_anyio(messages: int) -> float:
    import anyio

    async def main() -> float:
        locks: defaultdict[int, anyio.Lock] = defaultdict(anyio.Lock)
        limiter = anyio.CapacityLimiter(LIMIT)

        async def handle(i: int) -> None:
            async with locks[i % CUSTOMERS], limiter:
                await work(i)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for i in range(messages):
                group.start_soon(handle, i)
        return messages / (time.perf_counter() - start)

    return anyio.run(main)


def keyed_aiojobs(messages: int) -> float:
    import aiojobs

    async def main() -> float:
        locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

        async def handle(i: int) -> int:
            async with locks[i % CUSTOMERS]:
                return await work(i)

        start = time.perf_counter()
        async with aiojobs.Scheduler(limit=LIMIT, pending_limit=messages) as scheduler:
            jobs = [await scheduler.spawn(handle(i)) for i in range(messages)]
            await asyncio.gather(*(job.wait() for job in jobs))
        return messages / (time.perf_counter() - start)

    return asyncio.run(main())


def unkeyed_rxcoord(jobs: int, shape: str = "lambda") -> float:
    async def main() -> float:
        async with TenantTaskCoordinator(max_concurrency=LIMIT, max_queue_size=jobs) as c:
            start = time.perf_counter()
            await asyncio.gather(*(_submit(c, shape, i, None) for i in range(jobs)))
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


def unkeyed_aiojobs(jobs: int) -> float:
    import aiojobs

    async def main() -> float:
        start = time.perf_counter()
        async with aiojobs.Scheduler(limit=LIMIT, pending_limit=jobs) as scheduler:
            spawned = [await scheduler.spawn(work(i)) for i in range(jobs)]
            await asyncio.gather(*(job.wait() for job in spawned))
        return jobs / (time.perf_counter() - start)

    return asyncio.run(main())


def unkeyed_aiometer(jobs: int) -> float:
    import aiometer

    async def main() -> float:
        start = time.perf_counter()
        await aiometer.run_all([functools.partial(work, i) for i in range(jobs)], max_at_once=LIMIT)
        return jobs / (time.perf_counter() - start)

    return asyncio.run(main())


def unkeyed_anyio(jobs: int) -> float:
    import anyio

    async def main() -> float:
        limiter = anyio.CapacityLimiter(LIMIT)

        async def handle(i: int) -> None:
            async with limiter:
                await work(i)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for i in range(jobs):
                group.start_soon(handle, i)
        return jobs / (time.perf_counter() - start)

    return anyio.run(main)


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


# Peers: the package each needs, and the contenders that use it.
PEERS = {"anyio": "anyio", "aiojobs": "aiojobs", "aiometer": "aiometer"}


def missing_peers() -> list[str]:
    """Peers not installed here (their rows are skipped)."""
    return [name for name, package in PEERS.items() if importlib.util.find_spec(package) is None]


def medians(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Run the contenders alternately ``repeat`` times; the median of each."""
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, run in contenders.items():
            runs[name].append(run())
    return {name: statistics.median(values) for name, values in runs.items()}


Row = tuple[str, str, str, str, str, str]


def _row(name: str, ours: float, baseline: str, theirs: float, unit: str, goal: str) -> Row:
    return (
        name,
        f"{ours:,.0f} {unit}",
        baseline,
        f"{theirs:,.0f} {unit}",
        f"{ours / theirs:.2f}x",
        goal,
    )


def bench_rows(quick: bool, **options: object) -> list[Row]:
    """Rows for ``rxcoord bench``."""
    messages, repeat = (5_000, 3) if quick else (20_000, 5)
    missing = missing_peers()
    notes = options.get("notes")
    for peer in missing:
        line = f"bench_asyncio: {peer} is not installed, its rows are skipped (pip install {peer})"
        if isinstance(notes, list):
            notes.append(line)
        else:
            print(line, file=sys.stderr)
    rows: list[Row] = []

    keyed_contenders: dict[str, Callable[[], float]] = {
        f"rxcoord {shape}": functools.partial(keyed_rxcoord, messages, shape) for shape in SHAPES
    }
    keyed_contenders["hand"] = functools.partial(keyed_by_hand, messages)
    if "anyio" not in missing:
        keyed_contenders["anyio"] = functools.partial(keyed_anyio, messages)
    if "aiojobs" not in missing:
        keyed_contenders["aiojobs"] = functools.partial(keyed_aiojobs, messages)
    keyed = medians(keyed_contenders, repeat)
    label = f"({messages:,} msgs, {CUSTOMERS} keys, limit {LIMIT})"
    for shape, written in zip(
        SHAPES, ("lambda: h(m)", "partial(h, m)", "execute(h, m)"), strict=True
    ):
        rows.append(
            _row(
                f"asyncio: keyed async jobs as {written} {label}",
                keyed[f"rxcoord {shape}"],
                "dict of asyncio.Lock + Semaphore",
                keyed["hand"],
                "msgs/s",
                ">= 0.75x",
            )
        )
    slowest = min(keyed[f"rxcoord {shape}"] for shape in SHAPES)
    for peer, baseline in (("anyio", "anyio Lock per key + CapacityLimiter"),
                           ("aiojobs", "aiojobs Scheduler + Lock per key")):  # fmt: skip
        if peer in keyed:
            rows.append(
                _row(
                    f"asyncio: keyed async jobs, slowest shape {label}",
                    slowest,
                    baseline,
                    keyed[peer],
                    "msgs/s",
                    ">= 2x",
                )
            )

    unkeyed_contenders: dict[str, Callable[[], float]] = {
        f"rxcoord {shape}": functools.partial(unkeyed_rxcoord, messages, shape)
        for shape in ("lambda", "args")
    }
    unkeyed_contenders["hand"] = functools.partial(unkeyed_by_hand, messages)
    for peer, run in (("aiojobs", unkeyed_aiojobs), ("aiometer", unkeyed_aiometer),
                      ("anyio", unkeyed_anyio)):  # fmt: skip
        if peer not in missing:
            unkeyed_contenders[peer] = functools.partial(run, messages)
    unkeyed = medians(unkeyed_contenders, repeat)
    for shape, written in (("lambda", "lambda: h()"), ("args", "execute(h, i)")):
        rows.append(
            _row(
                f"asyncio: unkeyed async jobs as {written} (limit {LIMIT})",
                unkeyed[f"rxcoord {shape}"],
                "Semaphore-gated gather",
                unkeyed["hand"],
                "jobs/s",
                ">= 0.7x",
            )
        )
    slowest = min(unkeyed["rxcoord lambda"], unkeyed["rxcoord args"])
    for peer, baseline in (("aiojobs", "aiojobs Scheduler(limit=8)"),
                           ("aiometer", "aiometer.run_all(max_at_once=8)"),
                           ("anyio", "anyio CapacityLimiter + task group")):  # fmt: skip
        if peer in unkeyed:
            rows.append(
                _row(
                    f"asyncio: unkeyed async jobs, slowest shape (limit {LIMIT})",
                    slowest,
                    baseline,
                    unkeyed[peer],
                    "jobs/s",
                    ">= 2x",
                )
            )

    uncontended = medians(
        {
            "ours": lambda: hold_uncontended_rxcoord(1_000),
            "hand": lambda: hold_uncontended_by_hand(1_000),
        },
        repeat * 3,
    )
    rows.append(
        _row(
            "asyncio: hold_async uncontended (1,000 keys)",
            uncontended["ours"],
            "dict of asyncio.Lock",
            uncontended["hand"],
            "holds/s",
            ">= 0.5x",
        )
    )
    contended = medians(
        {
            "ours": lambda: hold_contended_rxcoord(1_000, 16),
            "hand": lambda: hold_contended_by_hand(1_000, 16),
        },
        repeat * 3,
    )
    rows.append(
        _row(
            "asyncio: hold_async contended (1,000 tasks, 16 keys)",
            contended["ours"],
            "dict of asyncio.Lock",
            contended["hand"],
            "holds/s",
            ">= 0.8x",
        )
    )
    return rows


# -- one run against another source tree ------------------------------------------------------

# name -> (module, the call that runs the rxcoord contender, the call that runs its baseline);
# ``{n}`` is the workload size. bench_coordinator.py adds its sync row here.
PAIRS: dict[str, tuple[str, str, str]] = {
    **{
        f"keyed {shape}": (
            "bench_asyncio",
            f"keyed_rxcoord({{n}}, {shape!r})",
            "keyed_by_hand({n})",
        )
        for shape in SHAPES
    },
    **{
        f"unkeyed {shape}": (
            "bench_asyncio",
            f"unkeyed_rxcoord({{n}}, {shape!r})",
            "unkeyed_by_hand({n})",
        )
        for shape in ("lambda", "args")
    },
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
    alternating; per name and tree, the (rxcoord, baseline) figures of each repetition.

    The old tree runs this tree's benchmark code (only ``rxcoord`` comes from it): a call
    shape the old API lacks (``execute(fn, *args)``) fails there and is reported as missing.
    """
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
                    [sys.executable, "-c", code], capture_output=True, text=True, env=env
                )
                if done.returncode == 0:
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
        figures: dict[str, tuple[float, float] | None] = {}
        for which in ("old", "new"):
            pairs = by_tree[which]
            figures[which] = (
                (statistics.median(o for o, _ in pairs), statistics.median(o / b for o, b in pairs))
                if pairs
                else None
            )
        old, new = figures["old"], figures["new"]
        if old is None or new is None:
            print(f"{name:<18} {'(this workload does not run on one of the trees)':>58}")
            continue
        print(
            f"{name:<18} {old[0]:>10,.0f} {old[1]:>9.2f}x {new[0]:>10,.0f} {new[1]:>9.2f}x "
            f"{new[0] / old[0]:>7.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument(
        "--against", type=Path, metavar="DIR", help="also compare with rxcoord from DIR"
    )
    parser.add_argument("--only", action="append", help="with --against: just these pairs")
    args = parser.parse_args()
    if args.against is None:
        for name, ours, baseline, theirs, ratio, goal in bench_rows(args.quick):
            print(f"{name}: {ours} vs {baseline} {theirs} = {ratio} (goal {goal})")
    else:
        size, repeat = (5_000, 3) if args.quick else (20_000, 5)
        runs = against(args.against, args.only or list(PAIRS), size, repeat)
        print_against(runs, args.against)


if __name__ == "__main__":
    main()
