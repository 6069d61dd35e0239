"""Stores written by rxcoord 0.1 (a token counter per row or per name key) upgrade in place.

Deleting rows needs a store-wide sequence; when it is created over an old table (or meets an
old per-name counter on Redis), it must start above every token already handed out, or a
name's tokens would go back and fenced resources would refuse the new holder.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

from rxcoord.leases import PostgresLeases, RedisLeases, SqliteLeases

from .conftest import drop_table

OLD_SCHEMA = (
    "(name {text} PRIMARY KEY, token {int} NOT NULL, locked_until {time} NOT NULL, "
    "least_until {time} NOT NULL, released {bool} NOT NULL, locked_at {time} NOT NULL, "
    "locked_by {text} NOT NULL)"
)


def test_sqlite_sequence_starts_above_an_old_tables_tokens(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    schema = OLD_SCHEMA.format(text="TEXT", int="INTEGER", time="REAL", bool="INTEGER")
    conn.execute(f"CREATE TABLE rxcoord_leases {schema}")
    conn.execute("INSERT INTO rxcoord_leases VALUES ('old', 41, 0, 0, 1, 0, 'h:1')")  # expired
    conn.commit()
    conn.close()
    with SqliteLeases(path) as leases:
        other = leases.try_acquire("new", 5.0)
        again = leases.try_acquire("old", 5.0)
        assert other is not None
        assert again is not None
        assert sorted([other.token, again.token]) == [42, 43]


@pytest.mark.backend
def test_postgres_sequence_starts_above_an_old_tables_tokens(postgres_url: str) -> None:
    import psycopg

    table = f"old_{uuid.uuid4().hex[:8]}"
    schema = OLD_SCHEMA.format(text="text", int="bigint", time="timestamptz", bool="boolean")
    try:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{table}" {schema}')
            conn.execute(
                f"INSERT INTO \"{table}\" VALUES ('old', 41, now() - interval '1 hour', "
                "now() - interval '1 hour', true, now() - interval '1 hour', 'h:1')"
            )
        with PostgresLeases(postgres_url, table=table) as leases:
            other = leases.try_acquire("new", 5.0)
            again = leases.try_acquire("old", 5.0)
            assert other is not None
            assert again is not None
            assert min(other.token, again.token) > 41
    finally:
        drop_table(postgres_url, table)


@pytest.mark.backend
def test_redis_folds_an_old_per_name_counter_into_the_sequence(redis_url: str) -> None:
    import redis

    prefix = f"old:{uuid.uuid4().hex[:8]}:"
    with redis.Redis.from_url(redis_url) as client:
        client.set(f"{prefix}{{old}}:token", 41)
        with RedisLeases(redis_url, prefix=prefix) as leases:
            again = leases.try_acquire("old", 5.0)
            assert again is not None
            assert again.token == 42
            assert client.get(f"{prefix}{{old}}:token") is None  # folded in, then deleted
            other = leases.try_acquire("new", 5.0)
            assert other is not None
            assert other.token == 43
            again.release()
            other.release()
        assert client.keys(f"{prefix}*") == [f"{prefix}seq".encode()]
