"""Two processes, one tenant limit: ``TenantScheduler(..., fleet=provider)``.

Each process alone would let tenant ``acme`` run 2 jobs at once (``tenant_max_concurrency=2``),
so two processes would run 4. With ``fleet=`` and the same ``name`` on the same store, the
limits are the fleet's: at most 2 ``acme`` jobs at once across both processes, and at most 3
jobs of any tenants (``max_concurrency=3``). Each job reads its permit's fencing token with
``current_permit()``.

The processes share nothing but the store: an SQLite file here (processes of one machine);
pass a ``redis://`` or ``postgresql://`` URL to share limits across hosts.
Run: ``python examples/fleet_limits.py [STORE_URL]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rxcoord import TenantScheduler, current_permit
from rxcoord.leases import leases_from_url

JOBS_PER_PROCESS = 8
JOB_SECONDS = 0.05


def worker(url: str, log: str) -> None:
    """One process of the service: 8 jobs of acme and 4 of bolt, all submitted at once."""
    lock = threading.Lock()
    with (
        leases_from_url(url) as provider,
        TenantScheduler(3, tenant_max_concurrency=2, name="payments", fleet=provider) as scheduler,
        open(log, "a", encoding="utf-8") as out,
    ):

        def job(tenant: str) -> Callable[[], int]:
            return lambda: run(tenant)

        def run(tenant: str) -> int:
            permit = current_permit()
            assert permit is not None  # every job admitted through the fleet holds one
            with lock:
                out.write(json.dumps([tenant, "start", time.monotonic(), permit.token]) + "\n")
                out.flush()
            time.sleep(JOB_SECONDS)
            with lock:
                out.write(json.dumps([tenant, "end", time.monotonic(), permit.token]) + "\n")
                out.flush()
            return permit.token

        calls = [("acme", i) for i in range(JOBS_PER_PROCESS)] + [("bolt", i) for i in range(4)]
        results = [scheduler.execute(tenant, job(tenant)) for tenant, _ in calls]
        done = threading.Semaphore(0)
        for observable in results:
            observable.subscribe(on_completed=done.release, on_error=lambda _e: done.release())
        for _ in results:
            done.acquire()


def peaks(lines: list[tuple[str, str, float, int]]) -> tuple[int, int]:
    """Most jobs at once in all, and of acme, over both processes' logs (one machine clock).

    An end sorts before a start at the same instant: a slot handed over is no overlap.
    """
    events = sorted((t, 1 if kind == "start" else -1, tenant) for tenant, kind, t, _ in lines)
    total = acme = most_total = most_acme = 0
    for _, delta, tenant in events:
        total += delta
        acme += delta if tenant == "acme" else 0
        most_total, most_acme = max(most_total, total), max(most_acme, acme)
    return most_total, most_acme


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rxcoord-fleet-") as tmp:
        url = sys.argv[1] if len(sys.argv) > 1 else f"sqlite:///{Path(tmp) / 'fleet.db'}"
        log = str(Path(tmp) / "jobs.jsonl")
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", url, log]) for _ in range(2)
        ]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker process failed (exit {proc.returncode})")
        lines = [tuple(json.loads(line)) for line in Path(log).read_text().splitlines()]
    most_total, most_acme = peaks(lines)
    tokens = [line[3] for line in lines if line[1] == "start"]
    print(f"store: {url.split('://', 1)[0]}, 2 processes, {len(tokens)} jobs")
    print(f"acme ran at most {most_acme} jobs at once across both processes (limit 2)")
    print(f"all tenants together at most {most_total} (limit 3)")
    print(f"fencing tokens distinct: {len(set(tokens)) == len(tokens)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
