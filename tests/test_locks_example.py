"""Smoke test: ``examples/entity_locks.py`` runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "entity_locks.py"


def test_entity_locks_example_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per-account overlaps (violations): 0" in proc.stdout
    assert "lock state left behind: 0 keys, 0 leases held" in proc.stdout
    audits = next(line for line in proc.stdout.splitlines() if line.startswith("audits"))
    done, total = audits.rsplit(" ", 1)[1].split("/")
    assert done == total
    assert int(total) > 1
