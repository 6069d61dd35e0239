"""The coordinator, laid out like ``rxcoord._locks``: the path of a job is these modules.

* ``_execution`` - execute: what it returns, and what it decides at the call (the job's shape);
* ``_table`` - count and order: states, lanes and counters, one transition step (pure state);
* ``_admit`` - admit: the admission's permit (tickets, a rate's fast pass, a Permit's life);
* ``_run`` - guard and run: the key guard, the job where its shape says, its result to its end;
* ``_runners`` - where a sync job runs: worker threads, an asyncio loop, a scheduler;
* ``_awaited`` - the one awaited path: the awaiting task does the whole submission itself;
* ``_attempts`` - an attempt's time: its timeout, the retry after a failure, the stall watch;
* ``_task`` - one submission's object, and the work a job returned run to its end;
* ``_facade`` - :class:`TenantTaskCoordinator`: the public face, end and deliver, cancel, close;
* ``_reference`` - :class:`ReactorCoordinator`, the Reactor composition that defines it.
"""

from ._execution import Execution
from ._facade import CoordinatorStats, TenantTaskCoordinator
from ._reference import ReactorCoordinator

__all__ = ["CoordinatorStats", "Execution", "ReactorCoordinator", "TenantTaskCoordinator"]
