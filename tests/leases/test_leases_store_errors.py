"""Permanent store errors are not outages (issue 13, 2), on real servers.

A wrong password, an unknown role or database, a missing privilege: each raises
``LeaseStoreMisconfigured`` (not a ``ConnectionError``, so retry loops written for outages stop)
with a message naming the cause and the fix, after about one connection attempt rather than the
provider's whole ``timeout``. The time bounds below are generous (half of a 10 s timeout): they
tell "one attempt" from "waited for the timeout", they do not measure speed.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from loguru import logger
from support.servers import ThrowawayPostgres, ThrowawayRedis, postgres_bindir, start_redis
from support.waiting import wait_until

from rxcoord.leases import (
    LeaseStoreMisconfigured,
    LeaseStoreUnavailable,
    PostgresLeases,
    RedisLeases,
    leases_from_url,
)

TIMEOUT = 10.0
WELL_BEFORE_THE_TIMEOUT = TIMEOUT / 2

pytestmark = pytest.mark.backend


def _refused(provider: PostgresLeases | RedisLeases) -> tuple[LeaseStoreMisconfigured, float]:
    started = time.monotonic()
    with pytest.raises(LeaseStoreMisconfigured) as caught:
        provider.try_acquire("n", 1.0)
    elapsed = time.monotonic() - started
    assert not isinstance(caught.value, ConnectionError)
    assert caught.value.__cause__ is not None  # the driver's error, kept
    return caught.value, elapsed


# -- PostgreSQL -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_postgres() -> Iterator[ThrowawayPostgres]:
    """A throwaway server that asks TCP clients for a password (postgres / 'right')."""
    import psycopg

    server = ThrowawayPostgres(postgres_bindir())
    try:
        server.start()
        local = {"host": str(server.dir), "port": server.port, "user": "postgres"}
        with psycopg.connect(dbname="postgres", autocommit=True, **local) as conn:  # type: ignore[arg-type]
            conn.execute("ALTER ROLE postgres PASSWORD 'right'")
            hba = server.data / "pg_hba.conf"
            hba.write_text(
                "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n", encoding="utf-8"
            )
            conn.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.remove()


def test_a_wrong_postgres_password_fails_at_once_naming_the_fix(
    password_postgres: ThrowawayPostgres,
) -> None:
    url = f"postgresql://postgres:wrong@127.0.0.1:{password_postgres.port}/postgres"
    with PostgresLeases(url, timeout=TIMEOUT) as leases:
        error, elapsed = _refused(leases)
    assert "password authentication failed" in str(error)
    assert "fix the user name or password" in str(error)
    assert elapsed < WELL_BEFORE_THE_TIMEOUT
    right = f"postgresql://postgres:right@127.0.0.1:{password_postgres.port}/postgres"
    with PostgresLeases(right, timeout=TIMEOUT) as leases:  # the same server, right password
        lease = leases.try_acquire("n", 1.0)
        assert lease is not None
        lease.release()


def test_an_unknown_postgres_role_or_database_fails_at_once(
    postgres_server: ThrowawayPostgres,
) -> None:
    port = postgres_server.port
    cases = {
        f"postgresql://nosuchrole@127.0.0.1:{port}/postgres": "create the role",
        f"postgresql://postgres@127.0.0.1:{port}/nosuchdb": "create the database",
    }
    for url, fix in cases.items():
        with PostgresLeases(url, timeout=TIMEOUT) as leases:
            error, elapsed = _refused(leases)
            assert "does not exist" in str(error)
            assert fix in str(error)
            assert elapsed < WELL_BEFORE_THE_TIMEOUT
            with pytest.raises(LeaseStoreMisconfigured):  # every call, not only the first
                leases.holder("n")


def test_a_missing_postgres_privilege_names_the_grant(postgres_server: ThrowawayPostgres) -> None:
    import psycopg

    role = f"nopriv_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"REVOKE CREATE ON SCHEMA public FROM {role}")
        admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    try:
        url = f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
        with PostgresLeases(url, table=f"t_{role}", timeout=TIMEOUT) as leases:
            error, elapsed = _refused(leases)
        assert "permission denied" in str(error)
        assert "grant the role CREATE" in str(error)
        assert elapsed < WELL_BEFORE_THE_TIMEOUT
    finally:
        with psycopg.connect(postgres_server.url, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")


def test_a_closed_postgres_port_is_an_outage_reported_at_once(unused_port: int) -> None:
    with PostgresLeases(f"postgresql://postgres@127.0.0.1:{unused_port}/x", timeout=TIMEOUT) as pg:
        started = time.monotonic()
        with pytest.raises(LeaseStoreUnavailable, match="reconnects once the server"):
            pg.try_acquire("n", 1.0)
        assert time.monotonic() - started < WELL_BEFORE_THE_TIMEOUT


def test_psycopg_pool_logs_go_to_loguru_not_stderr(
    postgres_server: ThrowawayPostgres, capfd: pytest.CaptureFixture[str]
) -> None:
    seen: list[str] = []
    # loguru's default handler writes to stderr: the application chooses where enabled logs
    # go. Take it out, so stderr shows only what bypasses loguru (psycopg's own logging).
    try:
        logger.remove(0)
        restore_default = True
    except ValueError:  # removed before (by the application, or another test)
        restore_default = False
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    logger.enable("rxcoord")
    try:
        url = f"postgresql://nosuchrole@127.0.0.1:{postgres_server.port}/postgres"
        with PostgresLeases(url, timeout=TIMEOUT) as leases:
            _refused(leases)
            # The pool's own connection attempts fail in its background worker and log.
            wait_until(lambda: any("error connecting" in line for line in seen), timeout=10)
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
        if restore_default:
            logger.add(sys.stderr)
    assert "error connecting" not in capfd.readouterr().err
    # Disabled (the default), they reach nobody at all.
    with PostgresLeases(url, timeout=TIMEOUT) as leases:
        _refused(leases)
        time.sleep(0.2)
    assert capfd.readouterr().err == ""


# -- Redis ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_redis() -> Iterator[ThrowawayRedis]:
    import redis

    server = start_redis()
    try:
        with redis.Redis.from_url(server.url) as client:
            client.config_set("requirepass", "right")
        yield server
    finally:
        server.remove()


def test_a_wrong_or_missing_redis_password_fails_at_once_naming_the_fix(
    password_redis: ThrowawayRedis,
) -> None:
    port = password_redis.port
    for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        with RedisLeases(url, timeout=TIMEOUT) as leases:
            error, elapsed = _refused(leases)
        assert "password" in str(error)
        assert elapsed < WELL_BEFORE_THE_TIMEOUT
    with RedisLeases(f"redis://:right@127.0.0.1:{port}/0", timeout=TIMEOUT) as leases:
        lease = leases.try_acquire("n", 1.0)
        assert lease is not None
        lease.release()


def test_a_redis_database_the_server_does_not_have_is_a_configuration_error(
    redis_url: str,
) -> None:
    # SELECT of a missing database is refused on every connection: a retry loop written for
    # outages would spin on it forever, so it must not read as one (issue 26).
    import redis

    with redis.Redis.from_url(redis_url) as client:
        databases = int(client.config_get("databases")["databases"])  # indexes 0..databases-1
    missing = urlsplit(redis_url)._replace(path=f"/{databases}").geturl()
    with leases_from_url(missing, timeout=TIMEOUT) as leases:
        assert isinstance(leases, RedisLeases)
        error, elapsed = _refused(leases)
    assert f"the server has no database {databases}" in str(error)
    assert "redis://host:port/0" in str(error)  # the fix
    assert elapsed < WELL_BEFORE_THE_TIMEOUT
    existing = urlsplit(redis_url)._replace(path=f"/{databases - 1}").geturl()
    with RedisLeases(existing, timeout=TIMEOUT) as leases:
        lease = leases.try_acquire("n", 1.0)
        assert lease is not None
        lease.release()


def test_a_redis_without_the_commands_the_leases_need_is_a_configuration_error() -> None:
    # A managed Redis may rename or disable commands (rename-command): the reply is "ERR
    # unknown command", which redis-py reports without its "ERR " (it read as an outage).
    disabled = ("--rename-command", "EVALSHA", "", "--rename-command", "EVAL", "")
    server = start_redis(options=disabled)
    try:
        with RedisLeases(server.url, timeout=TIMEOUT) as leases:
            error, elapsed = _refused(leases)
    finally:
        server.remove()
    assert "unknown command" in str(error)
    assert "rename-command" in str(error)  # the fix
    assert elapsed < WELL_BEFORE_THE_TIMEOUT


def test_a_cluster_node_given_to_a_plain_provider_says_so(redis_cluster_url: str) -> None:
    with RedisLeases(redis_cluster_url, timeout=TIMEOUT, prefix="plain:") as leases:
        error, elapsed = _refused(leases)  # the sequence key is in another slot than the name
    assert "pass cluster=True" in str(error)
    assert elapsed < WELL_BEFORE_THE_TIMEOUT


@pytest.fixture
def unused_port(tmp_path: Path) -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]  # bound, never listening: connections are refused


def test_a_malformed_postgres_connection_string_is_a_configuration_error() -> None:
    with PostgresLeases("host=127.0.0.1 port=notaport", timeout=TIMEOUT) as leases:
        error, elapsed = _refused(leases)
    assert "port" in str(error)
    assert elapsed < WELL_BEFORE_THE_TIMEOUT
