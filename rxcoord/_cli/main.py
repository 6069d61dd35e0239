"""The ``rxcoord`` command line: ``rxcoord demo`` and ``rxcoord bench``.

Errors are one clear line on stderr (exit status 2), never a traceback; a demo whose checks
fail exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .._errors import LeaseStoreUnavailable, RxcoordError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rxcoord", description="Coordinate concurrent work on RxPY.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo",
        help="simulate a multi-tenant message service and a scheduled job, and check them",
        description=(
            "Customers across tenants send interleaved messages (one tenant floods) through a "
            "TenantScheduler with keyed jobs; then several OS processes run a ShedLock-style "
            "scheduled job under a distributed lease. Prints per-tenant figures and the checks; "
            "exits 1 if a check fails."
        ),
    )
    demo.add_argument("--tenants", type=_positive, default=4, help="tenants (default 4)")
    demo.add_argument("--customers", type=_positive, default=24, help="customers (default 24)")
    demo.add_argument("--messages", type=_positive, default=3000, help="messages (default 3000)")
    demo.add_argument("--seed", type=int, default=7, help="same seed, same workload (default 7)")
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary")
    demo.add_argument(
        "--store",
        choices=["sqlite", "postgres", "redis"],
        default="sqlite",
        help="lease store of the scheduled job (default: sqlite, embedded)",
    )
    demo.add_argument(
        "--url",
        help="store URL (default for postgres/redis: $RXCOORD_POSTGRES_URL / $RXCOORD_REDIS_URL "
        "or the local server; for sqlite: a temporary file)",
    )
    demo.add_argument(
        "--processes", type=_positive, default=3, help="scheduled-job processes (default 3)"
    )

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks and print one table of ratios against the baselines",
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    bench.add_argument(
        "--redis-url",
        default=os.environ.get("RXCOORD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis for the lease rows (default: $RXCOORD_REDIS_URL or the local server)",
    )
    bench.add_argument(
        "--postgres-url",
        default=os.environ.get("RXCOORD_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL for the lease rows (default: $RXCOORD_POSTGRES_URL or the local server)",
    )
    return parser


def _store_url(args: argparse.Namespace) -> str | None:
    if args.store == "sqlite":
        if args.url and not args.url.startswith("sqlite://"):
            raise ValueError(f"--store sqlite takes a sqlite:/// URL, not {args.url!r}")
        return args.url if args.url is None else str(args.url)  # None: a temporary SQLite file
    if not args.url:  # the usual local server, or the one the test suite is pointed at
        env = "RXCOORD_REDIS_URL" if args.store == "redis" else "RXCOORD_POSTGRES_URL"
        return os.environ.get(env, _EXAMPLE_URLS[args.store])
    scheme = args.url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES[args.store]:
        raise ValueError(f"--store {args.store} does not match the URL {args.url!r}")
    return str(args.url)


_EXAMPLE_URLS = {
    "postgres": "postgresql://postgres@127.0.0.1:5432/test",
    "redis": "redis://127.0.0.1:6379/0",
}
_SCHEMES = {"postgres": ("postgresql", "postgres"), "redis": ("redis", "rediss", "unix")}


def _check_store(url: str | None) -> None:
    """Fail fast, in this process, with one line, when the store cannot be reached."""
    if url is None:
        return
    from ..leases import leases_from_url

    with leases_from_url(url) as provider:
        lease = provider.try_acquire("rxcoord-demo-probe", at_most_for=1.0)
        if lease is not None:
            lease.release()


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    url = _store_url(args)
    _check_store(url)
    config = DemoConfig(
        tenants=args.tenants,
        customers=args.customers,
        messages=args.messages,
        seed=args.seed,
        store_url=url,
        processes=args.processes,
    )
    if args.json:
        report = run_demo(config)
        print(report.to_json())
        return 0 if report.ok else 1
    from .views import show_demo

    return show_demo(config)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_benchmarks

    return run_benchmarks(args.quick, redis_url=args.redis_url, postgres_url=args.postgres_url)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rxcoord`` console script and ``python -m rxcoord``."""
    args = _parser().parse_args(argv)
    handlers: dict[str, Any] = {"demo": _demo, "bench": _bench}
    try:
        return int(handlers[args.command](args))
    except KeyboardInterrupt:
        print("rxcoord: interrupted", file=sys.stderr)
        return 130
    except LeaseStoreUnavailable as exc:
        print(f"rxcoord: error: the lease store is unreachable: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = {"rich": "cli", "redis": "redis", "psycopg": "postgres"}.get(exc.name or "")
        hint = f": install it with: pip install 'rxcoord[{extra}]'" if extra else ""
        print(f"rxcoord: error: missing module {exc.name!r}{hint}", file=sys.stderr)
        return 2
    except (ValueError, RxcoordError, OSError, RuntimeError) as exc:
        print(f"rxcoord: error: {exc}", file=sys.stderr)
        return 2
