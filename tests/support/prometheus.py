"""Running ``examples/observability.py`` and reading its ``/metrics`` page as a scraper would."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["OBSERVABILITY", "Expected", "check_samples", "scrape_example"]

OBSERVABILITY = Path(__file__).resolve().parents[2] / "examples" / "observability.py"

# A Prometheus sample name, labels that must be present, and a check of its value.
Expected = tuple[str, dict[str, str], Callable[[float], bool]]


def scrape_example(*args: str) -> tuple[str, list[Sample]]:
    """Run the example with ``args``; what it printed, and the ``rxcoord_*`` samples it served.

    The example runs its workload, prints the page's address and serves it; the page is read
    once over HTTP and the example stopped.
    """
    proc = subprocess.Popen(
        [sys.executable, str(OBSERVABILITY), "--port", "0", "--serve-for", "60", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the workload runs first; then the page's address
            lines.append(line)
            if line.startswith("serving "):
                break
        if not lines or not lines[-1].startswith("serving "):
            raise AssertionError(proc.stderr.read() if proc.stderr else "no output")
        with urllib.request.urlopen(lines[-1].split()[-1], timeout=10) as response:
            page = response.read().decode()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    samples = [
        sample
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name.startswith("rxcoord_")
    ]
    return "".join(lines), samples


def check_samples(samples: list[Sample], expected: list[Expected]) -> None:
    """Each expected sample is served exactly once (one series) and its value passes."""
    for name, labels, check in expected:
        found = [
            s.value
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, f"{name}{labels}: {found} in {sorted({s.name for s in samples})}"
        assert check(found[0]), f"{name}{labels} = {found[0]}"
