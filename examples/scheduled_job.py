"""A ShedLock-style scheduled job across several OS processes, with fencing tokens.

Three "nodes" (processes) run the same schedule: every ``period`` seconds each one tries to run
the ``nightly-report`` job under a distributed lease, without waiting (``run(..., wait=False)``):
in every slot exactly one node runs it, the others skip. ``at_least_for`` keeps the lease taken
for a while after a short job ends, so a node that fires a little late cannot run the slot again.

In one slot the job stalls (think of a long GC pause) for longer than ``at_most_for``: its lease
expires, a later slot runs on another node with a newer fencing token, and when the stalled job
finally writes, the report store refuses the stale token. (So that the demonstration holds on a
busy machine, the stall lasts until the store has accepted a newer write.) The store lives in the
parent process (a stand-in for a database or a service) and checks tokens with ``FencingGuard``.

Run ``python examples/scheduled_job.py`` (SQLite in a temporary directory), or point it at a
server: ``--url postgresql://postgres@127.0.0.1:5432/test`` or ``--url redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as Flag
from pathlib import Path

from reactivex import operators as ops

from rxcoord.leases import DistributedLease, FencingGuard, LeaseLost, StaleToken, leases_from_url

JOB = "nightly-report"
AT_MOST_FOR = 0.8  # a crashed or stalled node blocks the job at most this long
AT_LEAST_FOR = 0.3  # a finished job keeps the slot taken this long (clock skew, late firing)

Event = tuple[str, int, int, int, str]  # (kind, node, slot, token, detail)


def node(
    index: int,
    url: str,
    options: dict[str, str],
    start_at: Synchronized[float],
    go: Flag,
    period: float,
    slots: int,
    stall_slot: int,
    events: Queue[Event],
    takeover: Flag,
) -> None:
    """One node: fire the job at each slot time; run it only under the lease."""
    with leases_from_url(url, **options) as leases:
        # The schedule starts once every node is up (starting processes can take seconds on a
        # busy machine, and a node firing late would be a different story: see at_least_for).
        events.put(("ready", index, -1, 0, ""))
        go.wait(60)
        start = start_at.value
        for slot in range(slots):
            time.sleep(max(0.0, start + slot * period - time.time()))

            def job(lease: DistributedLease, slot: int = slot) -> int:
                events.put(("run", index, slot, lease.token, ""))
                if slot == stall_slot:
                    takeover.wait(30)  # stalls past its lease, until another node took over
                time.sleep(0.02)  # the job's actual work
                events.put(("write", index, slot, lease.token, ""))
                return lease.token

            # Runs the job if the lease is free, completes empty (skips) if another node has it.
            guarded = leases.run(JOB, job, at_most_for=AT_MOST_FOR, at_least_for=AT_LEAST_FOR)
            try:
                guarded.pipe(ops.to_list()).run()
            except LeaseLost as exc:
                events.put(("lost", index, slot, 0, str(exc)))
    events.put(("done", index, -1, 0, ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="lease store URL (default: SQLite in a temp directory)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--period", type=float, default=0.4, help="seconds between slots")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rxcoord-example-") as tmp:
        url = args.url or f"sqlite://{Path(tmp) / 'leases.db'}"
        # A fresh namespace per run, so earlier runs against a shared server do not interfere.
        run_id = uuid.uuid4().hex[:8]
        if url.startswith("postgres"):
            options = {"table": f"example_leases_{run_id}"}
        elif url.startswith(("redis", "rediss", "unix")):
            options = {"prefix": f"example:{run_id}:"}
        else:
            options = {}
        print(f"{args.nodes} nodes, {args.slots} slots every {args.period}s, store {url}")

        context = multiprocessing.get_context("spawn")
        events: Queue[Event] = context.Queue()
        takeover = context.Event()
        go = context.Event()
        start_at = context.Value("d", 0.0)
        stall_slot = 2
        workers = [
            context.Process(
                target=node,
                args=(
                    i,
                    url,
                    options,
                    start_at,
                    go,
                    args.period,
                    args.slots,
                    stall_slot,
                    events,
                    takeover,
                ),
            )
            for i in range(args.nodes)
        ]
        for worker in workers:
            worker.start()
        for _ in workers:
            kind, *_ = events.get(timeout=60)
            assert kind == "ready", kind
        start_at.value = time.time() + 0.2
        go.set()

        # The report store: accepts a write only if its token is not older than one it has seen.
        guard = FencingGuard()
        runs: dict[int, list[int]] = defaultdict(list)
        refused: list[str] = []
        lost: list[str] = []
        done = 0
        while done < args.nodes:
            kind, index, slot, token, detail = events.get(timeout=60)
            if kind == "run":
                runs[slot].append(index)
            elif kind == "write":
                try:
                    guard.check(JOB, token)
                    print(f"slot {slot}: node-{index} wrote the report (token {token})")
                    if slot > stall_slot:
                        takeover.set()
                except StaleToken as exc:
                    refused.append(f"node-{index} (slot {slot})")
                    print(f"slot {slot}: store REFUSED node-{index}'s write: {exc}")
            elif kind == "lost":
                lost.append(f"node-{index}")
                print(f"slot {slot}: node-{index} learned its lease was lost: {detail}")
            elif kind == "done":
                done += 1
        for worker in workers:
            worker.join(30)
        events.close()
        events.join_thread()
        if url.startswith("postgres"):
            _drop_table(url, options["table"])

    twice = [slot for slot, nodes in runs.items() if len(nodes) > 1]
    skipped = [slot for slot in range(args.slots) if slot not in runs]
    print(f"slots run more than once: {len(twice)}")
    print(f"slots skipped while the stalled job held the lease: {skipped}")
    print(f"stale writes refused: {len(refused)}")
    ok = not twice and refused and all(code == 0 for code in (w.exitcode for w in workers))
    return 0 if ok else 1


def _drop_table(url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')


if __name__ == "__main__":
    threading.current_thread().name = "scheduler"
    raise SystemExit(main())
