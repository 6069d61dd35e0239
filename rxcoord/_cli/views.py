"""The rich view of ``rxcoord demo``: a progress bar while it runs, then tables and checks."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .demo import DemoConfig, DemoReport, Workload, describe_workload, run_demo

__all__ = ["show_demo"]


def show_demo(config: DemoConfig) -> int:
    """Run the demo with a progress bar, print its tables; the exit status (1: a check failed)."""
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the tables into 80 columns
        console = Console(width=max(console.width, 120))
    workload = describe_workload(config)
    console.print(
        f"[bold]rxcoord demo[/]: {workload.messages:,} messages from {config.customers} customers "
        f"of {len(workload.tenants)} tenants (tenant-0 floods), seed {config.seed}"
    )
    console.print(_workload_table(workload))
    with Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        messages = progress.add_task("messages processed", total=config.messages)
        ticks = progress.add_task(
            f"scheduled job, {config.processes} processes", total=config.ticks
        )
        report = run_demo(
            config,
            on_message=lambda n: progress.update(messages, completed=n),
            on_tick=lambda n: progress.update(ticks, completed=n),
        )
        progress.update(ticks, completed=config.ticks)
    console.print(_tenant_table(report))
    console.print(
        "[dim]timing-dependent: which messages find their tenant's queue full (rejected) "
        "depends on how fast this machine drains it, and so do the counts that follow from it "
        "and the latencies; they change from run to run. The workload above and the checks "
        "below do not.[/]"
    )
    console.print(_checks_table(report))
    verdict = "[bold green]all checks passed[/]" if report.ok else "[bold red]CHECKS FAILED[/]"
    console.print(f"{verdict} in {report.seconds:.1f} s")
    return 0 if report.ok else 1


def _workload_table(workload: Workload) -> Table:
    table = Table(
        title=(
            f"workload (fixed by --seed {workload.seed}: identical on every run; "
            f"fingerprint {workload.fingerprint})"
        ),
        title_justify="left",
    )
    for column in ("tenant", "customers", "messages", "planned to fail", "over timeout", "cancel"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for plan in workload.tenants:
        table.add_row(
            plan.tenant,
            str(plan.customers),
            f"{plan.messages:,}",
            str(plan.planned_failures),
            str(plan.planned_timeouts),
            str(plan.planned_cancels),
        )
    return table


def _tenant_table(report: DemoReport) -> Table:
    table = Table(
        title="TenantScheduler: outcomes per tenant (key = customer) - timing-dependent, see below",
        title_justify="left",
    )
    for column in (
        "tenant",
        "jobs",
        "completed",
        "failed",
        "rejected",
        "cancelled",
        "timed out",
        "p50 ms",
        "p99 ms",
        "max running / limit",
    ):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for row in report.tenants:
        table.add_row(
            row.tenant,
            f"{row.jobs:,}",
            f"{row.completed:,}",
            str(row.failed),
            str(row.rejected),
            str(row.cancelled),
            str(row.timed_out),
            f"{row.p50_ms:.1f}",
            f"{row.p99_ms:.1f}",
            f"{row.max_running} / {row.limit}",
        )
    table.add_row(
        "[bold]all tenants[/]",
        f"{sum(r.jobs for r in report.tenants):,}",
        f"{sum(r.completed for r in report.tenants):,}",
        str(sum(r.failed for r in report.tenants)),
        str(sum(r.rejected for r in report.tenants)),
        str(sum(r.cancelled for r in report.tenants)),
        str(sum(r.timed_out for r in report.tenants)),
        "",
        "",
        f"{report.global_max_running} / {report.global_limit}",
    )
    return table


def _checks_table(report: DemoReport) -> Table:
    table = Table(title="checks", title_justify="left")
    table.add_column("check")
    table.add_column("found", justify="right")
    table.add_column("", justify="left")
    rows = [
        ("per-customer ordering violations", report.ordering_violations),
        ("per-customer exclusion violations", report.exclusion_violations),
        ("concurrency limit violations (tenant and global)", report.limit_violations),
        (
            f"scheduled-job double runs ({report.scheduled_runs} runs of "
            f"{report.scheduled_ticks} ticks, {report.store} lease store)",
            report.double_runs,
        ),
        ("fencing tokens out of order", report.token_order_violations),
    ]
    for name, found in rows:
        table.add_row(name, str(found), "[green]ok[/]" if found == 0 else "[red]FAIL[/]")
    return table
