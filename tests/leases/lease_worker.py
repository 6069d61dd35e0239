"""A lease holder in its own OS process, driven by the lease tests.

Usage: ``python lease_worker.py SPEC COMMAND ARGS...`` where SPEC is JSON ``{"url": ...,
"options": {...}}`` naming the store (see ``rxcoord.leases.leases_from_url``). Replies are JSON
lines on stdout.

Commands:
    counter NAME COUNTER_FILE LOG_FILE N
        N times: under the lease, read the integer in COUNTER_FILE, write it back plus one, and
        append the lease's token to LOG_FILE. Lost updates would show as a short count.
    hold NAME AT_MOST_FOR
        Acquire, print {"token": ...}, then block until stdin closes (a holder to kill -9).
    pause NAME AT_MOST_FOR
        Acquire, print {"token": ...}, wait for a line on stdin (the test stops and resumes us
        meanwhile), then try extend and release and print what each did.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rxcoord.leases import LeaseLost, leases_from_url


def emit(message: dict[str, object]) -> None:
    print(json.dumps(message), flush=True)


def attempt(action: str, fn: object) -> str:
    assert callable(fn)
    try:
        fn()
    except LeaseLost:
        return "LeaseLost"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main() -> None:
    spec = json.loads(sys.argv[1])
    command, args = sys.argv[2], sys.argv[3:]
    with leases_from_url(spec["url"], **spec["options"]) as leases:
        if command == "counter":
            name, counter, log, count = args
            for _ in range(int(count)):
                with leases.lock(name, at_most_for=30.0, timeout=60.0) as lease:
                    value = int(Path(counter).read_text() or "0")
                    time.sleep(0.001)  # widen the read-modify-write window
                    Path(counter).write_text(str(value + 1))
                    with open(log, "a") as out:
                        out.write(f"{lease.token}\n")
            emit({"done": True})
        elif command == "hold":
            name, most = args
            lease = leases.acquire(name, float(most), timeout=30.0)
            emit({"token": lease.token})
            sys.stdin.read()
        elif command == "pause":
            name, most = args
            lease = leases.acquire(name, float(most), timeout=30.0)
            emit({"token": lease.token})
            sys.stdin.readline()
            extend = attempt("extend", lease.extend)
            release = attempt("release", lease.release)
            emit({"extend": extend, "release": release, "lost": lease.lost})
        else:
            raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
