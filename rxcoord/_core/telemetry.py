"""rxcoord's telemetry: the one module that talks to the OpenTelemetry API.

rxcoord instruments against ``opentelemetry-api`` only (the extra ``otel``) and never configures
an SDK or an exporter: that is the application's choice. Without the API installed, or with no
SDK configured, nothing is recorded and a hot path pays one check: ``metrics_on()`` /
``traces_on()`` read whether a global MeterProvider / TracerProvider has been set (the API's
own set-once flags, two attribute reads; no lock, no environment lookup, no call into the
API). The instruments are created once per process through the global meter, which before an
SDK is configured is the API's proxy: they start recording the moment the application sets a
provider, whether rxcoord's objects were made before or after.

Instruments (names and units fixed: dashboards rely on them)
-------------------------------------------------------------

=============================  ======================  =====  ===================================
name                           kind                    unit   attributes
=============================  ======================  =====  ===================================
``rxcoord.job.wait``           histogram               s      name [, tenant]
``rxcoord.job.duration``       histogram               s      name, outcome [, tenant]
``rxcoord.jobs.active``        up-down counter (obs.)  {job}  name [, tenant]
``rxcoord.jobs.queued``        up-down counter (obs.)  {job}  name [, tenant]
``rxcoord.jobs.waiting``       up-down counter (obs.)  {job}  name [, tenant]
``rxcoord.jobs.rejected``      counter                 {job}  name, reason [, tenant]
``rxcoord.lease.wait``         histogram               s      backend, outcome
``rxcoord.leases.held``        up-down counter (obs.)  {lease}  backend
``rxcoord.leases.lost``        counter                 {lease}  backend
``rxcoord.fleet.permit.wait``  histogram               s      name, outcome
``rxcoord.kafka.records``      counter                 {record}  name, topic, outcome
``rxcoord.kafka.lag``          gauge (obs.)            {record}  name, group, topic, partition
``rxcoord.kafka.in_flight``    gauge (obs.)            {record}  name, group, topic, partition
``rxcoord.kafka.paused``       gauge (obs.)            {partition}  name, group, topic
``rxcoord.kafka.commit.wait``  histogram               s      name, group
=============================  ======================  =====  ===================================

Attribute keys: ``rxcoord.name`` (the coordinator's, scheduler's or consumer's name),
``rxcoord.outcome`` (jobs and records: ``completed``, ``failed``, ``timed_out``,
``cancelled``, ``rejected``; lease waits: ``acquired``, ``taken``, ``timed_out``,
``cancelled``, ``failed``), ``rxcoord.reason`` (rejections: ``too_many_tasks``, ``closed``),
``rxcoord.backend`` (``memory``, ``sqlite``, ``postgres``, ``redis``), ``rxcoord.tenant``
(only a label the user mapped a tenant to: ``TenantScheduler(metrics_tenant=fn)``), and
OpenTelemetry's messaging keys for Kafka (``messaging.consumer.group.name``,
``messaging.destination.name``, ``messaging.destination.partition.id``).

The "(obs.)" instruments are asynchronous: their values are read from the owners' own counts
(``stats()``) when a reader collects, so they cost the hot path nothing and can never drift
(an up-down counter fed by increments would, if the SDK were configured between a job's +1 and
its -1). Owners are held weakly and summed per attribute set.

Cardinality: no tenant, key or lease-name attribute, ever, unless the user maps tenants to a
bounded label; even then at most :data:`MAX_LABELS` distinct labels per name are kept (further
ones are reported as ``"other"``, with one warning).

Spans
-----
* a job: ``rxcoord.job <name>``, kind INTERNAL, parent = the submitter's current span (read
  from the context the job was submitted in), ``rxcoord.job.wait`` (seconds) recorded on it,
  the outcome as ``rxcoord.outcome``, and on failure an error status and the exception. The
  job runs inside it (see :meth:`Job.started`), so the user's spans nest under it;
* a Kafka record: ``<topic> process``, kind CONSUMER, OpenTelemetry's messaging attributes
  (system, destination, partition, offset, consumer group; the message key only when the
  user opts in), parent = the context the global propagator extracts from the record's
  headers (W3C ``traceparent`` by default), else the consumer's current span.

Context
-------
A job runs in a copy of the context of the call that submitted it (:func:`capture`, as
``asyncio.to_thread`` does): on a worker thread or a scheduler ``context.run(fn)``, on a loop
``loop.create_task(coro, context=context)`` (or create the task inside ``context.run``).
Each job gets its own copy (a ``Context`` may be entered by one thread at a time); what the job
sets in it does not leak back to the caller.

How the layers use it::

    tel = telemetry.coordinator("orders")            # once, in the coordinator
    tel.observe(coordinator, lambda c: c.counts())   # the three up-down counters
    job = tel.accepted()                             # None when nobody listens
    ...
    if job is not None:
        job.started(context)                         # wait recorded, span opened in `context`
    context.run(fn)
    ...
    if job is not None:
        job.ended("completed")                       # or ("failed", error)
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from loguru import logger

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Span

try:
    from opentelemetry import context as _otel_context
    from opentelemetry import metrics as _otel_metrics
    from opentelemetry import propagate as _otel_propagate
    from opentelemetry import trace as _otel_trace
    from opentelemetry.metrics import Observation as _Observation
    from opentelemetry.metrics import _internal as _otel_metrics_internal
    from opentelemetry.propagators.textmap import Getter as _Getter
    from opentelemetry.trace import SpanKind as _SpanKind
    from opentelemetry.trace import Status as _Status
    from opentelemetry.trace import StatusCode as _StatusCode
except ImportError:  # the extra ``otel`` is not installed: everything below is a no-op
    AVAILABLE = False
else:
    AVAILABLE = True

__all__ = [
    "AVAILABLE",
    "INSTRUMENTS",
    "JOB_OUTCOMES",
    "LEASE_OUTCOMES",
    "MAX_LABELS",
    "REJECT_REASONS",
    "Attributes",
    "Job",
    "JobOutcome",
    "JobTelemetry",
    "KafkaTelemetry",
    "LeaseOutcome",
    "LeaseTelemetry",
    "PermitTelemetry",
    "RecordSpan",
    "RejectReason",
    "capture",
    "coordinator",
    "fleet",
    "inject_headers",
    "kafka",
    "leases",
    "metrics_on",
    "traces_on",
]

_T = TypeVar("_T")

Attributes = Mapping[str, "str | int | float | bool"]
JobOutcome = Literal["completed", "failed", "timed_out", "cancelled", "rejected"]
RejectReason = Literal["too_many_tasks", "closed"]
LeaseOutcome = Literal["acquired", "taken", "timed_out", "cancelled", "failed"]

JOB_OUTCOMES: Final = ("completed", "failed", "timed_out", "cancelled", "rejected")
REJECT_REASONS: Final = ("too_many_tasks", "closed")
LEASE_OUTCOMES: Final = ("acquired", "taken", "timed_out", "cancelled", "failed")

#: Distinct tenant labels kept per name; further labels are reported as ``"other"``.
MAX_LABELS: Final = 100

#: (name, kind, unit, description) of every instrument, in the order of the table above.
INSTRUMENTS: Final = (
    ("rxcoord.job.wait", "histogram", "s", "Time from a job's acceptance to its start"),
    ("rxcoord.job.duration", "histogram", "s", "Time from a job's start to its end"),
    ("rxcoord.jobs.active", "up_down_counter", "{job}", "Jobs running"),
    ("rxcoord.jobs.queued", "up_down_counter", "{job}", "Jobs accepted, waiting to start"),
    ("rxcoord.jobs.waiting", "up_down_counter", "{job}", "Submissions waiting for room"),
    ("rxcoord.jobs.rejected", "counter", "{job}", "Submissions rejected"),
    ("rxcoord.lease.wait", "histogram", "s", "Time from a lease request to its outcome"),
    ("rxcoord.leases.held", "up_down_counter", "{lease}", "Leases held by this process"),
    ("rxcoord.leases.lost", "counter", "{lease}", "Leases found lost"),
    ("rxcoord.fleet.permit.wait", "histogram", "s", "Time to obtain a fleet permit"),
    ("rxcoord.kafka.records", "counter", "{record}", "Kafka records handled"),
    ("rxcoord.kafka.lag", "gauge", "{record}", "Records behind the partition's end"),
    ("rxcoord.kafka.in_flight", "gauge", "{record}", "Records fetched and not committed"),
    ("rxcoord.kafka.paused", "gauge", "{partition}", "Partitions paused for back-pressure"),
    ("rxcoord.kafka.commit.wait", "histogram", "s", "Time a commit took"),
)

# Seconds: from a fast in-process hand-over to a long queue (the SDK's default boundaries
# are for milliseconds).
_SECONDS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

_NAME: Final = "rxcoord.name"
_OUTCOME: Final = "rxcoord.outcome"
_REASON: Final = "rxcoord.reason"
_BACKEND: Final = "rxcoord.backend"
_TENANT: Final = "rxcoord.tenant"
_GROUP: Final = "messaging.consumer.group.name"
_TOPIC: Final = "messaging.destination.name"
_PARTITION: Final = "messaging.destination.partition.id"


# -- is anything listening? ------------------------------------------------------------------------


class _Flag:
    __slots__ = ("_done",)

    def __init__(self, done: bool) -> None:
        self._done = done


def _set_once(module: Any, attribute: str) -> Any:
    """The API's set-once flag of a global provider (its ``_done`` turns True when set).

    A private attribute of ``opentelemetry-api`` (present since 1.x): an API that no longer
    has it is treated as always listening, which is correct and only slower.
    """
    once = getattr(module, attribute, None)
    return once if hasattr(once, "_done") else _Flag(True)


if AVAILABLE:
    _METRICS_SET: Any = _set_once(_otel_metrics_internal, "_METER_PROVIDER_SET_ONCE")
    _TRACES_SET: Any = _set_once(_otel_trace, "_TRACER_PROVIDER_SET_ONCE")
    # A provider named by OTEL_PYTHON_METER_PROVIDER / _TRACER_PROVIDER is set on the first
    # get: make that happen now, so that the flags above tell the truth from the start.
    _otel_metrics.get_meter_provider()
    _otel_trace.get_tracer_provider()
else:
    _METRICS_SET = _TRACES_SET = _Flag(False)


def metrics_on() -> bool:
    """True once the application has set a global MeterProvider (then metrics are recorded)."""
    return bool(_METRICS_SET._done)


def traces_on() -> bool:
    """True once the application has set a global TracerProvider (then spans are made)."""
    return bool(_TRACES_SET._done)


def capture() -> contextvars.Context:
    """A copy of the caller's context, to run a job in: call it where the job is submitted.

    Each job needs a copy of its own: one ``Context`` can be entered by one thread at a time,
    and what the job sets must not leak into the caller's (``asyncio.to_thread`` semantics).
    """
    return contextvars.copy_context()


# -- asynchronous instruments: owners held weakly, read at collection ------------------------------

_Reader = Callable[[Any], Iterable[tuple[float, Mapping[str, Any]]]]


class _Observed:
    """The sources of one asynchronous instrument: weakly held owners, each with a reader."""

    __slots__ = ("_lock", "_name", "_sources")

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._sources: weakref.WeakKeyDictionary[Any, _Reader] = weakref.WeakKeyDictionary()

    def add(self, owner: object, read: _Reader) -> None:
        with self._lock:
            self._sources[owner] = read

    def discard(self, owner: object) -> None:
        with self._lock:
            self._sources.pop(owner, None)

    def observe(self, options: CallbackOptions | None = None) -> list[Observation]:
        """The instrument's callback: every owner's values, summed per attribute set."""
        with self._lock:
            sources = list(self._sources.items())
        totals: dict[tuple[tuple[str, Any], ...], float] = {}
        for owner, read in sources:
            try:
                for value, attributes in read(owner):
                    key = tuple(sorted(attributes.items()))
                    totals[key] = totals.get(key, 0) + value
            except Exception:  # one broken owner must not hide the others
                logger.opt(exception=True).warning(
                    "rxcoord telemetry: reading {} from {!r} failed", self._name, owner
                )
        return [_Observation(value, dict(key)) for key, value in totals.items()]


_OBSERVED: Final = {
    name: _Observed(name)
    for name in (
        "rxcoord.jobs.active",
        "rxcoord.jobs.queued",
        "rxcoord.jobs.waiting",
        "rxcoord.leases.held",
        "rxcoord.kafka.lag",
        "rxcoord.kafka.in_flight",
        "rxcoord.kafka.paused",
    )
}


class _Instruments:
    """Every instrument, created once per process through the global (proxy) meter."""

    def __init__(self) -> None:
        from rxcoord import __version__

        meter = _otel_metrics.get_meter("rxcoord", __version__)
        made: dict[str, Any] = {}
        for name, kind, unit, description in INSTRUMENTS:
            if kind == "histogram":
                made[name] = meter.create_histogram(
                    name, unit, description, explicit_bucket_boundaries_advisory=_SECONDS
                )
            elif kind == "counter":
                made[name] = meter.create_counter(name, unit, description)
            elif kind == "up_down_counter":
                made[name] = meter.create_observable_up_down_counter(
                    name, [_OBSERVED[name].observe], unit, description
                )
            else:
                made[name] = meter.create_observable_gauge(
                    name, [_OBSERVED[name].observe], unit, description
                )
        self.job_wait = made["rxcoord.job.wait"]
        self.job_duration = made["rxcoord.job.duration"]
        self.jobs_rejected = made["rxcoord.jobs.rejected"]
        self.lease_wait = made["rxcoord.lease.wait"]
        self.leases_lost = made["rxcoord.leases.lost"]
        self.permit_wait = made["rxcoord.fleet.permit.wait"]
        self.kafka_records = made["rxcoord.kafka.records"]
        self.commit_wait = made["rxcoord.kafka.commit.wait"]
        self.all = made


_instruments_lock = threading.Lock()
_made: _Instruments | None = None


def _instruments() -> _Instruments:
    global _made
    made = _made
    if made is None:
        with _instruments_lock:
            made = _made
            if made is None:
                made = _made = _Instruments()
    return made


_tracer_made: Any = None


def _tracer() -> Any:
    """rxcoord's tracer, got once: before an SDK is set it is the API's proxy, which turns
    into the real tracer when one is."""
    global _tracer_made
    tracer = _tracer_made
    if tracer is None:
        from rxcoord import __version__

        tracer = _tracer_made = _otel_trace.get_tracer("rxcoord", __version__)
    return tracer


def _ready() -> None:
    """Create the instruments now (construction time), so that hot paths only use them."""
    if AVAILABLE:
        _instruments()


# -- tenant labels: bounded, whatever the user's function returns ----------------------------------

_labels_lock = threading.Lock()
_labels: dict[str, set[str]] = {}


def _bounded_label(name: str, label: object) -> str:
    text = str(label)
    with _labels_lock:
        seen = _labels.setdefault(name, set())
        if text in seen:
            return text
        if len(seen) < MAX_LABELS:
            seen.add(text)
            return text
        first = "other" not in seen
        seen.add("other")
    if first:
        logger.warning(
            "rxcoord telemetry: {!r} mapped tenants to more than {} labels; further labels "
            "are reported as 'other' (metrics_tenant must map to a small set: a tier, a region)",
            name,
            MAX_LABELS,
        )
    return "other"


# -- jobs ------------------------------------------------------------------------------------------


class JobTelemetry:
    """The instruments of one coordinator or scheduler (one ``rxcoord.name``, maybe a label).

    Cheap to keep per coordinator; every method is safe to call with nothing listening (it
    returns after one check).
    """

    __slots__ = ("__weakref__", "_outcomes", "_rejects", "attributes", "name")

    def __init__(self, name: str, tenant_label: object = None) -> None:
        self.name = name
        attributes: dict[str, str] = {_NAME: name}
        if tenant_label is not None:
            attributes[_TENANT] = _bounded_label(name, tenant_label)
        self.attributes: Mapping[str, str] = attributes
        self._outcomes = {o: {**attributes, _OUTCOME: o} for o in JOB_OUTCOMES}
        self._rejects = {r: {**attributes, _REASON: r} for r in REJECT_REASONS}
        _ready()

    def labelled(self, tenant_label: object) -> JobTelemetry:
        """The same name with ``rxcoord.tenant`` = the label (``metrics_tenant``'s result).

        None gives the unlabelled instruments. Labels beyond :data:`MAX_LABELS` per name are
        reported as ``"other"``.
        """
        return JobTelemetry(self.name, tenant_label)

    @property
    def on(self) -> bool:
        """True while a MeterProvider or a TracerProvider is set."""
        return bool(_METRICS_SET._done or _TRACES_SET._done)

    def accepted(self) -> Job | None:
        """A job was accepted (counted): its telemetry, or None when nobody listens."""
        if not (_METRICS_SET._done or _TRACES_SET._done):
            return None
        return Job(self, perf_counter())

    def rejected(self, reason: RejectReason) -> None:
        """A submission was refused: ``too_many_tasks`` or ``closed``."""
        if _METRICS_SET._done:
            _instruments().jobs_rejected.add(1, self._rejects[reason])

    def observe(
        self,
        owner: object,
        counts: Callable[[Any], tuple[int, int, int]],
    ) -> None:
        """Report ``rxcoord.jobs.active``/``queued``/``waiting`` from ``counts(owner)``.

        ``counts`` returns ``(active, queued, waiting)`` (say, from ``owner.stats()``) and is
        called at collection only, on the reader's thread; ``owner`` is held weakly (no
        reference to it may hide in ``counts``: take it as the argument). Registering the
        same owner again replaces its reader.
        """
        attributes = self.attributes
        for index, name in enumerate(
            ("rxcoord.jobs.active", "rxcoord.jobs.queued", "rxcoord.jobs.waiting")
        ):
            _OBSERVED[name].add(owner, _pick(counts, index, attributes))

    def forget(self, owner: object) -> None:
        """Stop reporting ``owner``'s counts (it closed); dropping it has the same effect."""
        for name in ("rxcoord.jobs.active", "rxcoord.jobs.queued", "rxcoord.jobs.waiting"):
            _OBSERVED[name].discard(owner)


def _pick(
    counts: Callable[[Any], tuple[int, int, int]], index: int, attributes: Mapping[str, str]
) -> _Reader:
    def read(owner: Any) -> Iterable[tuple[float, Mapping[str, Any]]]:
        return ((counts(owner)[index], attributes),)

    return read


class Job:
    """One accepted job's telemetry: its wait, its span, its duration.

    Made by :meth:`JobTelemetry.accepted` only while something listens; not thread-safe (a
    job's steps happen one after another, whichever threads they run on).
    """

    __slots__ = ("_since", "_started", "_token", "span", "telemetry", "wait")

    def __init__(self, telemetry: JobTelemetry, accepted_at: float) -> None:
        self.telemetry = telemetry
        self._since = accepted_at  # when the current wait began (acceptance, or a retry)
        self._started = 0.0
        self._token: object = None
        self.wait = 0.0  # seconds of the latest wait
        self.span: Span | None = None

    def started(self, context: contextvars.Context | None = None) -> None:
        """The job (or a retry of it) starts: record its wait; open its span on the first start.

        Args:
            context: The job's own context (:func:`capture`'d at submission) that it will run
                in: the span's parent is read from it and the span is made current in it, so
                the job runs inside the span. It must not be entered at the time of the call
                (call this before ``context.run(job)``, not inside it). None: the parent is
                the current context and the span is not made current; use :meth:`scope`
                around the job (the awaited path, which runs in the caller's own task).
        """
        now = perf_counter()
        wait = self.wait = now - self._since
        self._started = now
        if _METRICS_SET._done:
            _instruments().job_wait.record(wait, self.telemetry.attributes)
        if self.span is None and _TRACES_SET._done:
            name = self.telemetry.name
            attributes: dict[str, str | float] = {
                **self.telemetry.attributes,
                "rxcoord.job.wait": wait,
            }
            if context is None:
                self.span = _tracer().start_span(
                    f"rxcoord.job {name}", kind=_SpanKind.INTERNAL, attributes=attributes
                )
            else:
                self.span = context.run(_open_current, f"rxcoord.job {name}", attributes)
        elif self.span is not None:
            self.span.add_event("rxcoord.job.start", {"rxcoord.job.wait": wait})

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Make the job's span current in the running context for the ``with`` block.

        For a job that runs in its caller's own context (the awaited path: ``async with``
        is not needed, a plain ``with`` around ``await job()`` works within one task).
        """
        span = self.span
        if span is None:
            yield
            return
        token = _otel_context.attach(_otel_trace.set_span_in_context(span))
        try:
            yield
        finally:
            _otel_context.detach(token)

    def retrying(self, error: BaseException | None = None) -> None:
        """An attempt failed and the job will be retried: its next wait begins now."""
        self._since = perf_counter()
        if self.span is not None:
            attributes: dict[str, str] = {}
            if error is not None:
                attributes["exception.type"] = type(error).__qualname__
                attributes["exception.message"] = str(error)
            self.span.add_event("rxcoord.job.retry", attributes)

    def ended(self, outcome: JobOutcome, error: BaseException | None = None) -> None:
        """The job ended (after its last attempt): record its duration, end its span.

        Args:
            outcome: ``completed``, ``failed``, ``timed_out`` or ``cancelled`` (a job that
                never started ends with its outcome too; its duration is not recorded).
            error: The exception of a failure or a timeout, recorded on the span.
        """
        started = self._started
        if started and _METRICS_SET._done:
            _instruments().job_duration.record(
                perf_counter() - started, self.telemetry._outcomes[outcome]
            )
        span = self.span
        if span is not None:
            self.span = None
            _end_span(span, outcome, error)


def _open_current(name: str, attributes: Attributes) -> Span:
    """In the job's context: start its span under the current one, and make it current."""
    span: Span = _tracer().start_span(name, kind=_SpanKind.INTERNAL, attributes=attributes)
    # Never detached: the context is the job's own copy and goes away with it.
    _otel_context.attach(_otel_trace.set_span_in_context(span))
    return span


def _end_span(span: Span, outcome: str, error: BaseException | None) -> None:
    span.set_attribute(_OUTCOME, outcome)
    if error is not None:
        span.record_exception(error)
        span.set_attribute("error.type", type(error).__qualname__)
    if outcome in ("failed", "timed_out"):
        description = f"{type(error).__name__}: {error}" if error is not None else outcome
        span.set_status(_Status(_StatusCode.ERROR, description))
    span.end()


def coordinator(name: str, tenant_label: object = None) -> JobTelemetry:
    """The instruments of a coordinator (or a scheduler) named ``name``.

    Args:
        name: ``rxcoord.name``: the coordinator's or scheduler's name (a few per process).
        tenant_label: ``rxcoord.tenant``, only a label the user mapped a tenant to.
    """
    return JobTelemetry(name, tenant_label)


# -- leases and fleet permits ----------------------------------------------------------------------


class LeaseTelemetry:
    """The lease instruments of one provider (``rxcoord.backend``)."""

    __slots__ = ("_lost_attrs", "_outcomes", "backend")

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._outcomes = {o: {_BACKEND: backend, _OUTCOME: o} for o in LEASE_OUTCOMES}
        self._lost_attrs = {_BACKEND: backend}
        _ready()

    @staticmethod
    def begin() -> float:
        """When a request began (0.0 when metrics are off: its wait is not recorded)."""
        return perf_counter() if _METRICS_SET._done else 0.0

    def waited(self, begun: float, outcome: LeaseOutcome) -> None:
        """A request that :meth:`begin` stamped ended with ``outcome``."""
        if begun and _METRICS_SET._done:
            _instruments().lease_wait.record(perf_counter() - begun, self._outcomes[outcome])

    def lost(self) -> None:
        """A lease was found lost."""
        if _METRICS_SET._done:
            _instruments().leases_lost.add(1, self._lost_attrs)

    def observe_held(self, owner: object, held: Callable[[Any], int]) -> None:
        """Report ``rxcoord.leases.held`` as ``held(owner)`` (owner held weakly)."""
        attributes = self._lost_attrs

        def read(provider: Any) -> Iterable[tuple[float, Mapping[str, Any]]]:
            return ((held(provider), attributes),)

        _OBSERVED["rxcoord.leases.held"].add(owner, read)


def leases(backend: str) -> LeaseTelemetry:
    """The lease instruments of a provider of ``backend``."""
    return LeaseTelemetry(backend)


class PermitTelemetry:
    """``rxcoord.fleet.permit.wait`` of one fleet group (``rxcoord.name``)."""

    __slots__ = ("_outcomes",)

    def __init__(self, name: str) -> None:
        self._outcomes = {o: {_NAME: name, _OUTCOME: o} for o in LEASE_OUTCOMES}
        _ready()

    begin = staticmethod(LeaseTelemetry.begin)

    def waited(self, begun: float, outcome: LeaseOutcome) -> None:
        """A permit request stamped by :meth:`begin` ended (``acquired``, ``cancelled``...)."""
        if begun and _METRICS_SET._done:
            _instruments().permit_wait.record(perf_counter() - begun, self._outcomes[outcome])


def fleet(name: str) -> PermitTelemetry:
    """The fleet-permit instruments of the group ``name``."""
    return PermitTelemetry(name)


# -- Kafka -----------------------------------------------------------------------------------------


if AVAILABLE:

    class _HeaderGetter(_Getter[Sequence[tuple[str, Any]] | None]):
        """Reads a Kafka record's headers (``[(key, bytes | str | None)]``) for the propagator."""

        def get(self, carrier: Sequence[tuple[str, Any]] | None, key: str) -> list[str] | None:
            found = []
            for name, value in carrier or ():
                if name.lower() == key:
                    if isinstance(value, bytes | bytearray):
                        value = bytes(value).decode("utf-8", "replace")
                    if value is not None:
                        found.append(str(value))
            return found or None

        def keys(self, carrier: Sequence[tuple[str, Any]] | None) -> list[str]:
            return [name for name, _ in carrier or ()]

    _HEADERS: Any = _HeaderGetter()


def inject_headers(headers: list[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
    """The current trace context as Kafka headers (W3C ``traceparent``...), appended to ``headers``.

    What a producer adds so that the consumer's record span continues its trace; through the
    global propagator, so nothing is added without the API or with no span current.
    """
    headers = [] if headers is None else headers
    if AVAILABLE:
        carrier: dict[str, str] = {}
        _otel_propagate.inject(carrier)
        headers.extend((key, value.encode()) for key, value in carrier.items())
    return headers


class RecordSpan:
    """One Kafka record's span: ``context`` is where its handler runs; :meth:`ended` ends it.

    A record retried (``KeyedConsumer(retry=...)``) keeps its span across its attempts: each
    failed attempt is an event on it (:meth:`retrying`) and the next attempt runs in the same
    context.
    """

    __slots__ = ("again", "context", "span")

    def __init__(self, context: contextvars.Context, span: Span | None) -> None:
        self.context = context
        self.span = span
        self.again = False  # a failed attempt waits for the next one, under this span

    def retrying(self, error: BaseException) -> None:
        """An attempt failed and the record will be tried again (an event on the span)."""
        self.again = True
        if self.span is not None:
            self.span.add_event(
                "rxcoord.record.retry",
                {"exception.type": type(error).__qualname__, "exception.message": str(error)},
            )

    def ended(self, outcome: JobOutcome, error: BaseException | None = None) -> None:
        """End the span with the record's outcome (an error status on failure)."""
        span = self.span
        if span is not None:
            self.span = None
            _end_span(span, outcome, error)


class KafkaTelemetry:
    """The instruments of one keyed consumer (``rxcoord.name``, its group)."""

    __slots__ = ("_commit_attrs", "_records", "group", "name", "record_keys")

    def __init__(self, name: str, group: str, *, record_keys: bool = False) -> None:
        self.name = name
        self.group = group
        self.record_keys = record_keys  # messaging.kafka.message.key on spans: opt-in
        self._commit_attrs = {_NAME: name, _GROUP: group}
        self._records: dict[tuple[str, str], dict[str, str]] = {}
        _ready()

    def record(self, topic: str, outcome: JobOutcome) -> None:
        """Count a record of ``topic`` that ended with ``outcome``."""
        if _METRICS_SET._done:
            attributes = self._records.get((topic, outcome))
            if attributes is None:
                attributes = self._records[(topic, outcome)] = {
                    _NAME: self.name,
                    _TOPIC: topic,
                    _OUTCOME: outcome,
                }
            _instruments().kafka_records.add(1, attributes)

    def commit_waited(self, seconds: float) -> None:
        """A commit took ``seconds``."""
        if _METRICS_SET._done:
            _instruments().commit_wait.record(seconds, self._commit_attrs)

    def observe(
        self,
        owner: object,
        partitions: Callable[[Any], Iterable[tuple[str, int, int | None, int, bool]]],
    ) -> None:
        """Report lag, in-flight and paused from ``partitions(owner)`` at collection.

        ``partitions`` yields ``(topic, partition, lag, in_flight, paused)`` for each assigned
        partition (a lag of None, not known yet, is left out); ``owner`` is held weakly (no
        reference to it may hide in ``partitions``) until :meth:`forget`.
        """
        base = {_NAME: self.name, _GROUP: self.group}

        def per_partition(index: int) -> _Reader:
            def read(owner: Any) -> Iterable[tuple[float, Mapping[str, Any]]]:
                values = []
                for row in partitions(owner):
                    value = row[index]
                    if value is not None:
                        attributes = {**base, _TOPIC: row[0], _PARTITION: str(row[1])}
                        values.append((float(value), attributes))
                return values

            return read

        def paused(owner: Any) -> Iterable[tuple[float, Mapping[str, Any]]]:
            return [(int(row[4]), {**base, _TOPIC: row[0]}) for row in partitions(owner)]

        _OBSERVED["rxcoord.kafka.lag"].add(owner, per_partition(2))
        _OBSERVED["rxcoord.kafka.in_flight"].add(owner, per_partition(3))
        _OBSERVED["rxcoord.kafka.paused"].add(owner, paused)

    @staticmethod
    def forget(owner: object) -> None:
        """Stop reporting ``owner``'s partitions (it closed): its gauges drop out."""
        for name in ("rxcoord.kafka.lag", "rxcoord.kafka.in_flight", "rxcoord.kafka.paused"):
            _OBSERVED[name].discard(owner)

    def record_span(
        self,
        base: contextvars.Context,
        *,
        topic: str,
        partition: int,
        offset: int,
        headers: Sequence[tuple[str, Any]] | None,
        key: bytes | str | None = None,
    ) -> RecordSpan:
        """A record's handler context, with its ``<topic> process`` span current in it.

        Args:
            base: The consumer's context (captured where it was created or subscribed); the
                handler runs in a copy of it, so one record's changes stay its own.
            topic, partition, offset, headers, key: The record's.

        Returns:
            The copy to run the handler in, and the span to end (None when tracing is off).
        """
        context = base.copy()
        if not _TRACES_SET._done:
            return RecordSpan(context, None)
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            _TOPIC: topic,
            _PARTITION: str(partition),
            "messaging.kafka.offset": offset,
            _GROUP: self.group,
        }
        if self.record_keys and key is not None:
            attributes["messaging.kafka.message.key"] = (
                key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
            )
        span = context.run(_open_record, f"{topic} process", attributes, headers)
        return RecordSpan(context, span)


def _open_record(
    name: str, attributes: Attributes, headers: Sequence[tuple[str, Any]] | None
) -> Span:
    """In the handler's context: the parent from the headers, the span, made current."""
    # Into the current (the consumer's) context: without a traceparent its span stays the parent.
    parent = _otel_propagate.extract(headers, _otel_context.get_current(), getter=_HEADERS)
    span: Span = _tracer().start_span(
        name, context=parent, kind=_SpanKind.CONSUMER, attributes=attributes
    )
    _otel_context.attach(_otel_trace.set_span_in_context(span, parent))
    return span


def kafka(name: str, group: str, *, record_keys: bool = False) -> KafkaTelemetry:
    """The instruments of a keyed consumer named ``name`` in consumer group ``group``."""
    return KafkaTelemetry(name, group, record_keys=record_keys)
