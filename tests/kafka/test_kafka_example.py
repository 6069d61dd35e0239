"""The Kafka examples run to completion against the suite's broker (and PostgreSQL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.prometheus import check_samples, scrape_example

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kafka_orders.py"


def test_kafka_orders_example(kafka_bootstrap: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), kafka_bootstrap],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "handled 2000 orders" in proc.stdout
    assert "ordering violations: 0" in proc.stdout


TO_POSTGRES = EXAMPLE.with_name("kafka_to_postgres.py")


def test_kafka_to_postgres_example(kafka_bootstrap: str, postgres_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(TO_POSTGRES), kafka_bootstrap, postgres_url],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "payments applied: 2000 of 2000" in proc.stdout
    assert "applied twice: 0, missing: 0, customers out of order: 0" in proc.stdout
    assert "offsets table: 8 partitions, 0 done offsets left unfolded" in proc.stdout


def test_observability_example_serves_the_kafka_instruments(kafka_bootstrap: str) -> None:
    printed, samples = scrape_example("--kafka", kafka_bootstrap)
    assert "kafka: 20 records, 4 failed" in printed
    check_samples(
        samples,
        [
            # 20 records: the handler raised on 4 (skipped by on_error), returned on 16
            ("rxcoord_kafka_records_total", {"rxcoord_outcome": "completed"}, lambda v: v == 16),
            ("rxcoord_kafka_records_total", {"rxcoord_outcome": "failed"}, lambda v: v == 4),
            # the consumer committed its prefix at least once (the final commit at close)
            ("rxcoord_kafka_commit_wait_seconds_count", {}, lambda v: v >= 1),
        ],
    )
