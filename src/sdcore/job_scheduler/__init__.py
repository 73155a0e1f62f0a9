"""The job scheduler: a distributed lease on PostgreSQL, one owner per logical run.

Every replica that wants to run the same logical run ``{type, code, run_key}`` competes for one
row with a unique lock key; only the winner runs it. The lease coordinates execution; it does not
make external side effects exactly-once: use ``idempotency_key`` (and ``bullmq_job_id``) for that.
"""

from sdcore._json import JsonTypeError, JsonValueError
from sdcore.job_scheduler._admin import (
    InvalidAdminRequestError,
    JobNotFoundError,
    JobNotRunningError,
    LeaseAdmin,
    PruneReport,
    ReleasedRun,
    RunRecord,
)
from sdcore.job_scheduler._attempts import MAX_BACKOFF_MS, AttemptBudget, TickRecord, given_back
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
    js_trim,
    lock_key,
    resolve_timing,
)
from sdcore.job_scheduler._service import JobSchedulerDatabaseError, JobSchedulerService

__all__ = [
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_LEASE_MS",
    "LEASE_CLOCK_MARGIN",
    "LEASE_SLACK_MS",
    "MAX_BACKOFF_MS",
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
    "LostJobLeaseError",
    "PruneReport",
    "ReleasedRun",
    "RunExclusiveResult",
    "RunRecord",
    "TickRecord",
    "bullmq_job_id",
    "given_back",
    "idempotency_key",
    "js_trim",
    "lock_key",
    "resolve_timing",
]
