"""Benchmark rxcoord's distributed leases against the usual alternatives, on the same servers.

Redis (one server, one client process):
    try_acquire + release pairs per second for ``RedisLeases``, redis-py's ``Lock``,
    python-redis-lock, and the raw ``SET NX PX`` + ``DEL`` pair (no token check: the floor);
    round trips per pair (counted by the client connection) and server commands per pair (from
    ``INFO commandstats``, which also counts the commands Lua scripts run);
    hand-off latency: the holder releases in one process, the waiter wakes in another
    (``time.monotonic`` is one system-wide clock on Linux, so the two processes' readings
    compare).
PostgreSQL:
    pairs per second for ``PostgresLeases`` (durable, and with ``durable=False``), each beside
    the floor of its own approach measured in the same run (a hand-written lease row: one
    prepared ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` to grant, one ``UPDATE`` to
    release, autocommit; on an unlogged table with ``synchronous_commit=off`` for
    ``durable=False``), and a plain ``pg_try_advisory_lock`` / ``pg_advisory_unlock`` pair;
    with no goal, the unlogged floor through libpq's calls, the client path PostgresLeases takes
    for its grants and releases (so the two compare what the server spends on each);
    the rows left behind by distinct names acquired and released once each; hand-off latency.

Repetitions alternate the contenders and the medians are printed with ratios: the machine is a
noisy shared 2-core box, so only ratios within one run mean much. Usage::

    python benchmarks/bench_leases.py [--redis-url URL] [--postgres-url URL]
                                      [--pairs N] [--repeat R] [--handoffs H] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import redis
from redis.connection import Connection as RedisConnection

from rxcoord._cli.bench import left_out, missing
from rxcoord.leases import PostgresLeases, RedisLeases

Pair = Callable[[], None]


class CountingConnection(RedisConnection):
    """A redis-py connection that counts what it sends: one send is one round trip."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def redis_client(url: str, *, counting: bool = False) -> redis.Redis:
    kwargs: dict[str, Any] = {}
    if counting:
        kwargs["connection_class"] = CountingConnection
    pool = redis.ConnectionPool.from_url(url, **kwargs)
    return redis.Redis(connection_pool=pool)


# -- Redis contenders ------------------------------------------------------------------------


def redis_contenders(url: str, client: redis.Redis, prefix: str) -> dict[str, tuple[Pair, Any]]:
    """name -> (one acquire+release pair, an object to close afterwards).

    python-redis-lock is a contender only where it is installed (``rxcoord[bench]``).
    """
    # The same connection settings as the other contenders (RedisLeases makes its own
    # connections, without redis-py's retries: see rxcoord/leases/_backends/_redis.py).
    leases = RedisLeases(url, prefix=prefix, client=client)

    def ours() -> None:
        lease = leases.try_acquire("bench", 30.0)
        assert lease is not None
        lease.release()

    def redis_py_lock() -> None:
        lock = client.lock(prefix + "redis-py", timeout=30)
        assert lock.acquire(blocking=False)
        lock.release()

    def python_redis_lock() -> None:
        import redis_lock

        lock = redis_lock.Lock(client, prefix + "prl", expire=30)
        assert lock.acquire(blocking=False)
        lock.release()

    def raw_pair() -> None:
        assert client.set(prefix + "raw", b"1", nx=True, px=30000)
        client.delete(prefix + "raw")

    contenders: dict[str, tuple[Pair, Any]] = {
        "RedisLeases": (ours, leases),
        "redis-py Lock": (redis_py_lock, None),
        "python-redis-lock": (python_redis_lock, None),
        "raw SET NX PX + DEL": (raw_pair, None),
    }
    if missing("redis_lock"):
        del contenders["python-redis-lock"]
    return contenders


def pairs_per_second(pair: Pair, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        pair()
    return n / (time.perf_counter() - started)


def measure(
    contenders: dict[str, Pair],
    pairs: int,
    repeat: int,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Pairs/s per contender, ``repeat`` runs each, alternating.

    ``cpu``, if given, receives the client's own CPU time per pair in microseconds (this
    thread's CPU, syscalls included): what a lock costs the service, apart from the round trips
    it waits for. On a fast loopback the round trips bound every contender's rate alike.
    """
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for pair in contenders.values():  # warm up: scripts loaded, connections open
        for _ in range(50):
            pair()
    for _ in range(repeat):
        for name, pair in contenders.items():  # alternate, so drift hits everyone alike
            started = time.thread_time()
            results[name].append(pairs_per_second(pair, pairs))
            if cpu is not None:
                cpu.setdefault(name, []).append((time.thread_time() - started) / pairs * 1e6)
    return results


def print_rates(
    title: str,
    results: dict[str, list[float]],
    reference: str,
    cpu: dict[str, list[float]] | None = None,
) -> None:
    print(f"\n{title} (median of {len(next(iter(results.values())))} runs)")
    base = statistics.median(results[reference])
    for name, rates in results.items():
        median = statistics.median(rates)
        spread = f"{min(rates):7.0f}..{max(rates):<7.0f}"
        ratio = base / median
        used = f"  client CPU {statistics.median(cpu[name]):5.1f} us/pair" if cpu else ""
        print(
            f"  {name:<28} {median:8.0f} pairs/s  [{spread}]  {reference}/this {ratio:4.2f}x" + used
        )


def commands_per_pair(url: str, prefix: str, pairs: int) -> dict[str, tuple[float, float, str]]:
    """Round trips (client side) and server commands (INFO commandstats) per pair."""
    info = redis_client(url)
    counting = redis_client(url, counting=True)
    contenders = redis_contenders(url, counting, prefix)
    pairs_of: dict[str, Pair] = {name: pair for name, (pair, _) in contenders.items()}
    counts: dict[str, tuple[float, float, str]] = {}
    for name, pair in pairs_of.items():
        for _ in range(20):
            pair()
        before = _commandstats(info)
        sent_before = CountingConnection.sent
        for _ in range(pairs):
            pair()
        sent = CountingConnection.sent - sent_before
        after = _commandstats(info)
        after["info"] = after.get("info", 0) - 1  # our own INFO call
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        calls = {k: v / pairs for k, v in sorted(delta.items()) if v > 0 and k != "info"}
        detail = " ".join(f"{k}={v:.2f}" for k, v in calls.items())
        counts[name] = (sent / pairs, sum(calls.values()), detail)
    for _, closer in contenders.values():
        if closer is not None:
            closer.close()
    counting.close()
    info.close()
    return counts


def print_commands(counts: dict[str, tuple[float, float, str]], pairs: int) -> None:
    print(f"\nRedis round trips and commands per acquire+release pair ({pairs} pairs each)")
    for name, (trips, total, detail) in counts.items():
        print(f"  {name:<22} round trips {trips:4.2f}  server commands {total:4.2f}  ({detail})")


def _commandstats(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()}


# -- hand-off latency ------------------------------------------------------------------------


def pg_table(prefix: str) -> str:
    """A table name (an identifier) for a namespace prefix."""
    return re.sub(r"\W", "_", prefix).strip("_")


def _waiter(kind: str, url: str, prefix: str, rounds: int, conn: Connection) -> None:
    """In another process: on each "go", block until the lock is ours; report when we woke."""
    acquire, release, closer = _blocking_lock(kind, url, prefix)
    try:
        conn.send("ready")
        for _ in range(rounds):
            conn.recv()
            handle = acquire()
            woke = time.monotonic()
            release(handle)
            conn.send(woke)
    finally:
        closer()


def _blocking_lock(
    kind: str, url: str, prefix: str
) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    """(acquire -> handle, release(handle), close) for one contender."""
    if kind in ("RedisLeases", "PostgresLeases"):
        leases: Any
        if kind == "RedisLeases":
            leases = RedisLeases(url, prefix=prefix)
        else:
            leases = PostgresLeases(url, table=pg_table(prefix))
        return (
            lambda: leases.acquire("handoff", 30.0, timeout=30.0),
            lambda lease: lease.release(),
            leases.close,
        )
    client = redis.Redis.from_url(url)
    if kind == "python-redis-lock":
        import redis_lock

        def acquire_prl() -> Any:
            lock = redis_lock.Lock(client, prefix + "handoff", expire=30)
            assert lock.acquire(blocking=True, timeout=30)
            return lock

        return acquire_prl, lambda lock: lock.release(), client.close

    def acquire_redis_py() -> Any:
        lock = client.lock(prefix + "handoff", timeout=30)
        assert lock.acquire(blocking=True, blocking_timeout=30)
        return lock

    return acquire_redis_py, lambda lock: lock.release(), client.close


def handoff_latencies(
    kinds: list[str], url: str, prefix: str, rounds: int, block: int = 10
) -> dict[str, list[float]]:
    """Release here, wake there: milliseconds per round, for each contender.

    Every contender has its waiter process running throughout; rounds alternate between the
    contenders in blocks, so load changes on the machine hit them alike.
    """
    context = multiprocessing.get_context("spawn")
    pipes: dict[str, Connection] = {}
    waiters = []
    locks = {}
    for i, kind in enumerate(kinds):
        here, there = context.Pipe()
        waiter = context.Process(target=_waiter, args=(kind, url, f"{prefix}{i}:", rounds, there))
        waiter.start()
        waiters.append(waiter)
        pipes[kind] = here
        locks[kind] = _blocking_lock(kind, url, f"{prefix}{i}:")
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for kind in kinds:
            assert pipes[kind].recv() == "ready"
        done = 0
        while done < rounds:
            count = min(block, rounds - done)
            for kind in kinds:
                acquire, release, _ = locks[kind]
                for _ in range(count):
                    handle = acquire()
                    pipes[kind].send("go")
                    time.sleep(0.02)  # the waiter is blocked in acquire by now
                    released = time.monotonic()
                    release(handle)
                    woke: float = pipes[kind].recv()
                    latencies[kind].append((woke - released) * 1000.0)
            done += count
    finally:
        for waiter in waiters:
            waiter.join(30)
        for _, _, closer in locks.values():
            closer()
    return latencies


def print_handoffs(results: dict[str, list[float]], reference: str) -> None:
    print("\nHand-off latency: release in one process -> wake in another")
    base = statistics.median(results[reference])
    for name, latencies in results.items():
        ordered = sorted(latencies)
        median = statistics.median(ordered)
        p90 = ordered[max(0, int(len(ordered) * 0.9) - 1)]
        print(
            f"  {name:<22} median {median:7.2f} ms  p90 {p90:7.2f} ms  "
            f"this/{reference} {median / base:5.2f}x  ({len(ordered)} rounds)"
        )


# -- PostgreSQL ------------------------------------------------------------------------------


def postgres_contenders(url: str, table: str) -> tuple[dict[str, Pair], list[Any]]:
    """Our two modes, each beside the floor of its own approach, and the advisory-lock pair.

    The floors are what a hand-written lease row costs: one prepared ``INSERT ... ON CONFLICT
    DO UPDATE ... RETURNING`` to grant (with the expiry check), one ``UPDATE`` to release, in
    autocommit; on a logged table for the durable mode, on an unlogged table with
    ``synchronous_commit=off`` for ``durable=False``. Each contender has a table of its own.
    """
    import psycopg

    durable = PostgresLeases(url, table=f"{table}_d")
    fast = PostgresLeases(url, table=f"{table}_f", durable=False)
    conn = psycopg.connect(url, autocommit=True)
    floors: dict[str, Pair] = {}
    closers: list[Any] = [durable, fast, conn]
    for label, unlogged in (("durable", False), ("unlogged", True)):
        floor_conn = psycopg.connect(url, autocommit=True)
        closers.append(floor_conn)
        relation = f'"{table}_floor_{label}"'
        floor_conn.execute(
            f"CREATE {'UNLOGGED ' if unlogged else ''}TABLE {relation} "
            "(name text PRIMARY KEY, token bigint NOT NULL, until timestamptz NOT NULL)"
        )
        if unlogged:
            floor_conn.execute("SET synchronous_commit = off")
        grant = (
            f"INSERT INTO {relation} AS l (name, token, until) VALUES "
            "(%s, 1, clock_timestamp() + make_interval(secs => 30)) ON CONFLICT (name) DO "
            "UPDATE SET token = l.token + 1, until = excluded.until "
            "WHERE l.until <= clock_timestamp() RETURNING l.token"
        )
        release = (
            f"UPDATE {relation} SET until = clock_timestamp() WHERE name = %s AND token = %s "
            "AND until > clock_timestamp()"
        )

        def floor(c: Any = floor_conn, grant: str = grant, release: str = release) -> None:
            row = c.execute(grant, ("bench",), prepare=True).fetchone()
            assert row is not None
            cursor = c.execute(release, ("bench", row[0]), prepare=True)
            assert cursor.rowcount == 1

        floors[label] = floor

    # Not a goal: the unlogged floor's two statements through the client path PostgresLeases
    # takes for its grants and releases (libpq's calls, see DeadlineConnection.run_prepared),
    # so that the ratio of the two shows what the server spends on each side's statements.
    from rxcoord.leases._backends._pg_deadline import DeadlineConnection, Prepared

    libpq_conn = DeadlineConnection.connect(url, autocommit=True)
    libpq_conn.execute("SET synchronous_commit = off")
    closers.append(libpq_conn)
    relation = f'"{table}_floor_unlogged"'
    libpq_grant = Prepared(
        f"INSERT INTO {relation} AS l (name, token, until) VALUES "
        "(%(name)s, 1, clock_timestamp() + make_interval(secs => 30)) ON CONFLICT (name) DO "
        "UPDATE SET token = l.token + 1, until = excluded.until "
        "WHERE l.until <= clock_timestamp() RETURNING l.token"
    )
    libpq_release = Prepared(
        f"UPDATE {relation} SET until = clock_timestamp() WHERE name = %(name)s "
        "AND token = %(token)s AND until > clock_timestamp() RETURNING 1"
    )

    def libpq_floor() -> None:
        row = libpq_conn.run_prepared(libpq_grant, ("bench-libpq",))
        token = row.get_value(0, 0)
        assert token is not None
        done = libpq_conn.run_prepared(libpq_release, ("bench-libpq", int(token)))
        assert done.ntuples == 1

    def lease_pair(leases: PostgresLeases) -> Pair:
        def pair() -> None:
            lease = leases.try_acquire("bench", 30.0)
            assert lease is not None
            lease.release()

        return pair

    def advisory() -> None:
        row = conn.execute("SELECT pg_try_advisory_lock(42)").fetchone()
        assert row is not None
        assert row[0]
        conn.execute("SELECT pg_advisory_unlock(42)").fetchone()

    contenders = {
        "PostgresLeases": lease_pair(durable),
        "lease-row floor (durable)": floors["durable"],
        "PostgresLeases durable=False": lease_pair(fast),
        "lease-row floor (unlogged)": floors["unlogged"],
        "  same floor via libpq calls": libpq_floor,
        "pg_try_advisory_lock pair": advisory,
    }
    return contenders, closers


POSTGRES_GOALS: list[tuple[str, str, str, float]] = [
    # (label, ours, theirs, at least)
    ("durable >= 0.9x its lease-row floor", "PostgresLeases", "lease-row floor (durable)", 0.9),
    (
        "durable=False >= 0.9x its floor (unlogged, async commit)",
        "PostgresLeases durable=False",
        "lease-row floor (unlogged)",
        0.9,
    ),
    ("durable >= 0.2x advisory pair", "PostgresLeases", "pg_try_advisory_lock pair", 0.2),
    (
        "durable=False >= 0.5x advisory pair",
        "PostgresLeases durable=False",
        "pg_try_advisory_lock pair",
        0.5,
    ),
]


def postgres_rows_left_behind(url: str, table: str, names: int) -> tuple[int, int]:
    """Distinct names acquired and released once each; rows left in the table afterwards."""
    import psycopg

    with PostgresLeases(url, table=f"{table}_churn") as leases:
        for i in range(names):
            lease = leases.try_acquire(f"churn-{i}", 30.0)
            assert lease is not None
            lease.release()
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{table}_churn"').fetchone()
    return names, int(row[0]) if row else -1


def drop_postgres_tables(url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for suffix in ("_d", "_f", "_churn"):
            conn.execute(f'DROP TABLE IF EXISTS "{table}{suffix}"')
            conn.execute(f'DROP SEQUENCE IF EXISTS "{table}{suffix}_token_seq"')
        for label in ("durable", "unlogged"):
            conn.execute(f'DROP TABLE IF EXISTS "{table}_floor_{label}"')


# -- main ------------------------------------------------------------------------------------


def reachable_redis(url: str) -> str | None:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=2) as client:
            client.ping()
    except redis.RedisError as exc:
        return str(exc)
    return None


def reachable_postgres(url: str) -> str | None:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip()
    return None


def bench_rows(
    quick: bool,
    *,
    redis_url: str | None = None,
    postgres_url: str | None = None,
    notes: list[str] | None = None,
    **options: object,
) -> list[tuple[str, str, str, str, str, str]]:
    """Rows for ``rxcoord bench``; a store that is unreachable is left out, with a note."""
    pairs, repeat, handoffs = (300, 3, 15) if quick else (2000, 5, 60)
    notes = notes if notes is not None else []
    rows: list[tuple[str, str, str, str, str, str]] = []
    run = uuid.uuid4().hex[:8]
    problem = reachable_redis(redis_url) if redis_url else "no --redis-url"
    if problem or not redis_url:
        notes.append(f"Redis rows left out: {redis_url or 'no URL'} is unreachable ({problem})")
    else:
        prefix = f"bench:{run}:"
        client = redis_client(redis_url)
        contenders = redis_contenders(redis_url, client, prefix)
        cpu: dict[str, list[float]] = {}
        rates = measure({n: p for n, (p, _) in contenders.items()}, pairs, repeat, cpu)
        for _, closer in contenders.values():
            if closer is not None:
                closer.close()
        client.close()
        ours = statistics.median(rates["RedisLeases"])
        if "python-redis-lock" not in rates:
            notes.append(left_out("python-redis-lock rows", "redis_lock"))
        for baseline, goal in (
            ("redis-py Lock", ">= 1.2x"),
            ("python-redis-lock", ""),
            ("raw SET NX PX + DEL", ">= 0.9x"),
        ):
            if baseline not in rates:
                continue
            theirs = statistics.median(rates[baseline])
            rows.append(
                (
                    "leases, Redis try_acquire+release",
                    f"{ours:,.0f} pairs/s",
                    baseline,
                    f"{theirs:,.0f} pairs/s",
                    f"{ours / theirs:.2f}x",
                    goal,
                )
            )
        ours_cpu = statistics.median(cpu["RedisLeases"])
        theirs_cpu = statistics.median(cpu["redis-py Lock"])
        rows.append(
            (
                "leases, Redis client CPU per pair",
                f"{ours_cpu:.0f} us",
                "redis-py Lock",
                f"{theirs_cpu:.0f} us",
                f"{ours_cpu / theirs_cpu:.2f}x",
                "",
            )
        )
        counts = commands_per_pair(redis_url, prefix, min(pairs, 500))
        rows.append(
            (
                "leases, Redis round trips per pair",
                f"{counts['RedisLeases'][0]:.2f}",
                "redis-py Lock",
                f"{counts['redis-py Lock'][0]:.2f}",
                "",
                "2",
            )
        )
        if "python-redis-lock" in rates:  # the hand-off's baseline: it waits without polling
            latency = handoff_latencies(
                ["RedisLeases", "python-redis-lock"], redis_url, prefix, handoffs
            )
            ours_ms = statistics.median(latency["RedisLeases"])
            theirs_ms = statistics.median(latency["python-redis-lock"])
            rows.append(
                (
                    "leases, Redis hand-off (release -> wake)",
                    f"{ours_ms:.2f} ms",
                    "python-redis-lock",
                    f"{theirs_ms:.2f} ms",
                    f"{ours_ms / theirs_ms:.2f}x",
                    "<= 1x",
                )
            )
    if missing("psycopg"):
        notes.append(left_out("PostgreSQL rows", "psycopg"))
        return rows
    problem = reachable_postgres(postgres_url) if postgres_url else "no --postgres-url"
    if problem or not postgres_url:
        notes.append(
            f"PostgreSQL rows left out: {postgres_url or 'no URL'} is unreachable ({problem})"
        )
    else:
        table = f"bench_leases_{run}"
        contenders_pg, closers = postgres_contenders(postgres_url, table)
        try:
            rates = measure(contenders_pg, max(100, pairs // 4), repeat)
            churned, left = postgres_rows_left_behind(postgres_url, table, 200 if quick else 2000)
        finally:
            for closer in closers:
                closer.close()
            drop_postgres_tables(postgres_url, table)
        for _, ours_name, theirs_name, at_least in POSTGRES_GOALS:
            ours = statistics.median(rates[ours_name])
            theirs = statistics.median(rates[theirs_name])
            mode = ours_name.removeprefix("PostgresLeases").strip() or "durable"
            rows.append(
                (
                    f"leases, PostgreSQL {mode}",
                    f"{ours:,.0f} pairs/s",
                    theirs_name,
                    f"{theirs:,.0f} pairs/s",
                    f"{ours / theirs:.2f}x",
                    f">= {at_least}x",
                )
            )
        rows.append(
            (
                "leases, PostgreSQL rows left behind",
                f"{left} rows",
                f"{churned:,} names acquired+released",
                "",
                "",
                "0",
            )
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--pairs", type=int, default=2000, help="pairs per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per contender")
    parser.add_argument("--handoffs", type=int, default=60, help="hand-off rounds")
    parser.add_argument("--quick", action="store_true", help="small counts (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.repeat, args.handoffs = 200, 2, 10
    run = uuid.uuid4().hex[:8]
    print(f"bench_leases: {args.pairs} pairs x {args.repeat} runs, {args.handoffs} hand-offs")

    problem = reachable_redis(args.redis_url)
    if problem:
        print(f"\nRedis at {args.redis_url} is unreachable ({problem}): skipping Redis benchmarks")
    else:
        print(f"\nRedis: {args.redis_url}")
        prefix = f"bench:{run}:"
        client = redis_client(args.redis_url)
        contenders = redis_contenders(args.redis_url, client, prefix)
        cpu: dict[str, list[float]] = {}
        results = measure({n: p for n, (p, _) in contenders.items()}, args.pairs, args.repeat, cpu)
        print_rates("Redis try_acquire + release", results, "RedisLeases", cpu)
        ours = statistics.median(results["RedisLeases"])
        goals = [
            (
                "RedisLeases >= 1.2x redis-py Lock",
                ours / statistics.median(results["redis-py Lock"]),
                1.2,
            ),
            (
                "RedisLeases >= 0.9x raw pair",
                ours / statistics.median(results["raw SET NX PX + DEL"]),
                0.9,
            ),
        ]
        for _, closer in contenders.values():
            if closer is not None:
                closer.close()
        client.close()
        counted = min(args.pairs, 500)
        print_commands(commands_per_pair(args.redis_url, prefix, counted), counted)
        if missing("redis_lock"):
            sys.exit(left_out("python-redis-lock rows", "redis_lock"))
        handoffs = handoff_latencies(
            ["RedisLeases", "python-redis-lock"], args.redis_url, prefix, args.handoffs
        )
        # redis-py's Lock polls (sleep=0.1 s): a handful of rounds shows it.
        handoffs |= handoff_latencies(
            ["redis-py Lock"], args.redis_url, prefix + "polling:", max(5, args.handoffs // 6)
        )
        print_handoffs(handoffs, "python-redis-lock")
        ratio = statistics.median(handoffs["RedisLeases"]) / statistics.median(
            handoffs["python-redis-lock"]
        )
        print("\nGoals")
        for label, value, target in goals:
            print(f"  {label:<40} {value:5.2f}x  {'met' if value >= target else 'MISSED'}")
        print(
            f"  {'hand-off median <= python-redis-lock':<40} {ratio:5.2f}x  "
            f"{'met' if ratio <= 1.0 else 'MISSED'}"
        )

    problem = reachable_postgres(args.postgres_url)
    if problem:
        print(
            f"\nPostgreSQL at {args.postgres_url} is unreachable ({problem}): "
            "skipping PostgreSQL benchmarks"
        )
    else:
        print(f"\nPostgreSQL: {args.postgres_url}")
        table = f"bench_leases_{run}"
        contenders_pg, closers = postgres_contenders(args.postgres_url, table)
        try:
            results = measure(contenders_pg, max(100, args.pairs // 4), args.repeat)
            print_rates("PostgreSQL try_acquire + release", results, "PostgresLeases")
            print("\nGoals (each mode against the floor of its own approach, same run)")
            for label, ours_name, theirs_name, target in POSTGRES_GOALS:
                value = statistics.median(results[ours_name]) / statistics.median(
                    results[theirs_name]
                )
                print(f"  {label:<56} {value:5.2f}x  {'met' if value >= target else 'MISSED'}")
            same_path = statistics.median(
                results["PostgresLeases durable=False"]
            ) / statistics.median(results["  same floor via libpq calls"])
            print(
                f"  {'(no goal) durable=False / its floor on the same client path':<56} "
                f"{same_path:5.2f}x  (PostgresLeases sends its grant and release through "
                "libpq's calls; the floor, through psycopg's cursors)"
            )
            churned, left = postgres_rows_left_behind(args.postgres_url, table, args.pairs)
            print(
                f"\nRows left behind: {left} after {churned:,} distinct names acquired and "
                "released (goal: 0)"
            )
            handoffs = handoff_latencies(
                ["PostgresLeases"], args.postgres_url, table, args.handoffs
            )
            print_handoffs(handoffs, "PostgresLeases")
        finally:
            for closer in closers:
                closer.close()
            drop_postgres_tables(args.postgres_url, table)
            import psycopg

            with psycopg.connect(args.postgres_url, autocommit=True) as conn:
                name = pg_table(f"{table}0:")
                conn.execute(f'DROP TABLE IF EXISTS "{name}"')
                conn.execute(f'DROP SEQUENCE IF EXISTS "{name}_token_seq"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
