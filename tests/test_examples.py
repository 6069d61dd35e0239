"""Smoke tests: each example runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ordered_messages", "violations: 0"),
        ("seed_scenario", "interleaving violations: 0"),
        ("multi_tenant", "tenants with state left after going idle: 0"),
        ("async_jobs", "download cancelled inside the job"),
    ],
)
def test_example_runs(name: str, expected: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout
