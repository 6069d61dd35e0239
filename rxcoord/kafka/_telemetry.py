"""A keyed consumer's records in OpenTelemetry: their context, their span, their outcome.

The consumer calls this module at a few marked places ("telemetry hook" in ``_consumer.py``);
what happens there is decided here, on top of :mod:`rxcoord._core.telemetry` (which holds the
instruments, the span attributes and the header propagation).

Context. Handlers run in the context of the call to ``run()`` (``run_async()``: of the task that
awaits it), captured when the call starts: ``logger.contextualize(...)`` values and any
``ContextVar`` set before ``run()`` are seen inside every handler, sync on a worker thread or
inline on the poll thread, ``async def`` on the loop, and in a scheduler's jobs. With tracing
on, each record's handler runs in a copy of its own with the record's span current, so the
user's own spans nest under it. What a handler sets is never seen by the caller of ``run()``;
whether later handlers see it is not promised (inline calls share the poll thread's copy, which
keeps the hot path free of a copy per record), so set per-record values inside the handler
(``with logger.contextualize(...)``, or ``var.set`` with its ``reset``).

Outcomes of ``rxcoord.kafka.records`` (``rxcoord.outcome``, from the shared bounded set):

* ``completed``: the handler returned (its Observable completed, its future or awaitable
  resolved); the record counts as done and its offset may be committed.
* ``failed``: the handler raised (or its result failed) on the record's last attempt, counted
  whatever ``on_error`` or ``dead_letter`` did next: ``"skip"``, a callable that returns and a
  delivered dead letter make the record done, ``"stop"`` stops the consumer. A scheduler that
  ended the job with an error (a timeout, closing) counts here too. A record is counted once,
  however many attempts it took; its span covers them all (each failed attempt an event).
* ``cancelled``: the record held a slot but its result does not count, so the partition's next
  owner handles it again: its partition was revoked before the start gate let it run or before
  it ended, the consumer stopped without a drain, or ``offsets=`` fenced its transaction.
  Records that only waited behind their key (or for a slot) when that happened are not counted
  here (``stats().dropped`` counts them too).

A record refused by the scheduler (``TooManyTasks``) is offered again, so it is not counted
until it ends; its span (opened for the refused attempt) ends with ``rejected`` and the next
attempt opens another one.

Cost with nothing listening: the poll thread reads two flags per batch; per record, one branch
inline and one call returning at a branch in ``ended``; handlers off the poll thread run in a
copy of the consumer's context (one ``Context.copy()`` next to a thread or loop hand-off).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

from rxcoord._core import telemetry
from rxcoord._core.telemetry import (
    JobOutcome,
    KafkaTelemetry,
    RecordSpan,
    metrics_on,
    traces_on,
)

from ._offsets import Dropped, Stopped
from ._partitions import REVOKED
from ._record import Record

__all__ = ["ConsumerTelemetry", "record_done"]

_T = TypeVar("_T")


class ConsumerTelemetry:
    """One consumer's context (``base``) and its records' spans and counts."""

    __slots__ = ("base", "kafka")

    def __init__(self, kafka: KafkaTelemetry, *, record_keys: bool = False) -> None:
        if not isinstance(record_keys, bool):
            raise TypeError(f"trace_record_keys must be True or False, not {record_keys!r}")
        kafka.record_keys = record_keys
        self.kafka = kafka
        # Never entered: every thread and record runs in a copy (a Context can be entered by
        # one thread at a time, and what a handler sets must not reach the next copies).
        self.base = contextvars.Context()

    def begin(self) -> None:
        """The run starts: capture the caller's context (the handlers' from now on)."""
        self.base = telemetry.capture()

    def thread_context(self) -> contextvars.Context:
        """A copy of the consumer's context for a poll thread to run in."""
        return self.base.copy()

    @staticmethod
    def on() -> bool:
        """True while anything listens (then completed inline records are reported)."""
        return metrics_on() or traces_on()

    def open(self, record: Record) -> contextvars.Context:
        """The context to run ``record``'s handler in: a copy of the consumer's, with the
        record's span current in it while tracing (the span is kept on the record)."""
        if not traces_on():
            return self.base.copy()
        earlier: RecordSpan | None = getattr(record, "_span", None)
        if earlier is not None:
            if earlier.again:  # the next attempt of a retried record: the same span
                earlier.again = False
                return earlier.context
            earlier.ended("rejected")  # a scheduler refused the earlier attempt (TooManyTasks)
        opened = self.kafka.record_span(
            self.base,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            headers=record.headers,
            key=record.key,
        )
        record._span = opened
        return opened.context

    def run(self, record: Record, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in ``record``'s context (:meth:`open`): what it schedules inherits it."""
        return self.open(record).run(fn, *args)

    def wrap(self, handle: Callable[[Record], _T]) -> Callable[[Record], _T]:
        """``handle``, called in each record's own context (:meth:`open`)."""

        def call(record: Record) -> _T:
            return self.open(record).run(handle, record)

        return call

    def inline(self, handle: Callable[[Record], _T]) -> Callable[[Record], _T]:
        """The handler for the poll thread's inline calls: itself while nothing traces (the
        poll thread runs in a copy of the consumer's context already), else :meth:`wrap`'s."""
        return self.wrap(handle) if traces_on() else handle

    def completed(self, record: Record) -> None:
        """A record ran inline and completed (the one end that does not pass :meth:`ended`)."""
        self.kafka.record(record.topic, "completed")
        span: RecordSpan | None = getattr(record, "_span", None)
        if span is not None:
            span.ended("completed")

    @staticmethod
    def retrying(record: Record, error: BaseException) -> None:
        """An attempt of ``record`` failed and it waits for the next one: not counted yet; its
        span (if any) goes on, with the failure as an event."""
        span: RecordSpan | None = getattr(record, "_span", None)
        if span is not None:
            span.retrying(error)

    def ended(self, record: Record, error: BaseException | None, dropped: bool) -> None:
        """A record that held a slot ended (``KeyedConsumer._ended``'s arguments, before
        ``on_error`` is applied): count its outcome, end its span."""
        if not (metrics_on() or traces_on()):
            return
        outcome: JobOutcome
        if dropped or isinstance(error, Dropped):
            outcome, error = "cancelled", None
        elif isinstance(error, Stopped):
            outcome, error = "failed", error.error
        elif error is not None:
            outcome = "failed"
        elif record._state.phase == REVOKED:
            outcome = "cancelled"  # a late result of a revoked assignment: dropped
        else:
            outcome = "completed"
        self.kafka.record(record.topic, outcome)
        span: RecordSpan | None = getattr(record, "_span", None)
        if span is not None:
            span.ended(outcome, error)


def record_done(record: Record) -> None:
    """The Rx form's end of a record (``commit_records``): end its span, if it has one."""
    span: RecordSpan | None = getattr(record, "_span", None)
    if span is not None:
        span.ended("completed")
