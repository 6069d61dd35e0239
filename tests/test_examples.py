"""Smoke tests: each example runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.prometheus import Expected, check_samples, scrape_example

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# What each example must print. Examples with a test file of their own (entity_locks,
# scheduled_job, ...) are run there; test_every_example_is_run checks that none is left out.
EXPECTED = {
    "ordered_messages": ["violations: 0"],
    "seed_scenario": ["interleaving violations: 0"],
    "multi_tenant": [
        "acme ran at most 2 jobs at once",
        "all tenants together at most 4 (limit 4)",
        "FIFO pool of 4",
        "lower with fair sharing",
        "tenants with state left after going idle: 0",
    ],
    "async_jobs": ["download cancelled inside the job"],
    "retries": [
        "30 charges in",
        "6 retries",
        "alice: charged in order: True",
        "bob: charged in order: True",
        "carol: charged in order: True",
        "mallory: provider refused mallory#1 (rxcoord: gave up after 3 attempts",
    ],
    "fleet_limits": [
        "store: sqlite, 2 processes, 24 jobs",
        "acme ran at most 2 jobs at once across both processes (limit 2)",
        "all tenants together at most 3 (limit 3)",
        "fencing tokens distinct: True",
    ],
    "rate_limits": [
        "store: sqlite, 3 processes, 60 API calls",
        "refused by the API: 0\n",
        "without fleet= (each process its own rates)",
    ],
    "failures": [
        "38 of 40 came out; 2 failures vanished",
        "40 of 40 came out, 2 of them Failed: customer-1#3, customer-2#3",
        "3. fail fast: the stream ended with ValueError",
        "after executor.shutdown(wait=True): 0 running",
    ],
}


# Examples with a test of their own below.
RUN_HERE = {"observability"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for expected in EXPECTED[name]:
        assert expected in proc.stdout


def test_every_example_is_run() -> None:
    # An example is run here, or by a test file that names it (e.g. tests/test_locks_example.py).
    tests = [
        p.read_text()
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.resolve() != Path(__file__).resolve()
    ]
    for example in sorted(EXAMPLES.glob("*.py")):
        covered = (
            example.stem in EXPECTED
            or example.stem in RUN_HERE
            or any(f"{example.name}" in text for text in tests)
        )
        assert covered, f"examples/{example.name} is run by no test"


# What examples/observability.py's /metrics page must show after its workload (the Kafka
# consumer's instruments: tests/kafka/test_kafka_example.py, which has the broker).
OBSERVABILITY_METRICS: list[Expected] = [
    ("rxcoord_lease_wait_seconds_count", {"rxcoord_outcome": "acquired"}, lambda v: v == 5),
    ("rxcoord_lease_wait_seconds_count", {"rxcoord_outcome": "timed_out"}, lambda v: v == 1),
    ("rxcoord_lease_wait_seconds_count", {"rxcoord_outcome": "taken"}, lambda v: v == 1),
    # the timed-out wait lasted its 0.2 s timeout, not much more
    ("rxcoord_lease_wait_seconds_sum", {"rxcoord_outcome": "timed_out"}, lambda v: 0.15 < v < 5),
    ("rxcoord_leases_lost_total", {"rxcoord_backend": "sqlite"}, lambda v: v == 1),
    ("rxcoord_leases_held", {"rxcoord_backend": "sqlite"}, lambda v: v == 1),
    # the coordinator named orders: 10 jobs, 3 of them failing
    ("rxcoord_job_wait_seconds_count", {"rxcoord_name": "orders"}, lambda v: v == 10),
    (
        "rxcoord_job_duration_seconds_count",
        {"rxcoord_name": "orders", "rxcoord_outcome": "failed"},
        lambda v: v == 3,
    ),
    (
        "rxcoord_job_duration_seconds_count",
        {"rxcoord_name": "orders", "rxcoord_outcome": "completed"},
        lambda v: v == 7,
    ),
    # still open while served, all its jobs ended: nothing active, queued or waiting
    ("rxcoord_jobs_active", {"rxcoord_name": "orders"}, lambda v: v == 0),
    ("rxcoord_jobs_queued", {"rxcoord_name": "orders"}, lambda v: v == 0),
    ("rxcoord_jobs_waiting", {"rxcoord_name": "orders"}, lambda v: v == 0),
    # the burst: 2 of 4 refused by a coordinator with room for 2
    (
        "rxcoord_jobs_rejected_total",
        {"rxcoord_name": "burst", "rxcoord_reason": "too_many_tasks"},
        lambda v: v == 2,
    ),
    # the fleet scheduler named reports: a permit from the store for each of its 4 jobs
    (
        "rxcoord_fleet_permit_wait_seconds_count",
        {"rxcoord_name": "reports", "rxcoord_outcome": "acquired"},
        lambda v: v == 4,
    ),
]


def test_observability_example_serves_the_instruments_on_metrics() -> None:
    printed, samples = scrape_example()
    assert "leases: 5 acquired, 1 timed out, 1 taken, 1 lost, 1 held" in printed
    assert "jobs: 10 run, 3 failed; 2 rejected; 4 fleet jobs" in printed
    check_samples(samples, OBSERVABILITY_METRICS)
