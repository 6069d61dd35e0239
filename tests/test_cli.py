"""The ``rxcoord`` command line: demo, bench plumbing, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rxcoord._cli.bench import BENCHMARKS, run_benchmarks
from rxcoord._cli.main import main
from rxcoord._cli.demo import DemoConfig, make_workload, run_scheduled_job

ROOT = Path(__file__).resolve().parent.parent


def rxcoord(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rxcoord", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_json_runs_the_whole_job_and_every_check_passes() -> None:
    proc = rxcoord("demo", "--json", "--messages", "600", "--processes", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["ordering_violations"] == 0
    assert report["exclusion_violations"] == 0
    assert report["limit_violations"] == 0
    assert report["double_runs"] == 0
    assert report["scheduled_runs"] >= 1
    assert report["store"] == "sqlite"
    assert sum(t["jobs"] for t in report["tenants"]) == 600
    outcomes = ("completed", "failed", "rejected", "cancelled", "timed_out")
    assert all(sum(t[o] for o in outcomes) == t["jobs"] for t in report["tenants"])
    assert report["global_max_running"] <= report["global_limit"]


def test_demo_table_output() -> None:
    proc = rxcoord("demo", "--messages", "300", "--processes", "2")
    assert proc.returncode == 0, proc.stderr
    for text in ("tenant-0", "p99 ms", "per-customer ordering violations", "double runs"):
        assert text in proc.stdout
    assert "all checks passed" in proc.stdout


def test_same_seed_same_workload() -> None:
    config = DemoConfig(messages=500, seed=3)
    assert make_workload(config) == make_workload(config)
    assert make_workload(config) != make_workload(DemoConfig(messages=500, seed=4))
    tenants = {m.tenant for m in make_workload(DemoConfig(tenants=5, customers=10))}
    assert tenants == {f"tenant-{i}" for i in range(5)}


def test_the_double_run_check_catches_a_store_that_does_not_exclude() -> None:
    # memory:// gives every process a private store: nothing excludes the others, so the
    # scheduled job runs several times per tick. The check must see it.
    config = DemoConfig(store_url="memory://", processes=2, ticks=4, period=0.2)
    runs, ticks, double, _tokens, store = run_scheduled_job(config)
    assert store == "memory"
    assert double > 0
    assert runs > ticks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--tenants", "0"], "must be at least 1"),
        (["demo", "--store", "mysql"], "invalid choice"),
        (["demo", "--store", "redis", "--url", "redis://127.0.0.1:1/0"], "unreachable"),
        (["demo", "--store", "redis", "--url", "postgresql://x/y"], "does not match"),
        (["nothing"], "invalid choice"),
    ],
)
def test_errors_are_one_clear_line(args: list[str], message: str) -> None:
    proc = rxcoord(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_every_benchmark_script_exposes_bench_rows() -> None:
    import importlib.util

    for name in BENCHMARKS:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert callable(getattr(module, "bench_rows", None)), name


def test_bench_prints_one_table_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The table plumbing, on stand-in scripts (the real ones take minutes: `rxcoord bench`).
    import rxcoord._cli.bench as bench

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "pkg").mkdir()
    for name in BENCHMARKS:
        (tmp_path / "benchmarks" / f"{name}.py").write_text(
            "def bench_rows(quick, **options):\n"
            "    if options.get('redis_url') is None:\n"
            "        options['notes'].append('no redis')\n"
            f"    return [('{name} workload', '10/s', 'baseline', '5/s', '2.00x', '>= 1x')]\n"
        )
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "pkg" / "_cli" / "bench.py"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # _load adds the benchmarks directory
    for name in BENCHMARKS:  # import the stand-ins, not scripts an earlier test imported
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert run_benchmarks(True, redis_url=None, postgres_url=None) == 0
    finally:
        for name in BENCHMARKS:
            sys.modules.pop(name, None)
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert f"{name} workload" in out
    assert "2.00x" in out
    assert "no redis" in out


def test_main_returns_an_exit_status() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
