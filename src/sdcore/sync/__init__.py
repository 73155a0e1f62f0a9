"""sdcore without ``await``: the lease, the outbox, the runtime and the admin for blocking code.

Each object with connections runs its async twin on an event loop of its own, on a thread of its
own (:mod:`sdcore.sync._portal`); the names, arguments, results and errors are the async API's.
"""

from sdcore.sync._admin import OutboxAdmin, ScheduleAdmin
from sdcore.sync._lease import JobSchedulerService
from sdcore.sync._lease_admin import LeaseAdmin
from sdcore.sync._outbox import Outbox, OutboxDriver
from sdcore.sync._runtime import Runtime

__all__ = [
    "JobSchedulerService",
    "LeaseAdmin",
    "Outbox",
    "OutboxAdmin",
    "OutboxDriver",
    "Runtime",
    "ScheduleAdmin",
]
