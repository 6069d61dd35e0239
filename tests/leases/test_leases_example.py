"""Smoke test: examples/scheduled_job.py runs as a user would run it (SQLite, no server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scheduled_job.py"


def run_example(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def check_output(out: str) -> None:
    assert "slots run more than once: 0" in out
    assert "stale writes refused: 1" in out
    assert "REFUSED" in out


def test_the_scheduled_job_example_runs_on_sqlite() -> None:
    check_output(run_example())
