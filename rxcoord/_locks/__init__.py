"""KeyedLocks: the in-process lock manager, laid out as its design.

* ``_table.py`` - the grant table: one rule (a request is granted exactly when no earlier
  present request conflicts with it), per-key queues, segments and barriers; pure state, no
  threads, no delivery. Its docstring explains the algorithm; ``tests/test_locks_model.py``
  checks it directly against a model of the rule.
* ``_lease.py`` - the lease (a table request its holder carries) and the inlined uncontended
  ``hold`` path.
* ``_waiting.py`` - the waiting side: blocking, asyncio and Rx waiters, each one
  ``rxcoord._core.waiter.Waiter`` (a grant to a waiter that is gone is released, never lost),
  trampolined delivery, the grant workers.
* ``_run.py`` - ``run*``: call a job (``fn()`` or ``fn(lease)``) under a lease and release it
  when the work has ended.
* ``_facade.py`` - :class:`KeyedLocks`: validates arguments, owns the mutex that guards the
  table, wires the others together.
"""

from ._facade import KeyedLocks, KeyedLocksStats, Lease

__all__ = ["KeyedLocks", "KeyedLocksStats", "Lease"]
