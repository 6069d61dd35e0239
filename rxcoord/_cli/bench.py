"""``rxcoord bench``: run the scripts in ``benchmarks/`` in this process and print one table.

Each script exposes ``bench_rows(quick, redis_url=..., postgres_url=...)`` returning rows of
``(workload, rxcoord's figure, baseline, baseline's figure, ratio, goal)``. The scripts live in
the source checkout, next to the package, not inside it: a benchmark is not library code.
"""

from __future__ import annotations

import importlib
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["BENCHMARKS", "run_benchmarks"]

BENCHMARKS = (
    "bench_serialize",
    "bench_coordinator",
    "bench_tenants",
    "bench_locks",
    "bench_leases",
)


def _load(directory: Path, name: str) -> ModuleType:
    # Importable by plain name (the directory goes on sys.path) so that benchmarks which start
    # worker processes with multiprocessing's "spawn" can be re-imported in the child.
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return importlib.import_module(name)


def run_benchmarks(quick: bool, *, redis_url: str | None, postgres_url: str | None) -> int:
    """Run every benchmark; print their rows as one table. Returns the exit status."""
    from rich.console import Console
    from rich.table import Table

    directory = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (directory / "bench_serialize.py").is_file():
        raise RuntimeError(
            "rxcoord bench runs the scripts in benchmarks/ of a source checkout; "
            f"none at {directory}"
        )
    console = Console()
    if not console.is_terminal:  # piped or captured: keep the table readable
        console = Console(width=max(console.width, 150))
    console.print(
        f"[bold]rxcoord bench[/]{' --quick' if quick else ''}: Python {platform.python_version()}, "
        f"{platform.machine()}, {_cpus()} CPUs; figures are medians, ratios rxcoord / baseline"
    )
    table = Table(title_justify="left")
    for column in ("workload", "rxcoord", "baseline", "baseline figure", "ratio", "goal"):
        table.add_column(
            column, justify="right" if column in ("rxcoord", "baseline figure", "ratio") else "left"
        )
    notes: list[str] = []
    started = time.perf_counter()
    for name in BENCHMARKS:
        with console.status(f"running {name}..."):
            module = _load(directory, name)
            if not hasattr(module, "bench_rows"):
                notes.append(f"{name}.py has no bench_rows(): run it on its own")
                continue
            rows: list[tuple[Any, ...]] = module.bench_rows(
                quick, redis_url=redis_url, postgres_url=postgres_url, notes=notes
            )
        for workload, ours, baseline, theirs, ratio, goal in rows:
            table.add_row(workload, ours, baseline, theirs, ratio, goal)
        table.add_section()
    console.print(table)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
