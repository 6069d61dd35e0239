"""Throwaway servers for the test suites: PostgreSQL and Redis started from the installed binaries.

Shared by the lease suite and the Kafka suite (``PostgresOffsets``). Servers start on free ports
in temporary directories and are removed afterwards. PostgreSQL refuses to run as root, and the
development machines and CI run as root: its cluster then runs as the ``postgres`` system user
(``runuser``), in a directory that user owns, with a socket directory of its own. A missing
binary skips with the Debian package to install, except under ``RXCOORD_REQUIRE_BACKENDS=1``
(CI), where it fails the run.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import pytest

__all__ = [
    "REQUIRE_BACKENDS",
    "ThrowawayPostgres",
    "ThrowawayRedis",
    "backend_unavailable",
    "free_port",
    "postgres_bindir",
    "postgres_server",
    "postgres_url",
    "start_postgres",
    "start_redis",
]

REQUIRE_BACKENDS = os.environ.get("RXCOORD_REQUIRE_BACKENDS") == "1"


def backend_unavailable(message: str) -> NoReturn:
    """Skip, or fail when CI requires every backend."""
    if REQUIRE_BACKENDS:
        pytest.fail(f"{message} [RXCOORD_REQUIRE_BACKENDS=1 makes this an error]", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayRedis:
    """A redis-server on a free port in a temporary directory.

    Without persistence by default; ``persistent=True`` fsyncs every write to the append-only
    file before acknowledging it (``appendfsync always``).
    """

    def __init__(
        self, binary: str, *, persistent: bool = False, options: Sequence[str] = ()
    ) -> None:
        self.binary = binary
        self.persistent = persistent
        self.options = tuple(options)  # more redis-server command-line options
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="rxcoord-redis-"))
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        args += ["--dir", str(self.dir), "--daemonize", "no", *self.options]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._pong():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.01)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_redis(*, persistent: bool = False, options: Sequence[str] = ()) -> ThrowawayRedis:
    """A throwaway redis-server on a free port, started; skips (or fails in CI) without one.

    ``options``: more redis-server command-line options (``"--rename-command", "EVAL", ""``).
    """
    binary = shutil.which("redis-server")
    if binary is None:
        backend_unavailable(
            "redis-server not found: install the Debian package 'redis-server' "
            "(apt-get install redis-server)"
        )
    server = ThrowawayRedis(binary, persistent=persistent, options=options)
    server.start()
    return server


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temporary directory, run as the ``postgres`` user under root."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="rxcoord-pg-"))
        self.data = self.dir / "data"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.running = False
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.dir, ignore_errors=True)
                backend_unavailable(
                    "running as root needs the 'postgres' system user (created by the Debian "
                    "package 'postgresql')"
                )
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bindir / tool), *args]
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stdout}{result.stderr}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.dir / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``mode="immediate"`` is a crash (no shutdown checkpoint)."""
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
            self.running = False

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are (the newest installed version); skips without."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if not found and (initdb := shutil.which("initdb")):
        found = [initdb]  # other distributions put the server binaries on PATH
    if not found:
        backend_unavailable(
            "PostgreSQL binaries (initdb, pg_ctl) not found: install the Debian package "
            "'postgresql' (apt-get install postgresql)"
        )
    return Path(found[-1]).parent


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parent.parent.name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def start_postgres() -> ThrowawayPostgres:
    """A throwaway PostgreSQL server on a free port, started (remove it when done)."""
    server = ThrowawayPostgres(postgres_bindir())
    try:
        server.start()
    except BaseException:
        server.remove()
        raise
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL server with a persistent data directory this session may stop and start.

    One per test session (per xdist worker), shared by the lease and Kafka suites; each test
    uses tables of its own on it.
    """
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_url(request: pytest.FixtureRequest) -> str:
    """RXCOORD_POSTGRES_URL, or the throwaway server's URL."""
    url = os.environ.get("RXCOORD_POSTGRES_URL")
    if url:
        return url
    server: ThrowawayPostgres = request.getfixturevalue("postgres_server")
    return server.url


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ThrowawayRedis]:
    """A Redis server this session may stop and start (store-restart tests)."""
    server = start_redis()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """RXCOORD_REDIS_URL, or the throwaway server's URL."""
    url = os.environ.get("RXCOORD_REDIS_URL")
    if url:
        return url
    server: ThrowawayRedis = request.getfixturevalue("redis_server")
    return server.url
