"""The exactly-once tests' effects table and its invariant checker (``PostgresOffsets``).

Every handler run inserts one row ``(key, seq, worker, partition, kafka_offset)`` into an
effects table **without** a unique constraint, in the record's transaction: a record applied
twice shows as two rows, a record lost as none. ``id`` is a ``bigserial`` taken at the insert;
a key's records run one at a time, each starting after the previous one's transaction ended, so
a key's rows in ``id`` order are its records in the order their effects were applied.

:func:`check_exactly_once` asserts over the table: every produced ``(key, seq)`` applied once,
nothing else applied, and each key's rows in ``seq`` order.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from rxcoord.kafka import Record

from .support import Produced


@dataclass
class Applied:
    """One row of the effects table."""

    id: int
    key: str
    seq: int
    worker: str
    partition: int
    offset: int


class Effects:
    """A test's effects table and offsets table on a real PostgreSQL."""

    def __init__(self, url: str, tag: str) -> None:
        self.url = url
        self.table = f"effects_{tag}"
        self.offsets_table = f"offsets_{tag}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {self.table} (id bigserial, key text NOT NULL, "
                "seq integer NOT NULL, worker text NOT NULL, part integer NOT NULL, "
                "kafka_offset bigint NOT NULL)"
            )

    def handler(
        self, worker: str, hook: Callable[[Record, Any], None] | None = None
    ) -> Callable[[Record, Any], None]:
        """``handle(record, tx)``: one INSERT into the effects table (``hook`` runs after it)."""
        sql = (
            f"INSERT INTO {self.table} (key, seq, worker, part, kafka_offset) "
            "VALUES (%s, %s, %s, %s, %s)"
        )

        def handle(record: Record, tx: Any) -> None:
            key, seq = parse(record)
            tx.execute(sql, (key, seq, worker, record.partition, record.offset))
            if hook is not None:
                hook(record, tx)

        return handle

    def rows(self) -> list[Applied]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            found = conn.execute(
                f"SELECT id, key, seq, worker, part, kafka_offset FROM {self.table} ORDER BY id"
            ).fetchall()
        return [Applied(*row) for row in found]

    def count(self) -> int:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.table}").fetchone()
        return int(row[0]) if row else 0

    def stored(self) -> list[tuple[Any, ...]]:
        """The offsets table's partition rows (offset -1) and done rows (offsets >= 0):
        (group, topic, partition, offset, epoch, done_below); not its lock rows (the stripes,
        whose number is fixed per partition)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(
                f"SELECT group_id, topic, partition_id, kafka_offset, epoch, done_below "
                f"FROM {self.offsets_table} WHERE kafka_offset >= -1 ORDER BY 1, 2, 3, 4"
            ).fetchall()

    def rows_per_partition(self) -> dict[int, int]:
        """Every row the offsets table keeps per partition, lock rows included."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            found = conn.execute(
                f"SELECT partition_id, count(*) FROM {self.offsets_table} GROUP BY 1"
            ).fetchall()
        return {int(p): int(n) for p, n in found}

    def drop(self) -> None:
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(self.url, autocommit=True) as conn,
        ):
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")
            conn.execute(f"DROP TABLE IF EXISTS {self.offsets_table}")


def parse(record: Record) -> tuple[str, int]:
    key, _, seq = (record.value or b"").decode().rpartition(":")
    return key, int(seq)


def check_exactly_once(produced: Produced, rows: list[Applied]) -> dict[str, int]:
    """Assert: each produced (key, seq) applied exactly once, nothing else, per key in seq order.

    Returns a few counts (rows, workers that applied something).
    """
    applied: dict[tuple[str, int], list[Applied]] = defaultdict(list)
    for row in rows:
        applied[(row.key, row.seq)].append(row)
    twice = {pair: found for pair, found in applied.items() if len(found) > 1}
    assert not twice, (
        f"{len(twice)} record(s) applied more than once, e.g. {sorted(twice.items())[:3]}"
    )
    missing = set(produced.where) - set(applied)
    assert not missing, f"{len(missing)} record(s) never applied, e.g. {sorted(missing)[:10]}"
    extra = set(applied) - set(produced.where)
    assert not extra, f"rows for records never produced: {sorted(extra)[:10]}"
    per_key: dict[str, list[int]] = defaultdict(list)
    for row in rows:  # in id order: the order the effects were applied
        per_key[row.key].append(row.seq)
    for key, seqs in per_key.items():
        assert seqs == sorted(seqs), f"key {key}: applied out of order: {seqs[:30]}"
    return {"rows": len(rows), "workers": len({row.worker for row in rows})}
