"""examples/kafka_orders.py runs to completion against the suite's broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
