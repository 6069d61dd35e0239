"""Benchmark ``KeyedLocks.hold`` against the textbook keyed-lock design and a plain lock.

The textbook design is the Python equivalent of the seed's: a dict of refcounted
``threading.Semaphore(1)`` guarded by one ``threading.Lock``, written the way one would write
it (``with`` blocks, ``acquire``/``release`` around the work in ``try``/``finally``). A plain
``threading.Lock`` (``with lock:``) is the floor any Python lock pays.

Three measurements:

* **uncontended** - one thread, acquire+release pairs/s on distinct keys (entities come and
  go), nothing inside the critical section;
* **contended** - 4 threads on 16 keys chosen at random, each critical section yielding the
  GIL once (``time.sleep(0)``, as any real work would), so threads really collide; the figure
  is total pairs/s and KeyedLocks' ``contended_total`` shows how many requests had to wait;
* **memory** - 1,000,000 distinct keys acquired and released one after another, then 100,000
  held at once and released, then 100,000 more one after another; keys retained and
  ``tracemalloc`` bytes retained after each phase, in a fresh subprocess per contender. (Right
  after the burst, the per-key dict still has its large table - CPython shrinks a dict only
  when later inserts resize it - which the last phase shows.)

The machine is noisy (a shared 2-core box), so contenders alternate within each repetition
and the medians of the repetitions are printed, with ratios of medians. Usage::

    python benchmarks/bench_locks.py [--repeat R] [--ops N] [--contended-ops N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from rxcoord import KeyedLocks

# -- contenders --------------------------------------------------------------------------------


class TextbookLocks:
    """The seed's design in Python: refcounted ``Semaphore(1)`` per key under a guard lock."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[object, list[object]] = {}  # key -> [semaphore, refcount]

    def acquire(self, key: object) -> None:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = [threading.Semaphore(1), 0]
            entry[1] += 1  # type: ignore[operator]
        entry[0].acquire()  # type: ignore[attr-defined]

    def release(self, key: object) -> None:
        with self._guard:
            entry = self._entries[key]
            entry[0].release()  # type: ignore[attr-defined]
            entry[1] -= 1  # type: ignore[operator]
            if not entry[1]:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, key: object) -> _TextbookHold:
        return _TextbookHold(self, key)


class _TextbookHold:
    __slots__ = ("_key", "_locks")

    def __init__(self, locks: TextbookLocks, key: object) -> None:
        self._locks = locks
        self._key = key

    def __enter__(self) -> None:
        self._locks.acquire(self._key)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._locks.release(self._key)


# -- uncontended -------------------------------------------------------------------------------


def uncontended_hold(ops: int) -> float:
    hold = KeyedLocks().hold
    start = time.perf_counter()
    for key in range(ops):
        with hold(key):
            pass
    return ops / (time.perf_counter() - start)


def uncontended_textbook(ops: int) -> float:
    locks = TextbookLocks()
    acquire, release = locks.acquire, locks.release
    start = time.perf_counter()
    for key in range(ops):
        acquire(key)
        try:
            pass
        finally:
            release(key)
    return ops / (time.perf_counter() - start)


def uncontended_lock(ops: int) -> float:
    lock = threading.Lock()
    start = time.perf_counter()
    for _ in range(ops):
        with lock:
            pass
    return ops / (time.perf_counter() - start)


UNCONTENDED: dict[str, Callable[[int], float]] = {
    "KeyedLocks.hold": uncontended_hold,
    "textbook Semaphore dict": uncontended_textbook,
    "threading.Lock": uncontended_lock,
}


# -- contended ---------------------------------------------------------------------------------


def contended(name: str, ops: int, threads: int = 4, keys: int = 16) -> tuple[float, int]:
    """Total pairs/s of ``threads`` threads on ``keys`` random keys; and waits (KeyedLocks)."""
    keyed = KeyedLocks()
    textbook = TextbookLocks()
    barrier = threading.Barrier(threads + 1)

    def worker(seed: int) -> None:
        choices = random.Random(seed).choices(range(keys), k=ops)
        barrier.wait()
        if name == "KeyedLocks.hold":
            hold = keyed.hold
            for key in choices:
                with hold(key):
                    time.sleep(0)
        else:
            acquire, release = textbook.acquire, textbook.release
            for key in choices:
                acquire(key)
                try:
                    time.sleep(0)
                finally:
                    release(key)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in workers:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - start
    assert len(keyed) == 0
    assert len(textbook) == 0
    return threads * ops / elapsed, keyed.stats().contended_total


# -- memory (one fresh subprocess per contender) -----------------------------------------------


def memory_child(name: str, distinct: int, at_once: int) -> dict[str, int]:
    make: Callable[[], KeyedLocks | TextbookLocks] = (
        KeyedLocks if name == "KeyedLocks.hold" else TextbookLocks
    )
    locks = make()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for key in range(distinct):  # entities come and go, one at a time
        with locks.hold(key):
            pass
    gc.collect()
    after_stream = tracemalloc.get_traced_memory()[0] - base
    keys_after_stream = len(locks)
    holds = [locks.hold(("held", key)) for key in range(at_once)]
    for hold in holds:
        hold.__enter__()
    peak_held = tracemalloc.get_traced_memory()[0] - base
    for hold in holds:
        hold.__exit__(None, None, None)
    del holds, hold
    gc.collect()
    after_burst = tracemalloc.get_traced_memory()[0] - base
    # A dict keeps its table after deletions until later inserts resize it: keep streaming.
    for key in range(at_once):
        with locks.hold(("later", key)):
            pass
    gc.collect()
    after_more = tracemalloc.get_traced_memory()[0] - base
    return {
        "keys_after_stream": keys_after_stream,
        "bytes_after_stream": after_stream,
        "bytes_while_held": peak_held,
        "keys_after_burst": len(locks),
        "bytes_after_burst": after_burst,
        "bytes_after_more": after_more,
    }


def memory(name: str, distinct: int, at_once: int) -> dict[str, int]:
    # The child imports this file from its own directory (benchmarks/ in a checkout,
    # rxcoord/_benchmarks/ in a wheel), whatever the working directory is.
    here = str(Path(__file__).resolve().parent)
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import bench_locks as b; "
        f"print(json.dumps(b.memory_child({name!r}, {distinct}, {at_once})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    result: dict[str, int] = json.loads(out)
    return result


# -- main --------------------------------------------------------------------------------------


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median of the ratios within each repetition (robust to load that drifts over time)."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def fmt(rate: float) -> str:
    return f"{rate:>12,.0f} pairs/s"


def bench_rows(quick: bool, **options: object) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``."""
    repeat, ops, contended_ops, distinct = (
        (3, 20_000, 1_000, 100_000)
        if quick
        else (
            5,
            100_000,
            5_000,
            1_000_000,
        )
    )
    rates: dict[str, list[float]] = {name: [] for name in UNCONTENDED}
    for _ in range(repeat):
        for name, run in UNCONTENDED.items():
            rates[name].append(run(ops))
    med = {name: statistics.median(values) for name, values in rates.items()}
    crates: dict[str, list[float]] = {"KeyedLocks.hold": [], "textbook Semaphore dict": []}
    for _ in range(repeat):
        for name in crates:
            crates[name].append(contended(name, contended_ops)[0])
    cmed = {name: statistics.median(values) for name, values in crates.items()}
    m = memory("KeyedLocks.hold", distinct, distinct // 10)
    hold = med["KeyedLocks.hold"]
    return [
        (
            "locks, uncontended hold pairs",
            f"{hold:,.0f}/s",
            "textbook Semaphore(1) dict",
            f"{med['textbook Semaphore dict']:,.0f}/s",
            f"{hold / med['textbook Semaphore dict']:.2f}x",
            ">= 4x",
        ),
        (
            "locks, uncontended hold pairs",
            f"{hold:,.0f}/s",
            "plain threading.Lock",
            f"{med['threading.Lock']:,.0f}/s",
            f"{hold / med['threading.Lock']:.2f}x",
            "",
        ),
        (
            "locks, 4 threads on 16 keys",
            f"{cmed['KeyedLocks.hold']:,.0f}/s",
            "textbook Semaphore(1) dict",
            f"{cmed['textbook Semaphore dict']:,.0f}/s",
            f"{cmed['KeyedLocks.hold'] / cmed['textbook Semaphore dict']:.2f}x",
            ">= 1x",
        ),
        (
            f"locks, keys retained after {distinct:,} keys",
            str(m["keys_after_stream"] + m["keys_after_burst"]),
            "",
            "",
            "",
            "0",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=9, help="repetitions (medians printed)")
    parser.add_argument("--ops", type=int, default=100_000, help="uncontended pairs per run")
    parser.add_argument("--contended-ops", type=int, default=5_000, help="pairs per thread")
    parser.add_argument("--distinct", type=int, default=1_000_000, help="keys for memory")
    parser.add_argument("--at-once", type=int, default=100_000, help="keys held at once")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.ops, args.contended_ops = 3, 20_000, 1_000
        args.distinct, args.at_once = 100_000, 10_000

    print(f"Python {sys.version.split()[0]}, {args.repeat} repetitions, medians")

    print(f"\nuncontended: 1 thread, {args.ops:,} acquire+release pairs on distinct keys")
    rates: dict[str, list[float]] = {name: [] for name in UNCONTENDED}
    for _ in range(args.repeat):
        for name, run in UNCONTENDED.items():  # alternate, so noise hits everyone alike
            rates[name].append(run(args.ops))
    med = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in med.items():
        spread = f"(min {min(rates[name]):,.0f}, max {max(rates[name]):,.0f})"
        print(f"  {name:<26}{fmt(value)}  {spread}")
    hold_vs_textbook = med["KeyedLocks.hold"] / med["textbook Semaphore dict"]
    hold_vs_lock = med["KeyedLocks.hold"] / med["threading.Lock"]
    paired = paired_ratio(rates["KeyedLocks.hold"], rates["textbook Semaphore dict"])
    print(
        f"  ratio hold / textbook     {hold_vs_textbook:>8.2f}x   (goal >= 4x; "
        f"median of per-repetition ratios {paired:.2f}x)"
    )
    print(f"  ratio hold / plain Lock   {hold_vs_lock:>8.2f}x")

    print(
        f"\ncontended: 4 threads, 16 random keys, {args.contended_ops:,} pairs per thread, "
        "time.sleep(0) inside"
    )
    crates: dict[str, list[float]] = {"KeyedLocks.hold": [], "textbook Semaphore dict": []}
    waits: list[int] = []
    for _ in range(args.repeat):
        for name in crates:
            rate, waited = contended(name, args.contended_ops)
            crates[name].append(rate)
            if name == "KeyedLocks.hold":
                waits.append(waited)
    cmed = {name: statistics.median(values) for name, values in crates.items()}
    for name, value in cmed.items():
        spread = f"(min {min(crates[name]):,.0f}, max {max(crates[name]):,.0f})"
        print(f"  {name:<26}{fmt(value)}  {spread}")
    share = statistics.median(waits) / (4 * args.contended_ops)
    print(f"  KeyedLocks requests that had to wait: {share:.0%} (median)")
    contended_ratio = cmed["KeyedLocks.hold"] / cmed["textbook Semaphore dict"]
    cpaired = paired_ratio(crates["KeyedLocks.hold"], crates["textbook Semaphore dict"])
    print(
        f"  ratio hold / textbook     {contended_ratio:>8.2f}x   (goal >= 1x; "
        f"median of per-repetition ratios {cpaired:.2f}x)"
    )

    print(
        f"\nmemory: {args.distinct:,} distinct keys one after another / then {args.at_once:,} "
        "held at once and released / then as many more one after another "
        "(tracemalloc, fresh process each)"
    )
    retained = 0
    for name in ("KeyedLocks.hold", "textbook Semaphore dict"):
        m = memory(name, args.distinct, args.at_once)
        if name == "KeyedLocks.hold":
            retained = m["keys_after_stream"] + m["keys_after_burst"]
        print(
            f"  {name:<26}keys retained {m['keys_after_stream']} / {m['keys_after_burst']}; "
            f"bytes retained {m['bytes_after_stream']:,} / {m['bytes_after_burst']:,} / "
            f"{m['bytes_after_more']:,}; {m['bytes_while_held'] / args.at_once:,.0f} bytes "
            "per held key"
        )

    print("\ngoals")
    print(f"  hold >= 4x textbook uncontended: {hold_vs_textbook:.2f}x")
    print(f"  hold >= 1x textbook contended:   {contended_ratio:.2f}x")
    print(f"  zero keys retained:              {retained} keys")


if __name__ == "__main__":
    main()
