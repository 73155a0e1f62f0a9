"""The job scheduler: a distributed lease on PostgreSQL, one owner per logical run.

Every replica that wants to run the same logical run ``{type, code, run_key}`` competes for one
row with a unique lock key; only the winner runs it. The lease coordinates execution; it does not
make external side effects exactly-once: use ``idempotency_key`` (and ``bullmq_job_id``) for that.

The tick operations (``acquire_attempt``, ``tick_records`` and their values ``AttemptBudget``,
``AttemptAcquireResult``, ``TickRecord``) are part of the backend contract that
:mod:`sdcore.scheduling` runs on; the helpers only the scheduler needs stay private.
"""

import warnings
from typing import TYPE_CHECKING, Any

from sdcore._json import JsonTypeError, JsonValueError
from sdcore.job_scheduler import _admin, _attempts, _options
from sdcore.job_scheduler._admin import (
    InvalidAdminRequestError,
    JobNotFoundError,
    JobNotRunningError,
    LeaseAdmin,
    LeaseRecord,
    PruneReport,
    ReleasedRun,
)
from sdcore.job_scheduler._attempts import AttemptAcquireResult, AttemptBudget, TickRecord
from sdcore.job_scheduler._base import BaseJobScheduler
from sdcore.job_scheduler._model import (
    DEFAULT_HEARTBEAT_MS,
    DEFAULT_LEASE_MS,
    LEASE_CLOCK_MARGIN,
    LEASE_SLACK_MS,
    InvalidJobIdentityOptionsError,
    InvalidJobLeaseOptionsError,
    JobAcquired,
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobNotAcquired,
    JobScheduler,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerType,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
    RunExclusiveResult,
)
from sdcore.job_scheduler._options import (
    JobAcquireOptions,
    bullmq_job_id,
    idempotency_key,
    lock_key,
)
from sdcore.job_scheduler._service import JobSchedulerDatabaseError, JobSchedulerService

__all__ = [
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_LEASE_MS",
    "LEASE_CLOCK_MARGIN",
    "LEASE_SLACK_MS",
    "AttemptAcquireResult",
    "AttemptBudget",
    "BaseJobScheduler",
    "InvalidAdminRequestError",
    "InvalidJobIdentityOptionsError",
    "InvalidJobLeaseOptionsError",
    "JobAcquireOptions",
    "JobAcquireResult",
    "JobAcquired",
    "JobExecutionLease",
    "JobLease",
    "JobNotAcquired",
    "JobNotFoundError",
    "JobNotRunningError",
    "JobScheduler",
    "JobSchedulerDatabaseError",
    "JobSchedulerError",
    "JobSchedulerService",
    "JobSchedulerStatus",
    "JobSchedulerType",
    "JobSchedulerUnavailableError",
    "JsonTypeError",
    "JsonValueError",
    "LeaseAdmin",
    "LeaseRecord",
    "LostJobLeaseError",
    "PruneReport",
    "ReleasedRun",
    "RunExclusiveResult",
    "TickRecord",
    "bullmq_job_id",
    "idempotency_key",
    "lock_key",
]

# Names that left the public surface, resolved for one release with a DeprecationWarning that
# says where each went: old name -> (the module that holds it, its name there, the message).
_MOVED: dict[str, tuple[Any, str, str]] = {
    "RunRecord": (_admin, "LeaseRecord", "renamed sdcore.job_scheduler.LeaseRecord"),
    "MAX_BACKOFF_MS": (
        _attempts,
        "MAX_BACKOFF_MS",
        "private now: AttemptBudget checks backoff_ms against it",
    ),
    "given_back": (
        _attempts,
        "given_back",
        "private now: give_back(lease, reason) writes that data",
    ),
    "js_trim": (_options, "js_trim", "private now: a helper of sdcore.scheduling"),
    "resolve_timing": (
        _options,
        "resolve_timing",
        "private now: JobAcquireOptions resolves the timing",
    ),
}

if not TYPE_CHECKING:  # type checkers keep reporting unknown names (and these) as errors

    def __getattr__(name: str) -> Any:
        """Resolve a name that left the public surface, with a ``DeprecationWarning``."""
        if name not in _MOVED:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        home, attribute, message = _MOVED[name]
        warnings.warn(
            f"sdcore.job_scheduler.{name} is deprecated and goes away in the next release: "
            f"{message}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(home, attribute)
