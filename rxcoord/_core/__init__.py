"""rxcoord's runtime: nothing here is public API.

* :mod:`.timer` - one timer thread for every deadline in the process;
* :mod:`.workers` - every worker pool rxcoord starts, in one place;
* :mod:`.futures` - safe ``await`` of Observables and delivery onto a subscriber's loop;
* :mod:`.lifecycle` - the open -> closing -> closed state shared by every closeable object;
* :mod:`.waiter` - the one waiter primitive (a one-shot grant that may be cancelled);
* :mod:`.checks` - the one validation policy (durations, counts, weights, names);
* :mod:`.jobs` - the one job runner behind ``KeyedLocks.run`` and ``LeaseProvider.run``: a
  value, a coroutine or awaitable, a future or an Observable, run to its real end;
* :mod:`.telemetry` - the one wrapper of the OpenTelemetry API (metrics, spans, the caller's
  context carried into jobs), a no-op without it or without an SDK.

The layers (``serialize_by_key``, the coordinator, the scheduler, the locks and the leases) build
on these and never on each other's internals.
"""
