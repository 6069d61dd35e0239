"""PostgreSQL grants and releases through ``DeadlineConnection.run_prepared`` (libpq's calls,
statements prepared under names of ours): the same errors, retries and values as psycopg's
cursor path they replace; and the ``waited`` column those statements need, added to older tables
without asking a role that shares the table for ownership."""

from __future__ import annotations

import uuid

import pytest
from support.servers import ThrowawayPostgres

from rxcoord import LeaseStoreMisconfigured
from rxcoord.leases import PostgresLeases
from rxcoord.leases._backends._pg_deadline import Prepared

from .conftest import drop_table


def test_prepared_numbers_the_placeholders_in_order_of_first_use() -> None:
    statement = Prepared("SELECT %(b)s, %(a)s, %(b)s || '%%'")
    assert statement.query == b"SELECT $1, $2, $1 || '%'"
    assert statement.keys == ("b", "a")
    assert statement.name.startswith(b"rxl_")
    assert Prepared("SELECT %(a)s").name != Prepared("SELECT %(a)s + 1").name
    with pytest.raises(ValueError, match="placeholders"):
        Prepared("SELECT %s")


@pytest.mark.backend
def test_a_table_dropped_behind_a_prepared_grant_is_recreated(postgres_url: str) -> None:
    import psycopg

    table = f"fast_{uuid.uuid4().hex[:8]}"
    try:
        with PostgresLeases(postgres_url, table=table, max_size=1) as leases:
            lease = leases.try_acquire("n", 5.0)  # prepares the grant and the release
            assert lease is not None
            lease.release()
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                conn.execute(f'DROP TABLE "{table}"')
            lease = leases.try_acquire("n", 5.0)  # UndefinedTable: set up again, retried once
            assert lease is not None
            assert leases.try_acquire("n", 5.0) is None
            lease.release()
            again = leases.try_acquire("n", 5.0)
            assert again is not None
            assert again.token > lease.token
            again.release()
    finally:
        drop_table(postgres_url, table)


@pytest.mark.backend
def test_a_privilege_revoked_after_the_statements_were_prepared_is_a_configuration_error(
    postgres_server: ThrowawayPostgres,
) -> None:
    import psycopg

    role = f"fast_{uuid.uuid4().hex[:8]}"
    table = f"t_{role}"
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
    url = f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
    try:
        with PostgresLeases(url, table=table, timeout=10.0, max_size=1) as leases:
            lease = leases.try_acquire("n", 5.0)
            assert lease is not None
            lease.release()
            with psycopg.connect(postgres_server.url, autocommit=True) as admin:
                admin.execute(f'ALTER TABLE "{table}" OWNER TO postgres')
                admin.execute(f'GRANT SELECT, DELETE ON "{table}" TO {role}')
            with pytest.raises(LeaseStoreMisconfigured, match="permission denied"):
                leases.try_acquire("n", 5.0)
            assert leases.stats().held == 0
    finally:
        _drop_table_and_role(postgres_server.url, table, role)


@pytest.mark.backend
def test_names_in_any_script_round_trip_through_the_fast_path(postgres_url: str) -> None:
    table = f"fast_{uuid.uuid4().hex[:8]}"
    names = ["ünïcødé", "名前", "emoji-🔒", "quote'\"\\", "percent-%s-%(x)s"]
    try:
        with PostgresLeases(postgres_url, table=table) as leases:
            for name in names:
                lease = leases.try_acquire(name, 5.0)
                assert lease is not None, name
                holder = leases.holder(name)  # read by psycopg's cursor path
                assert holder is not None
                assert holder.token == lease.token
                lease.release()
                assert leases.holder(name) is None
    finally:
        drop_table(postgres_url, table)


@pytest.mark.backend
def test_a_role_that_does_not_own_the_table_shares_it_without_altering_it(
    postgres_server: ThrowawayPostgres,
) -> None:
    """The ``waited`` column is added only to a table that lacks it: ALTER TABLE needs the
    owner, and a second role with the data privileges must still be able to use the table."""
    import psycopg

    role = f"share_{uuid.uuid4().hex[:8]}"
    table = f"t_{role}"
    with PostgresLeases(postgres_server.url, table=table) as owner:  # created by postgres
        owner.try_acquire("setup", 5.0).release()  # type: ignore[union-attr]
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}", "{table}_permits" TO {role}'
        )
        admin.execute(f'GRANT USAGE ON SEQUENCE "{table}_token_seq" TO {role}')
        admin.execute(f"GRANT CREATE ON SCHEMA public TO {role}")  # CREATE ... IF NOT EXISTS
    url = f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
    try:
        with PostgresLeases(url, table=table, timeout=10.0) as leases:
            lease = leases.try_acquire("n", 5.0)
            assert lease is not None
            lease.release()
    finally:
        _drop_table_and_role(postgres_server.url, table, role)


def _drop_table_and_role(admin_url: str, table: str, role: str) -> None:
    """Remove a test's lease table (with its sequence, permit table and functions) and role."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_permits"')
        admin.execute(f'DROP SEQUENCE IF EXISTS "{table}_token_seq"')
        for suffix in ("_permits_acquire", "_permits_release", "_permits_extend"):
            admin.execute(f'DROP FUNCTION IF EXISTS "{table}{suffix}"')
        admin.execute(f"REVOKE CREATE ON SCHEMA public FROM {role}")
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE IF EXISTS {role}")
