"""The public surface, pinned: a change here is an API change and shows in review."""

from __future__ import annotations

import subprocess
import sys

import sdcore
import sdcore.job_scheduler
import sdcore.postgres
import sdcore.runtime
import sdcore.testing

JOB_SCHEDULER = [
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


def test_job_scheduler_surface() -> None:
    assert sdcore.job_scheduler.__all__ == JOB_SCHEDULER
    for name in JOB_SCHEDULER:
        assert hasattr(sdcore.job_scheduler, name)


def test_seed_export_table_is_covered() -> None:
    seed = [
        "JobScheduler",
        "JobSchedulerStatus",
        "JobSchedulerType",
        "JobAcquireOptions",
        "JobAcquireResult",
        "JobLease",
        "JobExecutionLease",
        "RunExclusiveResult",
        "DEFAULT_LEASE_MS",
        "DEFAULT_HEARTBEAT_MS",
        "LostJobLeaseError",
        "InvalidJobLeaseOptionsError",
        "InvalidJobIdentityOptionsError",
        "JobSchedulerService",
    ]
    assert set(seed) <= set(JOB_SCHEDULER)
    assert sdcore.job_scheduler.DEFAULT_LEASE_MS == 900_000
    assert sdcore.job_scheduler.DEFAULT_HEARTBEAT_MS == 60_000
    assert list(sdcore.job_scheduler.JobSchedulerStatus) == ["RUNNING", "SUCCESS", "FAIL"]
    assert list(sdcore.job_scheduler.JobSchedulerType) == ["INITIAL", "SCHEDULE"]


def test_error_tree() -> None:
    js = sdcore.job_scheduler
    assert issubclass(js.InvalidJobLeaseOptionsError, ValueError)
    assert issubclass(js.InvalidJobIdentityOptionsError, ValueError)
    assert issubclass(js.JobSchedulerUnavailableError, ConnectionError)
    for error in (
        js.LostJobLeaseError,
        js.InvalidJobLeaseOptionsError,
        js.JobSchedulerDatabaseError,
    ):
        assert issubclass(error, js.JobSchedulerError)


def test_other_surfaces() -> None:
    assert sdcore.testing.__all__ == [
        "FakeClock",
        "InMemoryJobScheduler",
        "InMemoryScheduleStore",
        "MemoryOutboxRow",
        "MemoryOutboxStore",
        "RecordingPublisher",
    ]
    assert "schema_sql" in sdcore.postgres.__all__
    assert "PoolSettings" in sdcore.postgres.__all__
    assert sdcore.__all__ == ["Runtime", "SdcoreError", "__version__"]
    assert sdcore.runtime.__all__ == ["ComponentHealth", "Runtime", "RuntimeStateError"]
    assert sdcore.Runtime is sdcore.runtime.Runtime


def test_importing_sdcore_imports_no_optional_dependency() -> None:
    code = (
        "import sys, sdcore, sdcore.job_scheduler, sdcore.testing, sdcore.postgres;"
        "import sdcore.probes, sdcore.jsonlog;"
        "opt = ('sqlalchemy', 'redis', 'bullmq', 'fastapi', 'cronsim', 'prometheus_client',"
        " 'opentelemetry');"
        "bad = [m for m in opt if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_observability_surfaces() -> None:
    import sdcore.jsonlog
    import sdcore.metrics
    import sdcore.probes
    import sdcore.tracing

    assert sdcore.metrics.__all__ == [
        "CONTENT_TYPE",
        "METRIC_NAMES",
        "ClusterCollector",
        "ClusterFigures",
        "MetricsObserver",
        "SdcoreMetrics",
    ]
    assert sdcore.tracing.__all__ == ["SdcoreTracing"]
    assert sdcore.jsonlog.__all__ == ["JsonFormatter"]
    assert sdcore.probes.__all__ == [
        "DEFAULT_RELAY_STUCK_AFTER_S",
        "ProbeCheck",
        "ProbeResult",
        "liveness",
        "readiness",
        "serve",
    ]


def test_scheduling_surface() -> None:
    import sdcore.scheduling

    assert sdcore.scheduling.__all__ == [
        "ActionKind",
        "CatchUp",
        "ControlAction",
        "ControlSettings",
        "ControlWriteUncertainError",
        "CronExpression",
        "DayRule",
        "InMemoryScheduleStore",
        "InvalidScheduleError",
        "LiveVersion",
        "MissedTick",
        "Overlap",
        "PostgresScheduleStore",
        "RunRecord",
        "ScheduleAdmin",
        "ScheduleControl",
        "ScheduleControlError",
        "ScheduleInfo",
        "ScheduleKind",
        "ScheduleNotFoundError",
        "ScheduleOptions",
        "ScheduleState",
        "ScheduleStore",
        "Scheduler",
        "SchedulingError",
        "SchedulingSettings",
        "Tick",
        "TickOutcome",
        "format_run_key",
    ]


def test_events_outbox_fastapi_surfaces() -> None:
    import sdcore.events
    import sdcore.fastapi
    import sdcore.outbox

    assert sdcore.events.__all__ == [
        "MAX_EVENT_NAME_LENGTH",
        "EventBus",
        "EventError",
        "EventLoopRequiredError",
        "InvalidEventNameError",
        "InvalidListenerError",
        "Listener",
        "Subscription",
        "UnknownEventError",
    ]
    assert sdcore.outbox.__all__ == [
        "DEFAULT_CHANNEL",
        "DEFAULT_DEDUP_WINDOW_MS",
        "DEFAULT_KEEP",
        "DEFAULT_RELAY_BATCH_BYTES",
        "DEFAULT_RELAY_BATCH_SIZE",
        "DuplicateOutboxKeyError",
        "InvalidOutboxMessageError",
        "InvalidOutboxRequestError",
        "Outbox",
        "OutboxAdmin",
        "OutboxDatabaseError",
        "OutboxEntry",
        "OutboxError",
        "OutboxFailure",
        "OutboxKeyConflictError",
        "OutboxMessage",
        "OutboxRelay",
        "OutboxRow",
        "OutboxStats",
        "OutboxStatus",
        "OutboxStore",
        "OutboxTransactionRequiredError",
        "PostgresOutboxStore",
        "Publisher",
        "PublisherUnavailableError",
        "ReadOnlyDict",
        "ReadOnlyList",
        "RelaySettings",
        "RelayState",
        "check_options",
    ]
    assert sdcore.fastapi.__all__ == [
        "ComponentHealth",
        "EventsDep",
        "JobsDep",
        "OutboxDep",
        "SchedulerDep",
        "Sdcore",
        "SdcoreDep",
        "get_events",
        "get_jobs",
        "get_outbox",
        "get_scheduler",
        "get_sdcore",
        "health_router",
        "install",
        "metrics_router",
        "probes_router",
    ]


def test_sdcore_fastapi_without_redis_imports_no_queue_package() -> None:
    code = (
        "import sys, sdcore.fastapi, sdcore.outbox, sdcore.events;"
        "print(','.join(m for m in ('bullmq', 'redis', 'sdcore.queues') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_queues_surface() -> None:
    import sdcore.queues

    assert sdcore.queues.__all__ == [
        "DEFAULT_MAX_JOB_BYTES",
        "DEFAULT_PREFIX",
        "BullMQPublisher",
        "InvalidProcessorError",
        "Job",
        "JobRejectedError",
        "JobTooLargeError",
        "Processor",
        "QueuesError",
        "RedisClientError",
        "RedisServerInfo",
        "RedisUnavailableError",
        "UnrecoverableError",
        "Workers",
        "check_redis_server",
        "is_final_attempt",
        "queues_enabled",
    ]
