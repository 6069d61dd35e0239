"""The coordinator, laid out like ``rxcoord._locks``: the path of a job is these modules.

* ``_execution`` - what ``execute`` returns, and what it decides at the call (the job's shape);
* ``_table`` - the task table: states, lanes and counters, one transition step (pure state);
* ``_runners`` - where a sync job runs: worker threads, an asyncio loop, a scheduler;
* ``_task`` - one submission's object, and the work a job returned run to its end;
* ``_facade`` - :class:`TenantTaskCoordinator`: count, order, admit, guard, run, end, deliver;
* ``_reference`` - :class:`ReactorCoordinator`, the Reactor composition that defines it.
"""

from ._execution import Execution
from ._facade import CoordinatorStats, TenantTaskCoordinator
from ._reference import ReactorCoordinator

__all__ = ["CoordinatorStats", "Execution", "ReactorCoordinator", "TenantTaskCoordinator"]
