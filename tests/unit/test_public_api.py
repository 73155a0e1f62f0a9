"""The public surface, pinned: a change here is an API change and shows in review.

Every public module (a package or module of ``sdcore`` whose dotted path has no part starting
with ``_``) is listed in ``SURFACES`` with its ``__all__``, exactly. Adding a name means adding it
here, in ``docs/reference`` (``tests/docs/test_reference_names.py``) and in the changelog.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import warnings

import pytest

import sdcore
import sdcore.job_scheduler
import sdcore.postgres
import sdcore.runtime
import sdcore.testing

SDCORE = ["Runtime", "SdcoreError", "__version__"]
ALERTING = [
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Alert",
    "AlertKind",
    "Alerting",
    "AlertingError",
    "CheckIn",
    "CheckInSink",
    "CheckInStatus",
    "HealthchecksSink",
    "HttpRequest",
    "InvalidAlertingConfigError",
    "SentryCronsSink",
    "WebhookSignatureError",
    "WebhookSink",
    "sign_webhook",
    "verify_webhook",
]
CLI = ["main", "run"]
DASHBOARD = ["DashboardError", "Operator", "dashboard_app"]
DJANGO = [
    "AtomicBlockRequiredError",
    "DjangoScheduler",
    "SdcoreSettings",
    "dashboard_asgi",
    "database_url",
    "enqueue_once",
    "get_runtime",
    "scheduler",
]
# Django 6's django.tasks backend: on Django 5.2 its module refuses to import, so its __all__ is
# read from the source there (declared_all).
DJANGO_TASKS = ["SdcoreBackend", "enqueue_on_tick"]
DEMO = [
    "DemoOptions",
    "EmbeddedUnavailableError",
    "Takeover",
    "Verdict",
    "compute_verdict",
    "embedded_postgres",
    "run_demo",
]
EVENTS = [
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
EXCEPTIONS = ["SdcoreError"]
FASTAPI = [
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
JOB_SCHEDULER = [
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
JSONLOG = ["JsonFormatter"]
METRICS = [
    "CONTENT_TYPE",
    "METRIC_NAMES",
    "ClusterCollector",
    "ClusterFigures",
    "MetricsObserver",
    "SdcoreMetrics",
]
OUTBOX = [
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
    "OutboxDriver",
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
OUTBOX_CELERY = [
    "DEFAULT_LEDGER_TABLE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "BrokerRefusedError",
    "CeleryPublisher",
    "LedgerTransactionRequiredError",
    "MessageTooLargeError",
    "TaskLedger",
    "exactly_once",
]
POSTGRES = [
    "DEFAULT_TABLES",
    "POOLER_SQLSTATES",
    "SCHEMA_LOCK_ID",
    "AppliedMigration",
    "Component",
    "DatabaseConnectError",
    "HeldConnections",
    "InvalidIdentifierError",
    "Migration",
    "MigrationError",
    "MigrationScript",
    "MigrationStatus",
    "PoolSettings",
    "SdcorePool",
    "TableInventory",
    "UpgradeReport",
    "apply_schema",
    "check_identifier",
    "create_pool",
    "derived_name",
    "full_sql",
    "migrate",
    "migration_scripts",
    "migration_status",
    "migrations",
    "notifications",
    "open_pool",
    "outbox_schema_sql",
    "redact_dsn",
    "redact_text",
    "schema_sql",
    "upgrade",
]
PROBES = [
    "DEFAULT_RELAY_STUCK_AFTER_S",
    "ProbeCheck",
    "ProbeResult",
    "liveness",
    "readiness",
    "serve",
]
QUEUES = [
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
RUNTIME = ["ComponentHealth", "Runtime", "RuntimeStateError"]
SCHEDULING = [
    "ActionKind",
    "CatchUp",
    "ControlAction",
    "ControlSettings",
    "ControlWriteUncertainError",
    "CronExpression",
    "DayRule",
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
    "format_run_key",
]
SYNC = [
    "JobSchedulerService",
    "LeaseAdmin",
    "Outbox",
    "OutboxAdmin",
    "OutboxDriver",
    "Runtime",
    "ScheduleAdmin",
]
SQLALCHEMY = [
    "JobSchedulerColumns",
    "JobSchedulerRecord",
    "ReadOnlyJobRecordError",
    "enqueue_once",
    "forbid_orm_writes",
    "job_scheduler_table",
    "make_job_scheduler_model",
]
TESTING = [
    "FakeClock",
    "MemoryJobScheduler",
    "MemoryOutboxRow",
    "MemoryOutboxStore",
    "MemoryScheduleStore",
    "RecordingPublisher",
]
TRACING = ["SdcoreTracing"]

SURFACES: dict[str, list[str]] = {
    "sdcore": SDCORE,
    "sdcore.alerting": ALERTING,
    "sdcore.cli": CLI,
    "sdcore.dashboard": DASHBOARD,
    "sdcore.demo": DEMO,
    "sdcore.django": DJANGO,
    "sdcore.django.tasks": DJANGO_TASKS,
    "sdcore.events": EVENTS,
    "sdcore.exceptions": EXCEPTIONS,
    "sdcore.fastapi": FASTAPI,
    "sdcore.job_scheduler": JOB_SCHEDULER,
    "sdcore.jsonlog": JSONLOG,
    "sdcore.metrics": METRICS,
    "sdcore.outbox": OUTBOX,
    "sdcore.outbox.celery": OUTBOX_CELERY,
    "sdcore.postgres": POSTGRES,
    "sdcore.probes": PROBES,
    "sdcore.queues": QUEUES,
    "sdcore.runtime": RUNTIME,
    "sdcore.scheduling": SCHEDULING,
    "sdcore.sqlalchemy": SQLALCHEMY,
    "sdcore.sync": SYNC,
    "sdcore.testing": TESTING,
    "sdcore.tracing": TRACING,
}
PUBLIC_NAME_COUNT = 259  # the sum of the lists above
# Modules Django finds by name in an app (its config, commands, migrations, models and admin):
# no Python API.
DJANGO_CONVENTIONS = (
    "sdcore.django.apps",
    "sdcore.django.management",
    "sdcore.django.migrations",
    "sdcore.django.models",
    "sdcore.django.admin",
)


def public_modules() -> list[str]:
    """Every module and package of sdcore with no private part in its dotted path."""
    found = ["sdcore"]
    for info in pkgutil.walk_packages(sdcore.__path__, "sdcore."):
        if info.name.startswith(DJANGO_CONVENTIONS):
            continue
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            found.append(info.name)
    return sorted(found)


def test_every_public_module_is_pinned() -> None:
    assert public_modules() == sorted(SURFACES)


def needs_newer_django(module: str) -> bool:
    """Whether ``module`` refuses to import on the installed Django (``sdcore.django.tasks``
    before Django 6)."""
    if module != "sdcore.django.tasks":
        return False
    import django

    return bool(django.VERSION < (6, 0))


def declared_all(module: str) -> list[str]:
    """The module's ``__all__``: imported, or read from its source when it needs a newer
    Django than the installed one."""
    if not needs_newer_django(module):
        return list(importlib.import_module(module).__all__)
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no __all__")


@pytest.mark.parametrize("module", sorted(SURFACES))
def test_surface(module: str) -> None:
    assert declared_all(module) == SURFACES[module]
    if needs_newer_django(module):
        return
    imported = importlib.import_module(module)
    for name in SURFACES[module]:
        assert hasattr(imported, name), f"{module}.{name}"


def test_public_name_count() -> None:
    assert sum(len(names) for names in SURFACES.values()) == PUBLIC_NAME_COUNT


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("RunRecord", "LeaseRecord"),
        ("MAX_BACKOFF_MS", "AttemptBudget"),
        ("given_back", "give_back"),
        ("js_trim", "sdcore.scheduling"),
        ("resolve_timing", "JobAcquireOptions"),
    ],
)
def test_a_name_that_left_job_scheduler_still_resolves_with_a_warning(
    name: str, where: str
) -> None:
    from sdcore.job_scheduler import _admin, _attempts, _options

    homes = {"RunRecord": _admin.LeaseRecord}
    expected = homes.get(name) or getattr(_attempts, name, None) or getattr(_options, name)
    with pytest.warns(DeprecationWarning, match=rf"sdcore\.job_scheduler\.{name} .*{where}"):
        got = getattr(sdcore.job_scheduler, name)
    assert got is expected
    assert name not in sdcore.job_scheduler.__all__
    with pytest.raises(AttributeError, match="no attribute 'RunRecrod'"):
        getattr(sdcore.job_scheduler, "RunRecrod")  # noqa: B009 - a name that never existed


def test_tick_outcome_left_scheduling_with_a_warning() -> None:
    import sdcore.scheduling
    from sdcore.scheduling import _runner

    with pytest.warns(DeprecationWarning, match=r"sdcore\.scheduling\.TickOutcome .*private"):
        got = sdcore.scheduling.TickOutcome  # type: ignore[attr-defined]
    assert got is _runner.TickOutcome
    assert "TickOutcome" not in sdcore.scheduling.__all__
    with pytest.raises(AttributeError, match="no attribute 'Tock'"):
        getattr(sdcore.scheduling, "Tock")  # noqa: B009 - a name that never existed


def test_from_import_of_a_moved_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="LeaseRecord"):
        from sdcore.job_scheduler import RunRecord  # type: ignore[attr-defined]
    assert RunRecord is sdcore.job_scheduler.LeaseRecord


def test_the_attempt_acquire_result_still_unpacks_as_the_former_pair() -> None:
    from sdcore.job_scheduler import AttemptAcquireResult, JobNotAcquired

    lost = JobNotAcquired()
    value = AttemptAcquireResult(result=lost, attempt=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, attempt = value
    assert (result, attempt) == (lost, 0)
    assert (value[0], value[1]) == (lost, 0)
    with pytest.raises(IndexError, match="0 or 1"):
        value[2]  # type: ignore[call-overload]


def test_unpacking_a_migration_script_warns() -> None:
    [first, *_] = sdcore.postgres.migration_scripts("lease", table="job_scheduler")
    assert first.migration.name == "0001_initial"
    assert "sdcore_migrations" in first.sql
    with pytest.warns(DeprecationWarning, match=r"\.migration and \.sql"):
        migration, script = first
    assert (migration, script) == (first.migration, first.sql)


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


def test_sdcore_fastapi_without_redis_imports_no_queue_package() -> None:
    code = (
        "import sys, sdcore.fastapi, sdcore.outbox, sdcore.events;"
        "print(','.join(m for m in ('bullmq', 'redis', 'sdcore.queues') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_sdcore_reexports_the_runtime_lazily() -> None:
    assert sdcore.Runtime is sdcore.runtime.Runtime
    assert sdcore.SdcoreError is sdcore.exceptions.SdcoreError
