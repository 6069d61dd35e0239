"""Benchmark fleet-wide limits (``fleet=``) against a minimal hand-written Redis semaphore.

Both run trivial jobs through one limit shared by 4 OS processes on the same Redis server:

* **rxcoord**: each process is a ``TenantScheduler(LIMIT, tenant_max_concurrency=LIMIT,
  name=..., fleet=RedisLeases(...))`` and submits its jobs (spread over 4 tenants) at once:
  expiring fenced permits, per-tenant limits, fair shares in the store, notifications,
  keep-alive.
* **hand-written semaphore**: what a user writes without rxcoord: a sorted set of expiring
  permits, one ``EVALSHA`` to acquire (drop expired members, count, add) and one to release
  (``ZREM``), ``THREADS`` threads per process each looping acquire -> job -> release and
  retrying a refused acquire after a short sleep. No tenants, no fairness, no keep-alive, no
  fencing tokens.

Jobs per second from the moment every process is ready until the last job ends, medians over
repetitions that alternate the contenders (a shared, noisy 2-core machine: only the ratio in
one run means much); and the store round trips of an uncontended job (one process, one job at
a time: ``FleetStats.round_trips`` per job). Usage::

    python benchmarks/bench_fleet.py [--redis-url URL] [--jobs N] [--repeat R] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

from rxcoord._cli.bench import left_out, missing

PROCESSES = 4
LIMIT = 8
THREADS = 4  # per process, for the hand-written semaphore (16 threads for 8 permits)
TENANTS = 4
RETRY = 0.0005  # seconds the hand-written semaphore sleeps after a refused acquire

# KEYS: the permit set. ARGV: member, now in ms (the script reads TIME), ttl ms, limit.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  return 1
end
return 0
"""
_RELEASE = "return redis.call('ZREM', KEYS[1], ARGV[1])"


def _semaphore_worker(url: str, key: str, jobs: int, barrier: Barrier, out: Any) -> None:
    import redis

    client = redis.Redis.from_url(url)
    acquire = client.register_script(_ACQUIRE)
    release = client.register_script(_RELEASE)
    acquire(keys=[key], args=["warm", 1, LIMIT])  # load the scripts before the clock starts
    release(keys=[key], args=["warm"])
    per_thread = [jobs // THREADS + (1 if i < jobs % THREADS else 0) for i in range(THREADS)]

    def loop(count: int) -> None:
        for _ in range(count):
            member = uuid.uuid4().hex
            while not acquire(keys=[key], args=[member, 30_000, LIMIT]):
                time.sleep(RETRY)
            try:
                pass  # the trivial job
            finally:
                release(keys=[key], args=[member])

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
    from rxcoord import TenantScheduler
    from rxcoord.leases import RedisLeases

    provider = RedisLeases(url, prefix=prefix)
    scheduler = TenantScheduler(
        LIMIT,
        tenant_max_concurrency=LIMIT,
        tenant_max_queue_size=jobs,
        name=name,
        fleet=provider,
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


def fleet_rate(kind: str, url: str, jobs: int) -> float:
    """Jobs per second through one limit shared by PROCESSES processes."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    run = uuid.uuid4().hex[:8]
    pipes = []
    procs = []
    per_process = jobs // PROCESSES
    for _ in range(PROCESSES):
        here, there = context.Pipe(duplex=False)
        if kind == "rxcoord":
            args: tuple[Any, ...] = (url, f"bench:{run}:", "fleet", per_process, barrier, there)
            target: Any = _rxcoord_worker
        else:
            args = (url, f"bench:{run}:semaphore", per_process, barrier, there)
            target = _semaphore_worker
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


def round_trips_per_job(url: str, jobs: int) -> float:
    """Store round trips of an uncontended job: one process, one job at a time."""
    from rxcoord import TenantTaskCoordinator
    from rxcoord.leases import RedisLeases

    provider = RedisLeases(url, prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    coordinator = TenantTaskCoordinator(name="rt", max_concurrency=4, fleet=provider)
    for _ in range(jobs):
        coordinator.execute(lambda: None).run()
    coordinator.close()  # waits for the last release
    stats = coordinator.stats().fleet
    provider.close()
    assert stats is not None
    return stats.round_trips / jobs


def reachable_redis(url: str) -> str | None:
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        client.ping()
        client.close()
    except Exception as exc:  # the reason goes into the note
        return f"{type(exc).__name__}: {exc}"
    return None


def bench_rows(
    quick: bool,
    *,
    redis_url: str | None = None,
    notes: list[str] | None = None,
    **options: object,
) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``; without a reachable Redis, none (with a note)."""
    notes = notes if notes is not None else []
    if missing("redis"):
        notes.append(left_out("fleet rows", "redis"))
        return []
    problem = reachable_redis(redis_url) if redis_url else "no --redis-url"
    if problem or not redis_url:
        notes.append(f"fleet rows left out: {redis_url or 'no URL'} is unreachable ({problem})")
        return []
    jobs, repeat = (2000, 3) if quick else (8000, 5)
    return rows_for(redis_url, jobs, repeat)


def rows_for(url: str, jobs: int, repeat: int) -> list[tuple[str, str, str, str, str, str]]:
    rates: dict[str, list[float]] = {"rxcoord": [], "semaphore": []}
    for _ in range(repeat):  # alternate, so drifting machine load hits both alike
        for kind in rates:
            rates[kind].append(fleet_rate(kind, url, jobs))
    ours, theirs = (statistics.median(rates[k]) for k in ("rxcoord", "semaphore"))
    trips = round_trips_per_job(url, 200)
    return [
        (
            f"fleet limit {LIMIT}, {PROCESSES} processes, trivial jobs (Redis)",
            f"{ours:,.0f} jobs/s",
            "hand-written Redis semaphore",
            f"{theirs:,.0f} jobs/s",
            f"{ours / theirs:.2f}x",
            ">= 0.9x",
        ),
        (
            "fleet, round trips per uncontended job (Redis)",
            f"{trips:.2f}",
            "",
            "",
            "",
            "2",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--jobs", type=int, default=8000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    problem = reachable_redis(args.redis_url)
    if problem:
        sys.exit(f"Redis at {args.redis_url} is unreachable: {problem}")
    jobs, repeat = (2000, 3) if args.quick else (args.jobs, args.repeat)
    for row in rows_for(args.redis_url, jobs, repeat):
        print(" | ".join(row))


if __name__ == "__main__":
    main()
