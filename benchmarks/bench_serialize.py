"""Benchmark ``serialize_by_key`` against the naive composition and plain ``flat_map``.

Every contender gets the same source (``reactivex.from_iterable``) and the same inner
(``reactivex.just(x)``), so the figures compare what each pays per item: ``flat_map`` is the floor
an Rx operator pays per inner subscription (and gives no ordering at all); the naive composition
``group_by`` + ``flat_map`` + ``concat_map`` orders per key but keeps every group forever.

Two workloads: 1,000 keys with a Zipf-like skew, and all-distinct keys (which measures no ordering
at all, so both are needed). Each contender runs in a fresh subprocess so its peak memory (growth
of peak RSS during the run) is its own; repetitions alternate contenders, and medians are printed
with ratios. Usage::

    python benchmarks/bench_serialize.py [--items N] [--distinct-items N] [--repeat R] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import reactivex as rx
from reactivex import Observable
from reactivex import operators as ops

from rxcoord import serialize_by_key

CONTENDERS = ("serialize_by_key", "naive group_by", "flat_map")


def zipf_keys(n: int, keys: int, seed: int = 1) -> list[int]:
    """``n`` keys drawn from ``keys`` values with a Zipf-like (1/rank) skew."""
    rng = random.Random(seed)
    weights = [1.0 / rank for rank in range(1, keys + 1)]
    return rng.choices(range(keys), weights=weights, k=n)


def pipeline(name: str) -> Callable[[Observable[tuple[int, int]]], Observable[Any]]:
    def key(m: tuple[int, int]) -> int:
        return m[0]

    def inner(m: tuple[int, int]) -> Observable[Any]:
        return rx.just(m)

    if name == "serialize_by_key":
        return serialize_by_key(key, inner)
    if name == "naive group_by":

        def naive(source: Observable[tuple[int, int]]) -> Observable[Any]:
            return source.pipe(
                ops.group_by(key),
                ops.flat_map(
                    lambda group: cast(Observable[Any], group).pipe(ops.concat_map(inner))
                ),
            )

        return naive
    if name == "flat_map":
        return ops.flat_map(inner)
    raise ValueError(name)


def run_once(name: str, workload: str, items: int) -> dict[str, float]:
    keys = zipf_keys(items, 1000) if workload == "zipf" else list(range(items))
    messages = list(zip(keys, range(items), strict=True))
    count = 0

    def on_next(_: object) -> None:
        nonlocal count
        count += 1

    # Peak memory is the growth of the process's peak RSS (each run is a fresh process), so
    # timing runs untraced: tracemalloc would slow every contender several-fold.
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    rx.from_iterable(messages).pipe(pipeline(name)).subscribe(on_next)
    elapsed = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if count != items:
        raise AssertionError(f"{name}: {count} of {items} items came out")
    return {"items_per_s": items / elapsed, "peak_mb": (rss_after - rss_before) / 1024}


def bench_rows(quick: bool, **options: Any) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench`` (measured in this process; no memory figures)."""
    items, repeat = (3_000, 3) if quick else (20_000, 3)
    rows = []
    for workload, label in (("zipf", "1,000 Zipf keys"), ("distinct", "distinct keys")):
        rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for _ in range(repeat):
            for name in CONTENDERS:
                rates[name].append(run_once(name, workload, items)["items_per_s"])
        med = {name: statistics.median(values) for name, values in rates.items()}
        ours = f"{med['serialize_by_key']:,.0f} items/s"
        for baseline, goal in (
            ("naive group_by", "2x" if workload == "zipf" else "15x"),
            ("flat_map", "1x"),
        ):
            rows.append(
                (
                    f"serialize_by_key, {label}",
                    ours,
                    baseline,
                    f"{med[baseline]:,.0f} items/s",
                    f"{med['serialize_by_key'] / med[baseline]:.2f}x",
                    f">= {goal}",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000, help="items, 1,000-key workload")
    parser.add_argument("--distinct-items", type=int, default=20_000, help="items, distinct keys")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions (medians printed)")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument(
        "--child", nargs=3, metavar=("NAME", "WORKLOAD", "ITEMS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        name, workload, items = args.child
        print(json.dumps(run_once(name, workload, int(items))))
        return
    if args.quick:
        args.items, args.distinct_items, args.repeat = 5_000, 5_000, 3
    for workload, items in (("zipf", args.items), ("distinct", args.distinct_items)):
        results: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
        for _ in range(args.repeat):
            for name in CONTENDERS:  # alternate so drift on the shared machine hits all alike
                out = subprocess.run(
                    [sys.executable, __file__, "--child", name, workload, str(items)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                results[name].append(json.loads(out.stdout))
        label = "1,000 Zipf keys" if workload == "zipf" else "all-distinct keys"
        print(f"\n{label}, {items:,} items, median of {args.repeat} runs (inner: reactivex.just)")
        print(
            f"{'contender':<18} {'items/s':>10} {'+peak MB':>9} {'vs naive':>9} {'vs flat_map':>12}"
        )
        med = {n: statistics.median(r["items_per_s"] for r in results[n]) for n in CONTENDERS}
        for name in CONTENDERS:
            peak = statistics.median(r["peak_mb"] for r in results[name])
            print(
                f"{name:<18} {med[name]:>10,.0f} {peak:>9.1f} "
                f"{med[name] / med['naive group_by']:>8.2f}x {med[name] / med['flat_map']:>11.2f}x"
            )


if __name__ == "__main__":
    main()
