"""The real OpenTelemetry SDK for tests: metrics and spans read back by name and attributes.

The SDK's global providers can be set once per process (``set_meter_provider`` refuses a
second one), so this module installs one ``MeterProvider`` with an ``InMemoryMetricReader`` and
one ``TracerProvider`` with an ``InMemorySpanExporter`` the first time a test asks for the
:func:`otel` fixture, and keeps them for the rest of the process (each pytest-xdist worker is a
process of its own). From then on every test in that process runs with telemetry on, which
also exercises the instrumented paths; a test about the state *without* an SDK runs a
subprocess.

Isolation between tests: counters and histograms are read with delta temporality, so the
fixture collects (and drops) what earlier tests recorded before the test starts, and each
:meth:`Telemetry.collect` adds what was recorded since the previous one; the up-down counters
and gauges are read cumulatively (their current value). Spans: the exporter is cleared before
the test. Use names of your own (a coordinator's ``name``) where other threads of earlier tests
might still record.

Usage::

    def test_waits(otel: Telemetry) -> None:
        ...workload...
        metrics = otel.collect()
        assert metrics.count("rxcoord.lease.wait", {"rxcoord.outcome": "acquired"}) == 3
        assert [s.name for s in otel.spans()] == ["rxcoord.job orders"]
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
    Sum,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["Metrics", "Point", "Telemetry", "drop_recorded", "install", "otel"]

_AttrKey = tuple[tuple[str, Any], ...]


@dataclass
class Point:
    """What one instrument recorded for one attribute set since the test began.

    Attributes:
        value: A counter's sum, an up-down counter's or gauge's latest value, a histogram's sum.
        count: A histogram's number of observations (0 for the others).
        min, max: A histogram's smallest and largest observation.
    """

    value: float = 0.0
    count: int = 0
    min: float = float("inf")
    max: float = float("-inf")


@dataclass
class Metrics:
    """Everything recorded since the test began, by instrument name and attribute set."""

    points: dict[str, dict[_AttrKey, Point]] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    current: set[str] = field(default_factory=set)  # instruments read as current values

    def names(self) -> set[str]:
        """The instruments that recorded something."""
        return set(self.points)

    def select(self, name: str, attributes: Mapping[str, Any] | None = None) -> list[Point]:
        """The points of ``name`` whose attributes include every item of ``attributes``."""
        wanted = dict(attributes or {})
        return [
            point
            for key, point in self.points.get(name, {}).items()
            if all(dict(key).get(k, _MISSING) == v for k, v in wanted.items())
        ]

    def attribute_sets(self, name: str) -> list[dict[str, Any]]:
        """The attribute sets ``name`` recorded."""
        return [dict(key) for key in self.points.get(name, {})]

    def value(self, name: str, attributes: Mapping[str, Any] | None = None) -> float:
        """The sum of the matching points' values (counter totals, current up-down values)."""
        return sum(point.value for point in self.select(name, attributes))

    def count(self, name: str, attributes: Mapping[str, Any] | None = None) -> int:
        """A histogram's number of matching observations."""
        return sum(point.count for point in self.select(name, attributes))

    def max(self, name: str, attributes: Mapping[str, Any] | None = None) -> float:
        """A histogram's largest matching observation (-inf if none)."""
        return max((point.max for point in self.select(name, attributes)), default=float("-inf"))

    def min(self, name: str, attributes: Mapping[str, Any] | None = None) -> float:
        """A histogram's smallest matching observation (inf if none)."""
        return min((point.min for point in self.select(name, attributes)), default=float("inf"))


_MISSING = object()


class Telemetry:
    """The process's in-memory reader and exporter, as one test sees them."""

    def __init__(self, reader: InMemoryMetricReader, exporter: InMemorySpanExporter) -> None:
        self.reader = reader
        self.exporter = exporter
        self._lock = threading.Lock()
        self._metrics = Metrics()

    def reset(self) -> None:
        """Forget what was recorded so far (earlier tests' data, or this test's setup)."""
        with self._lock:
            self.reader.get_metrics_data()  # delta instruments start again from here
            self._metrics = Metrics()
        self.exporter.clear()

    def collect(self) -> Metrics:
        """Collect now; everything recorded since :meth:`reset`, merged."""
        with self._lock:
            data = self.reader.get_metrics_data()
            merged = self._metrics
            # Current values (up-down counters, gauges) are what this collection reports:
            # an owner that is gone (or an attribute set no longer observed) drops out.
            for name in merged.current:
                merged.points.pop(name, None)
            for resource in data.resource_metrics if data is not None else ():
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        merged.units[metric.name] = metric.unit or ""
                        points = merged.points.setdefault(metric.name, {})
                        if _merge(points, metric.data):
                            merged.current.add(metric.name)
            return merged

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans (of ``name`` only, if given), in the order they ended."""
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


def _merge(points: dict[_AttrKey, Point], data: Any) -> bool:
    """Add a collection's points; True if they are current values (not deltas)."""
    cumulative = (
        isinstance(data, Sum) and data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    ) or isinstance(data, Gauge)
    for dp in data.data_points:
        key = tuple(sorted((dp.attributes or {}).items()))
        point = points.setdefault(key, Point())
        if isinstance(dp, HistogramDataPoint):
            point.value += dp.sum
            point.count += dp.count
            if dp.count:
                point.min = min(point.min, dp.min)
                point.max = max(point.max, dp.max)
        elif isinstance(dp, NumberDataPoint):
            point.value = dp.value if cumulative else point.value + dp.value
    return cumulative


_installed: Telemetry | None = None
_install_lock = threading.Lock()


def install() -> Telemetry:
    """Set the SDK's global providers (once per process) and return the shared reader/exporter.

    Raises:
        RuntimeError: Another MeterProvider or TracerProvider was set in this process before.
    """
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        delta, cumulative = AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE
        reader = InMemoryMetricReader(
            preferred_temporality={
                Counter: delta,
                Histogram: delta,
                ObservableCounter: delta,
                UpDownCounter: cumulative,
                ObservableUpDownCounter: cumulative,
                ObservableGauge: cumulative,
            }
        )
        meter_provider = MeterProvider(metric_readers=[reader])
        exporter = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        metrics.set_meter_provider(meter_provider)
        trace.set_tracer_provider(tracer_provider)
        if metrics.get_meter_provider() is not meter_provider:
            raise RuntimeError("another MeterProvider was set in this process before the tests'")
        if trace.get_tracer_provider() is not tracer_provider:
            raise RuntimeError("another TracerProvider was set in this process before the tests'")
        _installed = Telemetry(reader, exporter)
        return _installed


def drop_recorded() -> None:
    """Drop what the SDK holds, if a test of this process installed it (else nothing).

    A memory test must not count the finished spans the in-memory exporter keeps: once the SDK
    is installed (by any earlier test in the process), every job records one.
    """
    with _install_lock:
        installed = _installed
    if installed is not None:
        installed.reset()


@pytest.fixture
def otel() -> Telemetry:
    """The real SDK, installed for the process; what this test records, read back."""
    telemetry = install()
    telemetry.reset()
    return telemetry
