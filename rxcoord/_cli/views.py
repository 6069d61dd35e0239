"""The rich view of ``rxcoord demo``: a progress bar while it runs, then tables and checks."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .demo import DemoConfig, DemoReport, Workload, describe_workload, run_demo
from .kafka_stage import KafkaReport, describe_kafka_workload, resolve_kafka

__all__ = ["show_demo"]


def show_demo(config: DemoConfig) -> int:
    """Run the demo with a progress bar, print its tables; the exit status (1: a check failed)."""
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the tables into 80 columns
        console = Console(width=max(console.width, 120))
    workload = describe_workload(config)
    plan = config.kafka if config.kafka is not None else resolve_kafka(None, disabled=False)
    config = dataclasses.replace(config, kafka=plan)
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
        records = None
        if plan.skipped is None:
            total = describe_kafka_workload(config.seed).records
            records = progress.add_task("kafka records handled", total=total)

        def on_record(n: int) -> None:
            if records is not None:
                progress.update(records, completed=n)

        report = run_demo(
            config,
            on_message=lambda n: progress.update(messages, completed=n),
            on_tick=lambda n: progress.update(ticks, completed=n),
            on_record=on_record,
        )
        progress.update(ticks, completed=config.ticks)
        if records is not None and not report.kafka.ran:  # Tansu did not start: see the note
            progress.remove_task(records)
    console.print(_tenant_table(report))
    console.print(
        "[dim]timing-dependent: which messages find their tenant's queue full (rejected) "
        "depends on how fast this machine drains it, and so do the counts that follow from it "
        "and the latencies; they change from run to run. The workload above and the checks "
        "below do not.[/]"
    )
    if report.kafka.ran:
        console.print(_kafka_table(report.kafka))
    else:
        note = f"[yellow]note:[/] kafka stage skipped: {escape(report.kafka.skipped or '')}"
        console.print(note, soft_wrap=True)  # one line, however narrow the terminal
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
        (
            f"fleet: jobs above the fleet limit {report.fleet_limit} or a tenant's limit "
            f"{report.fleet_tenant_limit} across {report.fleet_processes} processes "
            f"({report.fleet_jobs} jobs, at most {report.fleet_max_running} at once, "
            f"{report.fleet_tenant_max_running} of one tenant; {report.store} store)",
            report.fleet_violations,
        ),
        ("fencing tokens out of order", report.token_order_violations),
    ]
    kafka = report.kafka
    if kafka.ran:
        rows += [
            (
                f"kafka: records lost (of {kafka.handled + kafka.checks['lost']})",
                kafka.checks["lost"],
            ),
            ("kafka: per-key order violations", kafka.checks["ordering_violations"]),
            ("kafka: one key's records overlapping", kafka.checks["overlap_violations"]),
            (
                "kafka: partitions whose committed offset is not the end offset",
                kafka.checks["commit_mismatches"],
            ),
        ]
    for name, found in rows:
        table.add_row(name, str(found), "[green]ok[/]" if found == 0 else "[red]FAIL[/]")
    return table


def _kafka_table(kafka: KafkaReport) -> Table:
    w = kafka.workload
    assert w is not None
    table = Table(
        title=(
            f"Kafka: KeyedConsumer on {escape(kafka.broker)}; workload fixed by --seed {w.seed} "
            f"(fingerprint {w.fingerprint}), the rest timing-dependent"
        ),
        title_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    offsets = ", ".join(f"p{p} {kafka.committed.get(p)}/{e}" for p, e in kafka.end_offsets.items())
    stats = kafka.stats
    rows = [
        ("records / keys / partitions (fixed)", f"{w.records} / {w.keys} / {w.partitions}"),
        ("records per partition (fixed)", " ".join(str(n) for n in w.per_partition)),
        ("records of the busiest key (fixed)", str(w.largest_key)),
        ("handled (duplicates)", f"{kafka.handled} ({kafka.duplicates})"),
        ("committed / end offset per partition", offsets),
        ("handlers running at once, max / limit", f"{kafka.max_running} / {kafka.max_concurrency}"),
        ("throughput, first to last record", f"{kafka.records_per_second:,.0f} records/s"),
        ("stage time (broker start and group join included)", f"{kafka.seconds:.1f} s"),
        (
            "stats(): fetched / completed / failed / dropped",
            f"{stats['fetched']} / {stats['completed']} / {stats['failed']} / {stats['dropped']}",
        ),
        (
            "stats(): commit requests / assignments and revocations",
            f"{stats['commits']} / {stats['rebalances']}",
        ),
        (
            "stats() peaks: in flight / queued / longest key queue",
            f"{stats.get('peak_in_flight', 0)} / {stats.get('peak_queued', 0)} / "
            f"{stats.get('peak_longest_key_queue', 0)}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
