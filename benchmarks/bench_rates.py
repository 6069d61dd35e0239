"""Benchmark rate limits (``Rate``): fleet-wide admission on Redis, its accuracy, its overhead.

Rows (contenders alternate within one run; medians and ratios):

1. **Fleet rate admission, 4 processes, Redis, uncontended** (the rate far above the load, the
   fleet limit far above the jobs in flight): jobs per second through
   ``TenantScheduler(LIMIT, name=..., fleet=RedisLeases(...), rate=Rate(...))`` against a
   hand-written GCRA script driving the same jobs: redis-cell's ``CL.THROTTLE`` algorithm in
   Lua (``TIME``, the bucket's theoretical arrival time read and written back with a TTL),
   one ``EVALSHA`` per job, ``THREADS`` threads per process each looping script -> job
   (sleeping the wait it returns when refused). The baseline bounds starts and nothing else;
   rxcoord also holds a fenced, expiring permit per job under a fleet-wide limit, so each job
   costs it a release too (batched when a process is busy).
2. **Round trips to admit one job** (Redis, one process, one job at a time, with a rate): the
   store steps that admitted it, counted at the provider: the rate adds none.
3. **Accuracy**: the starts per second over 10 s at ``Rate(500, burst=10)`` with far more jobs
   offered, in one process (``TenantScheduler(rate=...)``, the in-process gate) and across 4
   processes (``fleet=`` Redis), as a ratio to 500/s. Long (about a minute): full run only.
   The burst absorbs the lateness of a waiter's wake-up, which with ``burst=1`` is lost time
   at every start (a strict spacing can only run slow).
4. **In-process overhead** of a rate far above the load, trivial async jobs: a coordinator with
   ``rate=Rate(...)`` against the same coordinator without it (goal >= 0.91x: at most 10% more
   per job; a job within its rate takes its token inline, ``RateAdmission.try_pass()``, with
   no ticket), and (a third contender) with an admission that grants at once, which shows
   what the general admission path costs.

Usage::

    python benchmarks/bench_rates.py [--redis-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import threading
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

PROCESSES = 4
LIMIT = 64  # fleet-wide permits, and per tenant: far above the jobs in flight (uncontended)
THREADS = 4  # per process, for the hand-written GCRA script (more threads ran it slower here)
TENANTS = 4
FAR_ABOVE = (1_000_000, 1_000)  # count per second, burst: a rate the load never reaches
ACCURATE = (500, 10)  # the accuracy rows' Rate(count, burst)

# redis-cell's GCRA (CL.THROTTLE key burst count period 1) as one script, in microseconds.
# KEYS: the bucket. ARGV: emission interval us, burst. Returns 0 (allowed) or the wait in us.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = interval * tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + interval
local allow_at = new_tat - tolerance
if now < allow_at then return math.ceil(allow_at - now) end
redis.call('SET', KEYS[1], string.format('%.17g', new_tat), 'PX',
  math.max(1, math.ceil((new_tat - now) / 1000)))
return 0
"""


# -- 1. fleet rate admission vs the hand-written script -----------------------------------------


def _gcra_worker(url: str, key: str, jobs: int, barrier: Barrier, out: Any) -> None:
    import redis

    client = redis.Redis.from_url(url)
    throttle = client.register_script(_GCRA)
    interval_us = repr(1e6 / FAR_ABOVE[0])
    throttle(keys=[key + ":warm"], args=[interval_us, FAR_ABOVE[1]])  # load the script first
    per_thread = [jobs // THREADS + (1 if i < jobs % THREADS else 0) for i in range(THREADS)]

    def loop(count: int) -> None:
        for _ in range(count):
            while (wait := int(throttle(keys=[key], args=[interval_us, FAR_ABOVE[1]]))) > 0:
                time.sleep(wait / 1e6)
            pass  # the trivial job

    threads = [threading.Thread(target=loop, args=(n,)) for n in per_thread]
    barrier.wait()
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.send((started, time.monotonic()))
    client.close()


def _rxcoord_worker(
    url: str, prefix: str, name: str, jobs: int, barrier: Barrier, out: Any
) -> None:
    from rxcoord import Rate, TenantScheduler
    from rxcoord.leases import RedisLeases

    provider = RedisLeases(url, prefix=prefix)
    scheduler = TenantScheduler(
        LIMIT,
        tenant_max_concurrency=LIMIT,
        tenant_max_queue_size=jobs,
        name=name,
        fleet=provider,
        rate=Rate(FAR_ABOVE[0], per=1.0, burst=FAR_ABOVE[1]),
    )
    scheduler.execute("warm", lambda: None).run()  # connections, scripts, subscription
    done = threading.Event()
    left = [jobs]
    lock = threading.Lock()

    def finished(*_: object) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    barrier.wait()
    started = time.monotonic()
    for i in range(jobs):
        scheduler.execute(f"tenant-{i % TENANTS}", lambda: None).subscribe(
            on_error=finished, on_completed=finished
        )
    done.wait()
    ended = time.monotonic()
    scheduler.close()
    provider.close()
    out.send((started, ended))


def fleet_jobs_per_second(kind: str, url: str, jobs: int) -> float:
    """Jobs per second of ``kind`` (rxcoord or gcra) in PROCESSES processes on one Redis."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    run = uuid.uuid4().hex[:8]
    pipes, procs = [], []
    per_process = jobs // PROCESSES
    for _ in range(PROCESSES):
        here, there = context.Pipe(duplex=False)
        if kind == "rxcoord":
            args: tuple[Any, ...] = (url, f"bench:{run}:", "rates", per_process, barrier, there)
            target: Any = _rxcoord_worker
        else:
            args = (url, f"bench:{run}:gcra", per_process, barrier, there)
            target = _gcra_worker
        proc = context.Process(target=target, args=args)
        proc.start()
        procs.append(proc)
        pipes.append(here)
    spans = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a {kind} worker failed (exit {proc.exitcode})")
    elapsed: float = max(end for _, end in spans) - min(start for start, _ in spans)
    return per_process * PROCESSES / elapsed


# -- 2. round trips to admit ----------------------------------------------------------------------


def admit_round_trips_per_job(url: str, jobs: int) -> tuple[float, float]:
    """(admission steps, all store round trips) per job: one process, one job at a time, under
    a rate the jobs never reach."""
    from rxcoord import FleetAdmission, Rate, TenantTaskCoordinator
    from rxcoord.leases import RedisLeases

    provider = RedisLeases(url, prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    counted = [0]
    acquire = provider._permits_acquire

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return acquire(*args, **kwargs)

    provider._permits_acquire = counting  # type: ignore[method-assign]
    fleet = FleetAdmission(provider, "rt", 4, rate=Rate(FAR_ABOVE[0], per=1.0, burst=FAR_ABOVE[1]))
    coordinator = TenantTaskCoordinator(
        name="rt",
        max_concurrency=4,
        admission=fleet.lane("rt", rate=Rate(FAR_ABOVE[0], per=1.0, burst=FAR_ABOVE[1])),
    )
    for _ in range(jobs):
        coordinator.execute(lambda: None).run()
    coordinator.close()  # waits for the last release
    stats = fleet.stats()
    fleet.close()
    provider.close()
    return counted[0] / jobs, stats.round_trips / jobs


# -- 3. accuracy ----------------------------------------------------------------------------------


def _achieved(starts: list[float], window: float) -> float:
    """Starts per second over ``window`` seconds beginning 1 s after the first start."""
    first = min(starts) + 1.0
    return sum(1 for t in starts if first <= t < first + window) / window


def accuracy_one_process(window: float) -> float:
    from rxcoord import Rate, TenantScheduler

    count, burst = ACCURATE
    per_tenant = int(count * (window + 3) / 8)
    starts: list[float] = []
    with TenantScheduler(
        16,
        tenant_max_concurrency=16,
        tenant_max_queue_size=per_tenant,
        rate=Rate(count, per=1.0, burst=burst),
    ) as scheduler:
        for i in range(per_tenant * 8):
            scheduler.execute(f"t{i % 8}", lambda: starts.append(time.monotonic())).subscribe(
                on_error=lambda _e: None
            )
        time.sleep(window + 1.5)
    return _achieved(starts, window)


def _accuracy_worker(
    url: str, prefix: str, jobs: int, window: float, barrier: Barrier, out: Any
) -> None:
    from rxcoord import Rate, TenantScheduler
    from rxcoord.leases import RedisLeases

    count, burst = ACCURATE
    starts: list[float] = []
    provider = RedisLeases(url, prefix=prefix)
    scheduler = TenantScheduler(
        16,
        tenant_max_concurrency=16,
        tenant_max_queue_size=jobs,
        name="accuracy",
        fleet=provider,
        rate=Rate(count, per=1.0, burst=burst),
    )
    barrier.wait()
    for i in range(jobs):
        scheduler.execute(f"t{i % 2}", lambda: starts.append(time.monotonic())).subscribe(
            on_error=lambda _e: None
        )
    time.sleep(window + 1.5)
    out.send(list(starts))
    scheduler.close()
    provider.close()


def accuracy_processes(url: str, window: float) -> float:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    jobs = int(ACCURATE[0] * (window + 3) / PROCESSES) * 2  # twice the share of each
    pipes, procs = [], []
    for _ in range(PROCESSES):
        here, there = context.Pipe(duplex=False)
        proc = context.Process(
            target=_accuracy_worker, args=(url, prefix, jobs, window, barrier, there)
        )
        proc.start()
        procs.append(proc)
        pipes.append(here)
    starts: list[float] = []
    for pipe in pipes:
        starts.extend(pipe.recv())  # CLOCK_MONOTONIC: one clock for the machine's processes
    for proc in procs:
        proc.join()
    return _achieved(starts, window)


# -- 4. in-process overhead (prepared for TenantTaskCoordinator(rate=...)) ------------------------


async def _trivial() -> int:
    return 1


class _AtOnce:
    """An admission that grants every ticket at once: the admission path's own cost."""

    def request(self, ticket: Any) -> None:
        ticket.grant(None)

    def withdraw(self, ticket: Any) -> bool:
        return False

    def release(self, permit: object) -> None:
        pass


def coordinator_async_jobs_per_second(jobs: int, kind: str) -> float:
    """``kind``: ``rate`` (``rate=Rate(...)``), ``none``, or ``at-once``."""
    from rxcoord import Admission, Rate, TenantTaskCoordinator

    async def main() -> float:
        admission: Admission | None = _AtOnce() if kind == "at-once" else None
        rate = Rate(FAR_ABOVE[0], per=1.0, burst=FAR_ABOVE[1]) if kind == "rate" else None
        async with TenantTaskCoordinator(
            max_concurrency=8, max_queue_size=jobs, admission=admission, rate=rate
        ) as coordinator:
            start = time.perf_counter()
            await asyncio.gather(*(coordinator.execute(_trivial) for _ in range(jobs)))
            return jobs / (time.perf_counter() - start)

    return asyncio.run(main())


# -- the rows -------------------------------------------------------------------------------------


def reachable_redis(url: str) -> str | None:
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        client.ping()
        client.close()
    except Exception as exc:  # the reason goes into the note
        return f"{type(exc).__name__}: {exc}"
    return None


Row = tuple[str, str, str, str, str, str]


def fleet_rows(url: str, jobs: int, repeat: int) -> list[Row]:
    rates: dict[str, list[float]] = {"rxcoord": [], "gcra": []}
    for _ in range(repeat):  # alternate, so drifting machine load hits both alike
        for kind in rates:
            rates[kind].append(fleet_jobs_per_second(kind, url, jobs))
    ours, theirs = (statistics.median(rates[k]) for k in ("rxcoord", "gcra"))
    admits, trips = admit_round_trips_per_job(url, 200)
    return [
        (
            f"fleet rate, {PROCESSES} processes, trivial jobs, uncontended (Redis)",
            f"{ours:,.0f} jobs/s",
            "hand-written GCRA script (redis-cell's)",
            f"{theirs:,.0f} jobs/s",
            f"{ours / theirs:.2f}x",
            ">= 0.9x",
        ),
        (
            "fleet rate, round trips to admit a job (Redis)",
            f"{admits:.2f}",
            f"all round trips per job: {trips:.2f}",
            "",
            "",
            "1",
        ),
    ]


def accuracy_rows(url: str | None, window: float) -> list[Row]:
    count, burst = ACCURATE
    rows: list[Row] = []
    achieved = accuracy_one_process(window)
    rows.append(
        (
            f"rate accuracy, Rate({count}, burst={burst}), {window:g} s, one process",
            f"{achieved:,.1f} starts/s",
            "configured",
            f"{count}/s",
            f"{achieved / count:.3f}x",
            ">= 0.98x",
        )
    )
    if url is not None:
        achieved = accuracy_processes(url, window)
        rows.append(
            (
                f"rate accuracy, Rate({count}, burst={burst}), {window:g} s, "
                f"{PROCESSES} processes (Redis)",
                f"{achieved:,.1f} starts/s",
                "configured",
                f"{count}/s",
                f"{achieved / count:.3f}x",
                ">= 0.98x",
            )
        )
    return rows


def overhead_rows(jobs: int, repeat: int) -> list[Row]:
    rates: dict[str, list[float]] = {"none": [], "rate": [], "at-once": []}
    for _ in range(repeat):
        for kind in rates:
            rates[kind].append(coordinator_async_jobs_per_second(jobs, kind))
    ours, theirs, at_once = (statistics.median(rates[k]) for k in ("rate", "none", "at-once"))
    return [
        (
            "coordinator, rate far above the load, trivial async jobs (rate=Rate(...))",
            f"{ours:,.0f} jobs/s",
            "the same coordinator without a rate",
            f"{theirs:,.0f} jobs/s",
            f"{ours / theirs:.2f}x",
            ">= 0.91x",
        ),
        (
            "  the same, rate=Rate(...)",
            f"{ours:,.0f} jobs/s",
            "with an admission granting at once",
            f"{at_once:,.0f} jobs/s",
            f"{ours / at_once:.2f}x",
            "",
        ),
    ]


def bench_rows(
    quick: bool,
    *,
    redis_url: str | None = None,
    notes: list[str] | None = None,
    **options: object,
) -> list[Row]:
    """Rows for ``rxcoord bench``: the Redis rows need a reachable server (else a note); the
    accuracy rows (a minute) only in a full run."""
    notes = notes if notes is not None else []
    rows: list[Row] = []
    problem = reachable_redis(redis_url) if redis_url else "no --redis-url"
    url = None if problem else redis_url
    if url is None:
        notes.append(
            f"fleet rate rows left out: {redis_url or 'no URL'} is unreachable ({problem})"
        )
    else:
        rows += fleet_rows(url, *((2000, 3) if quick else (8000, 5)))
    rows += overhead_rows(*((5000, 3) if quick else (20000, 5)))
    if quick:
        notes.append("rate accuracy rows (10 s each) left out of --quick: run the full bench")
    else:
        rows += accuracy_rows(url, 10.0)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    problem = reachable_redis(args.redis_url)
    if problem:
        sys.exit(f"Redis at {args.redis_url} is unreachable: {problem}")
    notes: list[str] = []
    for row in bench_rows(args.quick, redis_url=args.redis_url, notes=notes):
        print(" | ".join(row))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
