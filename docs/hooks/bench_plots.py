"""MkDocs hook: the performance page's table and plots, drawn at build time from one run.

``docs/data/bench.json`` is what ``rxcoord bench --json docs/data/bench.json`` wrote on the
project's machine (committed, so the build needs no server and takes no minutes). From it this
hook makes, at every build:

* the table: a page's ``<!-- bench: table -->`` line becomes the run's rows as Markdown;
* ``img/bench-throughput.svg``: rxcoord's throughput against each baseline, as ratios;
* ``img/bench-light-tenant.svg``: the light tenants' latency under a flood, fair vs FIFO.

So the figures, the plots and the table cannot disagree, and a new run is one command and a
commit. Matplotlib draws with fixed SVG ids (``svg.hashsalt``), so the same data gives the
same files.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

# Figure objects, not pyplot: no backend, no global figure state, nothing to close.
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

DATA = Path(__file__).resolve().parent.parent / "data" / "bench.json"
TABLE_MARK = "<!-- bench: table -->"
RUN_MARK = "<!-- bench: run -->"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_VERDICT_COLOUR = {"met": "#2e7d32", "not met": "#c62828"}


def load_run(path: Path = DATA) -> dict[str, Any]:
    """The committed run.

    Raises:
        FileNotFoundError: The data file is missing.
        ValueError: It is not a run written by ``rxcoord bench --json``.
    """
    run: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(run.get("rows"), list) or not run["rows"]:
        raise ValueError(f"{path}: no rows (write it with rxcoord bench --json {path})")
    return run


def number(text: str) -> float | None:
    """The first number in a figure such as ``"71,564 items/s"`` or ``"1.04x"``."""
    found = _NUMBER.search(text)
    return None if found is None else float(found.group().replace(",", ""))


def table(run: dict[str, Any]) -> str:
    """The run's rows as a Markdown table."""
    lines = [
        "| workload | rxcoord | baseline | baseline figure | ratio | goal | verdict |",
        "|---|--:|---|--:|--:|---|---|",
    ]
    for row in run["rows"]:
        verdict = "" if row["verdict"] == "no goal" else row["verdict"]
        cells = (
            row["workload"],
            row["ours"],
            row["baseline"],
            row["theirs"],
            row["ratio"],
            row["goal"],
            verdict,
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def describe(run: dict[str, Any]) -> str:
    """One sentence saying where the figures come from."""
    size = "quick sizes" if run["quick"] else "full sizes"
    load = [value for value in run.get("load") or [] if value is not None]
    busy = f", load average {min(load):g}-{max(load):g} (start and end of the run)" if load else ""
    return (
        f"One `rxcoord bench` run ({size}, {run['seconds']} s) on {run['date']}: Python "
        f"{run['python']}, {run['machine']}, {run['cpus']} CPUs{busy}."
    )


def _svg(figure: Figure) -> bytes:
    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    return out.getvalue().encode()


def throughput_plot(run: dict[str, Any]) -> bytes:
    """Bars from parity to rxcoord / baseline for every throughput row, with each goal."""
    rows = [
        row
        for row in run["rows"]
        if row["ours"].endswith("/s") and row["ratio"].endswith("x") and row["baseline"]
    ]
    labels = [f"{row['workload']}\nvs {row['baseline']}" for row in rows]
    ratios = [number(row["ratio"]) or 1.0 for row in rows]
    colours = [_VERDICT_COLOUR.get(row["verdict"], "#607d8b") for row in rows]
    goals = [number(row["goal"]) if row["goal"].lstrip().startswith(">=") else None for row in rows]
    figure = Figure(figsize=(9, 0.42 * len(rows) + 1.4))
    axes = figure.subplots()
    positions = list(range(len(rows)))
    # From 1x (parity) to the ratio, so a bar's length and side say how far and which way.
    axes.barh(positions, [r - 1.0 for r in ratios], left=1.0, color=colours)
    for at, goal in zip(positions, goals, strict=True):
        if goal is not None:
            axes.plot([goal, goal], [at - 0.4, at + 0.4], color="black", linewidth=1.5)
    axes.axvline(1.0, color="#616161", linewidth=1)
    axes.set_xscale("log")
    extent = [*ratios, *(g for g in goals if g is not None), 1.0]
    axes.set_xlim(min(extent) / 1.4, max(extent) * 1.4)
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_yticks(positions, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("rxcoord / baseline (log scale; black ticks: goals; green met, red not met)")
    axes.set_title("Throughput against the baselines")
    return _svg(figure)


def light_tenant_plot(run: dict[str, Any]) -> bytes:
    """p50 and p99 of the light tenants' latency under a flood: fair sharing vs a FIFO pool."""
    rows = [row for row in run["rows"] if "light-tenant" in row["workload"]]
    if not rows:
        raise ValueError("the run has no light-tenant rows (bench_tenants)")
    names = [row["workload"].split("light-tenant ")[1].split(" ")[0] for row in rows]  # p50...
    fair = [number(row["ours"]) or 0.0 for row in rows]
    fifo = [number(row["theirs"]) or 0.0 for row in rows]
    figure = Figure(figsize=(6, 3.6))
    axes = figure.subplots()
    width = 0.38
    at = range(len(rows))
    axes.bar([i - width / 2 for i in at], fair, width, label="TenantScheduler (fair shares)")
    axes.bar([i + width / 2 for i in at], fifo, width, label=rows[0]["baseline"])
    for i, (ours, theirs) in enumerate(zip(fair, fifo, strict=True)):
        axes.annotate(f"{ours:,.0f} ms", (i - width / 2, ours), ha="center", va="bottom")
        axes.annotate(f"{theirs:,.0f} ms", (i + width / 2, theirs), ha="center", va="bottom")
    axes.set_ylim(0, max(fifo + fair) * 1.15)
    axes.set_xticks(list(at), names)
    axes.set_ylabel("latency (ms)")
    flood = rows[0]["workload"].split("(")[-1].rstrip(")")
    axes.set_title(f"Light tenants' jobs after a {flood}")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    return _svg(figure)


# -- the hook's entry points (mkdocs calls these by name) -------------------------------------


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    matplotlib.rcParams["svg.hashsalt"] = "rxcoord"  # stable ids: same data, same files
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: small, and the page's font
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    run = load_run()
    files.append(File.generated(config, "img/bench-throughput.svg", content=throughput_plot(run)))
    files.append(
        File.generated(config, "img/bench-light-tenant.svg", content=light_tenant_plot(run))
    )
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if TABLE_MARK not in markdown and RUN_MARK not in markdown:
        return markdown
    run = load_run()
    return markdown.replace(TABLE_MARK, table(run)).replace(RUN_MARK, describe(run))
