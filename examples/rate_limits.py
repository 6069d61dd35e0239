"""A fleet of processes calling a rate-limited API: ``TenantScheduler(fleet=..., rate=...)``.

The "API" is a stub HTTP server in this process that counts its calls per second, in all and
per merchant, and answers ``429 Too Many Requests`` beyond 20 calls a second in all or 10 of one
merchant (as a payment provider's API would). Three worker processes call it for three
merchants, 20 calls each, all submitted at once. Each process alone would respect a rate of its
own; three of them would triple it. With ``fleet=`` and the same ``name`` on the same store the
rates are the fleet's, kept in the store on its clock:

* ``rate=Rate(15, per=1.0, burst=3)``: all merchants together, at most 3 + 15 calls in any
  second, under the API's 20 with room for the network's jitter;
* ``tenant_rate=Rate(6, per=1.0, burst=2)``: each merchant at most 2 + 6 in any second (10).

A call over its rate waits for its time, holding no slot and no thread; none fails. Then the
same three processes run with the same rates but without ``fleet=`` (each process its own):
together they call three times as often, and the API refuses calls. The store is an SQLite file
here (processes of one machine); pass a ``redis://`` or ``postgresql://`` URL to share the rates
across hosts. Run: ``python examples/rate_limits.py [STORE_URL]``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rxcoord import Rate, TenantScheduler
from rxcoord.leases import leases_from_url

API_LIMIT = 20  # calls per second, in all
MERCHANT_LIMIT = 10  # calls per second, of one merchant
MERCHANTS = ("acme", "bolt", "cora")
CALLS_PER_PROCESS = 20


class Api:
    """The stub: counts calls per (whole) second of its clock; refuses those over a limit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total: Counter[int] = Counter()
        self.per_merchant: Counter[tuple[int, str]] = Counter()
        self.refused = 0

    def call(self, merchant: str) -> int:
        second = int(time.monotonic())
        with self.lock:
            self.total[second] += 1
            self.per_merchant[second, merchant] += 1
            if (
                self.total[second] > API_LIMIT
                or self.per_merchant[second, merchant] > MERCHANT_LIMIT
            ):
                self.refused += 1
                return 429
        return 200


class Handler(BaseHTTPRequestHandler):
    """``POST /charge/<merchant>``: one call of the API."""

    api: Api  # the stub the calls count against

    def do_POST(self) -> None:
        self.send_response(self.api.call(self.path.rsplit("/", 1)[-1]))
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet


def serve(api: Api) -> ThreadingHTTPServer:
    Handler.api = api
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def worker(url: str, api: str, first: int) -> None:
    """One process of the service: 20 calls spread over the merchants, all submitted at once
    (``url`` ``-``: without a fleet, the rates are this process's own)."""
    failures: list[str] = []

    def charge(merchant: str) -> Callable[[], int]:
        def call() -> int:
            request = urllib.request.Request(f"{api}/charge/{merchant}", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return int(response.status)
            except urllib.error.HTTPError as error:  # 429: the API refused the call
                failures.append(f"{merchant}: {error.code}")
                return error.code

        return call

    provider = None if url == "-" else leases_from_url(url)
    with TenantScheduler(
        4,
        tenant_max_concurrency=2,
        name="payments-api",
        fleet=provider,
        rate=Rate(15, per=1.0, burst=3),
        tenant_rate=Rate(6, per=1.0, burst=2),
    ) as scheduler:
        calls = [MERCHANTS[(first + i) % len(MERCHANTS)] for i in range(CALLS_PER_PROCESS)]
        done = threading.Semaphore(0)
        for merchant in calls:
            scheduler.execute(merchant, charge(merchant)).subscribe(
                on_completed=done.release, on_error=lambda _e: done.release()
            )
        for _ in calls:
            done.acquire()
        fleet = scheduler.stats().fleet
        if fleet is not None:
            print(
                f"worker {first}: {len(calls)} calls, {len(failures)} refused, "
                f"{fleet.rate_waits} waited for a rate ({fleet.rate_waited:.1f} s in all)"
            )
    if provider is not None:
        provider.close()
        if failures:
            raise SystemExit(f"the API refused calls: {failures}")


def run_fleet(url: str, address: str) -> float:
    """Three worker processes; the seconds they took."""
    started = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", url, address, str(i)])
        for i in range(3)
    ]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a worker process failed (exit {proc.returncode})")
    return time.monotonic() - started


def main() -> None:
    api = Api()
    server = serve(api)
    address = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="rxcoord-rates-") as tmp:
        url = sys.argv[1] if len(sys.argv) > 1 else f"sqlite:///{Path(tmp) / 'fleet.db'}"
        elapsed = run_fleet(url, address)
    calls = sum(api.total.values())
    print(f"store: {url.split('://', 1)[0]}, 3 processes, {calls} API calls in {elapsed:.1f} s")
    print(f"busiest second: {max(api.total.values())} calls (API limit {API_LIMIT})")
    busiest = max(api.per_merchant.values())
    print(f"busiest merchant-second: {busiest} calls (API limit {MERCHANT_LIMIT})")
    print(f"refused by the API: {api.refused}")
    alone = Api()  # the same processes and rates, each process on its own
    Handler.api = alone
    run_fleet("-", address)
    print(
        f"without fleet= (each process its own rates): busiest second "
        f"{max(alone.total.values())} calls, refused by the API: {alone.refused}"
    )
    server.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
