"""Smoke tests: each example runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
        covered = example.stem in EXPECTED or any(f"{example.name}" in text for text in tests)
        assert covered, f"examples/{example.name} is run by no test"
