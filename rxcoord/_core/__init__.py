"""rxcoord's runtime: nothing here is public API.

* :mod:`.timer` - one timer thread for every deadline in the process;
* :mod:`.workers` - every worker pool rxcoord starts, in one place;
* :mod:`.futures` - safe ``await`` of Observables and delivery onto a subscriber's loop;
* :mod:`.lifecycle` - the open -> closing -> closed state shared by every closeable object.

The layers (``serialize_by_key``, the coordinator, the scheduler, the locks and the leases) build
on these and never on each other's internals.
"""
