"""Fixtures for the lease suite: real servers, and one contract run over five providers.

Servers are throwaway instances started from the installed binaries on free ports (Redis:
``redis-server``; a three-master Redis Cluster from the same binary and ``redis-cli --cluster
create``; PostgreSQL: ``tests/support/servers.py``, its fixtures in ``tests/conftest.py``,
shared with the Kafka suite), or the servers named by ``RXCOORD_REDIS_URL`` /
``RXCOORD_REDIS_CLUSTER_URL`` / ``RXCOORD_POSTGRES_URL``. A missing binary skips with the Debian
package to install, except under ``RXCOORD_REQUIRE_BACKENDS=1`` (CI), where it fails the run;
so does a cluster that cannot start.

Every test gets its own namespace on the shared servers (a table per test for PostgreSQL, a key
prefix for Redis, a file for SQLite, a store object for memory), so tests never see each other's
leases and need no cleanup between them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from support.servers import backend_unavailable

from rxcoord.leases import (
    LeaseProvider,
    MemoryLeases,
    MemoryLeaseStore,
    PostgresLeases,
    RedisLeases,
    SqliteLeases,
)
from rxcoord.leases._registry import LeaseBackend, backends

WORKER = Path(__file__).with_name("lease_worker.py")
# Test variants of a registered backend that the suite runs as backends of their own.
VARIANTS = {"redis-cluster": "redis"}  # RedisLeases on a real three-master Redis Cluster
BACKEND_IDS = (*(entry.name for entry in backends()), *VARIANTS)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` on a daemon thread; the list receives its result or exception."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- Redis Cluster --------------------------------------------------------------------------


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port + 10000 > 65535:
            port -= 30000  # ephemeral ports are high; the bus must fit below 65536
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class ThrowawayRedisCluster:
    """Three redis-server masters in cluster mode on free ports, slots spread by redis-cli."""

    def __init__(self, server: str, cli: str) -> None:
        self.server = server
        self.cli = cli
        self.dir = Path(tempfile.mkdtemp(prefix="rxcoord-redis-cluster-"))
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for _ in range(3):
            port = free_cluster_port()
            while port in self.ports:
                port = free_cluster_port()
            self.ports.append(port)
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            self.procs.append(
                subprocess.Popen(
                    [
                        self.server,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "5000",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node_dir),
                        "--daemonize",
                        "no",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port, proc in zip(self.ports, self.procs, strict=True):
            self._wait(partial(self._answers, port, "PONG", "PING"), proc, "start")
        created = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {created.stdout}{created.stderr}"
            )
        for port, proc in zip(self.ports, self.procs, strict=True):
            self._wait(
                partial(self._answers, port, "cluster_state:ok", "CLUSTER", "INFO"),
                proc,
                "report cluster_state:ok",
            )

    def _answers(self, port: int, expected: str, *command: str) -> bool:
        return expected in self._ask(port, *command)

    def _ask(self, port: int, *command: str) -> str:
        result = subprocess.run(
            [self.cli, "-p", str(port), *command],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return result.stdout.strip()

    def _wait(self, ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
        deadline = time.monotonic() + 30
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a Redis Cluster node did not {what}")
            time.sleep(0.05)

    def keys(self, pattern: str) -> list[bytes]:
        """Every key matching ``pattern`` on every master."""
        import redis

        found: list[bytes] = []
        for port in self.ports:
            with redis.Redis(port=port) as node:
                found.extend(node.scan_iter(match=pattern, count=1000))
        return found

    def remove(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """RXCOORD_REDIS_CLUSTER_URL (any node of a cluster), or a throwaway cluster's."""
    url = os.environ.get("RXCOORD_REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if server is None or cli is None:
        backend_unavailable(
            "redis-server and redis-cli not found: install the Debian packages 'redis-server' "
            "and 'redis-tools' (apt-get install redis-server redis-tools)"
        )
    cluster = ThrowawayRedisCluster(server, cli)
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        cluster.remove()
        backend_unavailable(f"could not start a Redis Cluster: {exc}")
    try:
        yield cluster.url
    finally:
        cluster.remove()


def redis_keys(url: str, pattern: str, *, cluster: bool) -> list[bytes]:
    """Keys matching ``pattern`` on a server, or on every master of a cluster."""
    import redis

    if not cluster:
        with redis.Redis.from_url(url) as client:
            return list(client.scan_iter(match=pattern, count=1000))
    from redis.cluster import RedisCluster

    found: list[bytes] = []
    with RedisCluster.from_url(url) as client:
        for node in client.get_primaries():
            found.extend(client.scan_iter(match=pattern, count=1000, target_nodes=node))
    return found


# -- PostgreSQL -----------------------------------------------------------------------------


# The fleet permit table beside a PostgreSQL lease table (rxcoord/leases/_backends/_postgres.py;
# the test tables' names are short enough to be used unshortened): one row per busy group.
PG_PERMIT_TABLES = ("_permits",)


def drop_table(url: str, table: str) -> None:
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_token_seq"')
        for suffix in PG_PERMIT_TABLES:
            conn.execute(f'DROP TABLE IF EXISTS "{table}{suffix}"')
        for suffix in ("_permits_acquire", "_permits_release", "_permits_extend"):
            conn.execute(f'DROP FUNCTION IF EXISTS "{table}{suffix}"')


def pg_row_waited(url: str, table: str, name: str) -> bool:
    """Whether a waiter has marked the row of ``name`` in the PostgreSQL lease ``table``."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(f'SELECT waited FROM "{table}" WHERE name = %s', (name,)).fetchone()
    return bool(row and row[0])


# -- the contract's backend fixture ---------------------------------------------------------


@dataclass
class Backend:
    """One provider kind, with a private namespace for the current test.

    Attributes:
        id: ``memory``, ``sqlite``, ``postgres`` or ``redis``.
        make: A new provider on the same store and namespace (closed after the test).
        url: The store URL for worker processes (None: the store lives in this process).
        options: Provider keyword arguments that select the namespace (for workers).
        notifies: Whether waiters are woken by the store rather than by polling.
        records: How many rows or keys the store holds in this namespace (bookkeeping
            included), counted directly in the store, not through the provider.
        name: The provider's ``backend`` attribute (``redis`` for the cluster too).
        bookkeeping: The most rows or keys the store keeps once no name is taken: the token
            sequence (SQLite: one row; Redis: one key; Redis Cluster: one key per hash slot
            in use, at most 16,384; PostgreSQL: none, its sequence is not a row).
    """

    id: str
    make: Callable[..., LeaseProvider]
    url: str | None
    options: dict[str, object] = field(default_factory=dict)
    notifies: bool = True
    providers: list[LeaseProvider] = field(default_factory=list)
    cleanup: Callable[[], None] | None = None  # after the providers are closed
    records: Callable[[], int] = lambda: 0  # rows/keys in the store now
    name: str = ""  # LeaseProviderStats.backend
    bookkeeping: int = 0  # most rows/keys the store keeps when no name is taken

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.id

    def new(self, **overrides: object) -> LeaseProvider:
        provider = self.make(**overrides)
        self.providers.append(provider)
        return provider

    def worker(self, *args: str) -> subprocess.Popen[str]:
        """Start ``lease_worker.py`` against this backend's store."""
        assert self.url is not None, f"{self.id} has no store other processes can reach"
        spec = json.dumps({"url": self.url, "options": self.options})
        return subprocess.Popen(
            [sys.executable, str(WORKER), spec, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )


# How the suite opens a throwaway namespace of each registered backend: one entry per backend,
# beside the registry's one (rxcoord/leases/_registry.py). A factory gets the test's request
# (for server fixtures), a private directory and a unique suffix, and returns the Backend with
# its cleanup.


def _memory_store(request: pytest.FixtureRequest, tmp_path: Path, suffix: str) -> Backend:
    store = MemoryLeaseStore()

    def make_memory(**kw: object) -> LeaseProvider:
        return MemoryLeases(store, **kw)

    return Backend(
        "memory",
        make_memory,
        None,
        records=lambda: store.stats().names + store.permit_groups(),  # leases + fleet groups
    )


def _sqlite_store(request: pytest.FixtureRequest, tmp_path: Path, suffix: str) -> Backend:
    path = tmp_path / "leases.db"

    def make_sqlite(**kw: object) -> LeaseProvider:
        options: dict[str, object] = {"timeout": 2.0, **kw}
        return SqliteLeases(path, **options)  # type: ignore[arg-type]

    def sqlite_rows() -> int:
        import sqlite3

        conn = sqlite3.connect(path)
        try:
            tables = [
                row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            return sum(
                int(conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
                for table in tables
            )
        finally:
            conn.close()

    return Backend(
        "sqlite",
        make_sqlite,
        f"sqlite://{path}",
        notifies=False,
        records=sqlite_rows,
        bookkeeping=1,
    )


def _postgres_store(request: pytest.FixtureRequest, tmp_path: Path, suffix: str) -> Backend:
    url: str = request.getfixturevalue("postgres_url")
    table = f"leases_{suffix}"

    def make_pg(**kw: object) -> LeaseProvider:
        options: dict[str, object] = {"table": table, "timeout": 2.0, **kw}
        return PostgresLeases(url, **options)  # type: ignore[arg-type]

    def pg_rows() -> int:
        import psycopg

        total = 0
        with psycopg.connect(url, autocommit=True) as conn:
            # The lease table and the fleet permit table (the sequence is no row).
            for relation in (table, *(table + suffix for suffix in PG_PERMIT_TABLES)):
                exists = conn.execute("SELECT to_regclass(%s)", (relation,)).fetchone()
                if not exists or exists[0] is None:
                    continue
                row = conn.execute(f'SELECT count(*) FROM "{relation}"').fetchone()
                total += int(row[0]) if row else 0
        return total

    return Backend(
        "postgres",
        make_pg,
        url,
        {"table": table},
        cleanup=lambda: drop_table(url, table),
        records=pg_rows,
    )


def _redis_store(
    request: pytest.FixtureRequest, tmp_path: Path, suffix: str, *, cluster: bool = False
) -> Backend:
    url: str = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
    prefix = f"test:{suffix}:"
    extra: dict[str, object] = {"cluster": True} if cluster else {}

    def make_redis(**kw: object) -> LeaseProvider:
        options: dict[str, object] = {"prefix": prefix, "timeout": 2.0, **extra, **kw}
        return RedisLeases(url, **options)  # type: ignore[arg-type]

    return Backend(
        "redis-cluster" if cluster else "redis",
        make_redis,
        url,
        {"prefix": prefix, **extra},
        records=lambda: len(redis_keys(url, prefix + "*", cluster=cluster)),
        name="redis",
        # the token counters: one store-wide, or one per hash slot on a cluster
        bookkeeping=16384 if cluster else 1,
    )


def _redis_cluster_store(request: pytest.FixtureRequest, tmp_path: Path, suffix: str) -> Backend:
    return _redis_store(request, tmp_path, suffix, cluster=True)


STORES: dict[str, Callable[[pytest.FixtureRequest, Path, str], Backend]] = {
    "memory": _memory_store,
    "sqlite": _sqlite_store,
    "postgres": _postgres_store,
    "redis": _redis_store,
    "redis-cluster": _redis_cluster_store,
}


def registered(kind: str) -> LeaseBackend:
    """The registry's entry for backend ``kind``."""
    for entry in backends():
        if entry.name == kind:
            return entry
    raise KeyError(kind)


def backend_params() -> list[object]:
    """One parameter per registered backend (and per variant); server backends carry the
    ``backend`` mark.

    A registered backend without an entry in :data:`STORES` fails every contract test (no
    backend skips the contract silently).
    """
    params: list[object] = []
    for name in BACKEND_IDS:
        entry = registered(VARIANTS.get(name, name))
        marks = [pytest.mark.backend] if entry.server else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.fixture(params=backend_params())
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    kind: str = request.param
    factory = STORES.get(kind)
    if factory is None:
        pytest.fail(
            f"lease backend {kind!r} is registered but tests/leases/conftest.py has no STORES "
            "entry to open a throwaway store of it",
            pytrace=False,
        )
    entry = registered(VARIANTS.get(kind, kind))
    result = factory(request, tmp_path, uuid.uuid4().hex[:12])
    # The suite's expectations follow what the backend declares of itself.
    assert result.notifies == entry.notifies, f"{kind}: STORES and the registry disagree"
    assert (result.url is not None) == entry.shared, f"{kind}: STORES and the registry disagree"
    try:
        yield result
    finally:
        for provider in result.providers:
            provider.close()
        if result.cleanup is not None:
            result.cleanup()


@pytest.fixture
def leases(backend: Backend) -> LeaseProvider:
    """A provider of the backend under test."""
    return backend.new()


@pytest.fixture
def name() -> str:
    """A lease name of its own for the test."""
    return f"job-{uuid.uuid4().hex[:8]}"


def stop_process(proc: subprocess.Popen[str]) -> None:
    """Kill a worker if still running and reap it (no zombie, no ResourceWarning)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.communicate(timeout=10)
